"""The canonical per-linear record every format reader produces.

All readers map their layout onto one convention, N-major like ``nn.Linear.weight``:

    W[n, k] = (codes[n, k] - zeros[n, g]) * scales[n, g],   g = g_idx[k] (or k // group_size)

with ``codes`` unsigned int4 in [0, 15] and ``zeros`` the unsigned zero point (8 for a
symmetric layout). The W4A8 target is then ``q = codes - 8`` with ``zeros == 8``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import IntEnum

from ._lazy import torch

__all__ = ["LinearSpec", "QuantLinear", "FormatVerdict"]


@dataclass
class LinearSpec:
    """What the headers (and config) say about one quantised linear, before any data is read."""

    name: str  # module prefix, e.g. "model.layers.0.mlp.experts.3.down_proj"
    fmt: str  # "gptq" | "awq" | "ct-pack" | "ct-int"
    n: int  # out_features
    k: int  # in_features
    bits: int
    group_size: int  # source group size along K; == k for channelwise / group -1
    sym: bool
    act_order: bool  # carries a g_idx that may be non-trivial
    keys: tuple[str, ...]  # every source tensor this module consumes (incl. bias, g_idx, shape)
    scale_dtype: str  # safetensors dtype name of the source scales
    has_bias: bool = False
    refused: str | None = None  # reason this module cannot be converted, if any
    notes: list[str] = field(default_factory=list)
    # symmetric scales that carry a sign (AutoRound's full-range int: the largest |w| of each group at
    # q = -8, so a group led by a positive weight has a negative scale); other producers' are positive.
    # Such a module is requantised: a W4A8 scale is positive
    signed_scales: bool = False

    @property
    def groups(self) -> int:
        return -(-self.k // self.group_size)

    @property
    def params(self) -> int:
        return self.n * self.k

    @property
    def kept_path(self) -> str:
        """The path of a module whose ints carry over: an int-quantized W4A8 source is already the
        target, its tensors re-emitted; any other is unpacked losslessly."""
        return "reemit" if self.fmt == "ct-int" else "lossless"


class Packing(IntEnum):
    """How a linear's int4 values are held; the C++ one-pass jobs take it as their layout argument."""

    CODES = 0  # uint8 [N, K], one code per byte
    CT = 1  # compressed-tensors int32 words [N, K/8]
    GPTQ = 2  # GPTQ int32 words [K/8, N]
    AWQ = 3  # AWQ int32 words [K, N/8]


@dataclass
class QuantLinear:
    """One linear's quantised data in the canonical convention (see module docstring)."""

    spec: LinearSpec
    codes: torch.Tensor | None  # uint8 [N, K], values 0..15 (None only while ``packed`` holds them)
    scales: torch.Tensor  # float [N, G] (source dtype)
    zeros: torch.Tensor | None  # uint8 [N, G] unsigned zero points; None means all 8 (symmetric)
    g_idx: torch.Tensor | None = None  # int64 [K]; None means k // group_size
    bias: torch.Tensor | None = None  # [N] source dtype
    # (Packing, int32 words) while the codes are still packed; see Reader.read(unpack=False), which
    # lets the C++ jobs (w4a8.lossless_job, w4a8.requant_job) read the words
    packed: tuple[Packing, torch.Tensor] | None = None
    # float32 [N, K] weights of a source that is not int4 (MXFP4): no codes, every path requantises
    dense: torch.Tensor | None = None

    def unpacked(self) -> "QuantLinear":
        """This record with ``codes`` filled in (itself when they already are)."""
        if self.codes is not None or self.dense is not None:
            return self
        from . import kernels  # not at the top: the plan imports this module, and kernels imports torch

        layout, words = self.packed
        if layout == Packing.CT:
            codes = kernels.unpack_ct(words, self.spec.k)
        else:
            codes = kernels.unpack_gptq(words) if layout == Packing.GPTQ else kernels.unpack_awq(words)
        return replace(self, codes=codes, packed=None)

    def group_index(self) -> torch.Tensor:
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.spec.k, dtype=torch.long) // self.spec.group_size

    def has_trivial_g_idx(self) -> bool:
        if self.g_idx is None:
            return True
        return bool(torch.equal(self.g_idx.long(), torch.arange(self.spec.k) // self.spec.group_size))

    def is_symmetric(self) -> bool:
        """True when every zero point is 8, whatever the config claims."""
        return self.zeros is None or bool((self.zeros == 8).all())

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]."""
        if self.dense is not None:
            return self.dense.float()
        gi = self.group_index()
        s = self.scales.float()[:, gi]
        z = 8.0 if self.zeros is None else self.zeros.float()[:, gi]
        return (self.codes.float() - z) * s


@dataclass
class FormatVerdict:
    """The checkpoint-level format decision and the evidence behind it (reported, never hidden)."""

    format: str  # "gptq" | "awq" | "compressed-tensors"
    detail: str  # e.g. "gptq v1 zero points", "awq gemm", "pack-quantized"
    evidence: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # e.g. {"zero_convention": "v1"}

    def to_dict(self) -> dict:
        return {"format": self.format, "detail": self.detail, "evidence": self.evidence,
                "warnings": self.warnings, **self.extra}
