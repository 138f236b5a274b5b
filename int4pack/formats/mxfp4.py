"""gpt-oss MXFP4 experts (formats.md, "gpt-oss MXFP4"): the reader behind converting gpt-oss.

OpenAI's release stores each MoE layer's experts fused 3-D, in MXFP4:

    <moe>.experts.gate_up_proj_blocks  U8 [E, 2I, H/32, 16]   two E2M1 codes a byte, low nibble first
    <moe>.experts.gate_up_proj_scales  U8 [E, 2I, H/32]       E8M0 (2^(s - 127)) per 32 inputs
    <moe>.experts.gate_up_proj_bias    [E, 2I]                rows interleaved: even = gate, odd = up
    <moe>.experts.down_proj_{blocks [E, H, I/32, 16], scales [E, H, I/32], bias [E, H]}

The same OpenAI naming on the linears of any other family int4pack knows (``MXFP4LinearReader``):

    <module>.weight_blocks  U8 [N, K/32, 16],  <module>.weight_scales  U8 [N, K/32]   (+ <module>.bias)

MXFP4 is not an int4 layout: its 16 values are not evenly spaced. The reader decodes one expert at a
time to float32 (exactly: every value is a 2-bit-mantissa float times a power of two), splits the
interleaved rows into gate and up, and hands W4A8 per-expert linears ``<moe>.experts.E.gate_proj``,
``up_proj``, ``down_proj`` (N-major like nn.Linear) with their biases; convert requantises them.
"""

from __future__ import annotations

import re

from .._lazy import torch
from ..sources.checkpoint import Checkpoint
from ..errors import InputError, RefusedError
from ..records import FormatVerdict, LinearSpec, QuantLinear
from ._api import Format, Header, quant_method
from ._common import SpecsOnce, read_expert
from .float_source import DATA_FREE, NOT_INT4, float_linear, float_spec
from .minifloat import E2M1

__all__ = ["E2M1", "BLOCK", "decode", "deinterleave", "MXFP4Reader", "MXFP4LinearReader", "is_mxfp4", "FORMAT",
           "claims", "LINEAR_FORMAT", "claims_linears"]

BLOCK = 32  # inputs per E8M0 scale
_E8M0_NAN = 255
_FUSED = re.compile(r"^(?P<p>.+\.experts)\.gate_up_proj_blocks$")
_PART = re.compile(r"^(?P<p>.+\.experts)\.(?P<part>gate_up_proj|down_proj)_(?:blocks|scales|bias)$")
_ROLE = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_SPEC = re.compile(r"^(?P<p>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)$")


def is_mxfp4(q: dict | None) -> bool:
    return quant_method(q) == "mxfp4"


def claims(q: dict | None, header: Header) -> bool:
    """gpt-oss's MXFP4 release, the only MXFP4 layout this reader knows."""
    return is_mxfp4(q) and header.model_type == "gpt_oss"


def decode(blocks, scales):
    """MXFP4 -> float32: blocks U8 [..., G, 16], scales U8 [..., G] -> [..., G * 32], exact.

    Value k of a block is E2M1[code] * 2^(scale - 127), code k sitting in byte k // 2, low nibble
    first. Raises ValueError for an E8M0 NaN (255) or a value float32 cannot hold."""
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)}")
    if scales.numel() and int(scales.max()) == _E8M0_NAN:
        raise ValueError("E8M0 scale 255 (NaN)")
    lut = torch.tensor(E2M1, dtype=torch.float64)
    b = blocks.to(torch.int64)
    codes = torch.stack([b & 0x0F, b >> 4], dim=-1).reshape(*blocks.shape[:-1], BLOCK)
    # float64 holds every 2^(s - 127) and product exactly; float32 does too unless one overflows
    vals = lut[codes] * torch.exp2(scales.to(torch.float64) - 127).unsqueeze(-1)
    out = vals.to(torch.float32).reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK)
    if not bool(torch.isfinite(out).all()):
        raise ValueError("a value beyond float32's range (E8M0 scale too large)")
    return out


def deinterleave(t):
    """Rows of a gpt-oss gate_up tensor (dim 0) -> (gate = even rows, up = odd rows)."""
    return t[0::2], t[1::2]


