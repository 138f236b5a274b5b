"""Tensors a container computes when they are read: a quantised embedding, lm_head or router of a
GGUF or MLX checkpoint, which vLLM loads in float, seen by the planner as the BF16 tensor it becomes.

A container (a ``Checkpoint`` subclass) lists each one with ``add_derived(info, rows)``: ``info`` is
the result's TensorInfo (dtype BF16, its HF shape) and ``rows(r0, r1)`` returns rows r0..r1 of it
as a contiguous numpy array. Reads go through the same calls as stored tensors (``read_into``,
``get``, ``slice``), one bounded run of rows at a time, so a copied embedding never sits whole in
memory (``raw``/``view`` of one build it whole: verify's comparisons).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .safetensors_header import TensorInfo

__all__ = ["DerivedTensors", "bf16_bits"]

Rows = Callable[[int, int], np.ndarray]


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even as torch rounds."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = ((u >> 16) & 1) + np.uint32(0x7FFF)
    out = ((u + r) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0
    return out


class DerivedTensors:
    """Mixin for a Checkpoint subclass (listed before it): the derived tensors beside the stored ones."""

    def _init_derived(self) -> None:
        self._derived: dict[str, Rows] = {}

    def add_derived(self, info: TensorInfo, rows: Rows) -> None:
        self.tensors[info.name] = info
        self._derived[info.name] = rows

    def is_derived(self, name: str) -> bool:
        return name in self._derived

    def _read(self, t: TensorInfo, buf, offset: int, want: int) -> None:
        rows = self._derived.get(t.name)
        if rows is None:
            return super()._read(t, buf, offset, want)
        row_bytes = t.nbytes // max(1, t.shape[0])
        dst = memoryview(buf).cast("B")
        done = 0
        while done < want:  # a run of rows at a time: bounded memory whatever the request
            pos = offset + done
            r0 = pos // row_bytes
            r1 = min(t.shape[0], r0 + max(1, (16 << 20) // max(1, row_bytes)), -(-(offset + want) // row_bytes))
            data = memoryview(np.ascontiguousarray(rows(r0, r1))).cast("B")
            lo = pos - r0 * row_bytes
            n = min(want - done, len(data) - lo)
            dst[done:done + n] = data[lo:lo + n]
            done += n

    def raw(self, name: str) -> memoryview:
        if name in self._derived:
            return memoryview(self.read_bytes(name))
        return super().raw(name)

    def view(self, name: str):
        if name in self._derived:
            return self.get(name)
        return super().view(name)

    def release(self, name: str) -> None:
        if name not in self._derived:
            super().release(name)
