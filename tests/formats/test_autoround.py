"""AutoRound reader: synthetic checkpoints in each packing auto-round 0.16 writes (its qlinear_torch_zp
packer for auto_round:auto_gptq stores zero - 1, qlinear_torch for auto_round stores the zero, the AWQ
GEMM packer for auto_round:auto_awq), checked against float64 weights computed from the codes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from int4pack.checkpoint import Checkpoint
from int4pack.errors import InputError, RefusedError
from int4pack.formats import READERS, open_reader
from int4pack.formats.autoround import AutoRoundAWQReader, AutoRoundGPTQReader
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
