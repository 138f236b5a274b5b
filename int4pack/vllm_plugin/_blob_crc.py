"""The CRC-32 of the packed checkpoint's blobs as the plugin checks them at load (_layout.BlobCheck).

zlib's CRC-32, the one ``blobs.blob_checks`` records at convert: by int4pack's C++ library where it
is built (carry-less multiplies on x86-64, crc32x on Arm: 1.5-2.3x zlib's speed on x86-64), else by
zlib. Both release the GIL, so an expert blob is checksummed by background threads (one per core but
one, at most ``MAX_THREADS``) as soon as its loader has copied it, and the rest on one thread per
core once loading is done. docs/performance.md has what it costs.
"""

from __future__ import annotations

import ctypes
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import numpy as np
import torch

__all__ = ["MAX_THREADS", "engine", "background", "in_background", "crc32_rows", "crc_of"]

MAX_THREADS = 16  # threads of the load-time CRC


@lru_cache(maxsize=None)
def engine():
    """zlib's CRC-32 from the C++ library when it is built, else zlib's own. Only the library's
    i4p_crc32 is opened, by ctypes (which drops the GIL): nothing of the converter is imported and
    nothing is built here. Loading it installs its SIGBUS guard (csrc/fault_guard.cpp), which hands every fault outside its own
    guarded calls to the handler that was there before: vLLM's process sees no change."""
    from .. import _ext  # noqa: PLC0415  (here: vLLM imports the plugin early; stdlib only)

    path = _ext.library_path()
    if _ext.disabled() or not path.is_file():
        return zlib.crc32
    try:
        fn = ctypes.CDLL(str(path)).i4p_crc32
    except (OSError, AttributeError):
        return zlib.crc32
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32], ctypes.c_uint32

    def crc32(buf) -> int:
        a = np.ascontiguousarray(buf).view(np.uint8).reshape(-1)
        return int(fn(a.ctypes.data, a.nbytes, 0))

    check = np.frombuffer(b"123456789", dtype=np.uint8)
    return crc32 if crc32(check) == zlib.crc32(b"123456789") else zlib.crc32  # CRC-32's check value


_pool: list = []  # the process's background CRC threads (made on first use)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def background():
    """Threads that checksum blobs while the loader goes on to the next tensor: on a host with cores
    to spare, the check then costs the load almost no wall time (the bytes are also still in cache)."""
    if not _pool:
        _pool.append(ThreadPoolExecutor(max_workers=max(1, min(MAX_THREADS, _cores() - 1)),
                                        thread_name_prefix="int4pack-crc"))
    return _pool[0]


def in_background(t: torch.Tensor):
    """A future of the CRC-32 of ``t``'s bytes (contiguous), taken by the background threads."""
    return background().submit(engine(), t.numpy())


def crc32_rows(rows: list) -> list[int]:
    """zlib CRC-32 of each buffer, on up to one thread per core (both engines release the GIL)."""
    crc = engine()
    workers = max(1, min(len(rows), _cores(), MAX_THREADS))
    if workers == 1:
        return [crc(r) for r in rows]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(crc, rows))


def crc_of(t: torch.Tensor) -> int:
    return engine()(t.contiguous().reshape(-1).numpy())
