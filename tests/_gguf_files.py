"""Tiny GGUF models written by the gguf package's own writer and quantiser (GGUFWriter,
gguf.quants.quantize): the producer's files, for the GGUF reader's tests. Types gguf cannot
quantise (the K-quants, IQ4_*) get random blocks with sane fp16 scales, which gguf's own
dequantize then defines."""

from __future__ import annotations

from pathlib import Path

import numpy as np

H, I, E, LAYERS, HEADS, KV, HEAD_DIM, VOCAB, SHARED = 256, 256, 4, 2, 2, 1, 128, 320, 256
_SCALE_AT = {"Q4_K": (0, 4), "Q5_K": (0, 4), "Q6_K": (208, 210), "IQ4_NL": (0, 2), "IQ4_XS": (0, 2),
             "Q8_0": (0, 2)}  # fp16 scale bytes of each block (Q4_K/Q5_K: d and dmin)
# Q4_K/Q5_K: 12 bytes of 6-bit scales sc and mins m at byte 4 (ggml's get_scale_min_k4), all sc = 8, m = 60
# (value d * (8 q - 60)) or sc = 4, m = 62 (d * (4 q - 62)); Q6_K: int8 scales at byte 192
_SUB_SCALES = {"Q4_K": (4, [8] * 4 + [252] * 4 + [0xC8] * 4), "Q5_K": (4, [4] * 4 + [254] * 4 + [0xE4] * 4),
               "Q6_K": (192, [8] * 16)}


