"""CRC-32C (Castagnoli), the checksum of the bytes int4pack writes: one function, two engines.

``crc32c(data, crc=0)`` takes the compiled kernel (csrc/convert_kernels/crc32c.cpp, SSE4.2 at
memory speed) when the caller allows it and it is built, and otherwise a numpy engine, so a
digest can always be checked: verify without the extension, and the vLLM plugin, which must not
build or import the converter's kernels. ``crc32c_rows`` checksums the rows of a 2-D uint8 array
at once (the plugin's blobs: one call per loaded parameter).

The numpy engine: CRC-32C is linear over GF(2), so a buffer is cut into many lanes (after moving
the initial register into its first four bytes, and front-padding with zero bytes, neither of
which changes the result), every lane is run from a zero register in lockstep, eight bytes a step
through four 16-bit tables, and the lanes' registers are joined pairwise: the left one carried
over the right one's length of zero bytes (a linear map, applied as four byte tables, built by
squaring). Measured figures: docs/serve-format.md.
"""

from __future__ import annotations

import numpy as np

__all__ = ["crc32c", "crc32c_rows", "crc32c_hex"]

POLY = 0x82F63B78  # reflected Castagnoli polynomial
_TARGET_LANES = 1 << 16  # lanes run together: enough to make numpy's per-call cost small
_CHUNK_BYTES = 32 << 20  # rows taken per pass: bounds the working copies
_byte_table: np.ndarray | None = None
_word_tables: np.ndarray | None = None
_zero_tables: dict[int, np.ndarray] = {}  # L -> [4, 256]: the register carried over L zero bytes


def _tables() -> tuple[np.ndarray, np.ndarray]:
    global _byte_table, _word_tables
    if _byte_table is None:
        t = np.arange(256, dtype=np.uint32)
        for _ in range(8):
            t = (t >> 1) ^ (np.uint32(POLY) * (t & 1))
        slices = [t]  # slices[j][v]: byte v followed by j zero bytes
        for _ in range(7):
            p = slices[-1]
            slices.append(t[p & 0xFF] ^ (p >> 8))
        v = np.arange(1 << 16, dtype=np.uint32)
        lo, hi = v & 0xFF, v >> 8
        # word tables: a 16-bit little-endian pair at byte offset 2j of an 8-byte step
        words = np.stack([slices[7 - 2 * j][lo] ^ slices[6 - 2 * j][hi] for j in range(4)])
        _byte_table, _word_tables = t, words
    return _byte_table, _word_tables


