"""verify on converted real fixtures: passes when intact, fails with a per-layer message when a
copy is corrupted the ways a real bug or a bad copy would (flipped nibble, scale x2, missing
expert). Corrupted copies are written with the safetensors library. The packed serving format's
checks are in test_serve_format.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

import int4pack
from _reference import FIXTURES
from int4pack.cli import app
from int4pack.errors import VerifyFailed


EXP = "model.layers.0.mlp.experts"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite(folder: Path, edit) -> None:
    """Apply edit(tensors) -> tensors to every shard, keeping metadata and the index consistent."""
    idx_path = folder / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text()) if idx_path.is_file() else None
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            meta = fh.metadata()
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        new = edit(dict(tensors))
        if set(new) != set(tensors) or any(new[k] is not tensors[k] for k in new):
            save_file(new, str(f), metadata=meta)
            if idx is not None:
                for k in set(tensors) - set(new):
                    idx["weight_map"].pop(k, None)
    if idx is not None:
        idx_path.write_text(json.dumps(idx))


def _flip_nibble(t):
    if f"{EXP}.2.gate_proj.weight" not in t:
        return t
    w = t[f"{EXP}.2.gate_proj.weight"].clone()
    v = int(w[5, 7])
    w[5, 7] = v - 8 if v >= 0 else v + 8  # flip the sign bit of the nibble: 3 <-> -5
    t[f"{EXP}.2.gate_proj.weight"] = w
    return t


def _scale_x2(t):
    key = f"{EXP}.1.down_proj.weight_scale"
    if key not in t:
        return t
    t[key] = (t[key].float() * 2).to(t[key].dtype)
    return t


def _drop_expert(t):
    return {k: v for k, v in t.items() if not k.startswith(f"{EXP}.3.")}


def _problems(report) -> str:
    lines = [f"{p['where']}: {p['message']}" for p in report["structural"]["problems"]]
    for r in report["layers"] + report["dense"]:
        lines += [f"{r.get('layer') or r.get('module')}: {p}" for p in r.get("problems", [])]
    return "\n".join(lines)


@pytest.mark.parametrize("name", ["gptq_q3_sym", "awq_q3", "ct_qwen3moe_w4a16_channel", "gptq_q3_descact"])
def test_passes_on_converted_fixtures(name, converted):
    r = int4pack.verify(converted(name)[0], against=FIXTURES / name)
    assert r["ok"], _problems(r)
    assert r["verdict"].startswith("PASS")
    for lay in r["layers"]:
        assert lay["experts_checked"] == lay["experts"] == 4
        assert all(s["slots"] >= 2 for s in lay["expert_stats"].values())  # every expert got tokens
        assert lay["rel_l2"] <= lay["tolerance"]
        # the measured activation error is what the derivation predicts
        assert 0.8 < lay["act_ratio"] < 1.25
        assert lay["cosine"] > 0.99
    assert r["dense"] and all(d["ok"] for d in r["dense"])


def test_without_source_checks_kernel_against_converted_weights(converted):
    r = int4pack.verify(converted("gptq_q3_sym")[0], layers=[1], dense=False)
    assert r["ok"] and len(r["layers"]) == 1 and "weight_rel" not in r["layers"][0]


def test_flipped_nibble_fails_per_layer(converted, tmp_path):
    out = _copy(converted("gptq_q3_sym")[0], tmp_path / "bad")
    _rewrite(out, _flip_nibble)
    with pytest.raises(VerifyFailed) as ei:
        int4pack.verify(out, against=FIXTURES / "gptq_q3_sym", dense=False)
    r = ei.value.report
    assert ei.value.exit_code == 6 and r["verdict"].startswith("FAIL")
    bad = {lay["layer"]: lay for lay in r["layers"] if not lay["ok"]}
    assert list(bad) == ["model.layers.0.mlp"]
    msg = "\n".join(bad["model.layers.0.mlp"]["problems"])
    assert f"{EXP}.2.gate_proj: weight rel_l2" in msg and "the report's figure" in msg
    assert "expert 2: output on its" in msg  # the routed tokens' outputs deviate too
    assert "expert 0" not in msg and "expert 1" not in msg and "expert 3" not in msg
    # without convert's report the budget is the lossless path bound (2^-8): still caught
    (out / "int4pack_report.json").unlink()
    r = int4pack.verify(out, against=FIXTURES / "gptq_q3_sym", dense=False, raise_on_failure=False)
    msg = "\n".join(p for lay in r["layers"] for p in lay["problems"])
    assert not r["ok"] and f"{EXP}.2.gate_proj: weight rel_l2" in msg and "lossless" in msg


def test_flipped_nibble_without_source_caught_by_checksums(converted, tmp_path):
    out = _copy(converted("gptq_q3_sym")[0], tmp_path / "bad")
    _rewrite(out, _flip_nibble)
    r = int4pack.verify(out, raise_on_failure=False, dense=False)
    assert not r["ok"]
    assert "data checksum mismatch" in _problems(r)


def test_scale_x2_fails(converted, tmp_path):
    out = _copy(converted("awq_q3")[0], tmp_path / "bad")  # a requant source: budgets are ~10 %
    _rewrite(out, _scale_x2)
    r = int4pack.verify(out, against=FIXTURES / "awq_q3", raise_on_failure=False, dense=False)
    assert not r["ok"]
    msg = "\n".join(r["layers"][0]["problems"])
    assert f"{EXP}.1.down_proj: weight rel_l2" in msg and "expert 1: output" in msg
    assert r["layers"][1]["ok"]


def test_missing_expert_fails(converted, tmp_path):
    out = _copy(converted("gptq_q3_sym")[0], tmp_path / "bad")
    _rewrite(out, _drop_expert)
    with pytest.raises(VerifyFailed, match=r"expert\(s\) \[3\] missing"):
        int4pack.verify(out, dense=False)


def test_cli_json_and_exit_codes(converted, tmp_path):
    good = converted("gptq_q3_sym")[0]
    runner = CliRunner()
    res = runner.invoke(app, ["verify", str(good), "--against", str(FIXTURES / "gptq_q3_sym"), "--json",
                              "--threads", "1", "--layers", "1,", "--no-dense"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["ok"] and data["threads"] == 1 and [lay["layer"] for lay in data["layers"]] == ["model.layers.1.mlp"]
    bad = _copy(good, tmp_path / "bad")
    _rewrite(bad, _scale_x2)
    res = runner.invoke(app, ["verify", str(bad), "--against", str(FIXTURES / "gptq_q3_sym"), "--no-dense"])
    assert res.exit_code == 6
    assert "FAIL" in res.output and "expert 1" in res.output


# -- several schemes: each module checked against its own config group -------------------------------

@pytest.fixture(scope="module")
def two_schemes(tmp_path_factory) -> tuple[Path, Path]:
    """(source, output) of the DeepSeek-V3-style synthetic: kv_b_proj channel, the rest group 32."""
    import _synth

    root = tmp_path_factory.mktemp("ds")
    _synth.write_ct_deepseek_v3(root / "src")
    int4pack.convert(root / "src", root / "out")
    return root / "src", root / "out"


def _edit_config(folder: Path, edit) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg["quantization_config"]["config_groups"])
    (folder / "config.json").write_text(json.dumps(cfg))


def test_two_schemes_pass(two_schemes):
    src, out = two_schemes
    r = int4pack.verify(out, against=src)
    assert r["ok"] and r["structural"]["counts"]["modules"] > 0
    assert {d["module"] for d in r["dense"]} >= {"model.layers.1.self_attn.kv_b_proj"}


def test_module_under_the_wrong_group_fails(two_schemes, tmp_path):
    """o_proj (group 32 in the tensors) also named by the channel group: its scales are not fp32 [N, 1]."""
    out = _copy(two_schemes[1], tmp_path / "o")

    def edit(groups):
        groups["group_1"]["targets"].insert(0, "model.layers.0.self_attn.o_proj")
    _edit_config(out, edit)
    r = int4pack.verify(out, structural_only=True, raise_on_failure=False)
    msgs = [p["message"] for p in r["structural"]["problems"] if p["where"] == "model.layers.0.self_attn.o_proj"]
    assert any("expected F32[128, 1] (channel)" in m for m in msgs), msgs


def test_module_no_group_names_fails(two_schemes, tmp_path):
    out = _copy(two_schemes[1], tmp_path / "o")
    _edit_config(out, lambda groups: groups.pop("group_1"))
    r = int4pack.verify(out, structural_only=True, raise_on_failure=False)
    where = {p["where"] for p in r["structural"]["problems"] if "no quantization_config group" in p["message"]}
    assert where == {f"model.layers.{i}.self_attn.kv_b_proj" for i in (0, 1)}


def test_experts_of_one_layer_under_two_groups_fail(two_schemes, tmp_path):
    out = _copy(two_schemes[1], tmp_path / "o")
    _edit_config(out, lambda groups: groups["group_1"]["targets"].append("model.layers.1.mlp.experts.0.down_proj"))
    with pytest.raises(VerifyFailed):
        int4pack.verify(out, structural_only=True)
    r = int4pack.verify(out, structural_only=True, raise_on_failure=False)
    assert any(p["where"] == "model.layers.1.mlp" and "several config groups" in p["message"]
               for p in r["structural"]["problems"])


def test_default_tokens_give_every_sampled_expert_its_slots():
    # 128 experts, top-8: 40 rows by default (320 slots for 128 x 2); a router that prefers four
    # experts leaves many without slots, which the routing gives them from experts with some to spare
    import torch

    from int4pack.verify.random_inputs import MIN_SLOTS_PER_EXPERT, default_tokens, route as _route

    gen = torch.Generator().manual_seed(0)
    t = default_tokens(128, 8)
    assert t == 40 and default_tokens(4, 2) == 32
    x = torch.randn(t, 64, generator=gen)
    w = torch.randn(128, 64, generator=gen)
    w[:4] *= 20
    ids, wts = _route(x, w, list(range(128)), 8, True, gen)
    assert int(torch.bincount(ids.reshape(-1), minlength=128).min()) >= MIN_SLOTS_PER_EXPERT
    assert all(len(set(row.tolist())) == 8 for row in ids)  # no expert twice in one token
    assert torch.allclose(wts.sum(1), torch.ones(t))


@pytest.mark.parametrize("bad, message", [(float("nan"), "1 non-finite scale(s)"),
                                          (float("inf"), "1 non-finite scale(s)"),
                                          (0.0, "1 scale(s) <= 0 (symmetric scales must be positive)"),
                                          (-0.5, "1 scale(s) <= 0 (symmetric scales must be positive)")])
def test_a_bad_scale_is_a_structural_problem(converted, tmp_path, bad, message):
    out = _copy(converted("gptq_q3_sym")[0], tmp_path / "bad")
    key = f"{EXP}.1.up_proj.weight_scale"

    def edit(t):
        if key in t:
            s = t[key].clone()
            s[3, 0] = bad
            t[key] = s
        return t

    _rewrite(out, edit)
    r = int4pack.verify(out, structural_only=True, raise_on_failure=False)
    assert not r["ok"]
    got = [p["message"] for p in r["structural"]["problems"] if p["where"] == f"{EXP}.1.up_proj"]
    assert got == [f"{key}: {message}"]


def test_fused_shards_split_between_ignore_and_w4a8_fail(converted, tmp_path):
    """q_proj dequantised to bf16 and listed in ignore beside W4A8 k_proj/v_proj: vLLM refuses it
    (one scheme per fused qkv_proj), so verify must too, naming the fused module."""
    out = _copy(converted("gptq_q3_sym")[0], tmp_path / "bad")
    q = "model.layers.0.self_attn.q_proj"

    def dequantise(t):
        if f"{q}.weight" not in t:
            return t
        w, s = t.pop(f"{q}.weight").float(), t.pop(f"{q}.weight_scale").float()
        t[f"{q}.weight"] = (w * s.repeat_interleave(w.shape[1] // s.shape[1], dim=1)).to(torch.bfloat16)
        return t

    _rewrite(out, dequantise)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = [*cfg["quantization_config"].get("ignore", []), q]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(VerifyFailed, match=r"self_attn\.qkv_proj: vLLM fuses k_proj, q_proj, v_proj into qkv_proj "
                                           r"and runs one scheme: q_proj listed in quantization_config\.ignore"):
        int4pack.verify(out, dense=False)
