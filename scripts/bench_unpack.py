#!/usr/bin/env python3
"""Unpack kernels' throughput, one thread: python scripts/bench_unpack.py [--reps 50]

Times kernels.unpack_gptq / unpack_awq / unpack_ct on random words in Qwen3-30B-A3B expert
shapes (N=768, K=2048 and N=2048, K=768) and prints Gparam/s beside a copy of the same output
bytes (the memory-speed ceiling). A kernel far below its neighbours on one machine usually means
its compiler lowered the vector code badly there (GCC 13 did that to the AWQ transpose once).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_requant import best_time  # noqa: E402  (scripts/ is this script's first sys.path entry)
from int4pack import kernels  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    torch.set_num_threads(1)
    if kernels.ext() is None:
        raise SystemExit("the convert_kernels extension is not loaded: nothing to time")
    gen = torch.Generator().manual_seed(0)
    for n, k in [(768, 2048), (2048, 768)]:
        def words(*shape):
            return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, generator=gen)
        gptq, awq, ct = words(k // 8, n), words(k, n // 8), words(n, k // 8)
        src, dst = torch.empty(n, k, dtype=torch.uint8), torch.empty(n, k, dtype=torch.uint8)
        cases = {"gptq": lambda: kernels.unpack_gptq(gptq), "awq": lambda: kernels.unpack_awq(awq),
                 "ct": lambda: kernels.unpack_ct(ct, k), "copy": lambda: dst.copy_(src)}
        rates = {name: n * k / best_time(f, a.reps) / 1e9 for name, f in cases.items()}
        print(f"N={n:5d} K={k:5d}  " + "  ".join(f"{name} {r:6.2f}" for name, r in rates.items()) + "  Gparam/s")


if __name__ == "__main__":
    main()
