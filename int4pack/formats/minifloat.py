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

    v = _e4m3_table()[raw.numpy()]
    if not np.isfinite(v).all():
        raise ValueError("e4m3 NaN (byte 0x7F or 0xFF)")
    return torch.from_numpy(v)


def unpack_e2m1(packed) -> "torch.Tensor":
    """U8 [..., K/2] -> float32 [..., K]: code 2j in the low nibble of byte j, code 2j+1 in the high."""
    import numpy as np

    b = packed.numpy()
    lut = np.array(E2M1, dtype=np.float32)
    out = np.empty(b.shape[:-1] + (b.shape[-1] * 2,), dtype=np.float32)
    out[..., 0::2] = lut[b & 0x0F]
    out[..., 1::2] = lut[b >> 4]
    return torch.from_numpy(out)


def e8m0(scales) -> "torch.Tensor":
    """E8M0 bytes -> float32 2^(e - 127), exactly (2^-127 is a float32 subnormal); ValueError for 255 (NaN)."""
    s = scales.to(torch.int64)
    if s.numel() and int(s.max()) == _E8M0_NAN:
        raise ValueError("E8M0 scale 255 (NaN)")
    return torch.exp2(s.to(torch.float64) - 127).to(torch.float32)


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
    if not finite(s) or bool((s < 0).any()):
        raise InputError(f"{name}: NaN, Inf or negative scale", tensor=name,
                         hint="The scales are corrupt; re-download the checkpoint.")
    return s
