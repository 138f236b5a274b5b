"""Small helpers shared by the format readers: shape checks, tensor lookup, config values."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .._lazy import torch
from ..sources.checkpoint import Checkpoint
from ..sources.safetensors_header import NUMPY_DTYPES, torch_dtype
from ..errors import InputError, RefusedError

__all__ = [
    "SpecsOnce",
    "read_expert",
    "all_bytes",
    "read_transposed",
    "prefixes_with",
    "need",
    "check_shape",
    "check_dtype",
    "owned",
    "read_g_idx",
    "is_trivial_g_idx",
    "g_idx_unless_trivial",
    "nontrivial_g_idx",
    "cfg_int",
    "cfg_bool",
    "QuantParams",
    "quant_params",
    "require_bits4",
    "WIDE_BITS",
    "byte_rows",
    "byte_cols",
    "dequantize_rows",
]

# widths a module may have: 4-bit (converted as it is) and 8-bit (beside 4-bit modules: read as its
# float values, then requantised or kept in bf16, as the plan decides)
WIDE_BITS = (4, 8)

def all_bytes(data: bytearray, byte: int) -> bool:
    """Every byte is ``byte``: one memcmp (a uniform word such as 0x88888888 reads so in any byte order)."""
    return data == bytes((byte,)) * len(data)


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def read_transposed(ckpt: Checkpoint, name: str) -> torch.Tensor:
    """A 2-D tensor transposed, contiguous, in memory of its own: [G, N] scales -> [N, G].

    The copy goes through numpy as same-size integers (no bf16 there): half of torch's time."""
    t = ckpt.info(name)
    dt = torch_dtype(t.dtype)
    words = np.frombuffer(ckpt.read_bytes(name), _UINT[dt.itemsize]).reshape(t.shape)
    return torch.from_numpy(np.ascontiguousarray(words.T)).view(dt)


def read_expert(ckpt: Checkpoint, name: str, e: int) -> torch.Tensor:
    """Expert e's slice of a fused [E, ...] tensor, read alone (a positional read at its offset)."""
    t = ckpt.info(name)
    per = t.nbytes // t.shape[0]
    out = torch.empty(tuple(t.shape[1:]), dtype=torch_dtype(t.dtype))
    buf = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
    ckpt.read_into(name, buf.numpy().reshape(-1).view("u1"), e * per)
    return out


def prefixes_with(ckpt: Checkpoint, suffix: str) -> list[str]:
    """Module prefixes P for which tensor P<suffix> exists, sorted."""
    return sorted(n[: -len(suffix)] for n in ckpt.tensors if n.endswith(suffix))


def need(ckpt: Checkpoint, module: str, key: str, why: str) -> str:
    """The full tensor name, or an InputError naming the module and the missing partner."""
    name = f"{module}.{key}"
    if name not in ckpt.tensors:
        raise InputError(f"{module}: has {why} but no {key} tensor ({name})", tensor=name,
                         hint="The checkpoint is incomplete or mixes layouts; re-download or re-export it.")
    return name


def check_shape(ckpt: Checkpoint, name: str, expected: tuple[int, ...], what: str) -> None:
    got = ckpt.tensors[name].shape
    if tuple(got) != tuple(expected):
        raise InputError(f"{name}: shape {list(got)} does not match {what} (expected {list(expected)})",
                         path=str(ckpt.folder / ckpt.tensors[name].file), tensor=name,
                         hint="The tensors of this module disagree with each other or with the config; "
                              "the checkpoint is corrupt or not the format its config claims.")


def check_dtype(ckpt: Checkpoint, name: str, allowed: tuple[str, ...], what: str) -> None:
    dt = ckpt.tensors[name].dtype
    if dt not in allowed:
        raise InputError(f"{name}: dtype {dt} but {what} must be {' or '.join(allowed)}",
                         path=str(ckpt.folder / ckpt.tensors[name].file), tensor=name,
                         hint="The checkpoint is not the layout its config claims.")


