"""FP8 sources (formats.md, "Float, FP8 and FP4 sources"): e4m3 weights with their scales, dequantised
exactly to float32 and requantised to W4A8 (formats/float_source.py).

* The official layout (``quant_method: "fp8"``, as DeepSeek-V3/R1, Qwen3 and GLM publish it and
  transformers' ``FineGrainedFP8Config`` writes it): ``weight`` F8_E4M3 [N, K] and ``weight_scale_inv``
  per ``weight_block_size`` block [ceil(N/bn), ceil(K/bk)] (one scalar without a block size). Despite
  its name the scale is the dequantisation multiplier: W = e4m3 * weight_scale_inv (transformers'
  ``finegrained_fp8._dequantize_fp8_weight``). Scales are float32, or E8M0 (``scale_fmt: ue8m0``).
  DeepSeek-V4-style FP4 experts (``expert_dtype: fp4``) store ``weight`` as I8 [N, K/2], two E2M1 codes
  a byte, with an E8M0 ``weight_scale_inv`` per 32 inputs: the block is read from the scale's shape,
  as transformers does.
* compressed-tensors ``float-quantized`` (llm-compressor FP8, FP8_DYNAMIC, FP8_BLOCK): ``weight``
  F8_E4M3 [N, K] and ``weight_scale`` per tensor [1], channel [N, 1], group [N, K/g] or block
  [ceil(N/bn), ceil(K/bk)]: W = e4m3 * weight_scale.

e4m3 is decoded from its bits here (sign, 4 exponent bits of bias 7, 3 mantissa bits; 0x7F/0xFF NaN,
no infinity); every product with a float32 or narrower scale is then a float32 rounding of the exact
value at most (exact for bf16/fp16/E8M0 scales), as the producers' own float32 dequantisation.
"""

from __future__ import annotations

from .._lazy import torch
from ..sources.checkpoint import Checkpoint
from ..errors import InputError, RefusedError
from ..records import FormatVerdict, LinearSpec, QuantLinear
from ._api import Format, Header, quant_method
from .float_source import DATA_FREE, FLOAT_DTYPES, NOT_INT4, float_linear, float_spec
from .minifloat import e4m3, e8m0, positive, raw_bytes, unpack_e2m1

__all__ = ["block_dequant", "block_of", "FP8Reader", "CTFP8Reader", "is_official_fp8", "FORMAT", "CT_FORMAT"]

_SCALE_DTYPES = FLOAT_DTYPES + ("F8_E8M0", "U8")


