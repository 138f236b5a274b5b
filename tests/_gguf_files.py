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
