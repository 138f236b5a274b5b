"""MoE discovery per family: roles, experts, routers, shared experts, dense layers, refusals."""

from __future__ import annotations

import json

import pytest

import int4pack
from _synth import E, family_names, write_gptq_family
from int4pack.architectures import classify, discover
from int4pack.errors import InputError, RefusedError

FAMILIES = ["mixtral", "phimoe", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe"]


@pytest.mark.parametrize("name,role,proj", [
    ("model.layers.3.block_sparse_moe.experts.7.w1", "expert", "gate"),
    ("model.layers.3.block_sparse_moe.experts.7.w3", "expert", "up"),
    ("model.layers.3.block_sparse_moe.experts.7.w2", "expert", "down"),
    ("model.layers.3.block_sparse_moe.experts.7.down_proj", "expert", "down"),
    ("model.layers.3.mlp.experts.12.up_proj", "expert", "up"),
    ("model.layers.3.mlp.shared_expert.gate_proj", "shared_expert", "gate"),
    ("model.layers.3.mlp.shared_experts.down_proj", "shared_expert", "down"),
    ("model.layers.0.mlp.down_proj", "dense_mlp", "down"),
    ("model.layers.0.self_attn.kv_a_proj_with_mqa", "attention", None),
    ("model.layers.0.self_attn.o_proj", "attention", None),
])
def test_classify(name, role, proj):
    got_role, d = classify(name)
    assert got_role == role and d.get("proj") == proj


@pytest.mark.parametrize("model_type", FAMILIES)
def test_discover_every_family(model_type):
    lin, flt, extra = family_names(model_type)
    cfg = {"num_experts": E, **extra}
    tensors = [f"{n}.qweight" for n, _, _ in lin] + flt
    lay = discover(model_type, cfg, [n for n, _, _ in lin], tensors)
    dense_first = model_type in ("deepseek_v2", "deepseek_v3", "glm4_moe", "qwen3_moe")
    assert len(lay.moe_layers) == (1 if dense_first else 2)
    for m in lay.moe_layers:
        assert m.num_experts == E and m.router == f"{m.prefix}.gate"
        assert all(set(slot) == {"gate", "up", "down"} for slot in m.experts.values())
        assert bool(m.shared) == (model_type in ("qwen2_moe", "deepseek_v2", "deepseek_v3", "glm4_moe"))
        assert (m.shared_gate is not None) == (model_type == "qwen2_moe")
    counts = lay.counts()
    assert counts["attention"] == 8 and counts["expert"] == 3 * E * len(lay.moe_layers)
    assert counts.get("dense_mlp", 0) == (3 if dense_first else 0)


@pytest.mark.parametrize("model_type,tensor", [
    ("granitemoe", "model.layers.0.block_sparse_moe.input_linear.weight"),
    ("llama4_text", "model.layers.0.feed_forward.experts.gate_up_proj"),
    ("gpt_oss", "model.layers.0.mlp.experts.gate_up_proj.weight_packed"),  # MXFP4 converts, 3-D int4 does not
    ("qwen3_moe", "model.layers.0.mlp.experts.gate_up_proj"),  # a 3-D ct repack in a known family
])
def test_fused_layouts_refused_naming_tensors(model_type, tensor):
    with pytest.raises(RefusedError) as ei:
        discover(model_type, {}, [], [tensor, "model.norm.weight"])
    assert "fused" in str(ei.value) and (tensor in str(ei.value) or model_type in str(ei.value))


def test_unknown_family_refused():
    with pytest.raises(RefusedError, match="not a MoE family"):
        discover("jamba", {}, ["model.layers.0.mlp.experts.0.gate_proj"], [])


def test_missing_expert_and_projection():
    lin, flt, _ = family_names("qwen3_moe")  # layer 0 dense, layer 1 MoE
    names = [n for n, _, _ in lin if "experts.2." not in n]
    with pytest.raises(InputError, match=r"expert\(s\) \[2\] missing"):
        discover("qwen3_moe", {"num_experts": E}, names, flt)
    names = [n for n, _, _ in lin if not n.endswith("experts.1.up_proj")]
    with pytest.raises(InputError, match="no quantised up projection"):
        discover("qwen3_moe", {"num_experts": E}, names, flt)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_family_converts_end_to_end(model_type, tmp_path):
    src = write_gptq_family(tmp_path / "src", model_type)
    r = int4pack.convert(src, tmp_path / "out")
    plan = r["plan"]
    assert plan["paths"]["lossless"] == len(r["modules"])
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    ignore = cfg["quantization_config"]["ignore"]
    # routers (and Qwen2's shared expert gate) stay float and are listed for vLLM to skip
    assert all(m.endswith("gate") for m in ignore if m != "lm_head")
    assert sum(1 for m in ignore if m.endswith(".gate")) == plan["moe_layers"]
    if model_type == "qwen2_moe":
        assert any(m.endswith("shared_expert_gate") for m in ignore)
    assert all(v == "copied" for k, v in r["tensors"].items() if "e_score_correction_bias" in k)
