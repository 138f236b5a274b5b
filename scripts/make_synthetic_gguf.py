#!/usr/bin/env python3
"""Write large synthetic GGUF and MLX MoE checkpoints in Qwen3-30B-A3B shapes (as make_synthetic.py).

    python scripts/make_synthetic_gguf.py OUT --format gguf-q4_0|gguf-q4_k|gguf-q6_k|gguf-q8_0|mlx --layers 3

Same shapes per layer as make_synthetic.py (hidden 2048, 128 experts of 768, attention 4096/512).
GGUF: one .gguf file written by the gguf package's GGUFWriter, fused experts ``blk.N.ffn_*_exps``
[E, N, K], random blocks with small positive fp16 scales (Q4_0: every d > 0, so the ints are kept;
Q4_K: the 6-bit scales and mins of tests/_gguf_files.py; Q6_K: int8 scales 8..31; Q8_0: any int8). MLX: safetensors as mlx-lm writes them,
4-bit group 64, stacked ``switch_mlp`` experts, ``config.json["quantization"]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from make_synthetic import per_layer

H, I, E = 2048, 768, 128
FORMATS = ("gguf-q4_0", "gguf-q4_k", "gguf-q6_k", "gguf-q8_0", "mlx")
_GGUF = {"gguf-q4_0": "Q4_0", "gguf-q4_k": "Q4_K", "gguf-q6_k": "Q6_K", "gguf-q8_0": "Q8_0"}
_ATTN = {"q": (4096, H), "k": (512, H), "v": (512, H), "output": (H, 4096)}


def _gguf_blocks(rng, qtype: str, rows: int, k: int) -> np.ndarray:
    if qtype == "Q4_0":
        b = rng.integers(0, 256, (rows, k // 32, 18), dtype=np.uint8)
        b[..., :2] = np.full((rows, k // 32), 0.002, np.float16).view(np.uint8).reshape(rows, k // 32, 2)
        return b.reshape(rows, -1)
    if qtype == "Q8_0":  # fp16 d, 32 int8
        b = rng.integers(0, 256, (rows, k // 32, 34), dtype=np.uint8)
        b[..., :2] = np.full((rows, k // 32), 0.0002, np.float16).view(np.uint8).reshape(rows, k // 32, 2)
        return b.reshape(rows, -1)
    if qtype == "Q6_K":  # 128 + 64 bytes of 6-bit values, 16 int8 scales, fp16 d
        b = rng.integers(0, 256, (rows, k // 256, 210), dtype=np.uint8)
        b[..., 192:208] = rng.integers(8, 32, (rows, k // 256, 16), dtype=np.uint8)
        b[..., 208:] = np.full((rows, k // 256), 0.0002, np.float16).view(np.uint8).reshape(rows, k // 256, 2)
        return b.reshape(rows, -1)
    b = rng.integers(0, 256, (rows, k // 256, 144), dtype=np.uint8)  # Q4_K
    b[..., :4] = np.full((rows, k // 256, 2), 0.001, np.float16).view(np.uint8).reshape(rows, k // 256, 4)
    b[..., 4:16] = [8] * 4 + [252] * 4 + [0xC8] * 4
    return b.reshape(rows, -1)


def make_gguf(out: Path, qtype: str, layers: int, vocab: int = 4096, seed: int = 0, experts: int = E) -> int:
    import gguf

    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"synthetic-{qtype}.gguf"
    w = gguf.GGUFWriter(path, "qwen3moe")
    for add, v in ((w.add_block_count, layers), (w.add_context_length, 4096), (w.add_embedding_length, H),
                   (w.add_feed_forward_length, 6144), (w.add_head_count, 32), (w.add_head_count_kv, 4),
                   (w.add_key_length, 128), (w.add_value_length, 128), (w.add_rope_freq_base, 1e6),
                   (w.add_layer_norm_rms_eps, 1e-6), (w.add_expert_count, experts), (w.add_expert_used_count, min(8, experts)),
                   (w.add_expert_feed_forward_length, I)):
        add(v)
    t = gguf.GGMLQuantizationType[qtype]

    def quant(r, name: str, rows: int, k: int, lead: int = 1) -> tuple:
        b = _gguf_blocks(r, qtype, lead * rows, k)
        return name, (b.reshape(lead, rows, -1) if lead > 1 else b), t

    def floats(r, name: str, *shape: int, one: bool = False) -> tuple:
        return name, (np.ones(shape, np.float32) if one else (r.standard_normal(shape) * 0.02).astype(np.float32)), None

    def layer(li: int) -> list:
        r = np.random.default_rng([seed, li + 1])
        got = [quant(r, f"blk.{li}.attn_{part}.weight", n, k) for part, (n, k) in _ATTN.items()]
        got += [floats(r, f"blk.{li}.{part}.weight", H, one=True) for part in ("attn_norm", "ffn_norm")]
        got += [floats(r, f"blk.{li}.{part}.weight", 128, one=True) for part in ("attn_q_norm", "attn_k_norm")]
        got.append(floats(r, f"blk.{li}.ffn_gate_inp.weight", experts, H))
        got += [quant(r, f"blk.{li}.ffn_{part}_exps.weight", n, k, experts)
                for part, (n, k) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))]
        return got

    tensors = [floats(rng, "token_embd.weight", vocab, H)]
    for got in per_layer(layers, layer):  # the writer keeps every tensor until it writes the file
        tensors += got
    tensors += [floats(rng, "output_norm.weight", H, one=True), floats(rng, "output.weight", vocab, H)]
    for name, data, raw in tensors:
        if raw is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.stat().st_size


def make_mlx(out: Path, layers: int, vocab: int = 4096, seed: int = 0, experts: int = E) -> int:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)

    def quant(r, t: dict, name: str, n: int, k: int, lead: tuple = ()) -> None:
        t[f"{name}.weight"] = torch.from_numpy(r.integers(0, 2 ** 32, (*lead, n, k // 8), dtype=np.uint32))
        t[f"{name}.scales"] = torch.full((*lead, n, k // 64), 0.002, dtype=torch.bfloat16)
        t[f"{name}.biases"] = torch.full((*lead, n, k // 64), -0.015, dtype=torch.bfloat16)

    def shard(li: int) -> tuple[str, list[str]]:
        t: dict = {}
        if li == layers:
            t["model.embed_tokens.weight"] = (torch.randn(vocab, H, generator=g) * 0.02).bfloat16()
            t["lm_head.weight"] = (torch.randn(vocab, H, generator=g) * 0.02).bfloat16()
            t["model.norm.weight"] = torch.ones(H, dtype=torch.bfloat16)
        else:
            p = f"model.layers.{li}"
            r, lg = np.random.default_rng([seed, li + 1]), torch.Generator().manual_seed(seed * 100_003 + li + 1)
            for proj, (n, k) in zip(("q_proj", "k_proj", "v_proj", "o_proj"), _ATTN.values()):
                quant(r, t, f"{p}.self_attn.{proj}", n, k)
            for proj, (n, k) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                quant(r, t, f"{p}.mlp.switch_mlp.{proj}", n, k, (experts,))
            t[f"{p}.mlp.gate.weight"] = (torch.randn(experts, H, generator=lg) * 0.02).bfloat16()
            for norm in ("input_layernorm", "post_attention_layernorm"):
                t[f"{p}.{norm}.weight"] = torch.ones(H, dtype=torch.bfloat16)
            for qk in ("q_norm", "k_norm"):
                t[f"{p}.self_attn.{qk}.weight"] = torch.ones(128, dtype=torch.bfloat16)
        name = f"model-{li + 1:05d}-of-{layers + 1:05d}.safetensors"
        save_file(t, str(out / name), metadata={"format": "mlx"})
        return name, list(t)

    weight_map, total = {}, 0
    for name, keys in per_layer(layers, shard) + [shard(layers)]:
        weight_map.update({k: name for k in keys})
        total += (out / name).stat().st_size
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    q = {"group_size": 64, "bits": 4, "mode": "affine",
         **{f"model.layers.{li}.mlp.gate": False for li in range(layers)}}  # routers left in bf16
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": H,
           "intermediate_size": 6144, "moe_intermediate_size": I, "num_experts": experts,
           "num_experts_per_tok": min(8, experts),
           "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
           "vocab_size": vocab, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
           "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "quantization": q, "quantization_config": q}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return total


def make(out: Path, fmt: str, layers: int, experts: int = E) -> int:
    if fmt == "mlx":
        return make_mlx(out, layers, experts=experts)
    return make_gguf(out, _GGUF[fmt], layers, experts=experts)


def params(folder: Path) -> int:
    """Quantised parameters of a checkpoint this script wrote."""
    if any(folder.glob("*.gguf")):
        import gguf

        r = gguf.GGUFReader(next(folder.glob("*.gguf")))
        return sum(int(t.n_elements) for t in r.tensors if t.tensor_type.name not in ("F32", "F16", "BF16"))
    from safetensors import safe_open

    n = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            for key in fh.keys():
                if key.endswith(".scales"):
                    shape = fh.get_slice(key).get_shape()
                    n += int(np.prod(shape)) * 64
    return n


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--format", default="gguf-q4_0", choices=FORMATS)
    ap.add_argument("--layers", type=int, default=3)
    a = ap.parse_args()
    print(make(a.out, a.format, a.layers), "bytes")
