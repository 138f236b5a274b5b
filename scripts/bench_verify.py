"""Time ``int4pack.verify`` on one Qwen3-30B-A3B-shaped MoE layer and split the time.

Builds a tiny synthetic converted checkpoint in a temp dir: one MoE layer with 128 experts,
H=2048, I=768, top-8, W4A8 group 128 (bf16 scales) as convert writes it, a real-looking router
and norm. Then runs verify (structural + numerical pass, no dense linears) and reports the share
of time spent in the float32 reference, the W4A8 kernel (torch's _dyn_quant_matmul_4bit: KleidiAI
on Arm, the scalar reference kernel on x86), packing, the error prediction and the structural pass.

    python scripts/bench_verify.py [--tokens 64] [--threads N] [--experts 128] [--against-self]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import int4pack  # noqa: E402
from int4pack.target_config import w4a8_quant_config  # noqa: E402


def build(folder: Path, experts: int, hidden: int, inter: int, group: int, top_k: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    p = "model.layers.0.mlp"
    t: dict[str, torch.Tensor] = {
        f"{p}.gate.weight": (torch.randn(experts, hidden, generator=gen) * 0.02).bfloat16(),
        "model.layers.0.post_attention_layernorm.weight": (1 + 0.1 * torch.randn(hidden, generator=gen)).bfloat16(),
    }
    for e in range(experts):
        shapes = (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter)))
        for proj, (n, k) in shapes:
            t[f"{p}.experts.{e}.{proj}.weight"] = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
            t[f"{p}.experts.{e}.{proj}.weight_scale"] = (
                torch.rand(n, k // group, generator=gen) * 0.004 + 0.001).bfloat16()
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": hidden,
           "moe_intermediate_size": inter, "num_experts": experts, "num_experts_per_tok": top_k,
           "num_hidden_layers": 1, "norm_topk_prob": True, "hidden_act": "silu",
           "quantization_config": w4a8_quant_config(group, [f"{p}.gate", "lm_head"])}
    (folder / "config.json").write_text(json.dumps(cfg))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=None, help="default: verify's own (>= 2 slots per expert)")
    ap.add_argument("--sample-experts", type=int, default=None, help="verify --experts")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--against-self", action="store_true",
                    help="also run the source-weight path (the checkpoint is its own int-quantized source)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="int4pack-bench-") as tmp:
        folder = Path(tmp)
        t0 = time.perf_counter()
        build(folder, a.experts, a.hidden, a.inter, a.group, a.top_k, seed=0)
        t_build = time.perf_counter() - t0
        t0 = time.perf_counter()
        r = int4pack.verify(folder, against=folder if a.against_self else None, tokens=a.tokens,
                            experts=a.sample_experts, threads=a.threads, dense=False, raise_on_failure=False)
        wall = time.perf_counter() - t0
    tm = r["timing"]
    lay = r["layers"][0]
    parts = {"kernel": tm["kernel"], "reference": tm["reference"], "prediction": tm["prediction"],
             "pack": tm["pack"], "read": tm["read"], "structural": r["structural"]["seconds"]}
    parts["other"] = max(0.0, wall - sum(parts.values()))
    out = {"shape": {"experts": a.experts, "hidden": a.hidden, "inter": a.inter, "group": a.group, "top_k": a.top_k},
           "tokens": lay["tokens"], "threads": r["threads"], "host": platform.machine(), "torch": torch.__version__,
           "kernel": r["kernel"], "verify_seconds": round(wall, 3), "build_seconds": round(t_build, 3),
           "seconds": {k: round(v, 3) for k, v in parts.items()},
           "share": {k: round(v / wall, 3) for k, v in parts.items()},
           "layer": {k: lay.get(k) for k in ("rel_l2", "act_rel", "act_pred", "act_ratio", "cosine", "ok")},
           "verdict": r["verdict"]}
    if a.json:
        print(json.dumps(out, indent=2))
        return
    print(f"verify, one MoE layer {a.experts}x(H={a.hidden}, I={a.inter}), group {a.group}, top-{a.top_k}, "
          f"{lay['tokens']} tokens, {r['threads']} thread(s), {platform.machine()}, {r['kernel']['matmul']}")
    print(f"  total {wall:.2f} s (synthetic checkpoint built in {t_build:.1f} s, not counted)")
    for k, v in parts.items():
        print(f"  {k:11s} {v:8.3f} s  {100 * v / wall:5.1f} %")
    print(f"  layer: rel_l2 {lay['rel_l2']:.4g}, activation error {lay['act_rel']:.4g} vs predicted "
          f"{lay['act_pred']:.4g} (ratio {lay['act_ratio']:.3f}); {r['verdict']}")


if __name__ == "__main__":
    main()
