"""Mixed precision in one int4 checkpoint (precision.py): an 8-bit and a bf16 expert beside int4 ones, an
8-bit attention linear, bf16 shared experts. Checked against float64 weights computed from the codes and
an independent absmax RTN: each module's decision in the plan, the output's values and ignore list."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

import int4pack
from int4pack.sources.checkpoint import Checkpoint
from int4pack.errors import RefusedError
from int4pack.plan import make_plan

sys.path.insert(0, str(Path(__file__).parent / "formats"))
from test_gptq import gptq8_tensors, gptq_tensors  # noqa: E402

H, I, E = 128, 64, 4
P = "model.layers.0"
WIDE_EXPERT = f"{P}.mlp.experts.0.gate_proj"  # 8-bit
FLOAT_EXPERT = f"{P}.mlp.experts.1.down_proj"  # bf16 .weight
WIDE_ATTN = f"{P}.self_attn.q_proj"  # 8-bit


def build(make_ckpt, rng=None):
    """qwen2_moe, one layer: GPTQ v1 sym group 32, with the odd modules above. -> (folder, float64 truth)."""
    rng = rng or np.random.default_rng(0)
    t, truth = {}, {}
    mods = [(f"{P}.self_attn.{p}", H, H) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    mods += [(f"{P}.mlp.experts.{e}.{p}", n, k) for e in range(E)
             for p, (n, k) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I)))]
    for m, n, k in mods:
        if m in (WIDE_EXPERT, WIDE_ATTN):
            tt, w = gptq8_tensors(rng, m, k=k, n=n, group=32, store="v1")
        elif m == FLOAT_EXPERT:
            w = rng.normal(0, 0.02, (n, k))
            tt = {f"{m}.weight": torch.from_numpy(w).to(torch.bfloat16)}
            w = tt[f"{m}.weight"].double().numpy()
        else:
            tt, w = gptq_tensors(rng, m, k=k, n=n, group=32, store="v1")
        t.update(tt)
        truth[m] = w
    for p in ("gate_proj", "up_proj", "down_proj"):  # the shared expert in bf16, as vLLM keeps it
        n, k = (H, I) if p == "down_proj" else (I, H)
        t[f"{P}.mlp.shared_expert.{p}.weight"] = torch.randn(n, k).to(torch.bfloat16)
    t[f"{P}.mlp.gate.weight"] = torch.randn(E, H).to(torch.bfloat16)
    t[f"{P}.mlp.shared_expert_gate.weight"] = torch.randn(1, H).to(torch.bfloat16)
    q = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False,
         "checkpoint_format": "gptq",
         "dynamic": {r"+:.*experts\.0\.gate_proj$": {"bits": 8}, r"+:.*q_proj$": {"bits": 8}}}
    folder = make_ckpt(t, q, model_type="qwen2_moe")
    c = json.loads((folder / "config.json").read_text())
    c.update(hidden_size=H, num_hidden_layers=1, num_experts=E, vocab_size=128, intermediate_size=I,
             moe_intermediate_size=I, shared_expert_intermediate_size=I)
    (folder / "config.json").write_text(json.dumps(c))
    return folder, truth


def paths(plan):
    return {m: p for j in plan.jobs for m, p in j.paths.items()}


def test_each_module_decided_and_said(make_ckpt):
    folder, _ = build(make_ckpt)
    plan = make_plan(Checkpoint(folder))
    p = paths(plan)
    assert p[WIDE_EXPERT] == "requant" and p[FLOAT_EXPERT] == "requant"
    assert p[WIDE_ATTN] == "dequant"  # default: 8-bit dense kept in bf16
    assert p[f"{P}.mlp.experts.2.gate_proj"] == "lossless" and p[f"{P}.self_attn.o_proj"] == "lossless"
    # k and v share vLLM's qkv_proj with the 8-bit q: one scheme for the three, bf16
    assert p[f"{P}.self_attn.k_proj"] == p[f"{P}.self_attn.v_proj"] == "dequant"
    rows = {(r["role"], r["source"]): r for r in plan.summary()["mixed_precision"]}
    assert set(rows) == {("expert", "8-bit"), ("expert", "float"), ("attention", "8-bit"), ("attention", "4-bit")}
    assert rows[("attention", "4-bit")]["modules"] == 2 and "qkv_proj" in rows[("attention", "4-bit")]["decision"]
    assert rows[("expert", "8-bit")]["first"] == WIDE_EXPERT and rows[("expert", "8-bit")]["modules"] == 1
    assert "requantised to int4" in rows[("expert", "float")]["decision"]
    assert "--dense w4a8" in rows[("attention", "8-bit")]["decision"]
    for part in ("gate_proj", "up_proj", "down_proj"):  # float dense modules stay as they are
        assert plan.accounted[f"{P}.mlp.shared_expert.{part}.weight"] == "copied"
    assert plan.accounted[f"{FLOAT_EXPERT}.weight"] == f"converted:{FLOAT_EXPERT}"
    assert any("float expert" in e for e in plan.verdict.evidence)


@pytest.mark.parametrize("dense,attn", [("w4a8", "requant"), ("bf16", "dequant")])
def test_dense_flag_decides_the_8bit_dense_module(make_ckpt, dense, attn):
    folder, _ = build(make_ckpt)
    plan = make_plan(Checkpoint(folder), dense=dense)
    p = paths(plan)
    assert p[WIDE_ATTN] == attn
    assert p[f"{P}.self_attn.k_proj"] == ("lossless" if dense == "w4a8" else "dequant")
    assert p[f"{P}.self_attn.o_proj"] == ("lossless" if dense == "w4a8" else "dequant")
    assert p[WIDE_EXPERT] == "requant"  # experts are int4 whatever --dense says
    if dense == "w4a8":  # the output differs from the default's: so does the resume fingerprint's options
        assert plan.options != make_plan(Checkpoint(folder)).options


def rtn_rel_l2(w: np.ndarray, g: int) -> float:
    """Plain symmetric absmax RTN at group g (scale amax/7 in bf16, q in [-8, 7]), float64."""
    n, k = w.shape
    wg = w.reshape(n, k // g, g)
    s = torch.from_numpy(np.abs(wg).max(axis=2, keepdims=True) / 7).to(torch.bfloat16).double().numpy()
    q = np.clip(np.round(wg / s), -8, 7)
    return float(np.linalg.norm((q * s - wg).ravel()) / np.linalg.norm(wg.ravel()))


def read_out(folder: Path) -> dict:
    out = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def test_converted_values_and_ignore(make_ckpt, tmp_path):
    folder, truth = build(make_ckpt)
    report = int4pack.convert(folder, tmp_path / "out")
    t = read_out(tmp_path / "out")
    for m in (WIDE_EXPERT, FLOAT_EXPERT):
        q = t[f"{m}.weight"].double().numpy()
        s = t[f"{m}.weight_scale"].double().numpy()
        g = q.shape[1] // s.shape[1]
        w = np.repeat(s, g, axis=1) * q
        err = np.linalg.norm(w - truth[m]) / np.linalg.norm(truth[m])
        assert err <= rtn_rel_l2(truth[m], g) * (1 + 1e-9), m  # never worse than plain RTN
        stats = report["modules"][m]
        assert stats["path"] == "requant" and abs(float(stats["rel_l2"]) - err) <= 1e-3 * err + 1e-6
    kept = t[f"{WIDE_ATTN}.weight"]
    assert kept.dtype == torch.bfloat16
    torch.testing.assert_close(kept, torch.from_numpy(truth[WIDE_ATTN]).to(torch.bfloat16), rtol=0, atol=0)
    ignore = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["ignore"]
    assert WIDE_ATTN in ignore and f"{P}.mlp.shared_expert.gate_proj" in ignore
    assert WIDE_EXPERT not in ignore and FLOAT_EXPERT not in ignore
    _one_scheme_per_fused_module(ignore, t)
    for m in (f"{P}.self_attn.k_proj", f"{P}.self_attn.v_proj"):  # int4 shards of the fused qkv, in bf16
        torch.testing.assert_close(t[f"{m}.weight"], torch.from_numpy(truth[m]).to(torch.bfloat16), rtol=0, atol=0)
    said = {(r["role"], r["source"], r["path"]) for r in report["plan"]["mixed_precision"]}
    assert said == {("expert", "8-bit", "requant"), ("expert", "float", "requant"), ("attention", "8-bit", "dequant"),
                    ("attention", "4-bit", "dequant")}
    assert report["modules"][WIDE_ATTN]["path"] == "dequant"


# vLLM's packed_modules_mapping (Qwen2MoeForCausalLM, vllm 0.32.0): the checkpoint linears one fused module loads
_VLLM_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _one_scheme_per_fused_module(ignore: list[str], tensors: dict) -> None:
    """vLLM's compressed-tensors ``should_ignore_layer`` refuses a fused module some of whose shards are
    in ``ignore`` and others not ("Detected some but not all shards of ... are quantized"): every
    shard of each fused dense module in ``ignore``, or none of them."""
    linears = {k.rsplit(".", 1)[0] for k in tensors if k.endswith((".weight", ".weight_packed"))}
    for fused, shards in _VLLM_FUSED.items():
        parents = {m.rsplit(".", 1)[0] for m in linears if m.rsplit(".", 1)[1] in shards and ".experts." not in m}
        for parent in parents:
            inside = {f"{parent}.{s}" in ignore for s in shards if f"{parent}.{s}" in linears}
            assert len(inside) == 1, f"{parent}.{fused}: shards of one fused module under different schemes"


@pytest.mark.parametrize("dense", [None, "w4a8", "bf16"])
def test_verify_against_the_source_passes(make_ckpt, tmp_path, dense):
    folder, _ = build(make_ckpt)
    int4pack.convert(folder, tmp_path / "out", dense=dense)
    r = int4pack.verify(tmp_path / "out", against=folder, processes=False)
    assert r["ok"]
    checked = {d["module"] for d in r["dense"] if not d.get("skipped")}
    assert (WIDE_ATTN in checked) == (dense == "w4a8")  # a W4A8 dense linear is checked numerically


def test_a_whole_8bit_model_is_refused(make_ckpt):
    rng = np.random.default_rng(1)
    t, _ = gptq8_tensors(rng, f"{P}.mlp.experts.0.gate_proj", k=H, n=I, group=32)
    q = {"quant_method": "gptq", "bits": 8, "group_size": 32, "sym": True, "desc_act": False}
    with pytest.raises(RefusedError, match="4-bit checkpoints only"):
        make_plan(Checkpoint(make_ckpt(t, q)))
