"""Requant throughput and quality: python scripts/bench_requant.py [--threads 2] [--n 2048 --k 2048].

Prints Mparam/s for requantize (with and without the scale search) and rel_l2 against plain
absmax RTN, per group size. --sweep also tries a few chunk sizes / search widths (for tuning).

--from-codes times the requant of an int4 source instead (w4a8.to_w4a8 on a QuantLinear built
from random codes, asymmetric zeros and fp16 scales, as AWQ / asym GPTQ checkpoints give it), in
Qwen3-30B-A3B expert shapes (N=768, K=2048 and N=2048, K=768), source group 128 -> target 128
unless --group / --target say otherwise; --threads defaults to 1 there (convert runs one
job per worker thread).

--sources FMT... times what convert's workers spend on each expert linear of a float, FP8, FP4, MLX
or GGUF source, in CPU seconds per Gparam, one thread: a synthetic checkpoint of one
Qwen3-30B-A3B-shaped layer with --experts experts (scripts/make_synthetic.py,
make_synthetic_gguf.py), its plan, then each expert through the C++ requant batch where the batch
takes it, else through the per-module path (convert.run_job). The work runs in a child process per
tree; --compare-tree DIR times another checkout (e.g. the previous commit) in the same run, the two
alternating, and prints this tree's CPU over that one's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from int4pack import kernels, w4a8
from int4pack.groups import normalize_group
from int4pack.records import LinearSpec, QuantLinear


def bench(w: torch.Tensor, g: int, search: bool, reps: int) -> tuple[float, dict]:
    w4a8.requantize(w[:64], g, search=search)  # warm up
    best = float("inf")
    info = {}
    for _ in range(reps):
        t0 = time.perf_counter()
        _, _, info = w4a8.requantize(w, g, search=search)
        best = min(best, time.perf_counter() - t0)
    return w.numel() / best / 1e6, info


def source_ql(n: int, k: int, group: int, seed: int, *, sym: bool = False) -> QuantLinear:
    """A QuantLinear from random int4 codes, zero points around 8 (None: symmetric) and fp16 scales."""
    gen = torch.Generator().manual_seed(seed)
    groups = k // group
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n, groups, generator=gen) * 0.01 + 0.001).half()
    zeros = None if sym else torch.randint(4, 13, (n, groups), dtype=torch.uint8, generator=gen)
    spec = LinearSpec(name=f"bench.{n}x{k}", fmt="awq", n=n, k=k, bits=4, group_size=group, sym=sym,
                      act_order=False, keys=(), scale_dtype="F16")
    return QuantLinear(spec, codes, scales, zeros, None, None)


def best_time(fn, reps: int) -> float:
    fn()  # warm up (and build the extension)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def from_codes(a) -> None:
    torch.set_num_threads(a.threads if a.threads > 0 else 1)
    mod = kernels.ext()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, extension "
          f"{'loaded' if mod is not None else 'MISSING (torch twin)'}; source group {a.group} -> target {a.target}")
    total_p = total_t = 0.0
    for n, k in ((768, 2048), (2048, 768)):
        ql = source_ql(n, k, a.group, seed=n + k, sym=a.sym)
        g = normalize_group(a.target, k)
        for label, fn in (
            ("to_w4a8", lambda: w4a8.to_w4a8(ql, a.target, search=not a.rtn)),
            ("w4a8.requant_job", lambda: w4a8.requant_job(ql, g, search=not a.rtn)),
        ):
            t = best_time(fn, a.reps)
            print(f"N={n:>5} K={k:>5} {label:>16}: {n * k / t / 1e6:8.1f} Mparam/s ({1e3 * t:7.2f} ms, best of {a.reps})")
            if label == "to_w4a8":
                total_p += n * k
                total_t += t
    out = w4a8.to_w4a8(ql, a.target, search=not a.rtn)
    print(f"to_w4a8 over both shapes: {total_p / total_t / 1e6:.1f} Mparam/s; last path {out.path}, "
          f"rel_l2 {out.error['rel_l2']:.5f} (RTN {out.error['baseline_rel_l2']})")


# the child of --sources: CPU seconds of the expert linears of one checkpoint, by the path they take
SOURCES_CHILD = r"""
import json, os, sys, time
sys.path.insert(0, os.environ["INT4PACK_BENCH_TREE"])
import numpy as np
import torch
torch.set_num_threads(1)
from int4pack import batch, kernels
from int4pack.convert import run_job
from int4pack.plan import make_plan
from int4pack.sources.containers import open_checkpoint

src, limit = sys.argv[1], int(sys.argv[2])
with open_checkpoint(src) as ckpt:
    plan = make_plan(ckpt)
    jobs = [j for j in plan.jobs if j.kind == "linear" and ".experts." in j.specs[0].name][:limit]
    coarse, fine = kernels.search_arrays(True)
    ext = kernels.ext()

    def one(job):
        got = batch._source(plan.reader, job, False)
        spec = job.specs[0]
        if got is None or got[1] is None:
            run_job(job, ckpt, plan.reader, plan)
            return "per-module"
        _, shard, row, spans, _ = got
        desc = np.array([row], dtype=np.int64)
        out = np.empty(spec.n * spec.k + 4 * spec.n * spec.k, np.uint8)
        desc[0, 19], desc[0, 20] = 0, spec.n * spec.k  # the outputs' places (batch._OUTQ, _OUTS)
        addr, length = ckpt.mapping(shard)
        res, _, _ = ext.requant_batch(addr, length, desc, out, coarse, fine, 1)
        if res[0, 0]:
            raise SystemExit(f"{spec.name}: handed back ({int(res[0, 0])})")
        return "batch"

    for job in jobs[:2]:  # warm-up: page cache, first calls
        one(job)
    paths, params = set(), 0
    t0 = time.process_time()
    for job in jobs:
        paths.add(one(job))
        params += job.specs[0].n * job.specs[0].k
    cpu = time.process_time() - t0
