#!/usr/bin/env python3
"""How much of a convert runs Python under the GIL: the serial part that more threads cannot share.

    python scripts/gil_convert.py SRC OUT --serve-format kleidiai --threads 1 4 16 --json gil.json

Converts SRC once per thread count, in this process, and splits the process's CPU time into the
part spent inside calls that release the GIL (the C++ kernels through ctypes, zlib's CRC-32 of
the packed format's provenance, madvise, pwrite/fsync) and the rest: Python, which one thread at
a time runs. CPU time, not wall time, so waits (the disk, a free staging buffer, a future) are in
neither. ``gil_busy`` is that Python CPU over the run's wall time: near 1.0, the run is as fast as
one core runs its Python, whatever the thread count; ``py_ms_per_tensor`` is that CPU per output
tensor. It is an upper bound: the wrappers' few microseconds per call, and the small torch ops
that release the GIL too (casts, allocations), count as Python; above 1.0, those are the excess.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
import threading
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_native_cpu = [0.0]
_lock = threading.Lock()
_mine = threading.local()  # this thread's share of _native_cpu


def thread_native_cpu() -> float:
    return getattr(_mine, "cpu", 0.0)


def _timed(fn):
    def wrapper(*a, **k):
        t0 = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            dt = time.thread_time() - t0
            _mine.cpu = getattr(_mine, "cpu", 0.0) + dt
            with _lock:
                _native_cpu[0] += dt

    wrapper.__wrapped__ = fn
    return wrapper


def _instrument() -> None:
    """Wrap every call known to release the GIL on convert's path."""
    from int4pack import _native, serve_spec
    from int4pack.sources import checkpoint

    _native._Lib._call = _timed(_native._Lib._call)
    _native.ConvertKernels.crc32c = _timed(_native.ConvertKernels.crc32c)
    _native.ConvertKernels.crc32c_copy = _timed(_native.ConvertKernels.crc32c_copy)
    checkpoint.Checkpoint._madvise = _timed(checkpoint.Checkpoint._madvise)

    class _Zlib:  # serve_spec's provenance CRC-32s
        crc32 = staticmethod(_timed(zlib.crc32))

    serve_spec.zlib = _Zlib
    for name in ("pwrite", "preadv", "fsync", "fdatasync", "ftruncate"):
        setattr(os, name, _timed(getattr(os, name)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--serve-format", default="compressed-tensors", choices=["compressed-tensors", "kleidiai"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1], help="0: convert's default")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    import torch  # noqa: F401  (outside the clock)

    _instrument()
    convert = importlib.import_module("int4pack.convert").convert
    rows = []
    for th in a.threads:
        shutil.rmtree(a.out, ignore_errors=True)
        os.sync()
        _native_cpu[0] = 0.0
        c0, t0 = time.process_time(), time.perf_counter()
        r = convert(a.src, a.out, threads=th or None, serve_format=a.serve_format)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        n = r["plan"]["tensors_out"]
        py = cpu - _native_cpu[0]
        row = {"serve_format": a.serve_format, "threads": th or "default", "workers": r.get("workers"),
               "tensors": n, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
               "native_cpu_s": round(_native_cpu[0], 2), "python_cpu_s": round(py, 2),
               "py_ms_per_tensor": round(py / n * 1e3, 3), "gil_busy": round(py / wall, 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if a.json:
            a.json.write_text(json.dumps(rows, indent=1))
    shutil.rmtree(a.out, ignore_errors=True)


if __name__ == "__main__":
    main()