def _apply(z: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The linear map whose byte tables are z [4, 256], applied to registers s."""
    return z[0][s & 0xFF] ^ z[1][(s >> 8) & 0xFF] ^ z[2][(s >> 16) & 0xFF] ^ z[3][s >> 24]


def _zeros(length: int) -> np.ndarray:
    """Byte tables of the register carried over ``length`` zero bytes (a power of two >= 8)."""
    z = _zero_tables.get(length)
    if z is None:
        if length == 8:
            t, _ = _tables()
            s = (np.arange(256, dtype=np.uint32)[None, :] << (8 * np.arange(4, dtype=np.uint32))[:, None])
            for _ in range(8):
                s = t[s & 0xFF] ^ (s >> 8)
            z = s
        else:
            half = _zeros(length // 2)
            z = _apply(half, half)
        _zero_tables[length] = z
    return z


def _rows_numpy(a: np.ndarray, crc: int) -> np.ndarray:
    """CRC-32C of each row of the uint8 array a [R, n] (n >= 4), each continuing from ``crc``."""
    r, n = a.shape
    _, words = _tables()
    lane = 8
    while lane < 1 << 16 and r * -(-n // lane) > _TARGET_LANES:
        lane *= 2
    nl = -(-n // lane)
    pad = nl * lane - n
    buf = np.zeros((r, nl * lane), dtype=np.uint8)
    buf[:, pad:] = a
    init = np.frombuffer((crc ^ 0xFFFFFFFF).to_bytes(4, "little"), dtype=np.uint8)
    buf[:, pad:pad + 4] ^= init  # the initial register is the same as these four bytes XORed in
    # lanes in lockstep: word pairs [lane/8, 2, R*nl] (one copy, transposed)
    w = np.ascontiguousarray(buf.view(np.uint32).reshape(r * nl, lane // 8, 2).transpose(1, 2, 0))
    del buf
    c = np.zeros(r * nl, dtype=np.uint32)
    x = np.empty_like(c)
    acc = np.empty_like(c)
    for step in w:
        lo, hi = step
        np.bitwise_xor(c, lo, out=x)
        np.take(words[0], x & 0xFFFF, out=acc)
        acc ^= words[1][x >> 16]
        acc ^= words[2][hi & 0xFFFF]
        acc ^= words[3][hi >> 16]
        c, acc = acc, c
    del w
    regs = c.reshape(r, nl)
    length = lane
    width = 1
    while width < nl:
        width *= 2
    if width > nl:  # zero lanes in front: a zero register stays zero over zero bytes
        regs = np.concatenate([np.zeros((r, width - nl), dtype=np.uint32), regs], axis=1)
    while regs.shape[1] > 1:
        regs = _apply(_zeros(length), regs[:, 0::2]) ^ regs[:, 1::2]
        length *= 2
    return regs[:, 0] ^ np.uint32(0xFFFFFFFF)


def _small(mv: memoryview, crc: int) -> int:
    t, _ = _tables()
    c = crc ^ 0xFFFFFFFF
    for b in mv:
        c = int(t[(c ^ b) & 0xFF]) ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _native():
    """The compiled kernel's crc32c, or None (not built, disabled by INT4PACK_NO_EXT)."""
    from . import _ext

    m = _ext.load("convert_kernels")
    return None if m is None else m.crc32c


def _as_bytes(data) -> memoryview:
    if hasattr(data, "numpy") and hasattr(data, "contiguous"):  # a torch tensor
        data = data.detach().contiguous().reshape(-1).view(__import__("torch").uint8).numpy()
    mv = memoryview(data)
    return mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv


def crc32c(data, crc: int = 0, *, native: bool = True) -> int:
    """CRC-32C of a contiguous buffer (bytes, memoryview, numpy array, torch tensor), continuing
    from ``crc`` (0 to start), like zlib.crc32. ``native`` False: numpy only (the vLLM plugin)."""
    mv = _as_bytes(data)
    fast = _native() if native else None
    if fast is not None:
        return int(fast(mv, crc))
    if len(mv) < 64:
        return _small(mv, crc)
    a = np.frombuffer(mv, dtype=np.uint8)
    for i in range(0, len(a), _CHUNK_BYTES):  # pieces: the working copies stay bounded
        piece = a[i:i + _CHUNK_BYTES]
        crc = _small(memoryview(piece), crc) if len(piece) < 4 else int(_rows_numpy(piece.reshape(1, -1), crc)[0])
    return crc


def crc32c_rows(a: np.ndarray, crc: int = 0) -> np.ndarray:
    """CRC-32C of each row of a 2-D uint8 array (numpy engine), as uint32 [R]."""
    a = np.asarray(a)
    if a.dtype != np.uint8 or a.ndim != 2:
        raise ValueError(f"crc32c_rows takes a 2-D uint8 array, got {a.dtype} {a.shape}")
    r, n = a.shape
    if n < 4:
        return np.array([_small(memoryview(row.tobytes()), crc) for row in a], dtype=np.uint32)
    per = max(1, _CHUNK_BYTES // max(n, 1))
    return np.concatenate([_rows_numpy(a[i:i + per], crc) for i in range(0, r, per)]) if r else \
        np.zeros(0, dtype=np.uint32)


def crc32c_hex(data, *, native: bool = True) -> str:
    return f"{crc32c(data, native=native):08x}"
