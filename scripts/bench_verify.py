"""Time ``int4pack.verify`` on one Qwen3-30B-A3B-shaped MoE layer and split the time; or, with
``--layers N``, verify against convert on a whole synthetic checkpoint.

Full scale (``--layers 48``: the Qwen3-30B-A3B shape, 15.7 GB of GPTQ int4, scripts/make_synthetic.py):
for each serving format, convert the checkpoint and verify the output, each in a fresh subprocess
started after os.sync(), and print verify's time over convert's (the issue's goal: at most 1.5).

    python scripts/bench_verify.py --layers 48 --serve-formats compressed-tensors kleidiai --json-out out.json [--against]

Builds a tiny synthetic converted checkpoint in a temp dir: one MoE layer with 128 experts,
H=2048, I=768, top-8, W4A8 group 128 (bf16 scales) as convert writes it, a real-looking router
and norm. Then runs verify (structural + numerical pass, no dense linears) and reports the share
of time spent in the float32 reference, the W4A8 kernel (torch's _dyn_quant_matmul_4bit with KleidiAI
on Arm; on x86 int4pack's twin of torch's reference kernel, or with INT4PACK_VERIFY_MATMUL=torch
torch's scalar op itself), packing, the error prediction and the structural pass.

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
from int4pack.serving.target_config import w4a8_quant_config  # noqa: E402


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


VERIFY = r"""
import json, os, sys, time
t0 = time.perf_counter()
if os.environ.get("INT4PACK_BENCH_TREE"):
    sys.path.insert(0, os.environ["INT4PACK_BENCH_TREE"])
import int4pack
out, threads = sys.argv[1], int(sys.argv[2])
against = sys.argv[3] if len(sys.argv) > 3 else None
r = int4pack.verify(out, against=against, threads=threads or None, raise_on_failure=False)
wall = time.perf_counter() - t0
rss = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) / 1024
print(json.dumps({"seconds": wall, "verify_s": r["timing"]["total"], "rss_mb": rss, "verdict": r["verdict"],
                  "kernel": r.get("kernel"),
                  "ok": r["ok"], "structural_s": r["structural"]["seconds"], "timing": r["timing"],
                  "threads": r["threads"], "experts": r["checked"].get("experts"),
                  "tokens": sorted({lay.get("tokens") for lay in r["layers"] if lay.get("tokens")}),
                  "dense": len(r["dense"]), "layers": len(r["layers"]), "workers": r.get("workers")}))
"""


def full(a) -> None:
    """convert then verify a whole synthetic checkpoint, per serving format; verify / convert."""
    import os
    import shutil

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_convert import CONVERT_RM, _run
    from make_synthetic import make

    work = a.workdir or Path(tempfile.mkdtemp(prefix="int4pack-bench-"))
    src = work / f"gptq-sym-{a.layers}L"
    if not src.exists():
        t0 = time.perf_counter()
        make(src, "gptq-sym", a.layers)
        print(f"wrote {src} in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    for serve in a.serve_formats:
        dst = work / f"out-{serve}"
        conv = _run(CONVERT_RM, src, dst, a.convert_threads, serve)
        os.sync()
        ver = _run(VERIFY, dst, a.threads or 0)
        os.sync()
        vag = _run(VERIFY, dst, a.threads or 0, src) if a.against else None
        shutil.rmtree(dst, ignore_errors=True)
        row = {"layers": a.layers, "serve_format": serve, "host": platform.machine(), "cores": os.cpu_count(),
               "torch": torch.__version__, "convert_s": round(conv["seconds"], 2),
               "convert_cpu_s": round(conv["cpu_user"] + conv["cpu_sys"], 1), "convert_rss_mb": round(conv["rss_mb"]),
               "verify_s": round(ver["seconds"], 2), "verify_cpu_s": round(ver["cpu_user"] + ver["cpu_sys"], 1),
               "verify_rss_mb": round(ver["rss_mb"]), "ratio": round(ver["seconds"] / conv["seconds"], 2),
               # on a loaded host the CPU seconds are the steadier figure
               "cpu_ratio": round((ver["cpu_user"] + ver["cpu_sys"]) / max(conv["cpu_user"] + conv["cpu_sys"], 1e-9),
                                  2),
               "kernel": ver.get("kernel"),
               **{k: ver[k] for k in ("verdict", "ok", "structural_s", "timing", "threads", "experts", "tokens",
                                      "dense")}, "moe_layers": ver["layers"], "workers": ver.get("workers")}
        if vag is not None:  # verify --against the source, in the same block
            row.update(against_s=round(vag["seconds"], 2), against_cpu_s=round(vag["cpu_user"] + vag["cpu_sys"], 1),
                       against_rss_mb=round(vag["rss_mb"]), against_ratio=round(vag["seconds"] / conv["seconds"], 2),
                       against_verdict=vag["verdict"], against_ok=vag["ok"], against_timing=vag["timing"])
        rows.append(row)
        print(json.dumps(row), flush=True)
        if a.json_out:
            a.json_out.write_text(json.dumps(rows, indent=1))
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)
    print()
    for r in rows:
        print(f"{r['layers']} layers, {r['serve_format']}: convert {r['convert_s']} s ({r['convert_cpu_s']} CPU s), "
              f"verify {r['verify_s']} s ({r['verify_cpu_s']} CPU s, {r['threads']} threads, peak RSS "
              f"{r['verify_rss_mb']} MB): verify / convert = {r['ratio']} (CPU {r['cpu_ratio']}); {r['verdict']}")
        if "against_s" in r:
            print(f"  verify --against the source {r['against_s']} s ({r['against_cpu_s']} CPU s, peak RSS "
                  f"{r['against_rss_mb']} MB): --against / convert = {r['against_ratio']}; {r['against_verdict']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=None,
                    help="verify a whole converted synthetic checkpoint of this many layers against its convert")
    ap.add_argument("--serve-formats", nargs="+", default=["compressed-tensors", "kleidiai"],
                    choices=["compressed-tensors", "kleidiai"])
    ap.add_argument("--convert-threads", type=int, default=0, help="with --layers: convert's --threads (0: default)")
    ap.add_argument("--workdir", type=Path, default=None, help="with --layers: where the checkpoints go")
    ap.add_argument("--json-out", type=Path, default=None, help="with --layers: write the rows here")
    ap.add_argument("--against", action="store_true",
                    help="with --layers: also verify each output --against its source (its time over convert's)")
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
    if a.layers:
        return full(a)
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