def block_of(n: int, k: int, scale_shape: tuple[int, ...], configured: tuple[int, int] | None) -> tuple[int, int] | None:
    """(rows, columns) of weights per scale for a scale tensor of ``scale_shape``, or None if it fits none:
    one scalar, the configured block (ceil division, as transformers pads), or an exact grid."""
    shape = tuple(scale_shape)
    if len(shape) == 0 or (len(shape) in (1, 2) and all(s == 1 for s in shape)):
        return n, k
    if len(shape) != 2:
        return None
    a, b = shape
    if configured is not None:
        bn, bk = configured
        if (a, b) == (-(-n // bn), -(-k // bk)):
            return bn, bk
    if a and b and n % a == 0 and k % b == 0:
        return n // a, k // b
    return None


def block_dequant(vals: "torch.Tensor", scale: "torch.Tensor", bn: int, bk: int) -> "torch.Tensor":
    """vals float32 [N, K] times scale [ceil(N/bn), ceil(K/bk)] per block, in place."""
    n, k = vals.shape
    s = scale.reshape(-(-n // bn), -(-k // bk)).float()
    if n % bn == 0 and k % bk == 0:  # a broadcast over a view (numpy's: faster here): no [N, K] scales
        a = vals.numpy().reshape(n // bn, bn, k // bk, bk)
        a *= s.contiguous().numpy().reshape(n // bn, 1, k // bk, 1)
        return vals
    s = s.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]  # partial blocks at the edges
    return vals.mul_(s)


def _scale_f32(ckpt: Checkpoint, name: str) -> "torch.Tensor":
    t = ckpt.tensors[name]
    try:
        if t.dtype in ("F8_E8M0", "U8"):
            s = e8m0(raw_bytes(ckpt, name))
        elif t.dtype == "F8_E4M3":
            s = e4m3(raw_bytes(ckpt, name))
        else:
            s = ckpt.get(name).float()
    except ValueError as e:
        raise InputError(f"{name}: {e}", tensor=name, hint="The scales are corrupt; re-download the checkpoint.") from None
    return positive(s, name)


def _values(ckpt: Checkpoint, name: str, k: int) -> "torch.Tensor":
    """float32 [N, K] of an e4m3 weight, or of an FP4-packed (I8/U8 [N, K/2]) one."""
    t = ckpt.tensors[name]
    raw = raw_bytes(ckpt, name)
    if t.dtype in ("I8", "U8"):
        return unpack_e2m1(raw)
    try:
        return e4m3(raw)
    except ValueError as e:
        raise InputError(f"{name}: {e}", tensor=name, hint="The weights are corrupt; re-download the checkpoint.") from None


def _module(ckpt: Checkpoint, mod: str, scale_key: str, configured, fmt: str, extra_keys=()) -> LinearSpec:
    w, sc = f"{mod}.weight", f"{mod}.{scale_key}"
    if w not in ckpt.tensors:
        raise InputError(f"{mod}: has {scale_key} but no weight tensor ({w})", tensor=w,
                         hint="The checkpoint is incomplete; re-download it.")
    t, st = ckpt.tensors[w], ckpt.tensors[sc]
    if len(t.shape) != 2:
        raise RefusedError(f"{w}: {len(t.shape)}-D FP8 weight {list(t.shape)}; int4pack reads 2-D per-module "
                           "FP8 linears", tensor=w, hint="Save the experts per module.")
    if t.dtype == "F8_E4M3":
        n, k, kind = t.shape[0], t.shape[1], "e4m3"
    elif t.dtype in ("I8", "U8") and scale_key == "weight_scale_inv":
        n, k, kind = t.shape[0], t.shape[1] * 2, "e2m1"  # DeepSeek-V4-style FP4-packed experts
    else:
        raise InputError(f"{w}: dtype {t.dtype}; an FP8 weight is F8_E4M3 (or FP4 pairs in I8)", tensor=w,
                         hint="The checkpoint is not the layout its config claims.")
    if st.dtype not in _SCALE_DTYPES:
        raise InputError(f"{sc}: dtype {st.dtype}; a scale is float (or E8M0)", tensor=sc,
                         hint="The checkpoint is not the layout its config claims.")
    blk = block_of(n, k, st.shape, configured)
    if blk is None:
        raise InputError(f"{sc}: shape {list(st.shape)} fits no block of the [{n}, {k}] weight"
                         + (f" (weight_block_size {list(configured)})" if configured else ""), tensor=sc,
                         hint="The scales disagree with the weights or the config; the checkpoint is corrupt.")
    keys = [w, sc] + [f"{mod}.{x}" for x in ("bias",) + tuple(extra_keys) if f"{mod}.{x}" in ckpt.tensors]
    note = f"{kind} x {st.dtype} scale per {blk[0]}x{blk[1]} block, dequantised exactly, then requantised"
    fmt = "mxfp4" if kind == "e2m1" else fmt  # E2M1 with an E8M0 scale per 32: MXFP4 values
    return float_spec(mod, fmt, n, k, tuple(keys), st.dtype, has_bias=f"{mod}.bias" in ckpt.tensors, notes=[note])


def _read(ckpt: Checkpoint, spec: LinearSpec, scale_key: str, configured) -> QuantLinear:
    m = spec.name
    sc = f"{m}.{scale_key}"
    bn, bk = block_of(spec.n, spec.k, ckpt.tensors[sc].shape, configured)
    w = block_dequant(_values(ckpt, f"{m}.weight", spec.k), _scale_f32(ckpt, sc), bn, bk)
    return float_linear(spec, w, ckpt.get(f"{m}.bias") if spec.has_bias else None)


def _in_place(ckpt: Checkpoint, spec: LinearSpec, scale_key: str, configured):
    """For convert's requant batches (batch.py): (e4m3 weight or FP4 pairs, its block scales, rows and
    columns per scale, None) of a module ``_read`` reads (float_source.float_in_place); None for a bias."""
    w, sc = ckpt.tensors[f"{spec.name}.weight"], ckpt.tensors[f"{spec.name}.{scale_key}"]
    shape = (spec.n, spec.k) if w.dtype == "F8_E4M3" else (spec.n, spec.k // 2)
    if spec.has_bias or w.dtype not in ("F8_E4M3", "I8", "U8") or tuple(w.shape) != shape:
        return None
    blk = block_of(spec.n, spec.k, sc.shape, configured)
    if blk is None or sc.numel != -(-spec.n // blk[0]) * -(-spec.k // blk[1]):
        return None
    return w, sc, blk[0], blk[1], None


def is_official_fp8(q: dict | None, header: Header | None = None) -> bool:
    return quant_method(q) == "fp8"


def _configured_block(q: dict, path: str) -> tuple[int, int] | None:
    b = q.get("weight_block_size")
    if b is None:
        return None
    if not (isinstance(b, (list, tuple)) and len(b) == 2 and all(isinstance(x, int) and x > 0 for x in b)):
        raise InputError(f"quantization_config.weight_block_size is {b!r}; expected two positive integers",
                         path=path, hint="Fix or re-download the config.")
    return int(b[0]), int(b[1])


class FP8Reader:
    """The official FP8 layout (``quant_method: fp8``, ``weight_scale_inv``)."""

    name = "fp8"

    def __init__(self, ckpt: Checkpoint, q: dict, path: str | None = None):
        self.ckpt = ckpt
        self.q = q
        self.path = path or str(getattr(ckpt, "quant_config_path", None) or ckpt.folder / "config.json")
        self.block = _configured_block(q, self.path)
        fmt = str(q.get("fmt") or "e4m3").lower()
        if fmt != "e4m3":
            raise RefusedError(f"quantization_config fmt {fmt!r}: int4pack reads e4m3 FP8 weights", path=self.path,
                               hint="FP8 e5m2 weights are not a layout the producers publish for MoE models.")
        self._specs: dict[str, LinearSpec] | None = None

    def linears(self) -> dict[str, LinearSpec]:
        if self._specs is None:
            mods = sorted(n[: -len(".weight_scale_inv")] for n in self.ckpt.tensors if n.endswith(".weight_scale_inv"))
            self._specs = {m: _module(self.ckpt, m, "weight_scale_inv", self.block, "fp8", ("input_scale",))
                           for m in mods}
        return self._specs

    def verdict(self) -> FormatVerdict:
        specs = self.linears()
        fp4 = sum(1 for s in specs.values() if s.fmt == "mxfp4")
        blk = f"{self.block[0]}x{self.block[1]} blocks" if self.block else "one scale per tensor"
        detail = f"FP8 e4m3 weights, weight_scale_inv per {blk}" + (f", {fp4} FP4-packed expert linear(s)" if fp4 else "")
        return FormatVerdict(
            "fp8", f"{detail}; dequantised exactly, then {DATA_FREE}",
            evidence=["quant_method: fp8", f"weight_block_size {list(self.block) if self.block else None}",
                      f"scale_fmt {self.q.get('scale_fmt') or 'float'}", f"{len(specs)} FP8 linear(s)"],
            warnings=["FP8 values are not int4 values: " + NOT_INT4],
            extra={"source_kind": "fp8", "data_free": True})

    def float_in_place(self, spec: LinearSpec):
        return _in_place(self.ckpt, spec, "weight_scale_inv", self.block)

    def read(self, spec: LinearSpec, *, unpack: bool = True) -> QuantLinear:
        return _read(self.ckpt, spec, "weight_scale_inv", self.block)


class CTFP8Reader:
    """compressed-tensors ``float-quantized`` FP8 modules (``weight`` F8_E4M3, ``weight_scale``)."""

    name = "compressed-tensors-fp8"

    def __init__(self, ckpt: Checkpoint, q: dict):
        self.ckpt = ckpt
        self.q = q
        blocks = set()
        for g in (q.get("config_groups") or {}).values():
            w = (g or {}).get("weights") or {}
            bs = w.get("block_structure")
            if isinstance(bs, str) and "x" in bs:  # older configs: "128x128"
                bs = [int(x) for x in bs.split("x")]
            if isinstance(bs, (list, tuple)) and len(bs) == 2:
                blocks.add((int(bs[0]), int(bs[1])))
        self.block = next(iter(blocks)) if len(blocks) == 1 else None
        self._specs: dict[str, LinearSpec] | None = None

    def linears(self) -> dict[str, LinearSpec]:
        if self._specs is None:
            ck = self.ckpt
            mods = sorted(n[: -len(".weight_scale")] for n, t in ck.tensors.items() if n.endswith(".weight_scale")
                          and ck.tensors.get(n[: -len("_scale")], t).dtype == "F8_E4M3")
            for m in mods:
                if f"{m}.weight_zero_point" in ck.tensors:
                    raise RefusedError(f"{m}.weight_zero_point: asymmetric FP8 is not a layout vLLM or int4pack reads",
                                       tensor=f"{m}.weight_zero_point", hint="Use a symmetric FP8 checkpoint.")
            if not mods:
                raise RefusedError("compressed-tensors format 'float-quantized', but no module has an F8_E4M3 weight "
                                   "with a weight_scale", path=str(ck.folder / "config.json"),
                                   hint="The tensors are not the layout the config claims; re-export the checkpoint.")
            self._specs = {m: _module(ck, m, "weight_scale", self.block, "ct-fp8", ("input_scale",)) for m in mods}
        return self._specs

    def verdict(self) -> FormatVerdict:
        strategies = sorted({s.notes[0].split(" per ")[1].split(" block")[0] for s in self.linears().values()})
        return FormatVerdict(
            "compressed-tensors", f"float-quantized (FP8 e4m3, scale per {', '.join(strategies) or '-'}), "
                                  f"dequantised exactly, then {DATA_FREE}",
            evidence=["config group format 'float-quantized'", f"{len(self.linears())} FP8 linear(s)"],
            warnings=["FP8 values are not int4 values: " + NOT_INT4],
            extra={"ct_version": str(self.q.get("version") or "unknown"), "ct_format": "float-quantized",
                   "source_kind": "fp8", "data_free": True})

    def float_in_place(self, spec: LinearSpec):
        return _in_place(self.ckpt, spec, "weight_scale", self.block)

    def read(self, spec: LinearSpec, *, unpack: bool = True) -> QuantLinear:
        return _read(self.ckpt, spec, "weight_scale", self.block)


def _claims_ct(q: dict | None, header: Header) -> bool:
    from .fp4 import ct_formats

    if q is None or not (quant_method(q) in ("compressed-tensors", "compressed_tensors") or "config_groups" in q):
        return False
    fmts = ct_formats(q)
    return bool(fmts) and fmts <= {"float-quantized"}


FORMAT = Format(
    "fp8", is_official_fp8, FP8Reader,
    reads="quant_method fp8 (e4m3 weight, weight_scale_inv per weight_block_size block; FP4-packed experts)",
    lossless="none (FP8 values are not int4 values)", requant="every FP8 linear, dequantised exactly, data-free",
    float_siblings=True)
CT_FORMAT = Format(
    "compressed-tensors", _claims_ct, lambda ckpt, q, path: CTFP8Reader(ckpt, q),
    reads="compressed-tensors float-quantized (FP8 e4m3, tensor/channel/group/block scales)",
    lossless="none (FP8 values are not int4 values)", requant="every FP8 linear, dequantised exactly, data-free",
    float_siblings=True)
