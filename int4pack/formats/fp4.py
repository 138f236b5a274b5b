"""FP4 sources (formats.md, "Float, FP8 and FP4 sources"): E2M1 weights with their block scales,
dequantised exactly and requantised to W4A8 (formats/float_source.py).

* compressed-tensors ``mxfp4-pack-quantized``: ``weight_packed`` U8 [N, K/2] (two E2M1 codes a byte,
  low nibble first), ``weight_scale`` U8 [N, K/32] E8M0 (2^(e - 127)).
  ``nvfp4-pack-quantized``: the same codes, ``weight_scale`` F8_E4M3 [N, K/16] and
  ``weight_global_scale`` F32 [1]: W = e2m1 * (weight_scale / weight_global_scale), in float32 as
  compressed-tensors 0.20 computes it (``_dequantize``: ``scale / global_scale``, then ``x * scale``)
  before its final cast to bfloat16.
* NVIDIA ModelOpt NVFP4 (``quant_method: modelopt``, ``quant_algo: NVFP4``): ``weight`` U8 [N, K/2],
  ``weight_scale`` F8_E4M3 [N, K/16], ``weight_scale_2`` F32 scalar: W = e2m1 * weight_scale *
  weight_scale_2 (compressed-tensors' ModelOpt converter maps weight_scale_2 to 1 / global scale).

E2M1 holds 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives: not evenly spaced, so no int4 grid holds a
block of them and every module is requantised.
"""

from __future__ import annotations

import re

from .._lazy import torch
from ..sources.checkpoint import Checkpoint
from ..errors import InputError, RefusedError
from ..records import FormatVerdict, LinearSpec, QuantLinear
from ._api import Format, Header, quant_method
from ._common import SpecsOnce
from .float_source import DATA_FREE, NOT_INT4, float_linear, float_spec
from .minifloat import e4m3, e8m0, positive, raw_bytes, unpack_e2m1

__all__ = ["CT_FP4_FORMATS", "ct_formats", "CTFP4Reader", "ModelOptNVFP4Reader", "is_modelopt_nvfp4", "CT_FORMAT",
           "MODELOPT_FORMAT"]

CT_FP4_FORMATS = {"mxfp4-pack-quantized": ("MXFP4", 32), "nvfp4-pack-quantized": ("NVFP4", 16)}


def _need(ckpt: Checkpoint, name: str, dtypes: tuple[str, ...], shape: tuple[int, ...] | None, what: str) -> None:
    t = ckpt.tensors.get(name)
    if t is None:
        raise InputError(f"{name}: missing ({what})", tensor=name,
                         hint="The checkpoint is incomplete or mixes layouts; re-download it.")
    if t.dtype not in dtypes:
        raise InputError(f"{name}: dtype {t.dtype}, {what} must be {' or '.join(dtypes)}", tensor=name,
                         hint="The checkpoint is not the layout its config claims.")
    if shape is not None and tuple(t.shape) != tuple(shape) and not (shape == (1,) and t.numel == 1):
        raise InputError(f"{name}: shape {list(t.shape)}, {what} must be {list(shape)}", tensor=name,
                         hint="The tensors of this module disagree; the checkpoint is corrupt.")


