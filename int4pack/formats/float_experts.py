"""Float experts beside int4 ones in one MoE layer (``down_proj`` kept in bf16 while gate/up are int4,
as ``mconcat/GLM-5.1-AWQ-4bit`` ships): read as linears of their own, so the plan can make the layer
uniform (vLLM's W4A8 MoE layer takes int4 experts only; precision.py decides, convert requantises).

A layer whose experts are all float is not touched: its tensors are copied and listed in ``ignore``.
"""

from __future__ import annotations

from dataclasses import replace

from .._lazy import torch
from ..architectures import classify
from ..sources.checkpoint import Checkpoint
from ..records import FormatVerdict, LinearSpec, QuantLinear

__all__ = ["FLOAT_DTYPES", "with_float_experts", "FloatExperts"]

FLOAT_DTYPES = ("BF16", "F16", "F32")


def _float_experts(ckpt: Checkpoint, quantised: dict[str, LinearSpec]) -> dict[str, LinearSpec]:
    """Float expert linears whose MoE layer has a quantised expert."""
    layers = set()
    for name in quantised:
        role, d = classify(name)
        if role == "expert":
            layers.add(d["moe"])
    out: dict[str, LinearSpec] = {}
    if not layers:
        return out
    for key, t in ckpt.tensors.items():
        if not key.endswith(".weight") or t.dtype not in FLOAT_DTYPES or len(t.shape) != 2:
            continue
        mod = key[: -len(".weight")]
        if mod in quantised:
            continue
        role, d = classify(mod)
        if role != "expert" or d["moe"] not in layers:
            continue
        n, k = t.shape
        bias = f"{mod}.bias" in ckpt.tensors
        out[mod] = LinearSpec(name=mod, fmt="float", n=n, k=k, bits=16, group_size=k, sym=False, act_order=False,
                              keys=(key, f"{mod}.bias") if bias else (key,), scale_dtype=t.dtype, has_bias=bias,
                              notes=[f"{t.dtype} expert beside int4 ones: read as its float values"])
    return out


class FloatExperts:
    """A reader with the float experts of its mixed MoE layers added as linears (bits 16, read as floats)."""

    def __init__(self, inner, ckpt: Checkpoint):
        self.inner = inner
        self.ckpt = ckpt
        self.name = inner.name
        self._extra: dict[str, LinearSpec] | None = None

    def __getattr__(self, attr):  # units() and the like: the inner reader's, where it has them
        if attr.startswith("__") or attr == "inner":  # not while copying or unpickling (no inner yet)
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def extra(self) -> dict[str, LinearSpec]:
        if self._extra is None:
            self._extra = _float_experts(self.ckpt, self.inner.linears())
        return self._extra

    def linears(self) -> dict[str, LinearSpec]:
        specs = self.inner.linears()
        extra = self.extra()
        return {**specs, **extra} if extra else specs

    def verdict(self) -> FormatVerdict:
        v = self.inner.verdict()
        extra = self.extra()
        if not extra:
            return v
        first = min(extra)
        return replace(v, evidence=[*v.evidence, f"{len(extra)} float expert linear(s) beside int4 ones in the same "
                                                  f"MoE layer(s), e.g. {first} ({extra[first].scale_dtype})"])

    def in_place(self, spec: LinearSpec):
        if spec.name in self.extra():
            return None
        where = getattr(self.inner, "in_place", None)
        return where(spec) if where is not None else None

    def float_in_place(self, spec: LinearSpec):
        if spec.name in self.extra():  # read as ``read`` reads it: the weight's float cast
            from .float_source import float_in_place

            return float_in_place(self.ckpt, spec, f"{spec.name}.weight")
        where = getattr(self.inner, "float_in_place", None)
        return where(spec) if where is not None else None

    def read(self, spec: LinearSpec, *, unpack: bool = True) -> QuantLinear:
        if spec.name not in self.extra():
            return self.inner.read(spec, unpack=unpack)
        w = self.ckpt.get(f"{spec.name}.weight").float()
        bias = self.ckpt.get(f"{spec.name}.bias") if spec.has_bias else None
        return QuantLinear(spec, None, torch.ones(spec.n, 1), None, None, bias, dense=w)


def with_float_experts(reader, ckpt: Checkpoint):
    """``reader``, wrapped when the checkpoint holds float expert weights (any at all: the wrapper
    decides lazily, on ``linears()``, whether they sit beside quantised siblings)."""
    has_float_expert = any(k.endswith(".weight") and t.dtype in FLOAT_DTYPES and ".experts." in k
                           for k, t in ckpt.tensors.items())
    return FloatExperts(reader, ckpt) if has_float_expert else reader