def _g_idx_array(ckpt: Checkpoint, name: str, k: int, groups: int) -> np.ndarray:
    """g_idx as numpy int64 [K], checked for shape and range (no torch: the plan reads it)."""
    check_shape(ckpt, name, (k,), "in_features K")
    check_dtype(ckpt, name, ("I32", "I64", "I16"), "g_idx")
    g = ckpt.array(name).astype(np.int64)
    if k and (int(g.min()) < 0 or int(g.max()) >= groups):
        raise InputError(f"{name}: group index out of range [{int(g.min())}, {int(g.max())}] for {groups} group(s)",
                         tensor=name, hint="g_idx must index the scales' groups; the checkpoint is corrupt.")
    return g


def read_g_idx(ckpt: Checkpoint, name: str, k: int, groups: int) -> torch.Tensor:
    """g_idx as int64 [K], checked for shape and range."""
    return torch.from_numpy(_g_idx_array(ckpt, name, k, groups))


def is_trivial_g_idx(g_idx, group_size: int) -> bool:
    """``g_idx`` (a torch tensor or numpy array) is arange(K) // group_size."""
    g = np.asarray(g_idx)
    return bool(np.array_equal(g, np.arange(g.size, dtype=np.int64) // group_size))


@functools.lru_cache(maxsize=32)
def _trivial_g_idx(k: int, group_size: int, dtype: str) -> bytes:
    return (np.arange(k, dtype=np.int64) // group_size).astype(NUMPY_DTYPES[dtype]).tobytes()


def nontrivial_g_idx(ckpt: Checkpoint, name: str, k: int, groups: int, group_size: int) -> np.ndarray | None:
    """The checked g_idx (numpy int64), or None for the usual arange(K) // group_size: its bytes compared
    as stored against a cached copy first (the conversion and range checks cost more than the module's
    other reads). No torch: the plan calls it for every module with a g_idx."""
    t = ckpt.info(name)
    if t.dtype in ("I32", "I64") and tuple(t.shape) == (k,) and k and group_size > 0 and (k - 1) // group_size < groups:
        if ckpt.read_bytes(name) == _trivial_g_idx(k, group_size, t.dtype):
            return None
    g = _g_idx_array(ckpt, name, k, groups)
    return None if is_trivial_g_idx(g, group_size) else g


def g_idx_unless_trivial(ckpt: Checkpoint, name: str, k: int, groups: int, group_size: int) -> torch.Tensor | None:
    """nontrivial_g_idx as a torch tensor (the readers' QuantLinear.g_idx)."""
    g = nontrivial_g_idx(ckpt, name, k, groups, group_size)
    return None if g is None else torch.from_numpy(g)


def cfg_int(cfg: dict, *keys: str, default: int | None = None) -> int | None:
    """First present integer among synonym keys (bits / w_bit, group_size / q_group_size)."""
    for key in keys:
        v = cfg.get(key)
        if v is not None:
            try:
                return int(v)
            except (TypeError, ValueError):
                raise InputError(f"quantization_config {key}={v!r} is not an integer",
                                 hint="Fix the config: it must be a number.") from None
    return default


def cfg_bool(cfg: dict, key: str, default: bool) -> bool:
    """A config flag; JSON true/false, also the strings "true"/"false" some tools write.

    bool("false") is True, which would silently read an asymmetric checkpoint as symmetric."""
    v = cfg.get(key)
    if v is None:
        return default
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in ("true", "false", "1", "0", "yes", "no"):
        return v.strip().lower() in ("true", "1", "yes")
    raise InputError(f"quantization_config {key}={v!r} is not true or false",
                     hint="Fix the config: it must be a boolean.")


@dataclass(frozen=True)
class QuantParams:
    """The config preamble every int reader starts from: bits, group along K, symmetry."""

    bits: int | None
    group_size: int | None  # as the config writes it: -1, 0 or None mean one group over all of K
    sym: bool

    def group_along(self, k: int) -> int:
        """The source group along K of a linear with ``k`` inputs."""
        return self.group_size if self.group_size and self.group_size > 0 else k

    def overridden(self, cfg: dict) -> "QuantParams":
        """These parameters with a per-module override's keys applied (GPTQ dynamic, AutoRound extra_config)."""
        return quant_params(cfg, bits=self.bits, group_size=self.group_size, sym=self.sym)


def quant_params(cfg: dict, *, bits: int | None = 4, group_size: int | None = 128, sym: bool = True) -> QuantParams:
    """bits / group size / symmetry under each producer's key (GPTQ and AutoRound ``bits``, AutoAWQ's
    ``w_bit``, compressed-tensors' ``num_bits``; ``group_size`` or ``q_group_size``; ``sym`` or
    ``symmetric``), with the format's defaults for keys that are absent."""
    return QuantParams(cfg_int(cfg, "bits", "w_bit", "num_bits", default=bits),
                       cfg_int(cfg, "group_size", "q_group_size", default=group_size),
                       cfg_bool(cfg, "symmetric" if "sym" not in cfg and "symmetric" in cfg else "sym", sym))


def require_bits4(bits: int | None, module: str, path: str | None = None) -> None:
    if bits != 4:
        raise RefusedError(f"int4pack converts 4-bit checkpoints only; the config says bits={bits} "
                           f"(first quantised module: {module})", path=path, tensor=module,
                           hint="Use a 4-bit int checkpoint (GPTQ/AWQ/compressed-tensors W4).")


def owned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous private copy (views of the read-only mmap must not escape)."""
    return t.clone(memory_format=torch.contiguous_format)


_SIGN = {"F16": (np.uint16, 0x8000), "BF16": (np.uint16, 0x8000), "F32": (np.uint32, 0x80000000)}


def has_negative(ckpt: Checkpoint, name: str) -> bool:
    """Whether a float tensor holds a value below zero: its sign bits, read without torch (-0.0 aside)."""
    dt, bit = _SIGN[ckpt.info(name).dtype]
    v = np.frombuffer(ckpt.read_bytes(name), dt)
    return bool(((v & dt(bit)) != 0).__and__((v & dt(bit - 1)) != 0).any())


def byte_rows(w: np.ndarray) -> np.ndarray:
    """uint32 [A, B] words packed along dim 0, four 8-bit values each (low byte first) -> uint8 [4A, B]."""
    return np.ascontiguousarray(w.astype("<u4").view(np.uint8).reshape(w.shape[0], w.shape[1], 4)
                                .transpose(0, 2, 1)).reshape(4 * w.shape[0], w.shape[1])


def byte_cols(w: np.ndarray) -> np.ndarray:
    """uint32 [A, B] words packed along dim 1 -> uint8 [A, 4B]: column 4j+m is byte m of word j."""
    return np.ascontiguousarray(w.astype("<u4")).view(np.uint8).reshape(w.shape[0], 4 * w.shape[1])


def dequantize_rows(u: np.ndarray, z: np.ndarray | int, scales: torch.Tensor, g_idx: np.ndarray) -> torch.Tensor:
    """float32 [N, K] = (u - z[:, g]) * scales[:, g], g = g_idx[k]: unsigned codes [N, K], zero points
    [N, G] (or one for all), scales [N, G]."""
    g = torch.from_numpy(np.asarray(g_idx, dtype=np.int64))
    s = scales.float()[:, g]
    zz = float(z) if np.isscalar(z) else torch.from_numpy(np.ascontiguousarray(z)).float()[:, g]
    return (torch.from_numpy(np.ascontiguousarray(u)).float() - zz) * s


class SpecsOnce:
    """A reader's checkpoint and config, and its ``linears()`` found once (``_find_linears``) and kept."""

    def __init__(self, ckpt, q: dict):
        self.ckpt = ckpt
        self.q = q
        self._specs = None

    def linears(self):
        if self._specs is None:
            self._specs = self._find_linears()
        return self._specs

    def _find_linears(self):
        raise NotImplementedError