class MXFP4Reader:
    """The experts of a gpt-oss MXFP4 checkpoint as per-expert linears (see the module docstring)."""

    name = "mxfp4"

    def __init__(self, ckpt: Checkpoint, q: dict, path: str | None = None):
        self.ckpt = ckpt
        self.q = q
        self._where: dict[str, tuple[str, int, str]] = {}  # module -> (experts prefix, e, role)
        self._specs: dict[str, LinearSpec] | None = None

    def verdict(self) -> FormatVerdict:
        layers = sorted(m["p"] for n in self.ckpt.tensors if (m := _FUSED.match(n)))
        return FormatVerdict(
            "mxfp4", "gpt-oss MXFP4 experts (E2M1 values, E8M0 scale per 32 inputs)",
            evidence=["quant_method: mxfp4", f"{len(layers)} MoE layer(s) with experts.gate_up_proj_blocks"],
            warnings=["MXFP4 is not int4: every expert is requantised (lossy; the report gives each module's "
                      "error) and gate/up rows are de-interleaved"])

    def linears(self) -> dict[str, LinearSpec]:
        if self._specs is not None:
            return self._specs
        ck = self.ckpt
        specs: dict[str, LinearSpec] = {}
        for name in sorted(ck.tensors):
            m = _FUSED.match(name)
            if not m:
                continue
            p = m["p"]
            gu = self._check(p, "gate_up_proj", None)
            e_n, two_i, h = gu
            if two_i % 2:
                raise InputError(f"{p}.gate_up_proj_blocks: {two_i} rows, not gate/up pairs",
                                 tensor=f"{p}.gate_up_proj_blocks",
                                 hint="gpt-oss interleaves gate and up rows: their count must be even.")
            i = two_i // 2
            e_d, h_d, i_d = self._check(p, "down_proj", (e_n, h, i))
            for e in range(e_n):
                for proj, n, k, part in (("gate_proj", i, h, "gate_up_proj"), ("up_proj", i, h, "gate_up_proj"),
                                         ("down_proj", h, i, "down_proj")):
                    keys = tuple(f"{p}.{part}{s}" for s in ("_blocks", "_scales", "_bias")
                                 if f"{p}.{part}{s}" in ck.tensors)
                    mod = f"{p}.{e}.{proj}"
                    specs[mod] = LinearSpec(mod, "mxfp4", n, k, 4, BLOCK, False, False, keys, "U8",
                                            has_bias=f"{p}.{part}_bias" in ck.tensors)
                    self._where[mod] = (p, e, _ROLE[proj])
        stray = sorted(n for n in ck.tensors
                       if (m := _PART.match(n)) and f"{m['p']}.{m['part']}_blocks" not in ck.tensors)
        if stray:
            raise InputError(f"{stray[0]}: MXFP4 expert tensor without its _blocks partner", tensor=stray[0],
                             hint="The checkpoint is incomplete; re-download it.")
        self._specs = specs
        return specs

    def _check(self, p: str, part: str, want: tuple[int, int, int] | None) -> tuple[int, int, int]:
        """(E, N, K) of one fused MXFP4 projection, its blocks, scales and bias checked."""
        ck = self.ckpt
        bn, sn, an = f"{p}.{part}_blocks", f"{p}.{part}_scales", f"{p}.{part}_bias"
        for n in (bn, sn):
            if n not in ck.tensors:
                raise InputError(f"{p}: has MXFP4 experts but no {n}", tensor=n,
                                 hint="The checkpoint is incomplete or mixes layouts; re-download it.")
            if ck.tensors[n].dtype != "U8":
                raise InputError(f"{n}: dtype {ck.tensors[n].dtype}, MXFP4 blocks and scales are U8", tensor=n,
                                 hint="The checkpoint is not the layout its config claims.")
        b, s = ck.tensors[bn].shape, ck.tensors[sn].shape
        if len(b) != 4 or b[3] != BLOCK // 2 or tuple(s) != tuple(b[:3]):
            raise InputError(f"{bn}: shape {list(b)} with scales {list(s)}; expected [E, N, K/32, 16] and "
                             "[E, N, K/32]", tensor=bn, hint="The checkpoint is not gpt-oss's MXFP4 layout.")
        got = (b[0], b[1], b[2] * BLOCK)
        if want is not None and got != (want[0], want[1], want[2]):
            raise InputError(f"{bn}: [E, N, K] = {list(got)}, but gate_up_proj gives {list(want)}", tensor=bn,
                             hint="The experts' projections disagree; the checkpoint is corrupt.")
        if an in ck.tensors:
            a = ck.tensors[an]
            if tuple(a.shape) != (b[0], b[1]) or a.dtype not in ("BF16", "F16", "F32"):
                raise InputError(f"{an}: {a.dtype}{list(a.shape)}, expected a float [E, N] = [{b[0]}, {b[1]}]",
                                 tensor=an, hint="The checkpoint is corrupt.")
        return got

    def read(self, spec: LinearSpec, *, unpack: bool = True) -> QuantLinear:
        self.linears()
        if spec.name not in self._where:
            raise RefusedError(f"{spec.name}: not an MXFP4 expert of this checkpoint", tensor=spec.name)
        p, e, role = self._where[spec.name]
        part = "down_proj" if role == "down" else "gate_up_proj"
        blocks = read_expert(self.ckpt, f"{p}.{part}_blocks", e)
        scales = read_expert(self.ckpt, f"{p}.{part}_scales", e)
        bias = read_expert(self.ckpt, f"{p}.{part}_bias", e) if spec.has_bias else None
        if role != "down":
            pick = 0 if role == "gate" else 1
            blocks, scales = blocks[pick::2], scales[pick::2]
            bias = bias[pick::2].contiguous() if bias is not None else None
        try:
            w = decode(blocks, scales)
        except ValueError as err:
            raise InputError(f"{p}.{part}_scales: expert {e}: {err}", tensor=f"{p}.{part}_scales",
                             hint="The checkpoint is damaged; re-download it.") from None
        s = torch.exp2(scales.to(torch.float32) - 127)
        return QuantLinear(spec, None, s, None, bias=bias, dense=w)

    def units(self) -> dict[str, list[str]]:
        """Module -> the expert's [gate, up, down]: written together (vLLM loads gate and up as one)."""
        out: dict[str, list[str]] = {}
        for mod in self.linears():
            m = _SPEC.match(mod)
            base = f"{m['p']}.{m['e']}"
            out[mod] = [f"{base}.gate_proj", f"{base}.up_proj", f"{base}.down_proj"]
        return out


