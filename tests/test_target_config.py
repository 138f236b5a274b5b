"""The quantization_config convert writes: one scheme as before, several schemes as config groups
whose targets vLLM resolves to exactly the intended modules (checked with tests/_reference.py's
VllmSchemes, the matching rules of vLLM 0.19.1 and 0.32.0 written independently)."""

from __future__ import annotations

import json
import re
from contextlib import nullcontext

import pytest

from int4pack.serving.target_config import scheme_targets, w4a8_quant_config
from _reference import VllmSchemes, vllm_detects_w4a8

VERSIONS = ("0.19.1", "0.32.0")

# int4pack 0.1.0's config for gptq_q3_sym (one scheme, group 32), written before per-module schemes
ONE_SCHEME_G32 = (
    '{"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed", '
    '"config_groups": {"group_0": {"targets": ["Linear"], "format": "int-quantized", "weights": {"num_bits": 4, '
    '"type": "int", "symmetric": true, "strategy": "group", "group_size": 32, "dynamic": false, "actorder": null, '
    '"block_structure": null, "observer": null, "observer_kwargs": {}}, "input_activations": {"num_bits": 8, '
    '"type": "int", "symmetric": true, "strategy": "token", "group_size": null, "dynamic": true, "observer": null, '
    '"observer_kwargs": {}}, "output_activations": null}}, "ignore": ["lm_head", "model.layers.0.mlp.gate", '
    '"model.layers.1.mlp.gate"], "kv_cache_scheme": null, "global_compression_ratio": null, "sparsity_config": {}, '
    '"transform_config": {}, "version": "0.20.0"}')
IGNORE = ["model.layers.1.mlp.gate", "lm_head", "model.layers.0.mlp.gate"]


@pytest.mark.parametrize("groups", [32, {"model.layers.0.self_attn.q_proj": 32, "model.layers.1.mlp.experts.3.w2": 32}])
def test_one_scheme_is_the_config_written_before(groups):
    assert json.dumps(w4a8_quant_config(groups, IGNORE)) == ONE_SCHEME_G32


def test_channel_scheme_fields():
    w = w4a8_quant_config(-1, [])["config_groups"]["group_0"]["weights"]
    assert (w["strategy"], w["group_size"]) == ("channel", None)


def test_targets_hand_checked():
    mods = [f"model.layers.{li}.self_attn.{p}_proj" for li in (0, 1, 10) for p in ("q", "k", "v")]
    mods += ["model.layers.1.mlp.experts.0.down_proj", "model.layers.1.mlp.experts.7.gate_proj",
             "model.layers.0.mlp.gate_proj", "lm_head"]
    assert scheme_targets(mods) == [
        r"re:^lm_head$",
        r"re:^model\.layers\.(?:0|1|10)\.self_attn\.(?:k_proj|q_proj|qkv_proj|v_proj)$",
        r"re:^model\.layers\.0\.mlp\.gate_proj$",  # its up_proj is elsewhere: no gate_up_proj
        r"re:^model\.layers\.1\.mlp\.experts\.\d+\.(?:down_proj|gate_proj|up_proj)$",
    ]


def test_targets_name_nothing_else():
    mods = ["model.layers.1.self_attn.kv_b_proj", "model.layers.3.self_attn.kv_b_proj"]
    (t,) = scheme_targets(mods)
    pat = t[3:]
    hits = [n for n in ("model.layers.1.self_attn.kv_b_proj", "model.layers.3.self_attn.kv_b_proj",
                        "model.layers.13.self_attn.kv_b_proj", "model.layers.31.self_attn.kv_b_proj",
                        "model.layers.1.self_attn.kv_b_proj_x", "model.layers.1.self_attn.q_b_proj",
                        "xmodel.layers.1.self_attn.kv_b_proj", "model.layers.1.self_attnXkv_b_proj")
            if re.match(pat, n)]
    assert hits == mods


# -- mixed schemes as vLLM resolves them -------------------------------------------------------------

def _deepseek_v3():
    """Module -> group of a 2-layer DeepSeek-V3 (layer 0 dense) whose kv_b_proj is channelwise."""
    g = {}
    for li in (0, 1):
        a = f"model.layers.{li}.self_attn"
        g.update({f"{a}.q_a_proj": 32, f"{a}.kv_a_proj_with_mqa": 32, f"{a}.q_b_proj": 32, f"{a}.o_proj": 32,
                  f"{a}.kv_b_proj": -1})
    for m in ["model.layers.0.mlp", "model.layers.1.mlp.shared_experts"] + [f"model.layers.1.mlp.experts.{e}"
                                                                          for e in range(4)]:
        g.update({f"{m}.{p}": 32 for p in ("gate_proj", "up_proj", "down_proj")})
    packed = {"gate_up_proj": ["gate_proj", "up_proj"], "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"]}
    layers = {}  # vLLM layer -> (class, expected group size or None)
    for li in (0, 1):
        a = f"model.layers.{li}.self_attn"
        layers.update({f"{a}.fused_qkv_a_proj": ("MergedColumnParallelLinear", 32),
                       f"{a}.q_b_proj": ("ColumnParallelLinear", 32), f"{a}.kv_b_proj": ("ColumnParallelLinear", -1),
                       f"{a}.o_proj": ("RowParallelLinear", 32)})
    for m in ("model.layers.0.mlp", "model.layers.1.mlp.shared_experts"):
        layers.update({f"{m}.gate_up_proj": ("MergedColumnParallelLinear", 32), f"{m}.down_proj": ("RowParallelLinear", 32)})
    layers["model.layers.1.mlp.gate"] = ("ReplicatedLinear", None)
    return g, packed, layers, {"model.layers.1.mlp.experts": (("gate_proj", "up_proj", "down_proj"), 32)}


