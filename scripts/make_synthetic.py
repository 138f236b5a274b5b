#!/usr/bin/env python3
"""Write large synthetic int4 MoE checkpoints in Qwen3-30B-A3B shapes, fast.

    python scripts/make_synthetic.py OUT --format gptq-sym|gptq-asym|awq|ct|ct-asym|autoround|fp8|ct-fp8|bf16|nvfp4|mxfp4|modelopt-nvfp4 --layers 3

Shapes per layer: hidden 2048, 128 experts of intermediate 768 (gate/up [768, 2048], down
[2048, 768]), attention q [4096, 2048], k/v [512, 2048], o [2048, 4096], group 128. About
0.31 GB of int4 per layer: 3 layers ~ 1 GB, 13 layers ~ 4 GB. The values are random (valid
nibbles, positive fp16/bf16 scales); GPTQ asym zeros are drawn so the data reads as v1. ``fp8``:
the official FP8 layout (e4m3 bytes without NaN, float32 ``weight_scale_inv`` per 128x128 block),
about 0.62 GB per layer; ``bf16``: float weights (no quantization_config), about 1.24 GB per layer.
``autoround``: GPTQ sym tensors under AutoRound's config (``auto_round:auto_gptq``). ``ct-fp8``:
compressed-tensors ``float-quantized`` with a bf16 ``weight_scale`` per 128x128 block (llm-compressor's
FP8_BLOCK). ``nvfp4`` / ``mxfp4``: compressed-tensors ``nvfp4-pack-quantized`` (U8 E2M1 pairs, E4M3
scale per 16, F32 ``weight_global_scale``) / ``mxfp4-pack-quantized`` (E8M0 scale per 32);
``modelopt-nvfp4``: ModelOpt's ``weight`` U8, ``weight_scale`` E4M3, ``weight_scale_2`` F32; about
0.33-0.35 GB per layer each. The layouts are the fixtures' (tests/fixtures/ct_qwen3moe_*, fp8_*).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file

H, I, E, G = 2048, 768, 128, 128
FORMATS = ("gptq-sym", "gptq-asym", "awq", "ct", "ct-asym", "autoround", "fp8", "ct-fp8", "bf16", "nvfp4", "mxfp4",
           "modelopt-nvfp4")
FLOAT_FORMATS = ("fp8", "ct-fp8", "bf16", "nvfp4", "mxfp4", "modelopt-nvfp4")  # quantised from float values


def per_layer(layers: int, fn) -> list:
    """fn(li) for every layer, in threads, results in layer order: torch's and numpy's random draws and
    safetensors' writes run without the GIL (one 48-layer FP8 input did not finish in 170 s on one core).
    Each layer draws from its own generator, so the bytes do not depend on the thread count."""
    with ThreadPoolExecutor(max_workers=max(1, min(layers, os.cpu_count() or 1))) as pool:
        return list(pool.map(fn, range(layers)))


def _words(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, generator=gen)


def _nibble_words(gen: torch.Generator, lo: int, hi: int, *shape: int) -> torch.Tensor:
    """int32 words whose 8 nibbles are each drawn from [lo, hi]."""
    nib = torch.randint(lo, hi + 1, (*shape, 8), dtype=torch.int64, generator=gen)
    w = torch.zeros(shape, dtype=torch.int64)
    for i in range(8):
        w |= nib[..., i] << (4 * i)
    return (w - (w >= 2**31).long() * 2**32).to(torch.int32)


def _scales(gen: torch.Generator, shape, dtype) -> torch.Tensor:
    return (torch.rand(shape, generator=gen) * 0.01 + 0.002).to(dtype)


def _e4m3_bytes(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """e4m3 bytes 0x00-0x7E and 0x80-0xFE: every finite value, no NaN."""
    return torch.randint(0, 127, shape, dtype=torch.uint8, generator=gen) | \
        (torch.randint(0, 2, shape, dtype=torch.uint8, generator=gen) << 7)


def _fp4(fmt: str, name: str, n: int, k: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """E2M1 pairs (any byte) with positive block scales: E8M0 per 32 (MXFP4, 2^-10..2^-4) or E4M3 per 16
    (NVFP4: bytes 0x08-0x77, positive normal values) and the global scale."""
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    if fmt == "mxfp4":
        return {f"{name}.weight_packed": packed,
                f"{name}.weight_scale": torch.randint(117, 124, (n, k // 32), dtype=torch.uint8, generator=gen)}
    sc = torch.randint(0x08, 0x78, (n, k // 16), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
    if fmt == "nvfp4":
        return {f"{name}.weight_packed": packed, f"{name}.weight_scale": sc,
                f"{name}.weight_global_scale": torch.tensor([448.0 * 6.0 / 0.05], dtype=torch.float32)}
    return {f"{name}.weight": packed, f"{name}.weight_scale": sc,  # modelopt
            f"{name}.weight_scale_2": torch.tensor([0.05 / (448.0 * 6.0)], dtype=torch.float32)}


def linear(fmt: str, name: str, n: int, k: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    g = k // G
    if fmt == "autoround":
        fmt = "gptq-sym"
    if fmt in ("nvfp4", "mxfp4", "modelopt-nvfp4"):
        return _fp4(fmt, name, n, k, gen)
    if fmt == "ct-fp8":
        return {f"{name}.weight": _e4m3_bytes(gen, n, k).view(torch.float8_e4m3fn),
                f"{name}.weight_scale": (torch.rand((-(-n // 128), -(-k // 128)), generator=gen) * 1e-4 + 1e-5
                                         ).to(torch.bfloat16)}
    if fmt.startswith("gptq"):
        zeros = (torch.full((g, n // 8), 0x77777777, dtype=torch.int32) if fmt == "gptq-sym"
                 else _nibble_words(gen, 6, 7, g, n // 8))
        return {f"{name}.qweight": _words(gen, k // 8, n), f"{name}.qzeros": zeros,
                f"{name}.scales": _scales(gen, (g, n), torch.float16),
                f"{name}.g_idx": (torch.arange(k, dtype=torch.int32) // G)}
    if fmt == "fp8":
        return {f"{name}.weight": _e4m3_bytes(gen, n, k).view(torch.float8_e4m3fn),
                f"{name}.weight_scale_inv": torch.rand((-(-n // 128), -(-k // 128)), generator=gen) * 1e-4 + 1e-5}
    if fmt == "bf16":
        return {f"{name}.weight": (torch.randn((n, k), generator=gen) * 0.02).to(torch.bfloat16)}
    if fmt == "awq":
        return {f"{name}.qweight": _words(gen, k, n // 8), f"{name}.qzeros": _nibble_words(gen, 5, 10, g, n // 8),
                f"{name}.scales": _scales(gen, (g, n), torch.float16)}
    out = {f"{name}.weight_packed": _words(gen, n, k // 8), f"{name}.weight_scale": _scales(gen, (n, g), torch.bfloat16),
           f"{name}.weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if fmt == "ct-asym":  # zero points packed along N (compressed-tensors >= 0.9.4): stored nibble = zp + 8
        out[f"{name}.weight_zero_point"] = _nibble_words(gen, 6, 9, n // 8, g)
    return out


def _ct_float(fmt: str, weights: dict) -> dict:
    """A compressed-tensors config of one float weight scheme (llm-compressor's, as in the fixtures)."""
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": fmt, "weights": {
                "type": "float", "symmetric": True, "dynamic": False, "actorder": None, **weights},
                "input_activations": None, "output_activations": None}},
            "ignore": ["lm_head", "re:.*mlp\\.gate$"], "version": "0.19.0"}


