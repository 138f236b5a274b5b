"""Tiny synthetic MoE checkpoints for tests, one per family's naming (formats.md §4).

Weights are written as GPTQ v1 symmetric (qweight packed along K with plain Python loops over
nibbles, independent of int4pack's unpackers), so a test can also check values end to end.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

H, I, E = 128, 64, 4


def pack_k(u: np.ndarray) -> np.ndarray:
    """uint4 [K, N] -> int32 [K/8, N], nibble i of row r = u[8r + i]."""
    k, n = u.shape
    out = np.zeros((k // 8, n), dtype=np.uint32)
    for i in range(8):
        out |= (u[i::8].astype(np.uint32) << np.uint32(4 * i))
    return out.view(np.int32)


def gptq_sym_linear(name: str, n: int, k: int, rng: np.random.Generator, group: int = 32) -> dict:
    u = rng.integers(0, 16, size=(k, n))
    zeros = np.full((k // group, n // 8), 0x77777777, dtype=np.uint32).view(np.int32)
    scales = (rng.random((k // group, n)) * 0.01 + 0.001).astype(np.float16)
    return {f"{name}.qweight": torch.from_numpy(pack_k(u)), f"{name}.qzeros": torch.from_numpy(zeros),
            f"{name}.scales": torch.from_numpy(scales),
            f"{name}.g_idx": torch.arange(k, dtype=torch.int32) // group}


def family_names(model_type: str, layers: int = 2, variant: str = "") -> tuple[list[tuple[str, int, int]], list, dict]:
    """(int4 linears [(name, N, K)], float tensors [name or (name, shape)], config extras) for one family."""
    if model_type in NEW_FAMILIES:
        return _new_family(model_type, layers, variant)
    lin, flt, extra = [], ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"], {}
    for li in range(layers):
        p = f"model.layers.{li}"
        for proj, n in (("q_proj", H), ("k_proj", H), ("v_proj", H), ("o_proj", H)):
            lin.append((f"{p}.self_attn.{proj}", n, H))
        flt += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
        dense = False
        if model_type in ("deepseek_v2", "deepseek_v3", "glm4_moe") and li == 0:
            dense, extra["first_k_dense_replace"] = True, 1
        if model_type == "qwen3_moe" and li == 0:
            dense, extra["mlp_only_layers"] = True, [0]
        if dense:
            for proj, (n, k) in {"gate_proj": (2 * I, H), "up_proj": (2 * I, H), "down_proj": (H, 2 * I)}.items():
                lin.append((f"{p}.mlp.{proj}", n, k))
            continue
        moe = f"{p}.block_sparse_moe" if model_type in ("mixtral", "phimoe") else f"{p}.mlp"
        names = ({"w1": (I, H), "w3": (I, H), "w2": (H, I)} if model_type in ("mixtral", "phimoe")
                 else {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)})
        for e in range(E):
            for proj, (n, k) in names.items():
                lin.append((f"{moe}.experts.{e}.{proj}", n, k))
        flt.append(f"{moe}.gate.weight")
        if model_type == "qwen2_moe":
            for proj, (n, k) in {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}.items():
                lin.append((f"{moe}.shared_expert.{proj}", n, k))
            flt.append(f"{moe}.shared_expert_gate.weight")
        if model_type in ("deepseek_v2", "deepseek_v3", "glm4_moe"):
            for proj, (n, k) in {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}.items():
                lin.append((f"{moe}.shared_experts.{proj}", n, k))
            if model_type != "deepseek_v2":
                flt.append(f"{moe}.gate.e_score_correction_bias")
    return lin, flt, extra


def write_gptq_family(folder: Path, model_type: str, *, seed: int = 0, layers: int = 2, variant: str = "") -> Path:
    """A tiny GPTQ v1 sym checkpoint of one family, split over two shards with an index."""
    rng = np.random.default_rng(seed)
    lin, flt, extra = family_names(model_type, layers, variant)
    tensors: dict[str, torch.Tensor] = {}
    for name, n, k in lin:
        tensors.update(gptq_sym_linear(name, n, k, rng))
    for name in flt:
        if isinstance(name, tuple):
            name, shape = name
            tensors[name] = torch.randn(*shape).to(torch.bfloat16)
        elif name.endswith("e_score_correction_bias"):
            # random and non-zero: a copy that is not bit-exact shows
            tensors[name] = torch.randn(E, dtype=torch.float32)
            tensors[name] = torch.zeros(E, dtype=torch.float32)
        elif name.endswith("norm.weight"):
            tensors[name] = torch.ones(H, dtype=torch.bfloat16)
        elif name.endswith("gate.weight"):
            rows = 1 if "shared_expert_gate" in name else E
            tensors[name] = torch.randn(rows, H).to(torch.bfloat16)
        else:
            tensors[name] = torch.randn(128, H).to(torch.bfloat16)
    folder.mkdir(parents=True)
    keys = sorted(tensors)
    half = len(keys) // 2
    wmap = {}
    for i, part in enumerate((keys[:half], keys[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, str(folder / fname))
        wmap.update({k: fname for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    n_exp = {"num_local_experts" if model_type in ("mixtral", "phimoe", "minimax_m2", "llama4", "llama4_text") else
             ("n_routed_experts" if model_type.startswith(("deepseek", "glm", "kimi")) else "num_experts"): E}
    outer = extra.pop("__outer__", None)
    text = {"model_type": extra.pop("__text_type__", model_type), "hidden_size": H, "num_hidden_layers": layers,
            "vocab_size": 128, **n_exp, **extra}
    q = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False,
         "checkpoint_format": "gptq"}
    cfg = ({"model_type": outer, "text_config": text, "quantization_config": q} if outer
           else {**text, "quantization_config": q})
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


# -- the families added in 2026 (families/): names as each producer writes them -------------------------

NEW_FAMILIES = ("minimax_m2", "kimi_k2", "kimi_k25", "deepseek_v32", "glm4_moe_lite", "qwen3_next", "qwen3_5_moe",
                "qwen3_5_moe_text", "llama4", "llama4_text")
_PREFIX = {"kimi_k25": "language_model.model.", "qwen3_5_moe": "model.language_model.",
           "llama4": "language_model.model."}
_TRIPLE = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}


def _new_family(model_type: str, layers: int, variant: str) -> tuple[list, list, dict]:
    """Variants: minimax_m2 "llmc" (gate/up/down_proj names, llm-compressor#3069); qwen3_5_moe
    "mtp_fused" (a float 3-D MTP block, as Qwen's own checkpoints store it); deepseek_v32 "float_indexer"."""
    pre = _PREFIX.get(model_type, "model.")
    head = "language_model.lm_head.weight" if model_type in ("kimi_k25", "llama4") else "lm_head.weight"
    lin: list = []
    flt: list = [f"{pre}embed_tokens.weight", f"{pre}norm.weight", head]
    extra: dict = {"num_experts_per_tok": 2}
    deepseek = model_type in ("kimi_k2", "kimi_k25", "deepseek_v32", "glm4_moe_lite")
    qwen = model_type.startswith(("qwen3_5", "qwen3_next"))
    if model_type in ("kimi_k25", "qwen3_5_moe", "llama4"):
        extra["__outer__"] = model_type
        extra["__text_type__"] = {"kimi_k25": "deepseek_v3", "qwen3_5_moe": "qwen3_5_moe_text",
                                  "llama4": "llama4_text"}[model_type]
    if deepseek:
        extra.update(first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                     scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True)
    if model_type == "minimax_m2":
        extra.update(scoring_func="sigmoid", use_routing_bias=True)
    if model_type.startswith("llama4"):
        extra.update(num_experts_per_tok=1, interleave_moe_layer_step=2)
    if qwen:
        extra.update(layer_types=["linear_attention" if li % 2 == 0 else "full_attention" for li in range(layers)],
                     norm_topk_prob=True)
    for li in range(layers):
        p = f"{pre}layers.{li}"
        flt += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
        if qwen and li % 2 == 0:  # Gated DeltaNet
            la = f"{p}.linear_attn"
            projs = ({"in_proj_qkvz": (4 * 32, H), "in_proj_ba": (32, H)} if model_type == "qwen3_next" else
                     {"in_proj_qkv": (3 * 32, H), "in_proj_z": (32, H), "in_proj_b": (16, H), "in_proj_a": (16, H)})
            for proj, (n, k) in {**projs, "out_proj": (H, 32)}.items():
                lin.append((f"{la}.{proj}", n, k))
            flt += [(f"{la}.conv1d.weight", (3 * 32, 1, 4)), (f"{la}.A_log", (16,)), (f"{la}.dt_bias", (16,)),
                    (f"{la}.norm.weight", (16,))]
        else:
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                lin.append((f"{p}.self_attn.{proj}", H, H))
        if model_type == "deepseek_v32":
            ix = f"{p}.self_attn.indexer"
            lin.append((f"{ix}.wq_b", 64, H))
            if variant == "float_indexer":
                flt += [(f"{ix}.wk.weight", (32, H)), (f"{ix}.weights_proj.weight", (8, H))]
            else:
                lin += [(f"{ix}.wk", 32, H), (f"{ix}.weights_proj", 8, H)]
            flt.append((f"{ix}.k_norm.weight", (32,)))
        if (deepseek and li == 0) or (model_type.startswith("llama4") and li % 2 == 1):
            ff = f"{p}.feed_forward" if model_type.startswith("llama4") else f"{p}.mlp"
            for proj, (n, k) in {"gate_proj": (2 * I, H), "up_proj": (2 * I, H), "down_proj": (H, 2 * I)}.items():
                lin.append((f"{ff}.{proj}", n, k))
            continue
        if model_type == "minimax_m2":
            moe = f"{p}.block_sparse_moe"
            names = _TRIPLE if variant == "llmc" else {"w1": (I, H), "w3": (I, H), "w2": (H, I)}
            flt += [f"{moe}.gate.weight", f"{moe}.e_score_correction_bias"]
        elif model_type.startswith("llama4"):
            moe, names = f"{p}.feed_forward", _TRIPLE
            flt.append((f"{moe}.router.weight", (E, H)))
        else:
            moe, names = f"{p}.mlp", _TRIPLE
            flt.append(f"{moe}.gate.weight")
            if deepseek:
                flt.append(f"{moe}.gate.e_score_correction_bias")
        for e in range(E):
            for proj, (n, k) in names.items():
                lin.append((f"{moe}.experts.{e}.{proj}", n, k))
        shared = ("shared_experts" if deepseek else "shared_expert" if (qwen or model_type.startswith("llama4"))
                  else None)
        if shared:
            for proj, (n, k) in _TRIPLE.items():
                lin.append((f"{moe}.{shared}.{proj}", n, k))
        if qwen:
            flt.append(f"{moe}.shared_expert_gate.weight")
    if qwen:
        m = "mtp.layers.0.mlp"
        flt += [("mtp.fc.weight", (H, 2 * H)), ("mtp.norm.weight", (H,)),
                f"{m}.gate.weight", f"{m}.shared_expert_gate.weight"]
        if variant == "mtp_fused":
            flt += [(f"{m}.experts.gate_up_proj", (E, 2 * I, H)), (f"{m}.experts.down_proj", (E, H, I))]
        else:
            lin += [(f"{m}.experts.{e}.{proj}", n, k) for e in range(E) for proj, (n, k) in _TRIPLE.items()]
        lin += [(f"{m}.shared_expert.{proj}", n, k) for proj, (n, k) in _TRIPLE.items()]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            lin.append((f"mtp.layers.0.self_attn.{proj}", H, H))
    if model_type == "qwen3_5_moe":
        flt += [("model.visual.blocks.0.attn.qkv.weight", (3 * 64, 64)), ("model.visual.patch_embed.proj.weight", (64, 3, 2, 4, 4))]
    if model_type == "kimi_k25":
        flt += [("vision_tower.encoder.blocks.0.mlp.fc0.weight", (64, 64)), ("mm_projector.proj.0.weight", (H, 64))]
    if model_type == "llama4":
        flt += [("vision_model.model.layers.0.mlp.fc1.weight", (64, 64)),
                ("multi_modal_projector.linear_1.weight", (H, 64))]
    return lin, flt, extra


# -- compressed-tensors pack-quantized sources (formats.md §3) -----------------------------------------


def ct_pack_linear(name: str, w: torch.Tensor, group: int = 32) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Symmetric int4 round-to-nearest of float w [N, K] as compressed-tensors pack-quantized.

    Returns (tensors, q [N, K] int in [-8, 7], scales bf16 [N, K/group]); word j of row n holds
    q[n, 8j + i] + 8 in nibble i (low nibble first)."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    s = (wg.abs().amax(2) / 7).clamp(min=1e-8).to(torch.bfloat16)
    q = (wg / s.float().unsqueeze(2)).round().clamp(-8, 7).reshape(n, k).to(torch.int64)
    u = (q + 8).numpy().astype(np.uint32)
    words = np.zeros((n, k // 8), dtype=np.uint32)
    for i in range(8):
        words |= u[:, i::8] << np.uint32(4 * i)
    tensors = {f"{name}.weight_packed": torch.from_numpy(words.view(np.int32)), f"{name}.weight_scale": s,
               f"{name}.weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    return tensors, q, s


def _ct_w4a16_config(group: int, ignore: list[str]) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "version": "0.20.0",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized", "input_activations": None,
                                          "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                      "strategy": "group", "group_size": group, "dynamic": False}}},
            "ignore": ignore}


def _write_ct(folder: Path, config: dict, linears: list[tuple[str, int, int]], floats: dict[str, torch.Tensor],
              seed: int, group: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Quantise N(0, 0.02) weights of ``linears``, write them with ``floats``; returns {module: (q, scales)}."""
    gen = torch.Generator().manual_seed(seed)
    tensors, ints = dict(floats), {}
    for name, n, k in linears:
        t, q, s = ct_pack_linear(name, torch.randn(n, k, generator=gen) * 0.02, group)
        tensors.update(t)
        ints[name] = (q, s)
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    routers = sorted(k[: -len(".weight")] for k in floats if k.endswith("mlp.gate.weight"))
    config["quantization_config"] = _ct_w4a16_config(group, ["lm_head", *routers])
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return ints


def write_ct_deepseek_v3(folder: Path, *, seed: int = 0, group: int = 32) -> dict:
    """DeepSeek-V3-style MLA + MoE (symmetric int4, group 32) whose kv_b_proj has K = kv_lora_rank = 32:
    layer 0 dense, layer 1 with 4 routed experts and a shared expert. Returns {module: (q, scales)}."""
    h, inter, e, heads, nope, rope, v_dim, q_rank, kv_rank, vocab = 128, 64, 4, 2, 32, 32, 32, 64, 32, 128
    gen = torch.Generator().manual_seed(seed + 1)
    lin, flt = [], {"model.embed_tokens.weight": torch.randn(vocab, h, generator=gen) * 0.02,
                    "model.norm.weight": torch.ones(h), "lm_head.weight": torch.randn(vocab, h, generator=gen) * 0.02}
    for li in range(2):
        p = f"model.layers.{li}"
        lin += [(f"{p}.self_attn.q_a_proj", q_rank, h), (f"{p}.self_attn.q_b_proj", heads * (nope + rope), q_rank),
                (f"{p}.self_attn.kv_a_proj_with_mqa", kv_rank + rope, h),
                (f"{p}.self_attn.kv_b_proj", heads * (nope + v_dim), kv_rank), (f"{p}.self_attn.o_proj", h, heads * v_dim)]
        flt.update({f"{p}.input_layernorm.weight": torch.ones(h), f"{p}.post_attention_layernorm.weight": torch.ones(h),
                    f"{p}.self_attn.q_a_layernorm.weight": torch.ones(q_rank),
                    f"{p}.self_attn.kv_a_layernorm.weight": torch.ones(kv_rank)})
        mlps = [f"{p}.mlp"] if li == 0 else [f"{p}.mlp.experts.{x}" for x in range(e)] + [f"{p}.mlp.shared_experts"]
        width = 2 * inter if li == 0 else inter
        for m in mlps:
            lin += [(f"{m}.gate_proj", width, h), (f"{m}.up_proj", width, h), (f"{m}.down_proj", h, width)]
        if li:
            flt[f"{p}.mlp.gate.weight"] = torch.randn(e, h, generator=gen) * 0.02
            flt[f"{p}.mlp.gate.e_score_correction_bias"] = torch.zeros(e)
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": h,
           "intermediate_size": 2 * inter, "moe_intermediate_size": inter, "n_routed_experts": e, "n_shared_experts": 1,
           "num_experts_per_tok": 2, "first_k_dense_replace": 1, "num_hidden_layers": 2, "num_attention_heads": heads,
           "num_key_value_heads": heads, "q_lora_rank": q_rank, "kv_lora_rank": kv_rank, "qk_nope_head_dim": nope,
           "qk_rope_head_dim": rope, "v_head_dim": v_dim, "vocab_size": vocab, "rms_norm_eps": 1e-6,
           "hidden_act": "silu", "torch_dtype": "float32"}
    return _write_ct(folder, cfg, lin, flt, seed, group)


def write_ct_qwen3moe(folder: Path, *, heads: int = 1, kv_heads: int = 1, head_dim: int = 32, seed: int = 0,
                      group: int = 32, layers: int = 2) -> dict:
    """Qwen3-MoE (symmetric int4, group 32, H=128, 4 experts of I=64); with the default single head of
    dim 32 o_proj has K = 32, the source group. Returns {module: (q, scales)}."""
    h, inter, e, vocab = 128, 64, 4, 256
    gen = torch.Generator().manual_seed(seed + 1)
    lin, flt = [], {"model.embed_tokens.weight": torch.randn(vocab, h, generator=gen) * 0.02,
                    "model.norm.weight": torch.ones(h), "lm_head.weight": torch.randn(vocab, h, generator=gen) * 0.02}
    for li in range(layers):
        p = f"model.layers.{li}"
        lin += [(f"{p}.self_attn.q_proj", heads * head_dim, h), (f"{p}.self_attn.k_proj", kv_heads * head_dim, h),
                (f"{p}.self_attn.v_proj", kv_heads * head_dim, h), (f"{p}.self_attn.o_proj", h, heads * head_dim)]
        for x in range(e):
            m = f"{p}.mlp.experts.{x}"
            lin += [(f"{m}.gate_proj", inter, h), (f"{m}.up_proj", inter, h), (f"{m}.down_proj", h, inter)]
        flt.update({f"{p}.input_layernorm.weight": torch.ones(h), f"{p}.post_attention_layernorm.weight": torch.ones(h),
                    f"{p}.self_attn.q_norm.weight": torch.ones(head_dim), f"{p}.self_attn.k_norm.weight": torch.ones(head_dim),
                    f"{p}.mlp.gate.weight": torch.randn(e, h, generator=gen) * 0.02})
    # the keys transformers 5.23 writes for Qwen3-MoE (as in tests/fixtures/ct_qwen3moe_w4a16)
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
           "attention_dropout": 0.0, "decoder_sparse_step": 1, "dtype": "bfloat16", "head_dim": head_dim,
           "hidden_act": "silu", "hidden_size": h, "initializer_range": 0.02, "intermediate_size": 2 * inter,
           "max_position_embeddings": 256, "mlp_only_layers": [], "moe_intermediate_size": inter,
           "norm_topk_prob": False, "num_attention_heads": heads, "num_experts_per_tok": 2,
           "num_hidden_layers": layers, "num_key_value_heads": kv_heads, "num_local_experts": e,
           "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
           "sliding_window": None, "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False,
           "vocab_size": vocab}
    return _write_ct(folder, cfg, lin, flt, seed, group)
