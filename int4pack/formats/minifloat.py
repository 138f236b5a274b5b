"""The small float formats' values, decoded from their bits: E2M1 (FP4), e4m3 (FP8) and E8M0 (MX block
scales), each exactly to float32, for the FP8 and FP4 readers (formats/fp8.py, fp4.py, mxfp4.py)."""

from __future__ import annotations

from .._lazy import torch
from ..sources.checkpoint import Checkpoint
from ..errors import InputError

__all__ = ["E2M1", "E4M3_NAN", "unpack_e2m1", "e8m0", "e4m3", "raw_bytes", "finite", "positive"]

# E2M1 code -> value (sign bit 3, two exponent bits, one mantissa bit; OCP MX v1.0)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_E8M0_NAN = 255
E4M3_NAN = (0x7F, 0xFF)  # float8_e4m3fn has NaN and no infinity
_LUT: list = []
_PAIRS: list = []
_E8M0: list = []


def _e4m3_table():
    """float32 [256], NaN at the two NaN bytes (numpy: its ``take`` is ~10x torch's indexing here)."""
    if not _LUT:
        import numpy as np

        vals = []
        for b in range(256):
            sign = -1.0 if b & 0x80 else 1.0
            e, m = (b >> 3) & 0x0F, b & 0x07
            if b & 0x7F == 0x7F:
                v = float("nan")
            elif e == 0:
                v = sign * m / 8 * 2.0**-6  # subnormal
            else:
                v = sign * (1 + m / 8) * 2.0 ** (e - 7)
            vals.append(v)
        _LUT.append(np.array(vals, dtype=np.float32))
    return _LUT[0]


def e4m3(raw) -> "torch.Tensor":
    """F8_E4M3 bytes (uint8, any shape) -> float32, exactly; ValueError for a NaN byte."""
    import numpy as np

    b = raw.numpy()
    if ((b & 0x7F) == 0x7F).any():  # the NaN bytes, found before the decode
        raise ValueError("e4m3 NaN (byte 0x7F or 0xFF)")
    return torch.from_numpy(np.take(_e4m3_table(), b.astype(np.intp)))  # intp: see unpack_e2m1


def _e2m1_pairs():
    """uint64 [256]: the two E2M1 float32 values of each byte, low nibble first, as one 8-byte item (a
    1-D take of 8-byte items: ~8x numpy's gather of [256, 2] rows)."""
    if len(_PAIRS) == 0:
        import numpy as np

        lut = np.array(E2M1, dtype=np.float32)
        b = np.arange(256)
        _PAIRS.append(np.ascontiguousarray(np.stack([lut[b & 0x0F], lut[b >> 4]], axis=1)).view(np.uint64)[:, 0])
    return _PAIRS[0]


def unpack_e2m1(packed) -> "torch.Tensor":
    """U8 [..., K/2] -> float32 [..., K]: code 2j in the low nibble of byte j, code 2j+1 in the high."""
    import numpy as np

    b = packed.numpy()
    # [..., K]: each byte's pair side by side, as the codes lie (intp indices: numpy's take is ~3x
    # faster from them than from the bytes, the conversion included)
    out = np.take(_e2m1_pairs(), b.astype(np.intp)).view(np.float32)
    return torch.from_numpy(out.reshape(b.shape[:-1] + (b.shape[-1] * 2,)))


def _e8m0_table():
    """float32 [256]: 2^(e - 127), exactly (2^-127 is a float32 subnormal); NaN at 255."""
    if not _E8M0:
        import numpy as np

        bits = np.arange(256, dtype=np.uint32) << 23  # e in the exponent field: 2^(e - 127), e >= 1
        bits[0] = 0x00400000  # 2^-127: the subnormal with the top mantissa bit
        t = bits.view(np.float32).copy()
        t[_E8M0_NAN] = np.nan
        _E8M0.append(t)
    return _E8M0[0]


def e8m0(scales) -> "torch.Tensor":
    """E8M0 bytes -> float32 2^(e - 127), exactly (2^-127 is a float32 subnormal); ValueError for 255 (NaN)."""
    import numpy as np

    b = scales.numpy() if scales.dtype == torch.uint8 else scales.to(torch.uint8).numpy()
    if b.size and int(b.max()) == _E8M0_NAN:
        raise ValueError("E8M0 scale 255 (NaN)")
    return torch.from_numpy(_e8m0_table()[b])


def raw_bytes(ckpt: Checkpoint, name: str) -> "torch.Tensor":
    """A 1-byte tensor's raw bytes as uint8 in its stored shape (U8, I8, F8_E4M3, F8_E8M0 alike)."""
    import numpy as np

    t = ckpt.info(name)
    return torch.from_numpy(np.frombuffer(ckpt.read_bytes(name), dtype=np.uint8).reshape(t.shape))  # a bytearray: writable


def finite(t: "torch.Tensor") -> bool:
    """Every value finite: numpy's test, ~100x torch's on these CPUs (float32/float64 tensors)."""
    import numpy as np

    return bool(np.isfinite(t.detach().contiguous().numpy()).all())


def positive(s: "torch.Tensor", name: str) -> "torch.Tensor":
    import numpy as np

    a = s.detach().contiguous().numpy()
    if not (np.isfinite(a).all() and not (a < 0).any()):
        raise InputError(f"{name}: NaN, Inf or negative scale", tensor=name,
                         hint="The scales are corrupt; re-download the checkpoint.")
    return s