def _fp4_weights(ckpt: Checkpoint, spec: LinearSpec, packed: str, scale: str, block: int, global_div=None,
                 global_mul=None) -> "torch.Tensor":
    """float32 [N, K] of one FP4 module: E2M1 codes times their block scale (E8M0, or E4M3 with a global
    scale divided or multiplied in, in float32 as the producer's own dequantisation)."""
    codes = unpack_e2m1(raw_bytes(ckpt, packed))
    raw = raw_bytes(ckpt, scale)
    try:
        s = e8m0(raw) if ckpt.tensors[scale].dtype in ("U8", "F8_E8M0") else e4m3(raw)
    except ValueError as e:
        raise InputError(f"{scale}: {e}", tensor=scale, hint="The scales are corrupt; re-download the checkpoint.") from None
    s = positive(s, scale)
    if global_div is not None:
        s = s / positive(ckpt.get(global_div).float().reshape(()), global_div)
    if global_mul is not None:
        s = s * positive(ckpt.get(global_mul).float().reshape(()), global_mul)
    n, k = spec.n, spec.k
    a = codes.numpy().reshape(n, k // block, block)  # in place, numpy's broadcast (faster than torch's here)
    a *= s.contiguous().numpy().reshape(n, k // block, 1)
    return codes


def _scalar(ckpt: Checkpoint, name: str) -> float | None:
    """A one-value F32/F16/BF16 tensor's value, exactly, read without torch (the batches need none)."""
    import numpy as np

    t = ckpt.tensors[name]
    raw = np.frombuffer(ckpt.read_bytes(name), dtype=np.uint8)
    if t.numel != 1 or t.dtype not in ("F32", "F16", "BF16"):
        return None
    if t.dtype == "BF16":
        return float((raw.view("<u2").astype(np.uint32) << 16).view(np.float32)[0])
    return float(raw.view("<f4" if t.dtype == "F32" else "<f2")[0])


def _fp4_in_place(ckpt: Checkpoint, spec: LinearSpec, packed: str, scale: str, block: int, global_div=None,
                  global_mul=None):
    """For convert's requant batches (batch.py, float_source.float_in_place): the E2M1 pairs, their
    block scales and the global scale (1: divided in, 2: multiplied in; its float32 value) of a module
    ``_fp4_weights`` reads; None for a bias, or a global scale it refuses (``read`` words it)."""
    if spec.has_bias or spec.k % block:
        return None
    glob = None
    for op, name in ((1, global_div), (2, global_mul)):
        if name is not None:
            v = _scalar(ckpt, name)
            if v is None or not (v >= 0.0 and v != float("inf")):
                return None
            glob = (op, v)
    return ckpt.tensors[packed], ckpt.tensors[scale], 1, block, glob


class CTFP4Reader:
    """compressed-tensors MXFP4 / NVFP4 (pack-quantized E2M1) modules, dequantised and requantised."""

    name = "compressed-tensors-fp4"

    def __init__(self, ckpt: Checkpoint, q: dict):
        self.ckpt = ckpt
        self.q = q
        self.formats = sorted(ct_formats(q))
        self._specs: dict[str, LinearSpec] | None = None

    def linears(self) -> dict[str, LinearSpec]:
        if self._specs is not None:
            return self._specs
        ck = self.ckpt
        specs = {}
        for name in sorted(ck.tensors):
            if not name.endswith(".weight_packed"):
                continue
            mod = name[: -len(".weight_packed")]
            t = ck.tensors[name]
            if t.dtype != "U8" or len(t.shape) != 2:
                raise InputError(f"{name}: {t.dtype}{list(t.shape)}, an FP4 weight_packed is U8 [N, K/2]", tensor=name,
                                 hint="The checkpoint is not the layout its config claims.")
            n, k = t.shape[0], t.shape[1] * 2
            gs = f"{mod}.weight_global_scale"
            sc = f"{mod}.weight_scale"
            nv = gs in ck.tensors
            block = 16 if nv else 32
            if k % block:
                raise InputError(f"{name}: K = {k} is not a multiple of the {block}-value FP4 block", tensor=name,
                                 hint="The checkpoint is corrupt.")
            _need(ck, sc, ("F8_E4M3",) if nv else ("U8", "F8_E8M0"), (n, k // block),
                  "an NVFP4 scale (E4M3 per 16)" if nv else "an MXFP4 scale (E8M0 per 32)")
            if nv:
                _need(ck, gs, ("F32", "BF16", "F16"), (1,), "the NVFP4 global scale")
            ws = f"{mod}.weight_shape"
            keys = [k_ for k_ in (name, sc, gs, ws, f"{mod}.bias", f"{mod}.input_global_scale",
                                  f"{mod}.weight_zero_point") if k_ in ck.tensors]
            if f"{mod}.weight_zero_point" in ck.tensors:
                raise RefusedError(f"{mod}.weight_zero_point: asymmetric FP4 is not a layout vLLM or int4pack reads",
                                   tensor=f"{mod}.weight_zero_point", hint="Use a symmetric MXFP4/NVFP4 checkpoint.")
            kind = "nvfp4" if nv else "mxfp4"
            specs[mod] = float_spec(mod, kind, n, k, tuple(keys), ck.tensors[sc].dtype,
                                    has_bias=f"{mod}.bias" in ck.tensors,
                                    notes=[f"{kind.upper()} (E2M1, block {block}) dequantised, then requantised"])
        if not specs:
            raise RefusedError(f"compressed-tensors format {'/'.join(self.formats)!r}, but no module has a U8 "
                               "weight_packed", path=str(ck.folder / "config.json"),
                               hint="The tensors are not the layout the config claims; re-export the checkpoint.")
        self._specs = specs
        return specs

    def verdict(self) -> FormatVerdict:
        names = "/".join(CT_FP4_FORMATS[f][0] for f in self.formats)
        return FormatVerdict(
            "compressed-tensors", f"{'/'.join(self.formats)} ({names} E2M1 weights), dequantised exactly, then {DATA_FREE}",
            evidence=[f"config group format {f!r}" for f in self.formats] + [f"{len(self.linears())} FP4 linear(s)"],
            warnings=[f"{names} is a 4-bit float: " + NOT_INT4],
            extra={"ct_version": str(self.q.get("version") or "unknown"), "ct_format": "/".join(self.formats),
                   "source_kind": "fp4", "data_free": True})

    def float_in_place(self, spec: LinearSpec):
        m, nv = spec.name, spec.fmt == "nvfp4"
        return _fp4_in_place(self.ckpt, spec, f"{m}.weight_packed", f"{m}.weight_scale", 16 if nv else 32,
                             global_div=f"{m}.weight_global_scale" if nv else None)

    def read(self, spec: LinearSpec, *, unpack: bool = True) -> QuantLinear:
        ck, m = self.ckpt, spec.name
        nv = spec.fmt == "nvfp4"
        w = _fp4_weights(ck, spec, f"{m}.weight_packed", f"{m}.weight_scale", 16 if nv else 32,
                         global_div=f"{m}.weight_global_scale" if nv else None)
        return float_linear(spec, w, ck.get(f"{m}.bias") if spec.has_bias else None)


def ct_formats(q: dict) -> set[str]:
    """The formats of a compressed-tensors config's groups (the top-level one where a group says none)."""
    top = q.get("format")
    out = set()
    for g in (q.get("config_groups") or {}).values():
        if isinstance(g, dict) and g.get("weights"):
            out.add(str(g.get("format") or top or ""))
    return out


def is_modelopt_nvfp4(q: dict | None, header: Header | None = None) -> bool:
    q = q or {}
    algo = str(q.get("quant_algo") or (q.get("quantization") or {}).get("quant_algo") or "").upper()
    producer = q.get("producer") if isinstance(q.get("producer"), dict) else {}
    # config.json's quantization_config, or the older side file hf_quant_config.json ({"producer": ..., "quantization": ...})
    return (quant_method(q) == "modelopt" or str(producer.get("name", "")).lower() == "modelopt") and algo == "NVFP4"


_MODELOPT_WEIGHT = re.compile(r"^(?P<m>.+)\.weight_scale_2$")


class ModelOptNVFP4Reader(SpecsOnce):
    """NVIDIA ModelOpt NVFP4 modules (``weight`` U8 E2M1 pairs, ``weight_scale`` E4M3 per 16, ``weight_scale_2``)."""

    name = "modelopt-nvfp4"

    def _find_linears(self) -> dict[str, LinearSpec]:
        ck = self.ckpt
        specs = {}
        for name in sorted(ck.tensors):
            mm = _MODELOPT_WEIGHT.match(name)
            if not mm:
                continue
            mod = mm["m"]
            w, sc = f"{mod}.weight", f"{mod}.weight_scale"
            _need(ck, w, ("U8",), None, "an NVFP4 weight (two E2M1 codes a byte)")
            t = ck.tensors[w]
            if len(t.shape) != 2 or (t.shape[1] * 2) % 16:
                raise InputError(f"{w}: shape {list(t.shape)}; an NVFP4 weight is [N, K/2] with K a multiple of 16",
                                 tensor=w, hint="The checkpoint is not ModelOpt's NVFP4 layout.")
            n, k = t.shape[0], t.shape[1] * 2
            _need(ck, sc, ("F8_E4M3",), (n, k // 16), "an NVFP4 scale (E4M3 per 16)")
            _need(ck, name, ("F32",), (1,), "ModelOpt's second-level scale")
            keys = [k_ for k_ in (w, sc, name, f"{mod}.input_scale", f"{mod}.bias") if k_ in ck.tensors]
            specs[mod] = float_spec(mod, "nvfp4", n, k, tuple(keys), "F8_E4M3", has_bias=f"{mod}.bias" in ck.tensors,
                                    notes=["ModelOpt NVFP4 (E2M1, block 16) dequantised, then requantised"])
        return specs

    def verdict(self) -> FormatVerdict:
        return FormatVerdict(
            "modelopt", f"NVFP4 (ModelOpt: E2M1 weights, E4M3 scale per 16, weight_scale_2), dequantised exactly, "
                        f"then {DATA_FREE}",
            evidence=["quant_method: modelopt", "quant_algo: NVFP4", f"{len(self.linears())} NVFP4 linear(s)"],
            warnings=["NVFP4 is a 4-bit float: " + NOT_INT4],
            extra={"source_kind": "fp4", "data_free": True})

    def float_in_place(self, spec: LinearSpec):
        m = spec.name
        return _fp4_in_place(self.ckpt, spec, f"{m}.weight", f"{m}.weight_scale", 16, global_mul=f"{m}.weight_scale_2")

    def read(self, spec: LinearSpec, *, unpack: bool = True) -> QuantLinear:
        ck, m = self.ckpt, spec.name
        w = _fp4_weights(ck, spec, f"{m}.weight", f"{m}.weight_scale", 16, global_mul=f"{m}.weight_scale_2")
        return float_linear(spec, w, ck.get(f"{m}.bias") if spec.has_bias else None)


def _claims_ct(q: dict | None, header: Header) -> bool:
    if q is None or not (quant_method(q) in ("compressed-tensors", "compressed_tensors") or "config_groups" in q):
        return False
    fmts = ct_formats(q)
    return bool(fmts) and fmts <= set(CT_FP4_FORMATS)


CT_FORMAT = Format(
    "compressed-tensors", _claims_ct, lambda ckpt, q, path: CTFP4Reader(ckpt, q),
    reads="compressed-tensors mxfp4-pack-quantized / nvfp4-pack-quantized (E2M1 with E8M0 or E4M3 block scales)",
    lossless="none (E2M1 values are not int4 values)", requant="every FP4 linear, dequantised exactly, data-free",
    float_siblings=True)
MODELOPT_FORMAT = Format(
    "modelopt", is_modelopt_nvfp4, lambda ckpt, q, path: ModelOptNVFP4Reader(ckpt, q),
    reads="quant_method modelopt, quant_algo NVFP4 (E2M1, E4M3 scale per 16, weight_scale_2)",
    config_files=("hf_quant_config.json",),
    lossless="none (E2M1 values are not int4 values)", requant="every NVFP4 linear, dequantised exactly, data-free",
    float_siblings=True)
