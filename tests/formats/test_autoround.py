"""AutoRound reader: synthetic checkpoints in each packing auto-round 0.16 writes (its qlinear_torch_zp
packer for auto_round:auto_gptq stores zero - 1, qlinear_torch for auto_round stores the zero, the AWQ
GEMM packer for auto_round:auto_awq), checked against float64 weights computed from the codes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from int4pack.sources.checkpoint import Checkpoint
from int4pack.errors import InputError, RefusedError
from int4pack.formats import READERS, open_reader
from int4pack.formats.autoround import SIGNED_WARNING, AutoRoundAWQReader, AutoRoundGPTQReader
from int4pack.plan import make_plan
from test_awq import awq_tensors
from test_gptq import gptq8_tensors, gptq_tensors

H = 256
L0 = "model.layers.0.mlp"


def cfg(**kw):
    base = {"quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", "bits": 4, "group_size": 128,
            "sym": True, "data_type": "int", "act_bits": 16, "autoround_version": "0.16.1",
            "block_name_to_quantize": "model.layers"}
    base.update(kw)
    return base


def moe(rng, *, group=128, store="v1", asym=False, experts=2, wide: dict | None = None):
    """One MoE layer of ``experts`` experts (gate/up/down, 256 x 256) plus its float router: the tensors
    and each module's float64 weights [N, K]. ``wide``: module -> 8, written 8-bit."""
    tensors, truth = {f"{L0}.gate.weight": torch.randn(experts, H).to(torch.bfloat16)}, {}
    for e in range(experts):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            m = f"{L0}.experts.{e}.{proj}"
            if (wide or {}).get(m) == 8:
                t, w = gptq8_tensors(rng, m, k=H, n=H, group=group if group > 0 else H, store=store, asym=asym)
            else:
                zeros = rng.integers(3, 13, (H // (group if group > 0 else H), H)) if asym else None
                t, w = gptq_tensors(rng, m, k=H, n=H, group=group if group > 0 else H, zeros=zeros, store=store)
            del t[f"{m}.g_idx"]  # auto-round's packers write none
            tensors.update(t)
            truth[m] = w
    return tensors, truth


@pytest.mark.parametrize("packing,store", [("auto_round:auto_gptq", "v1"), ("auto_round", "v2"),
                                           ("auto_round:gptqmodel", "v2")])
@pytest.mark.parametrize("asym", [False, True])
def test_gptq_packings_decode_to_the_weights(make_ckpt, packing, store, asym):
    t, truth = moe(np.random.default_rng(1), store=store, asym=asym)
    reader = open_reader(Checkpoint(make_ckpt(t, cfg(packing_format=packing, sym=not asym))))
    assert isinstance(reader, AutoRoundGPTQReader)
    v = reader.verdict()
    assert v.format == "auto-round" and v.extra["zero_convention"] == store and v.extra["packing_format"] == packing
    assert not v.warnings
    specs = reader.linears()
    assert set(specs) == set(truth)
    for m, spec in specs.items():
        assert spec.fmt == "gptq" and spec.bits == 4 and spec.group_size == 128 and spec.k == H
        np.testing.assert_allclose(reader.read(spec).dequantize().numpy(), truth[m], rtol=1e-6, atol=0)


@pytest.mark.parametrize("group", [32, 64, 128, -1])
def test_symmetric_at_kleidiai_groups_is_lossless(make_ckpt, group):
    t, _ = moe(np.random.default_rng(2), group=group)
    plan = make_plan(Checkpoint(make_ckpt(t, cfg(group_size=group))))
    assert set(p for j in plan.jobs for p in j.paths.values()) == {"lossless"}
    assert plan.group_size == group
    assert plan.verdict.format == "auto-round"


def test_full_range_signed_scales_are_requantised(make_ckpt):
    """auto-round's quant_tensor_sym: scale = -max / 8 for a group led by a positive weight, so that the
    largest weight sits at q = -8; such groups hold -7..8 x |scale|, no positive-scale int4 grid."""
    rng = np.random.default_rng(12)
    t, truth = moe(rng, group=32)
    m = f"{L0}.experts.0.up_proj"
    s = t[f"{m}.scales"].copy()
    s[:, ::2] *= -1  # every other column's scales negative, as auto-round writes them
    t[f"{m}.scales"] = s
    truth[m] = truth[m] * np.where(np.arange(H) % 2 == 0, -1.0, 1.0)[:, None]
    reader = open_reader(Checkpoint(make_ckpt(t, cfg(group_size=32))))
    v = reader.verdict()
    assert v.warnings == [SIGNED_WARNING] and any(e.startswith("negative scales in") for e in v.evidence)
    specs = reader.linears()
    assert all(sp.signed_scales for sp in specs.values())
    np.testing.assert_allclose(reader.read(specs[m]).dequantize().numpy(), truth[m], rtol=1e-6, atol=0)
    plan = make_plan(reader.ckpt)
    assert set(p for j in plan.jobs for p in j.paths.values()) == {"requant"}


def test_asymmetric_is_requantised(make_ckpt):
    t, _ = moe(np.random.default_rng(3), store="v2", asym=True)
    plan = make_plan(Checkpoint(make_ckpt(t, cfg(packing_format="auto_round", sym=False))))
    assert set(p for j in plan.jobs for p in j.paths.values()) == {"requant"}


def test_config_in_quantization_config_json_only(make_ckpt):
    t, truth = moe(np.random.default_rng(4))
    folder = make_ckpt(t, cfg())
    c = json.loads((folder / "config.json").read_text())
    q = c.pop("quantization_config")
    (folder / "config.json").write_text(json.dumps(c))
    (folder / "quantization_config.json").write_text(json.dumps(q))
    ck = Checkpoint(folder)
    assert ck.quant_config is None  # the checkpoint's own places hold none
    reader = open_reader(ck)
    assert isinstance(reader, AutoRoundGPTQReader) and reader.path.endswith("quantization_config.json")
    m = f"{L0}.experts.1.down_proj"
    np.testing.assert_allclose(reader.read(reader.linears()[m]).dequantize().numpy(), truth[m], rtol=1e-6)
    assert "quantization_config.json" not in ck.extra_files()  # the source's quantisation stays behind


def test_model_extra_tensors_is_one_more_shard(make_ckpt):
    """auto-round writes the MTP weights it copies from the source into model_extra_tensors.safetensors
    and adds them to the index: they are read like any shard (here an extra MoE layer's experts)."""
    rng = np.random.default_rng(5)
    t, _ = moe(rng)
    extra = {}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        m = f"model.layers.1.mlp.experts.0.{proj}"
        tt, _ = gptq_tensors(rng, m, k=H, n=H, group=128, store="v1")
        del tt[f"{m}.g_idx"]
        extra.update(tt)
    extra["model.layers.1.mlp.gate.weight"] = torch.randn(1, H).to(torch.bfloat16)
    folder = make_ckpt({**t, **extra}, cfg(), shards=[set(t), set(extra)])
    (folder / "model-00002-of-00002.safetensors").rename(folder / "model_extra_tensors.safetensors")
    idx = json.loads((folder / "model.safetensors.index.json").read_text())
    idx["weight_map"] = {k: ("model_extra_tensors.safetensors" if k in extra else v) for k, v in idx["weight_map"].items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(idx))
    ck = Checkpoint(folder)
    plan = make_plan(ck)
    assert "model_extra_tensors.safetensors" in ck.shards
    assert plan.accounted["model.layers.1.mlp.experts.0.down_proj.qweight"].startswith("converted:")
    assert plan.accounted["model.layers.1.mlp.gate.weight"] == "copied"


def test_extra_config_exact_name_8bit_and_regex_16bit(make_ckpt):
    rng = np.random.default_rng(6)
    wide = f"{L0}.experts.0.down_proj"
    t, truth = moe(rng, wide={wide: 8})
    # a 16-bit module: auto-round leaves its float weight (no qweight); a regex key says so
    t["model.layers.0.self_attn.q_proj.weight"] = torch.randn(H, H).to(torch.bfloat16)
    extra = {wide: {"bits": 8}, r".*self_attn.*": {"bits": 16, "data_type": "fp"},
             r".*experts\.1\..*": {"sym": True}, r".*experts.*": {"bits": 3}}  # the longest pattern wins
    reader = open_reader(Checkpoint(make_ckpt(t, cfg(extra_config=extra))))
    specs = reader.linears()
    assert "model.layers.0.self_attn.q_proj" not in specs
    s8 = specs[wide]
    assert s8.bits == 8 and any(f"extra_config {wide!r}" in n for n in s8.notes)
    np.testing.assert_allclose(reader.read(s8).dense.numpy(), truth[wide], rtol=1e-6, atol=1e-9)
    assert specs[f"{L0}.experts.1.up_proj"].bits == 4 and not specs[f"{L0}.experts.1.up_proj"].refused
    assert specs[f"{L0}.experts.0.up_proj"].refused and "bits=3" in specs[f"{L0}.experts.0.up_proj"].refused


def test_extra_config_bad_regex_names_the_key(make_ckpt):
    t, _ = moe(np.random.default_rng(7))
    with pytest.raises(InputError, match=r"extra_config key '\.\*\(mtp' is not a valid regex"):
        open_reader(Checkpoint(make_ckpt(t, cfg(extra_config={".*(mtp": {"bits": 8}}))))


def test_auto_awq_packing(make_ckpt):
    t, truth = awq_tensors(np.random.default_rng(8))
    reader = open_reader(Checkpoint(make_ckpt(t, cfg(packing_format="auto_round:auto_awq", group_size=16,
                                                     sym=False))))
    assert isinstance(reader, AutoRoundAWQReader)
    v = reader.verdict()
    assert v.format == "auto-round" and "auto_awq" in v.detail
    (m, spec), = reader.linears().items()
    np.testing.assert_allclose(reader.read(spec).dequantize().numpy(), truth, rtol=1e-6, atol=0)


def test_auto_awq_refuses_other_widths(make_ckpt):
    t, _ = awq_tensors(np.random.default_rng(9))
    (m,) = {k.rsplit(".", 1)[0] for k in t}
    reader = open_reader(Checkpoint(make_ckpt(t, cfg(packing_format="auto_round:auto_awq", group_size=16,
                                                     extra_config={m: {"bits": 8}}))))
    with pytest.raises(RefusedError, match="8-bit.*auto_awq"):
        reader.linears()


@pytest.mark.parametrize("over,match", [
    ({"packing_format": "auto_round:llm_compressor"}, "compressed-tensors tensors"),
    ({"packing_format": "auto_round:fp8_static"}, "FP8"),
    ({"packing_format": "auto_round:marlin"}, "does not know"),
    ({"data_type": "nv_fp"}, "float weights"),
    ({"act_bits": 8}, "act_bits 8"),
    ({"bits": 8}, "4-bit checkpoints only"),
])
def test_refused_configs(make_ckpt, over, match):
    t, _ = moe(np.random.default_rng(10))
    with pytest.raises(RefusedError, match=match) as e:
        open_reader(Checkpoint(make_ckpt(t, cfg(**over)))).linears()
    assert e.value.path.endswith("config.json")


def test_unknown_quant_method_lists_the_table(make_ckpt):
    t, _ = moe(np.random.default_rng(11))
    with pytest.raises(RefusedError, match="'hqq' is not supported") as e:
        open_reader(Checkpoint(make_ckpt(t, cfg(quant_method="hqq"))))
    for row in READERS:
        assert f"{row.name}: {row.reads}" in e.value.hint


# -- auto-round 0.16.1's own checkpoints (tests/fixtures/README.md) ------------------------------------
AUTOROUND_FIXTURES = {  # fixture -> (packing_format, zero convention, reader, signed symmetric scales)
    "autoround_q3_sym_g32": ("auto_round:auto_gptq", "v1", AutoRoundGPTQReader, True),
    "autoround_q3_sym_g128": ("auto_round:auto_gptq", "v1", AutoRoundGPTQReader, True),
    "autoround_q3_gptq_asym_g32": ("auto_round:auto_gptq", "v1", AutoRoundGPTQReader, False),
    "autoround_q3_asym_g32": ("auto_round", "v2", AutoRoundGPTQReader, False),
    "autoround_q3_awq_g32": ("auto_round:auto_awq", None, AutoRoundAWQReader, False),
    "autoround_q3_mixed_g32": ("auto_round:auto_gptq", "v1", AutoRoundGPTQReader, True),
}


@pytest.mark.parametrize("name", sorted(AUTOROUND_FIXTURES))
def test_real_fixture_matches_auto_rounds_own_dequantisation(name, fixture_dir):
    """reference/autoround_dequantized.safetensors holds auto-round's own float16 dequantisation of a few modules
    (an int4 expert's gate/up/down and an attention projection; 8-bit ones in the mixed fixture): the
    reader's exact float32 values, rounded to float16 once, are those bit for bit."""
    from safetensors.torch import load_file

    folder = fixture_dir(name)
    packing, conv, cls, signed = AUTOROUND_FIXTURES[name]
    reader = open_reader(Checkpoint(folder))
    assert isinstance(getattr(reader, "inner", reader), cls)
    v = reader.verdict()
    assert v.format == "auto-round" and v.extra["packing_format"] == packing
    assert v.warnings == ([SIGNED_WARNING] if signed else [])
    if conv:
        assert v.extra["zero_convention"] == conv
    specs = reader.linears()
    ref = load_file(str(folder / "reference" / "autoround_dequantized.safetensors"))
    assert len(ref) == 4
    for key, w in ref.items():
        spec = specs[key[: -len(".weight")]]
        ours = reader.read(spec).dequantize()
        assert ours.shape == w.shape == (spec.n, spec.k)
        torch.testing.assert_close(ours.to(torch.float16), w, rtol=0, atol=0, msg=key)


def test_real_mixed_fixture_decisions(fixture_dir):
    folder = fixture_dir("autoround_q3_mixed_g32")
    ck = Checkpoint(folder)
    plan = make_plan(ck)
    p = {m: x for j in plan.jobs for m, x in j.paths.items()}
    assert p["model.layers.1.mlp.experts.2.down_proj"] == "requant"  # 8-bit beside int4 siblings
    assert p["model.layers.0.mlp.experts.1.up_proj"] == "requant"  # bf16 beside int4 siblings
    assert p["model.layers.1.mlp.experts.2.gate_proj"] == "requant"  # signed scales (see below)
    attn = [m for m in p if ".self_attn." in m]
    assert attn and all(p[m] == "dequant" for m in attn)  # 8-bit attention, MTP's included: bf16
    # the MTP block in model_extra_tensors.safetensors: its int4 experts converted, mtp.fc copied
    assert "model_extra_tensors.safetensors" in ck.shards
    assert p["mtp.layers.0.mlp.experts.0.gate_proj"] == "requant"
    assert plan.accounted["mtp.fc.weight"] == "copied"
    rows = {(r["role"], r["source"]): r["modules"] for r in plan.summary()["mixed_precision"]}
    assert rows == {("expert", "8-bit"): 1, ("expert", "float"): 1, ("attention", "8-bit"): 12}


@pytest.mark.parametrize("name,serve", [(n, "compressed-tensors") for n in sorted(AUTOROUND_FIXTURES)]
                         + [("autoround_q3_sym_g32", "kleidiai"), ("autoround_q3_mixed_g32", "kleidiai")])
def test_real_fixture_converts_and_verifies(name, serve, fixture_dir, tmp_path):
    import int4pack

    report = int4pack.convert(fixture_dir(name), tmp_path / "out", serve_format=serve)
    assert "lossless" not in {m["path"] for m in report["modules"].values()}  # signed or asymmetric: requantised
    for m, rec in report["modules"].items():
        if rec["path"] == "requant":  # never worse than plain RTN
            assert float(rec["rel_l2"]) <= float(rec["baseline_rel_l2"]) * (1 + 1e-6), m
    assert int4pack.verify(tmp_path / "out", against=fixture_dir(name), processes=False)["ok"]