print(json.dumps({"cpu_s": cpu, "params": params, "modules": len(jobs), "paths": sorted(paths)}))
"""


def _sources_run(tree: Path, src: Path, limit: int) -> dict:
    env = {**os.environ, "INT4PACK_BENCH_TREE": str(tree.resolve())}
    r = subprocess.run([sys.executable, "-c", SOURCES_CHILD, str(src), str(limit)], capture_output=True, text=True,
                       env=env)
    if r.returncode != 0:
        raise SystemExit(f"{tree}: {src.name} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def sources(a) -> None:
    """--sources: CPU s per Gparam of each source kind's expert linears (see the module docstring)."""
    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    from make_synthetic import make
    import make_synthetic_gguf

    work = Path(tempfile.mkdtemp(prefix="int4pack-bench-requant-"))
    trees = [here.parent] + ([a.compare_tree] if a.compare_tree else [])
    rows = []
    try:
        for fmt in a.sources:
            src = work / fmt
            (make_synthetic_gguf.make if fmt in make_synthetic_gguf.FORMATS else make)(src, fmt, 1, experts=a.experts)
            best = [None] * len(trees)
            for rep in range(a.reps):  # the trees alternate (ABBA), the least CPU of each kept
                order = range(len(trees)) if rep % 2 == 0 else reversed(range(len(trees)))
                for t in order:
                    got = _sources_run(trees[t], src, a.modules)
                    if best[t] is None or got["cpu_s"] < best[t]["cpu_s"]:
                        best[t] = got
            row = {"source": fmt, "modules": best[0]["modules"]}
            for t, b in enumerate(best):
                tag = "" if t == 0 else "other_"
                row[tag + "cpu_s_per_gparam"] = round(b["cpu_s"] / b["params"] * 1e9, 2)
                row[tag + "paths"] = b["paths"]
            if len(best) > 1:
                row["cpu_speedup"] = round(row["other_cpu_s_per_gparam"] / row["cpu_s_per_gparam"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if a.json:
                a.json.write_text(json.dumps(rows, indent=1))
            shutil.rmtree(src, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (default 2, 1 with --from-codes)")
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--from-codes", action="store_true", help="requant an int4 QuantLinear (see above)")
    ap.add_argument("--group", type=int, default=128, help="--from-codes: source group size")
    ap.add_argument("--target", type=int, default=128, help="--from-codes: target group size (-1 channel)")
    ap.add_argument("--sym", action="store_true", help="--from-codes: symmetric source (zeros None)")
    ap.add_argument("--rtn", action="store_true", help="--from-codes: no scale search")
    ap.add_argument("--sources", nargs="+", help="time these source kinds' expert linears (see above): "
                    "bf16 fp8 ct-fp8 nvfp4 mxfp4 modelopt-nvfp4 mlx gguf-q4_0 gguf-q4_k ...")
    ap.add_argument("--experts", type=int, default=16, help="--sources: experts in the layer written")
    ap.add_argument("--modules", type=int, default=48, help="--sources: expert linears timed")
    ap.add_argument("--compare-tree", type=Path, help="--sources: another int4pack checkout timed in the same run")
    ap.add_argument("--json", type=Path, help="--sources: also write the rows here")
    a = ap.parse_args()
    if a.sources:
        sources(a)
        return
    if a.from_codes:
        from_codes(a)
        return
    torch.set_num_threads(a.threads if a.threads > 0 else 2)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(a.n, a.k, generator=gen) * (torch.rand(a.n, 1, generator=gen) + 0.1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, W [{a.n}, {a.k}]")
    configs = [(w4a8.CHUNK_ELEMS, len(w4a8.COARSE_RATIOS), w4a8.FINE_POINTS)]
    if a.sweep:
        configs += [(c, n1, n2) for c in (1 << 16, 1 << 17, 1 << 18) for n1, n2 in ((10, 6), (8, 4))]
    for chunk, n1, n2 in configs:
        w4a8.CHUNK_ELEMS = chunk
        w4a8.COARSE_RATIOS = torch.linspace(0.70, 1.15, n1)
        w4a8.FINE_POINTS = n2
        for g in (32, 128, -1):
            rtn_speed, _ = bench(w, g, False, a.reps)
            speed, info = bench(w, g, True, a.reps)
            print(f"chunk={chunk:>7} grid={n1}+{n2} g={g:>4}: search {speed:6.1f} Mparam/s "
                  f"(RTN only {rtn_speed:6.1f}), rel_l2 {info['rel_l2']:.5f} vs RTN "
                  f"{info['baseline_rel_l2']:.5f} ({100 * (1 - info['rel_l2'] / info['baseline_rel_l2']):.1f} % lower)")


if __name__ == "__main__":
    main()
