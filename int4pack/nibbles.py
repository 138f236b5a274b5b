"""int4 nibble layouts: where each of a 32-bit word's eight 4-bit codes sits, and the torch/numpy
unpacking that reads them (the C++ kernels' twins, and the readers' small tensors). The one packing
of int4 values into byte pairs (torch's packer's input) is kleidiai.nibble_pack."""

from __future__ import annotations

import numpy as np

from ._lazy import torch

__all__ = ["NATURAL_SHIFTS", "AWQ_ORDER", "AWQ_SHIFTS", "as_uint32", "unpack_cols", "words_u32", "unpack_rows",
           "nibble_rows", "nibble_cols"]

# nibble i of a word holds logical column i (GPTQ, compressed-tensors)
NATURAL_SHIFTS = tuple(4 * i for i in range(8))
# AWQ GEMM: logical column 8j + AWQ_ORDER[i] lives in nibble i of word j
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# the same read the other way: logical column 8j+m sits in nibble i with AWQ_ORDER[i] == m, at bit 4*i
AWQ_SHIFTS = tuple(4 * AWQ_ORDER.index(m) for m in range(8))


def as_uint32(words: torch.Tensor) -> torch.Tensor:
    """int32 words as non-negative int64 (stored words are often negative)."""
    return words.to(torch.int64) & 0xFFFFFFFF


def unpack_cols(words: torch.Tensor, shifts: tuple[int, ...] = NATURAL_SHIFTS) -> torch.Tensor:
    """[A, B] words -> uint8 [A, 8B]; column 8j+m is the nibble at bit shifts[m] of word j."""
    w = as_uint32(words).unsqueeze(-1)
    sh = torch.tensor(shifts, dtype=torch.int64)
    return ((w >> sh) & 0xF).to(torch.uint8).reshape(words.shape[0], -1)


def words_u32(words: torch.Tensor) -> np.ndarray:
    """Packed int4 words as a numpy uint32 array (a view of int32 words, no copy)."""
    return words.numpy().view(np.uint32) if words.dtype == torch.int32 else as_uint32(words).numpy().astype(np.uint32)


def unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """[A, B] words packed along dim 0 -> uint8 [8A, B] in natural nibble order."""
    return torch.from_numpy(nibble_rows(words_u32(words)))


_ROW_SHIFTS = np.array(NATURAL_SHIFTS, dtype=np.uint32)[:, None]


def nibble_rows(w: np.ndarray) -> np.ndarray:
    """uint32 [A, B] -> uint8 [8A, B]: row 8a+m is nibble m of row a (numpy: a third of torch's int64 chain)."""
    return ((w[:, None, :] >> _ROW_SHIFTS) & 0xF).astype(np.uint8).reshape(8 * w.shape[0], w.shape[1])


_COL_SHIFTS = np.array(NATURAL_SHIFTS, dtype=np.uint32)


def nibble_cols(w: np.ndarray) -> np.ndarray:
    """uint32 [A, B] -> uint8 [A, 8B]: column 8j+m is nibble m of word j (``unpack_cols`` in numpy)."""
    return ((w[:, :, None] >> _COL_SHIFTS) & 0xF).astype(np.uint8).reshape(w.shape[0], -1)