def blocks(rng, x: np.ndarray, qtype: str) -> np.ndarray:
    """x float32 [..., K] in ``qtype``'s block bytes: gguf's quantiser, else random blocks."""
    import gguf
    from gguf import quants

    t = gguf.GGMLQuantizationType[qtype]
    try:
        return quants.quantize(x, t)
    except NotImplementedError:
        bs, ts = gguf.GGML_QUANT_SIZES[t]
        n_blocks = x.size // bs
        b = rng.integers(0, 256, (n_blocks, ts), dtype=np.uint8)
        if qtype in _SUB_SCALES:  # sub-block scales and mins that centre the values, as a quantiser's would
            at, sub = _SUB_SCALES[qtype]
            b[:, at:at + len(sub)] = sub
        lo, hi = _SCALE_AT[qtype]
        scale = rng.uniform(0.001, 0.01, (n_blocks, (hi - lo) // 2)).astype(np.float16)
        b[:, lo:hi] = scale.view(np.uint8).reshape(n_blocks, hi - lo)
        return b.reshape(*x.shape[:-1], x.shape[-1] // bs * ts)


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (conversion/llama.py): the q/k row order its RoPE wants."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_qwen3moe(path: Path, **kw) -> Path:
    return write_moe(path, "qwen3moe", **kw)


def write_moe(path: Path, arch: str, *, expert_type: str = "Q4_0", attn_type: str = "Q4_0", embed_type: str = "F16",
              output: bool = True, seed: int = 0, split_max_tensors: int = 0, written: dict | None = None) -> Path:
    """A 2-layer MoE GGUF (qwen3moe, qwen2moe, or llama with experts: Mixtral) with the tensors and
    metadata llama.cpp's converter writes. ``written``: filled with the float arrays drawn, by GGUF name
    (in HF row order: before llama's q/k permutation)."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    w.add_block_count(LAYERS)
    w.add_context_length(4096)
    w.add_embedding_length(H)
    w.add_feed_forward_length(I if arch == "llama" else 3 * H)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    if arch == "llama":
        w.add_rope_dimension_count(HEAD_DIM)
    else:
        w.add_key_length(HEAD_DIM)
        w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(E)
    w.add_expert_used_count(2)
    if arch != "llama":
        w.add_expert_feed_forward_length(I)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(SHARED)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    tokens = [bytes([b]).decode("latin-1") for b in range(256)] + [f"t{i}" for i in range(VOCAB - 258)] + \
        ["<|endoftext|>", "<|im_end|>"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (VOCAB - 2) + [3, 3])
    w.add_token_merges(["t 0", "t 1"])
    w.add_eos_token_id(VOCAB - 1)
    w.add_bos_token_id(VOCAB - 2)
    w.add_chat_template("{{ messages }}")
    written = {} if written is None else written

    def put(name: str, shape: tuple, qtype: str, scale: float = 0.05, heads: int | None = None) -> None:
        x = (rng.standard_normal(shape) * scale).astype(np.float32)
        written[name] = x
        if heads is not None:
            x = llama_permute(x, heads)
        if qtype == "F32":
            w.add_tensor(name, x)
        elif qtype == "F16":
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, blocks(rng, x, qtype), raw_dtype=gguf.GGMLQuantizationType[qtype])

    llama = arch == "llama"
    put("token_embd.weight", (VOCAB, H), embed_type)
    for i in range(LAYERS):
        put(f"blk.{i}.attn_norm.weight", (H,), "F32", 1.0)
        put(f"blk.{i}.attn_q.weight", (HEADS * HEAD_DIM, H), attn_type, heads=HEADS if llama else None)
        put(f"blk.{i}.attn_k.weight", (KV * HEAD_DIM, H), attn_type, heads=KV if llama else None)
        put(f"blk.{i}.attn_v.weight", (KV * HEAD_DIM, H), attn_type)
        put(f"blk.{i}.attn_output.weight", (H, HEADS * HEAD_DIM), attn_type)
        if arch == "qwen3moe":
            put(f"blk.{i}.attn_q_norm.weight", (HEAD_DIM,), "F32", 1.0)
            put(f"blk.{i}.attn_k_norm.weight", (HEAD_DIM,), "F32", 1.0)
        if arch == "qwen2moe":
            for t, n in (("q", HEADS), ("k", KV), ("v", KV)):
                put(f"blk.{i}.attn_{t}.bias", (n * HEAD_DIM,), "F32")
        put(f"blk.{i}.ffn_norm.weight", (H,), "F32", 1.0)
        put(f"blk.{i}.ffn_gate_inp.weight", (E, H), "F32")
        put(f"blk.{i}.ffn_gate_exps.weight", (E, I, H), expert_type)
        put(f"blk.{i}.ffn_up_exps.weight", (E, I, H), expert_type)
        put(f"blk.{i}.ffn_down_exps.weight", (E, H, I), expert_type)
        if arch == "qwen2moe":
            put(f"blk.{i}.ffn_gate_inp_shexp.weight", (H,), "F32")
            put(f"blk.{i}.ffn_gate_shexp.weight", (SHARED, H), attn_type)
            put(f"blk.{i}.ffn_up_shexp.weight", (SHARED, H), attn_type)
            put(f"blk.{i}.ffn_down_shexp.weight", (H, SHARED), attn_type)
    put("output_norm.weight", (H,), "F32", 1.0)
    if output:
        put("output.weight", (VOCAB, H), "Q6_K" if embed_type != "F16" else "F16")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- deepseek2 and glm4moe, as llama.cpp's converter writes them from a Hugging Face model -------------
# (llama-cpp-python 0.3.36 sdist, vendor/llama.cpp: conversion/base.py TextModel.set_gguf_parameters,
# conversion/deepseek.py DeepseekV2Model, conversion/glm.py Glm4MoeModel)

def deepseek_v3_config(**over) -> dict:
    """A tiny DeepSeek-V3 config.json (the keys the converter reads); sizes in blocks of 32 for Q4_0/Q8_0."""
    cfg = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=VOCAB, hidden_size=H,
               intermediate_size=2 * H, moe_intermediate_size=I, num_hidden_layers=3, first_k_dense_replace=1,
               num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=64, kv_lora_rank=512,
               qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, n_shared_experts=1, n_routed_experts=E,
               n_group=2, topk_group=1, num_experts_per_tok=2, norm_topk_prob=True, routed_scaling_factor=2.5,
               scoring_func="sigmoid", topk_method="noaux_tc", max_position_embeddings=4096, rms_norm_eps=1e-6,
               rope_theta=10000.0, tie_word_embeddings=False)
    cfg.update(over)
    return cfg


def glm4_moe_config(**over) -> dict:
    """A tiny GLM-4.5 config.json, with one MTP layer."""
    cfg = dict(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", vocab_size=VOCAB, hidden_size=H,
               intermediate_size=2 * H, moe_intermediate_size=I, num_hidden_layers=2, first_k_dense_replace=1,
               num_attention_heads=4, num_key_value_heads=2, head_dim=64, partial_rotary_factor=0.5,
               attention_bias=True, use_qk_norm=True, n_shared_experts=1, n_routed_experts=E, n_group=1,
               topk_group=1, num_experts_per_tok=2, norm_topk_prob=True, routed_scaling_factor=2.5,
               num_nextn_predict_layers=1, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
               tie_word_embeddings=False)
    cfg.update(over)
    return cfg


def hf_weights(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 weights under the Hugging Face names of a DeepseekV3 or Glm4Moe model (MTP layers included)."""
    rng = np.random.default_rng(seed)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    out: dict[str, np.ndarray] = {}

    def put(name: str, *shape: int, scale: float = 0.05) -> None:
        out[name] = (rng.standard_normal(shape) * scale + (1.0 if scale == 1.0 else 0.0)).astype(np.float32)

    put("model.embed_tokens.weight", v, h)
    put("model.norm.weight", h, scale=1.0)
    put("lm_head.weight", v, h)
    main, mtp = cfg["num_hidden_layers"], cfg.get("num_nextn_predict_layers", 0)
    heads = cfg["num_attention_heads"]
    for i in range(main + mtp):
        p = f"model.layers.{i}."
        put(p + "input_layernorm.weight", h, scale=1.0)
        put(p + "post_attention_layernorm.weight", h, scale=1.0)
        if cfg["model_type"] == "glm4_moe":
            hd, kv = cfg["head_dim"], cfg["num_key_value_heads"]
            for proj, n in (("q_proj", heads * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)):
                put(p + f"self_attn.{proj}.weight", n, h)
                put(p + f"self_attn.{proj}.bias", n)
            put(p + "self_attn.o_proj.weight", h, heads * hd)
            put(p + "self_attn.q_norm.weight", hd, scale=1.0)
            put(p + "self_attn.k_norm.weight", hd, scale=1.0)
        else:
            qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
            r, q = cfg["kv_lora_rank"], cfg["q_lora_rank"]
            if q:
                put(p + "self_attn.q_a_proj.weight", q, h)
                put(p + "self_attn.q_a_layernorm.weight", q, scale=1.0)
                put(p + "self_attn.q_b_proj.weight", heads * qk, q)
            else:
                put(p + "self_attn.q_proj.weight", heads * qk, h)
            put(p + "self_attn.kv_a_proj_with_mqa.weight", r + cfg["qk_rope_head_dim"], h)
            put(p + "self_attn.kv_a_layernorm.weight", r, scale=1.0)
            put(p + "self_attn.kv_b_proj.weight", heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), r)
            put(p + "self_attn.o_proj.weight", h, heads * cfg["v_head_dim"])
        if i < cfg["first_k_dense_replace"]:
            put(p + "mlp.gate_proj.weight", cfg["intermediate_size"], h)
            put(p + "mlp.up_proj.weight", cfg["intermediate_size"], h)
            put(p + "mlp.down_proj.weight", h, cfg["intermediate_size"])
        else:
            n_e, im, sh = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["n_shared_experts"]
            put(p + "mlp.gate.weight", n_e, h)
            if cfg["model_type"] == "glm4_moe" or cfg.get("topk_method") == "noaux_tc":  # DeepSeek-V2: no bias
                put(p + "mlp.gate.e_score_correction_bias", n_e, scale=0.1)
            for e in range(n_e):
                put(p + f"mlp.experts.{e}.gate_proj.weight", im, h)
                put(p + f"mlp.experts.{e}.up_proj.weight", im, h)
                put(p + f"mlp.experts.{e}.down_proj.weight", h, im)
            put(p + "mlp.shared_experts.gate_proj.weight", im * sh, h)
            put(p + "mlp.shared_experts.up_proj.weight", im * sh, h)
            put(p + "mlp.shared_experts.down_proj.weight", h, im * sh)
        if i >= main:  # the MTP block's own tensors (GLM-4.5's model.layers.92.*)
            put(p + "eh_proj.weight", h, 2 * h)
            put(p + "enorm.weight", h, scale=1.0)
            put(p + "hnorm.weight", h, scale=1.0)
            put(p + "shared_head.norm.weight", h, scale=1.0)
    return out


def kv_b_split(kv_b: np.ndarray, heads: int, nope: int, v_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """DeepseekV2Model.modify_tensors' split of kv_b_proj [H * (nope + v), R] into k_b [H, R, nope]
    (transposed per head) and v_b [H, v, R], in torch as the converter runs it."""
    import torch

    t = torch.from_numpy(kv_b)
    kv = t.view(heads, v_dim + nope, t.shape[-1])
    k_b, v_b = torch.split(kv, [nope, v_dim], dim=1)
    return k_b.transpose(1, 2).contiguous().numpy(), v_b.contiguous().numpy()


def _converter_keys(w, arch: str, cfg: dict) -> None:
    """The metadata TextModel.set_gguf_parameters and the model class write (no tokenizer keys)."""
    import gguf

    mtp = cfg.get("num_nextn_predict_layers", 0) if arch == "glm4moe" else 0
    w.add_block_count(cfg["num_hidden_layers"] + mtp)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(1 if arch == "deepseek2" else cfg["num_key_value_heads"])
    rs = cfg.get("rope_scaling")
    if rs and rs.get("type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rs["factor"])
        w.add_rope_scaling_orig_ctx_len(rs["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rs["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rs["beta_slow"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])
    if "scoring_func" in cfg:
        w.add_expert_gating_func(gguf.ExpertGatingFuncType[cfg["scoring_func"].upper()])
    if arch == "glm4moe":
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    if arch == "deepseek2":
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        w.add_vocab_size(cfg["vocab_size"])
        if cfg["q_lora_rank"] is not None:
            w.add_q_lora_rank(cfg["q_lora_rank"])
        r, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
        w.add_kv_lora_rank(r)
        w.add_key_length(r + rope)
        w.add_value_length(r)
        w.add_key_length_mla(cfg["qk_nope_head_dim"] + rope)
        w.add_value_length_mla(cfg["v_head_dim"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        if cfg["norm_topk_prob"]:
            w.add_expert_weights_norm(True)
        w.add_rope_dimension_count(rope)
        if rs and rs.get("mscale_all_dim") is not None:
            w.add_rope_scaling_yarn_log_mul(0.1 * rs["mscale_all_dim"])
    else:
        w.add_rope_dimension_count(int(cfg["head_dim"] * cfg["partial_rotary_factor"]))
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
        if mtp:
            w.add_nextn_predict_layers(mtp)


def write_converted(path: Path, arch: str, cfg: dict, weights: dict[str, np.ndarray], *, expert_type: str = "Q4_0",
                    linear_type: str = "Q8_0", kv_b: str = "split", seed: int = 0) -> dict[str, np.ndarray]:
    """``weights`` (hf_weights) written as the converter writes ``arch`` (deepseek2 or glm4moe): names
    through gguf's TensorNameMap, experts stacked [E, N, K], deepseek2's kv_b_proj split (``kv_b``:
    "split" as today's converter, "fused" as files from before the split, "both"), 1-D tensors and
    routers F32, experts ``expert_type``, other matrices ``linear_type``. Returns GGUF name -> the
    float array written (before quantisation)."""
    import gguf

    rng = np.random.default_rng(seed)
    blocks_n = cfg["num_hidden_layers"] + (cfg.get("num_nextn_predict_layers", 0) if arch == "glm4moe" else 0)
    model_arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    tmap = gguf.get_tensor_name_map(model_arch, blocks_n)
    w = gguf.GGUFWriter(path, arch)
    _converter_keys(w, arch, cfg)
    tokens = [f"t{i}" for i in range(cfg["vocab_size"])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_merges([])
    w.add_eos_token_id(1)
    out: dict[str, np.ndarray] = {}

    def put(name: str, x: np.ndarray, qtype: str) -> None:
        out[name] = x
        if qtype == "F32" or x.ndim == 1:
            w.add_tensor(name, x.astype(np.float32))
        elif qtype == "F16":
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, blocks(rng, x, qtype), raw_dtype=gguf.GGMLQuantizationType[qtype])

    def gname(hf: str) -> str:
        hf = hf.replace("e_score_correction_bias", "e_score_correction.bias")  # ModelBase.filter_tensors
        g = tmap.get_name(hf, try_suffixes=(".weight", ".bias"))
        if g is None:  # NEXTN_* (PyPI gguf 0.19.0 lacks them for deepseek2; llama.cpp's gguf-py has them)
            layer, leaf = hf.split(".", 3)[2], hf.split(".", 3)[3].rsplit(".", 1)
            t = getattr(gguf.MODEL_TENSOR, "NEXTN_" + leaf[0].replace(".", "_").upper())
            g = gguf.TENSOR_NAMES[t].format(bid=int(layer)) + "." + leaf[1]
        return g

    stacked: dict[str, list] = {}
    for hf, x in weights.items():
        parts = hf.split(".")
        if ".mlp.experts." in hf:
            stacked.setdefault(f"model.layers.{parts[2]}.mlp.experts.{parts[6]}.weight", []).append((int(parts[5]), x))
            continue
        if hf.endswith("kv_b_proj.weight") and kv_b != "fused":
            k_b, v_b = kv_b_split(x, cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"])
            put(gname(hf.replace("kv_b_proj", "k_b_proj")), k_b, linear_type)
            put(gname(hf.replace("kv_b_proj", "v_b_proj")), v_b, linear_type)
            if kv_b == "split":
                continue
        qtype = "F32" if x.ndim == 1 or hf.endswith("mlp.gate.weight") else linear_type
        put(gname(hf), x, qtype)
    for hf, xs in stacked.items():
        put(gname(hf), np.stack([x for _, x in sorted(xs, key=lambda t: t[0])]), expert_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def retype(src: Path, dst: Path, pick, keys: dict | None = None) -> dict[str, str]:
    """A copy of ``src`` written by gguf's own writer, every KV pair as it is (``keys``: name -> (value,
    GGUFValueType) added or replaced), each tensor ``pick(name)`` gives a ggml type name for requantised
    by gguf.quants.quantize from gguf's dequantisation (F16/F32 cast), the rest copied. Returns GGUF name ->
    the type written."""
    import gguf
    from gguf import quants

    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    keys = dict(keys or {})
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        if f.name in keys:
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    for name, (value, vtype) in keys.items():
        w.add_key_value(name, value, vtype)
    types = {}
    for t in r.tensors:
        qtype = pick(t.name)
        if qtype is None or qtype == t.tensor_type.name:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            types[t.name] = t.tensor_type.name
            continue
        x = np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)
        if qtype in ("F32", "F16"):
            w.add_tensor(t.name, x.astype(np.float32 if qtype == "F32" else np.float16))
        else:
            w.add_tensor(t.name, quants.quantize(x, gguf.GGMLQuantizationType[qtype]),
                         raw_dtype=gguf.GGMLQuantizationType[qtype])
        types[t.name] = qtype
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return types