def quant_config(fmt: str) -> dict:
    if fmt == "autoround":
        return {"quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", "bits": 4,
                "group_size": G, "sym": True, "data_type": "int", "autoround_version": "0.16.1",
                "block_name_to_quantize": "model.layers"}
    if fmt == "ct-fp8":
        return _ct_float("float-quantized", {"num_bits": 8, "strategy": "block", "block_structure": [128, 128],
                                             "group_size": None})
    if fmt == "nvfp4":
        return _ct_float("nvfp4-pack-quantized", {"num_bits": 4, "strategy": "tensor_group", "group_size": 16,
                                                  "scale_dtype": "torch.float8_e4m3fn"})
    if fmt == "mxfp4":
        return _ct_float("mxfp4-pack-quantized", {"num_bits": 4, "strategy": "group", "group_size": 32,
                                                  "scale_dtype": "torch.uint8"})
    if fmt == "modelopt-nvfp4":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                "exclude_modules": ["lm_head", "*mlp.gate"]}
    if fmt.startswith("gptq"):
        return {"quant_method": "gptq", "bits": 4, "group_size": G, "desc_act": False, "sym": fmt == "gptq-sym",
                "checkpoint_format": "gptq", "pack_dtype": "int32"}
    if fmt == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": ["gate"]}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized", "weights": {
                "num_bits": 4, "type": "int", "symmetric": fmt == "ct", "strategy": "group", "group_size": G,
                "dynamic": False}, "input_activations": None, "output_activations": None}},
            "ignore": ["lm_head", "re:.*mlp\\.gate$"], "version": "0.20.0"}


