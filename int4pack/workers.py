"""How many convert jobs run at once.

Measured on a 16-core x86-64 host (docs/performance.md): before modules ran in batches
(batch.py), each job ran 1.5-2 ms of Python under the GIL and 8 or 16 workers were 3-27 % slower
than 4, so the cap was 4. With batches, 16 workers were the fastest for requantising sources (AWQ,
12 layers: 16.1 / 10.6 / 7.5 / 7.5 / 6.8 s at 1 / 2 / 4 / 8 / 16) and even with 4 for lossless
ones, so the cap is 16. ``INT4PACK_MAX_WORKERS=N`` moves it (to measure past it).
"""

from __future__ import annotations

import os

from ._lazy import torch, torch_loaded

__all__ = ["MAX_WORKERS", "job_workers"]

MAX_WORKERS = 16


def _max_workers() -> int:
    try:
        return max(1, int(os.environ.get("INT4PACK_MAX_WORKERS") or MAX_WORKERS))
    except ValueError:
        return MAX_WORKERS


def job_workers(threads: int | None) -> int:
    """Worker threads for ``--threads`` (None: the default, one per core), capped at MAX_WORKERS."""
    return max(1, min(threads or _cores(), _max_workers()))


def _cores() -> int:
    """torch's intra-op thread count once imported (what --threads meant before batches), else the
    cores this process may run on: a convert of batches alone never imports torch."""
    if torch_loaded():
        return torch.get_num_threads()
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
