"""int4pack/crc.py: the numpy CRC-32C engine against the published check value and a bit-by-bit reference."""

from __future__ import annotations

import numpy as np
import pytest

from int4pack import crc


def _bitwise(data: bytes, c: int = 0) -> int:
    """CRC-32C one bit at a time (RFC 3720, appendix B.4): no tables, no lanes."""
    c ^= 0xFFFFFFFF
    for b in data:
        c ^= b
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
    return c ^ 0xFFFFFFFF


def test_check_value():
    assert crc.crc32c(b"123456789", native=False) == 0xE3069283  # the CRC-32C catalogue's check value
    assert crc.crc32c(b"", native=False) == 0


@pytest.mark.parametrize("n", [1, 3, 4, 5, 63, 64, 65, 1000, 4097, 20001])
def test_numpy_engine_matches_the_bitwise_reference(n):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    want = _bitwise(data)
    assert crc.crc32c(data, native=False) == want
    half = n // 2  # continuing from an earlier CRC, like zlib.crc32
    assert crc.crc32c(data[half:], crc.crc32c(data[:half], native=False), native=False) == want


def test_rows():
    a = np.random.default_rng(1).integers(0, 256, (7, 333), dtype=np.uint8)
    assert crc.crc32c_rows(a).tolist() == [_bitwise(r.tobytes()) for r in a]


def test_native_and_numpy_agree():
    data = np.random.default_rng(2).integers(0, 256, 1 << 16, dtype=np.uint8).tobytes()
    assert crc.crc32c(data) == crc.crc32c(data, native=False) == _bitwise(data)


def test_the_plugins_crc32_engine_is_zlibs_crc32():
    """The plugin checks blobs with the C++ library's CRC-32 where it is built: zlib's values on
    every length and alignment (the blobs' CRC-32s were recorded by zlib at convert)."""
    import zlib

    from int4pack.vllm_plugin import _blob_crc

    _blob_crc.engine.cache_clear()
    crc = _blob_crc.engine()
    assert crc is not zlib.crc32, "the C++ library is built by the install"
    rng = np.random.default_rng(5)
    buf = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    for n in (0, 1, 7, 63, 64, 65, 1000, 4097, (1 << 20) - 3):
        for off in (0, 1, 3):
            piece = buf[off:off + n]
            assert crc(piece) == zlib.crc32(piece.tobytes()), (n, off)
    rows = [buf[i * 1000:(i + 1) * 1000 + i] for i in range(40)]
    assert _blob_crc.crc32_rows(rows) == [zlib.crc32(r.tobytes()) for r in rows]


def test_the_plugin_falls_back_to_zlib_without_the_library(monkeypatch):
    import zlib

    from int4pack.vllm_plugin import _blob_crc

    monkeypatch.setenv("INT4PACK_NO_EXT", "1")
    _blob_crc.engine.cache_clear()
    try:
        assert _blob_crc.engine() is zlib.crc32
    finally:
        _blob_crc.engine.cache_clear()


@pytest.mark.parametrize("engine", ["library", "zlib"])
def test_the_plugins_checking_thread_gives_zlibs_crc32_of_each_blob(engine, monkeypatch):
    """Blobs handed to the checking thread (views into one parameter, odd lengths and offsets, many
    at once): each one's zlib CRC-32, with the library's call for many blobs or with zlib's."""
    import zlib

    import torch

    from int4pack.vllm_plugin import _blob_crc

    if engine == "zlib":
        monkeypatch.setattr(_blob_crc, "engine", lambda: zlib.crc32)
    else:
        assert hasattr(_blob_crc.engine(), "many"), "the C++ library is built by the install"
    param = torch.from_numpy(np.random.default_rng(9).integers(0, 256, 1 << 20, dtype=np.uint8))
    cuts = [(i * 997 + i % 5, i * 997 + i % 5 + 64 * i + i % 3) for i in range(300)]
    handed = [_blob_crc.in_background(param[a:b]) for a, b in cuts]
    assert [p.result() for p in handed] == [zlib.crc32(param[a:b].numpy().tobytes()) for a, b in cuts]


def test_a_failing_checking_thread_is_an_error_not_a_hang(monkeypatch):
    import torch

    from int4pack.vllm_plugin import _blob_crc

    def broken(_buf):
        raise MemoryError("no room")

    checker = _blob_crc._Checker()
    monkeypatch.setattr(_blob_crc, "_checker", checker)
    monkeypatch.setattr(_blob_crc, "engine", lambda: broken)
    p = _blob_crc.in_background(torch.zeros(10, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="blob check failed: MemoryError"):
        p.result()