def make(out: Path, fmt: str, layers: int, seed: int = 0, vocab: int = 4096, *, hidden: int = H,
         inter: int = I, experts: int = E) -> int:
    """Write the checkpoint; returns its size in bytes. ``hidden``, ``inter`` and ``experts`` (multiples
    of 128 for the first two) shrink it for tests that need many small modules."""
    if fmt not in FORMATS:
        raise SystemExit(f"--format must be one of {FORMATS}")
    attn = {"q_proj": (4096, hidden), "k_proj": (512, hidden), "v_proj": (512, hidden), "o_proj": (hidden, 4096)}
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    fdt = torch.float16 if fmt in ("awq",) else torch.bfloat16
    if fmt == "autoround":  # AutoRound keeps the routers in 16 bits, said in extra_config
        extra = {"extra_config": {f".*model\\.layers\\.{li}\\.mlp\\.gate.*": {"bits": 16, "data_type": "float"}
                                  for li in range(layers)}}
    else:
        extra = {}
    weight_map: dict[str, str] = {}
    total = 0
    nshards = layers + 1

    def layer(li: int) -> tuple[str, list[str]]:
        lg = torch.Generator().manual_seed(seed * 100_003 + li + 1)
        t: dict[str, torch.Tensor] = {}
        p = f"model.layers.{li}"
        for proj, (n, k) in attn.items():
            t.update(linear(fmt, f"{p}.self_attn.{proj}", n, k, lg))
        for e in range(experts):
            for proj, (n, k) in {"gate_proj": (inter, hidden), "up_proj": (inter, hidden),
                                 "down_proj": (hidden, inter)}.items():
                t.update(linear(fmt, f"{p}.mlp.experts.{e}.{proj}", n, k, lg))
        t[f"{p}.mlp.gate.weight"] = (torch.randn(experts, hidden, generator=lg) * 0.02).to(fdt)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            t[f"{p}.{norm}.weight"] = torch.ones(hidden, dtype=fdt)
        for qk in ("q_norm", "k_norm"):
            t[f"{p}.self_attn.{qk}.weight"] = torch.ones(128, dtype=fdt)
        name = f"model-{li + 1:05d}-of-{nshards:05d}.safetensors"
        save_file(t, str(out / name), metadata={"format": "pt"})
        return name, list(t)

    for name, keys in per_layer(layers, layer):  # a layer per core in memory (~1.3 GB for bf16)
        weight_map.update({k: name for k in keys})
        total += (out / name).stat().st_size
    t = {"model.embed_tokens.weight": (torch.randn(vocab, hidden, generator=gen) * 0.02).to(fdt),
         "lm_head.weight": (torch.randn(vocab, hidden, generator=gen) * 0.02).to(fdt),
         "model.norm.weight": torch.ones(hidden, dtype=fdt)}
    name = f"model-{nshards:05d}-of-{nshards:05d}.safetensors"
    save_file(t, str(out / name), metadata={"format": "pt"})
    weight_map.update({k: name for k in t})
    total += (out / name).stat().st_size
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=1))
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": hidden,
           "intermediate_size": 6144, "moe_intermediate_size": inter, "num_experts": experts,
           "num_experts_per_tok": min(8, experts),
           "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
           "vocab_size": vocab, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
           "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": str(fdt).replace("torch.", ""),
           **({} if fmt == "bf16" else {"quantization_config": {**quant_config(fmt), **extra}})}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--format", default="gptq-sym", choices=FORMATS)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    t0 = time.perf_counter()
    size = make(a.out, a.format, a.layers, a.seed)
    print(f"wrote {a.out} ({a.format}, {a.layers} layers): {size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
