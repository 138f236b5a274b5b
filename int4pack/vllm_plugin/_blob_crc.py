"""The CRC-32 of the packed checkpoint's blobs as the plugin checks them at load (_layout.BlobCheck).

zlib's CRC-32, the one ``blobs.blob_checks`` records at convert: by int4pack's C++ library where it
is built (carry-less multiplies on x86-64, crc32x on Arm: 1.5-3x zlib's speed on x86-64), else by
zlib. An expert blob is handed to one checking thread as soon as its loader has copied it; that
thread takes every blob handed since its last pass in one library call (``i4p_crc32_many``, the
GIL released for the lot), so the loader's thread, which runs Python between its copies, is not
held up taking the GIL back for each blob (with a thread pool, one task per blob, that hand-over
cost the load more than the CRCs themselves). What is left after loading is summed on one thread
per core. docs/performance.md has what it costs.
"""

from __future__ import annotations

import ctypes
import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import numpy as np
import torch

__all__ = ["MAX_THREADS", "engine", "in_background", "crc32_rows", "crc_of"]

MAX_THREADS = 16  # threads of the CRCs left after loading


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
        lib = ctypes.CDLL(str(path))
        fn, many = lib.i4p_crc32, lib.i4p_crc32_many
    except (OSError, AttributeError):
        return zlib.crc32
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32], ctypes.c_uint32
    many.argtypes, many.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p], None

    def crc32(buf) -> int:
        a = np.ascontiguousarray(buf).view(np.uint8).reshape(-1)
        return int(fn(a.ctypes.data, a.nbytes, 0))

    def crc32_many(tensors: list) -> list[int]:
        """The CRC-32 of each contiguous tensor's bytes, in one call."""
        n = len(tensors)
        ptrs = np.fromiter((t.data_ptr() for t in tensors), dtype=np.uint64, count=n)
        lens = np.fromiter((t.numel() * t.element_size() for t in tensors), dtype=np.int64, count=n)
        out = np.empty(n, dtype=np.uint32)
        many(ptrs.ctypes.data, lens.ctypes.data, n, out.ctypes.data)
        return out.tolist()

    crc32.many = crc32_many
    check = np.frombuffer(b"123456789", dtype=np.uint8)
    ok = crc32(check) == zlib.crc32(b"123456789") == crc32_many([torch.from_numpy(check.copy())])[0]
    return crc32 if ok else zlib.crc32  # CRC-32's check value


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class Pending:
    """The CRC-32 of one handed tensor, once the checking thread has taken it."""

    __slots__ = ("tensor", "value")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.value = tensor, None

    def result(self) -> int:
        return _checker.wait(self)


class _Checker:
    """One thread that sums the handed blobs, all those handed since its last pass at a time."""

    def __init__(self):
        self._cv = threading.Condition()
        self._todo: list[Pending] = []
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def hand(self, t: torch.Tensor) -> Pending:
        p = Pending(t)
        with self._cv:
            self._todo.append(p)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="int4pack-crc", daemon=True)
                self._thread.start()
            self._cv.notify_all()
        return p

    def wait(self, p: Pending) -> int:
        with self._cv:
            while p.value is None and self._error is None:
                self._cv.wait()
            if p.value is None:
                raise RuntimeError(f"int4pack-kleidiai: the blob check failed: {self._error!r}")
            return p.value

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._todo:
                    self._cv.wait()
                todo, self._todo = self._todo, []
            try:
                crc = engine()
                many = getattr(crc, "many", None)
                got = many([p.tensor for p in todo]) if many is not None else \
                    [crc(p.tensor.numpy()) for p in todo]
            except BaseException as e:  # told to every waiter, never a hang
                with self._cv:
                    self._error = e
                    self._cv.notify_all()
                return
            with self._cv:
                for p, v in zip(todo, got):
                    p.tensor, p.value = None, v
                self._cv.notify_all()


_checker = _Checker()


def in_background(t: torch.Tensor) -> Pending:
    """The CRC-32 of ``t``'s bytes (contiguous), taken by the checking thread while loading goes on;
    ``t`` is kept alive until then."""
    return _checker.hand(t)


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
