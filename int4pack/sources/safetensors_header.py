"""The safetensors format's header: its dtypes (names, sizes, torch and numpy views), where each
tensor lives (TensorInfo), and ``read_header``, which parses and checks one shard's header."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from .._lazy import torch
from ..errors import InputError

__all__ = ["DTYPES", "DTYPE_NAMES", "DTYPE_KEY", "ITEMSIZE", "NUMPY_DTYPES", "NUMPY_VIEW", "MAX_HEADER", "TensorInfo",
           "torch_dtype", "read_header"]

# safetensors dtype names -> (the torch dtype's name, bytes per element): plain names, so that the
# plan needs no torch (_lazy.py); DTYPES / DTYPE_NAMES (torch dtypes) are built on first use
_DTYPE_SPECS = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "U16": ("uint16", 2),
    "U32": ("uint32", 4),
    "U64": ("uint64", 8),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1),  # MX block scales (2^(e - 127)): DeepSeek-V3.2/V4 ue8m0
}
ITEMSIZE = {k: size for k, (_, size) in _DTYPE_SPECS.items()}
DTYPE_KEY = {k: k for k in _DTYPE_SPECS}  # the shared name string instead of one per tensor from JSON
# same-size dtypes numpy has, to read into a torch tensor through its numpy view
NUMPY_VIEW = {"BF16": "int16", "F8_E4M3": "uint8", "F8_E5M2": "uint8", "F8_E8M0": "uint8"}
# the dtypes numpy reads as they are (``Checkpoint.array``)
NUMPY_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
                "U8": "u1", "U16": "<u2", "U32": "<u4", "U64": "<u8", "BOOL": "?"}


def torch_dtype(name: str):
    """The torch dtype of a safetensors dtype name (imports torch)."""
    return getattr(torch, _DTYPE_SPECS[name][0])


def __getattr__(name: str):
    """DTYPES (safetensors name -> torch dtype) and DTYPE_NAMES (the reverse), built on first use."""
    if name in ("DTYPES", "DTYPE_NAMES"):
        dtypes = {k: torch_dtype(k) for k in _DTYPE_SPECS}
        globals().update(DTYPES=dtypes, DTYPE_NAMES={v: k for k, v in dtypes.items()})
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit


@dataclass(frozen=True, slots=True)  # slots: one per source tensor, alive for the whole run
class TensorInfo:
    """Where one tensor lives; read from the shard header only."""

    name: str
    file: str  # shard file name, relative to the checkpoint folder
    dtype: str  # safetensors dtype name, e.g. "I32"
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the shard
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def read_header(path: Path) -> tuple[dict[str, dict], dict[str, str], int]:
    """Parse and check a safetensors header.

    Returns ``(tensors, metadata, data_start)``; raises InputError naming the file for a
    truncated file, a corrupt or oversized header, or offsets out of range.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise InputError(f"{path.name}: file is {size} bytes, too short for a safetensors header",
                                 path=str(path), hint="The shard is truncated; download it again.")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER or n + 8 > size:
                raise InputError(
                    f"{path.name}: header length {n} is larger than the file ({size} bytes) or than 100 MB",
                    path=str(path), hint="The shard is truncated or not a safetensors file; download it again.")
            blob = fh.read(n)
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})", path=str(path),
                         hint="Check that the file exists and is readable.") from e
    try:
        header = json.loads(blob)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, huge ints, deep nesting
        raise InputError(f"{path.name}: corrupt safetensors header ({type(e).__name__}: {str(e)[:200]})",
                         path=str(path), hint="The shard is damaged; download it again.") from None
    damaged = "The shard is damaged or not a safetensors file; download it again."
    if not isinstance(header, dict):
        raise InputError(f"{path.name}: safetensors header is not a JSON object", path=str(path), hint=damaged)
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise InputError(f"{path.name}: __metadata__ is not a JSON object", path=str(path), hint=damaged)
    data_start = 8 + n
    data_len = size - data_start
    spans = []
    for name, info in header.items():
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise InputError(f"{path.name}: tensor {name!r} has a malformed header entry",
                             path=str(path), tensor=name, hint=damaged)
        dt, shape, off = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dt, str) or dt not in _DTYPE_SPECS:
            raise InputError(f"{path.name}: tensor {name!r} has unknown dtype {dt!r}", path=str(path),
                             tensor=name, hint=damaged)
        # one loop, no generators: a 48-layer MoE's headers hold ~56,000 entries, read on every run
        numel, ok = 1, type(shape) is list and type(off) is list and len(off) == 2
        if ok:
            for s in shape:
                if type(s) is not int or s < 0:
                    ok = False
                    break
                numel *= s
            b, e = off
            ok = ok and type(b) is int and type(e) is int
        if not ok:
            raise InputError(f"{path.name}: tensor {name!r} has a malformed shape or offsets",
                             path=str(path), tensor=name, hint=damaged)
        if not (0 <= b <= e <= data_len):
            raise InputError(
                f"{path.name}: tensor {name!r} offsets {off} fall outside the data ({data_len} bytes)",
                path=str(path), tensor=name, hint="The shard is truncated or corrupt; download it again.")
        if e - b != numel * ITEMSIZE[dt]:
            raise InputError(
                f"{path.name}: tensor {name!r} spans {e - b} bytes but {dt}{shape} needs {numel * ITEMSIZE[dt]}",
                path=str(path), tensor=name, hint="The shard is corrupt; download it again.")
        spans.append((b, e, name))
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise InputError(f"{path.name}: tensors {n0!r} and {n1!r} overlap", path=str(path), tensor=n1,
                             hint=damaged)
    return header, {str(k): str(v) for k, v in meta.items()}, data_start
