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


def family_names(model_type: str, layers: int = 2) -> tuple[list[tuple[str, int, int]], list[str], dict]:
    """(int4 linears [(name, N, K)], float tensors [name], config extras) for one family."""
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


def write_gptq_family(folder: Path, model_type: str, *, seed: int = 0, layers: int = 2) -> Path:
    """A tiny GPTQ v1 sym checkpoint of one family, split over two shards with an index."""
    rng = np.random.default_rng(seed)
    lin, flt, extra = family_names(model_type, layers)
    tensors: dict[str, torch.Tensor] = {}
    for name, n, k in lin:
        tensors.update(gptq_sym_linear(name, n, k, rng))
    for name in flt:
        if name.endswith("e_score_correction_bias"):
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
    n_exp = {"num_local_experts" if model_type in ("mixtral", "phimoe") else
             ("n_routed_experts" if model_type.startswith(("deepseek", "glm")) else "num_experts"): E}
    cfg = {"model_type": model_type, "hidden_size": H, "num_hidden_layers": layers, "vocab_size": 128,
           **n_exp, **extra,
           "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True,
                                   "desc_act": False, "checkpoint_format": "gptq"}}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder
