"""Requant throughput and quality: python scripts/bench_requant.py [--threads 2] [--n 2048 --k 2048].

Prints Mparam/s for requantize (with and without the scale search) and rel_l2 against plain
absmax RTN, per group size. --sweep also tries a few chunk sizes / search widths (for tuning).
"""

from __future__ import annotations

import argparse
import time

import torch

from int4pack import w4a8


def bench(w: torch.Tensor, g: int, search: bool, reps: int) -> tuple[float, dict]:
    w4a8.requantize(w[:64], g, search=search)  # warm up
    best = float("inf")
    info = {}
    for _ in range(reps):
        t0 = time.perf_counter()
        _, _, info = w4a8.requantize(w, g, search=search)
        best = min(best, time.perf_counter() - t0)
    return w.numel() / best / 1e6, info


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sweep", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
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