def _qwen3_minority_experts():
    """Qwen3-MoE: attention at group 64, layer 1's experts channelwise, layer 0's at group 64."""
    g = {}
    for li in (0, 1):
        g.update({f"model.layers.{li}.self_attn.{p}_proj": 64 for p in "qkvo"})
        g.update({f"model.layers.{li}.mlp.experts.{e}.{p}": (64 if li == 0 else -1)
                  for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")})
    layers = {}
    for li in (0, 1):
        layers[f"model.layers.{li}.self_attn.qkv_proj"] = ("QKVParallelLinear", 64)
        layers[f"model.layers.{li}.self_attn.o_proj"] = ("RowParallelLinear", 64)
        layers[f"model.layers.{li}.mlp.gate"] = ("ReplicatedLinear", None)
    moes = {"model.layers.0.mlp.experts": (("gate_proj", "up_proj", "down_proj"), 64),
            "model.layers.1.mlp.experts": (("gate_proj", "up_proj", "down_proj"), -1)}
    return g, {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}, layers, moes


def _mixtral_w123():
    """Mixtral with block_sparse_moe.experts.E.w1/w3/w2: experts at group 32, o_proj channelwise."""
    g = {}
    for li in (0, 1):
        g.update({f"model.layers.{li}.self_attn.{p}_proj": 32 for p in "qkv"})
        g[f"model.layers.{li}.self_attn.o_proj"] = -1
        g.update({f"model.layers.{li}.block_sparse_moe.experts.{e}.{w}": 32 for e in range(4) for w in ("w1", "w2", "w3")})
    layers = {}
    for li in (0, 1):
        layers[f"model.layers.{li}.self_attn.qkv_proj"] = ("QKVParallelLinear", 32)
        layers[f"model.layers.{li}.self_attn.o_proj"] = ("RowParallelLinear", -1)
        layers[f"model.layers.{li}.block_sparse_moe.gate"] = ("ReplicatedLinear", None)
    moes = {f"model.layers.{li}.block_sparse_moe.experts": (("w1", "w3", "w2"), 32) for li in (0, 1)}
    return g, {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}, layers, moes


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("model", [_deepseek_v3, _qwen3_minority_experts, _mixtral_w123])
def test_vllm_resolves_every_layer_to_its_scheme(model, version):
    groups, packed, layers, moes = model()
    routers = [n for n, (_, g) in layers.items() if g is None]
    cfg = w4a8_quant_config(groups, ["lm_head", *routers])
    assert len(cfg["config_groups"]) == len(set(groups.values())) > 1
    assert vllm_detects_w4a8(cfg)
    size = {name: (-1 if grp["weights"]["strategy"] == "channel" else grp["weights"]["group_size"])
            for name, grp in cfg["config_groups"].items()}
    assert all("Linear" not in grp["targets"] for grp in cfg["config_groups"].values())
    v = VllmSchemes(cfg, version, packed)
    for name, (cls, want) in layers.items():
        got = v.linear(name, cls)
        assert (None if got is None else size[got]) == want, name
    for prefix, (ckpt_names, want) in moes.items():
        assert size[v.moe(prefix, ckpt_names)] == want, prefix
    if version == "0.32.0":  # 0.32.0 also asks for lm_head (ParallelLMHead) and the embedding
        assert v.linear("lm_head", "ParallelLMHead") is None
        assert v.linear("model.embed_tokens", "VocabParallelEmbedding") is None
    with pytest.raises(ValueError) if version == "0.19.1" else nullcontext():
        assert v.linear("model.layers.5.self_attn.o_proj") is None  # a layer the config does not know


@pytest.mark.parametrize("version", VERSIONS)
def test_matcher_sees_a_split_fused_module(version):
    """The reference matcher itself: shards of one fused module under two ignore states are refused."""
    cfg = w4a8_quant_config({"m.layers.0.self_attn.q_proj": 32, "m.layers.0.self_attn.o_proj": -1},
                            ["m.layers.0.self_attn.k_proj"])
    with pytest.raises(ValueError):
        VllmSchemes(cfg, version, {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}).linear("m.layers.0.self_attn.qkv_proj")


@pytest.mark.parametrize("serve_format", [None, "kleidiai"])
def test_minimax_m3_ignore_names_vision_tower_as_vllm_registers_it(serve_format, tmp_path):
    """vLLM 0.32.0's MiniMaxVLEncoderLayer holds fc1 / fc2 on the encoder layer
    (models/minimax_m3/common/vision_tower.py:204 ``prefix=f"{prefix}.fc1"``, :213 ``.fc2``) and loads
    the checkpoint's ``.mlp.fc1.`` through its WeightsMapper (nvidia/model.py:1135-1136), which an
    ``ignore`` entry (no trailing dot) never matches: the output must name ``layers.0.fc1``, or vLLM
    quantises the bf16 tower. The tensors on disk keep transformers' names (the mapper renames them)."""
    import int4pack
    from _reference import FIXTURES

    src = FIXTURES / "ct_minimaxm3_w4a16"
    kw = {"serve_format": serve_format} if serve_format else {}
    int4pack.convert(src, tmp_path / "out", **kw)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    ignore = cfg["quantization_config"]["ignore"]
    tower = sorted(m for m in ignore if m.startswith("vision_tower."))
    # written from vision_tower.py: MiniMaxVLEncoderLayer.{self_attn.(q,k,v: shards of qkv_proj), out_proj; fc1, fc2}
    assert tower == sorted(f"vision_tower.vision_model.encoder.layers.0.{m}" for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "fc1", "fc2")), tower
    assert not [m for m in ignore if re.search(r"vision_tower\..*\.mlp\.fc[12]$", m)]
    names = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight" in names
