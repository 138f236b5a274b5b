#!/usr/bin/env python3
"""The C++ kernels against their pure-torch twins (what INT4PACK_NO_EXT=1 runs) on one
Qwen3-30B-A3B expert matrix (768 x 2048, group 128): to_w4a8's CPU seconds (all threads) and wall,
best of 3, 2 threads, for the requant (GPTQ asym) and lossless (GPTQ sym) paths. Checks that both
give the same tensors.

    python scripts/bench_no_ext.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_requant import source_ql  # noqa: E402

from int4pack import _ext, kernels, w4a8  # noqa: E402


def best(fn, reps: int = 3) -> tuple[float, float]:
    out = []
    for _ in range(reps):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        out.append((time.process_time() - c0, time.perf_counter() - w0))
    return min(out)


def main() -> int:
    torch.set_num_threads(2)
    real = kernels.ext
    if real() is None:
        print(f"the C++ kernels are not available: {_ext.build_error()}", file=sys.stderr)
        return 1
    for sym, name in ((False, "GPTQ asym (requant)"), (True, "GPTQ sym (lossless)")):
        ql = source_ql(768, 2048, 128, 0, sym=sym)
        with kernels.threads_here(2):
            a = w4a8.to_w4a8(ql, 128)
            cpp = best(lambda: w4a8.to_w4a8(ql, 128))
            kernels.ext = lambda: None
            try:
                b = w4a8.to_w4a8(ql, 128)
                tor = best(lambda: w4a8.to_w4a8(ql, 128))
            finally:
                kernels.ext = real
        same = a.path == b.path and torch.equal(a.q, b.q) and torch.equal(a.scales.view(torch.uint8),
                                                                           b.scales.view(torch.uint8))
        print(f"{name}: path {a.path}, same tensors {same}; C++ {cpp[0]:.3f} s cpu {cpp[1]:.3f} s wall; "
              f"torch {tor[0]:.3f} s cpu {tor[1]:.3f} s wall; slowdown {tor[0] / cpp[0]:.0f}x cpu "
              f"{tor[1] / cpp[1]:.0f}x wall; load {open('/proc/loadavg').read().split()[0]}")
        if not same:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
