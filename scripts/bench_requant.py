"""Requant throughput and quality: python scripts/bench_requant.py [--threads 2] [--n 2048 --k 2048].

Prints Mparam/s for requantize (with and without the scale search) and rel_l2 against plain
absmax RTN, per group size. --sweep also tries a few chunk sizes / search widths (for tuning).

--from-codes times the requant of an int4 source instead (w4a8.to_w4a8 on a QuantLinear built
from random codes, asymmetric zeros and fp16 scales, as AWQ / asym GPTQ checkpoints give it), in
Qwen3-30B-A3B expert shapes (N=768, K=2048 and N=2048, K=768), source group 128 -> target 128
unless --group / --target say otherwise; --threads defaults to 1 there (convert runs one
job per worker thread).
"""

from __future__ import annotations

import argparse
import time

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
    a = ap.parse_args()
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
