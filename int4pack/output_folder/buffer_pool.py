"""Reused page-aligned buffers, taken by the writer's direct writes and by convert's batches."""

from __future__ import annotations

import mmap
import threading

__all__ = ["BufferPool"]


class BufferPool:
    """Page-aligned buffers (anonymous mappings, reused: fresh memory costs page faults) of
    ``nbytes`` each, made as needed up to ``count``; taking one waits while all are in use or queued
    behind the disk, so the workers slow to the disk's pace."""

    def __init__(self, count: int, nbytes: int) -> None:
        self.count, self.nbytes = count, nbytes
        self._free: list[memoryview] = []
        self._made = 0
        self._cv = threading.Condition()

    def take(self) -> memoryview:
        with self._cv:
            while not self._free and self._made >= self.count:
                self._cv.wait()
            if self._free:
                return self._free.pop()
            self._made += 1
        return memoryview(mmap.mmap(-1, self.nbytes))

    def give(self, buf: memoryview) -> None:
        with self._cv:
            self._free.append(buf)
            self._cv.notify()

    def resize(self, count: int) -> None:
        """Up to ``count`` buffers from now on (those made stay, for reuse)."""
        with self._cv:
            self.count = count
            self._cv.notify_all()
