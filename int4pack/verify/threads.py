"""How verify's numerical pass runs: torch's thread count, a pool of threads (torch and the C++
kernels let go of the GIL), and the clock of its stages."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch

__all__ = ["torch_threads", "Clock", "timed", "shutting", "parallel", "PerThread"]


@contextmanager
def torch_threads(n: int | None):
    if not n:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(old)


class Clock:
    """Seconds per stage, summed over the threads that ran it (so their sum can exceed the wall time)."""

    def __init__(self):
        self.s = {"reference": 0.0, "kernel": 0.0, "pack": 0.0, "read": 0.0, "prediction": 0.0, "compare": 0.0}
        self._lock = threading.Lock()

    @contextmanager
    def __call__(self, what: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            with self._lock:
                self.s[what] += dt

    def add(self, seconds: dict) -> None:
        """Another clock's seconds (a worker process's) added to this one's."""
        with self._lock:
            for what, dt in seconds.items():
                self.s[what] = self.s.get(what, 0.0) + dt


def timed(fn, *args):
    t0 = time.perf_counter()
    return fn(*args), time.perf_counter() - t0


@contextmanager
def shutting(pool):
    try:
        yield
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def parallel(pool, fn, items: list):
    """fn(*item) for each item, in order; on ``pool`` (a ThreadPoolExecutor) when there is one.
    torch and the C++ kernels let go of the GIL, so threads run the experts side by side."""
    if pool is None or len(items) < 2:
        return [fn(*it) for it in items]
    return [f.result() for f in [pool.submit(fn, *it) for it in items]]


class PerThread:
    """One object per thread, made by ``make()`` on the thread's first ``get``: the buffers a thread
    reuses from one module to the next (fresh memory per module costs page faults that measured
    about a quarter of verify's CPU time)."""

    def __init__(self, make):
        self._make = make
        self._by_thread: dict[int, object] = {}
        self._lock = threading.Lock()

    def get(self):
        key = threading.get_ident()  # a finished thread's ident may be reused: by a thread, one at a time
        obj = self._by_thread.get(key)
        if obj is None:
            obj = self._make()
            with self._lock:
                self._by_thread[key] = obj
        return obj