FORMAT = Format(
    "mxfp4", claims, MXFP4Reader,
    reads="quant_method mxfp4 (gpt-oss's release only)",
    lossless="none (E2M1 values are not an int4 grid)",
    requant="every expert, gate/up de-interleaved")


_LINEAR = re.compile(r"^(?P<m>.+)\.weight_blocks$")


class MXFP4LinearReader(SpecsOnce):
    """OpenAI's ``_blocks``/``_scales`` MXFP4 naming on per-module linears of any family int4pack knows
    (see the module docstring); fused gpt-oss-style experts outside gpt-oss are refused by name."""

    name = "mxfp4-linear"

    def _find_linears(self) -> dict[str, LinearSpec]:
        ck = self.ckpt
        fused = sorted(n for n in ck.tensors if _FUSED.match(n))
        if fused:
            raise RefusedError(f"{fused[0]}: fused MXFP4 experts in a {ck.family_type!r} checkpoint; int4pack "
                               "splits fused MXFP4 experts only in gpt-oss's layout (gate/up rows interleaved)",
                               tensor=fused[0], hint="Use a checkpoint with one weight_blocks per expert linear.")
        specs = {}
        for name in sorted(ck.tensors):
            mm = _LINEAR.match(name)
            if not mm:
                continue
            mod, sn = mm["m"], f"{mm['m']}.weight_scales"
            b, s = ck.tensors[name], ck.tensors.get(sn)
            if s is None:
                raise InputError(f"{mod}: has weight_blocks but no {sn}", tensor=sn,
                                 hint="The checkpoint is incomplete; re-download it.")
            if b.dtype != "U8" or s.dtype != "U8" or len(b.shape) != 3 or b.shape[2] != BLOCK // 2 \
                    or tuple(s.shape) != tuple(b.shape[:2]):
                raise InputError(f"{name}: {b.dtype}{list(b.shape)} with scales {s.dtype}{list(s.shape)}; expected "
                                 "U8 [N, K/32, 16] and U8 [N, K/32]", tensor=name,
                                 hint="The checkpoint is not the MXFP4 layout its config claims.")
            keys = tuple(k for k in (name, sn, f"{mod}.bias") if k in ck.tensors)
            specs[mod] = float_spec(mod, "mxfp4", b.shape[0], b.shape[1] * BLOCK, keys, "U8",
                                    has_bias=f"{mod}.bias" in ck.tensors,
                                    notes=["MXFP4 (E2M1, E8M0 per 32) dequantised, then requantised"])
        return specs

    def verdict(self) -> FormatVerdict:
        return FormatVerdict(
            "mxfp4", f"MXFP4 linears (weight_blocks/weight_scales: E2M1 values, E8M0 scale per 32), dequantised "
                     f"exactly, then {DATA_FREE}",
            evidence=["quant_method: mxfp4", f"{len(self.linears())} linear(s) with weight_blocks"],
            warnings=["MXFP4 is a 4-bit float: " + NOT_INT4], extra={"source_kind": "fp4", "data_free": True})

    def read(self, spec: LinearSpec, *, unpack: bool = True) -> QuantLinear:
        ck, m = self.ckpt, spec.name
        try:
            w = decode(ck.get(f"{m}.weight_blocks"), ck.get(f"{m}.weight_scales"))
        except ValueError as err:
            raise InputError(f"{m}.weight_scales: {err}", tensor=f"{m}.weight_scales",
                             hint="The checkpoint is damaged; re-download it.") from None
        return float_linear(spec, w, ck.get(f"{m}.bias") if spec.has_bias else None)


def claims_linears(q: dict | None, header: Header) -> bool:
    """MXFP4 in a family other than gpt-oss that int4pack knows (OpenAI's naming per linear)."""
    from ..families import family

    return is_mxfp4(q) and header.model_type != "gpt_oss" and family(header.model_type) is not None


LINEAR_FORMAT = Format(
    "mxfp4", claims_linears, lambda ckpt, q, path: MXFP4LinearReader(ckpt, q),
    reads="quant_method mxfp4 in other families: per-linear weight_blocks/weight_scales (E2M1, E8M0 per 32)",
    lossless="none (E2M1 values are not an int4 grid)",
    requant="every linear, dequantised exactly, then quantised data-free",
    float_siblings=True)
