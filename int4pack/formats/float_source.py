"""Float sources (formats.md, "Float, FP8 and FP4 sources"): bf16/fp16/fp32 weights quantised to W4A8.

A checkpoint without a quantization_config whose family int4pack knows: every linear of the decoder
layers that vLLM runs quantised becomes W4A8 through the error-minimising scale search, data-free
(no calibration set; the weights alone decide each group's scale). Routers, norms, embeddings,
lm_head and what the family keeps float (``Family.float_only``, ``Family.kept``) stay as they are.

The same few functions carry the FP8 and FP4 readers and any other reader whose values are not
int4 (formats/fp8.py, fp4.py, mxfp4.py): ``float_spec`` describes such a module to the plan,
``float_linear`` hands its float32 weights to convert, which requantises them (w4a8.to_w4a8), and
``stays_float`` says which linears of a source without per-module quantisation stay float.
"""

from __future__ import annotations

import re
from dataclasses import replace

from .._lazy import torch
from ..sources.checkpoint import Checkpoint
from ..errors import InputError, RefusedError
from ..families import family, supported_types
from ..records import FormatVerdict, LinearSpec, QuantLinear
from ._api import Format, Header
from ._common import read_expert

__all__ = ["FLOAT_DTYPES", "VALUES", "DATA_FREE", "REQUANT_GROUP", "NOT_INT4", "float_spec", "float_linear", "stays_float",
           "float_weights", "float_in_place", "FloatReader", "is_float_source", "claims", "FORMAT"]

FLOAT_DTYPES = ("BF16", "F16", "F32")
DATA_FREE = "quantised from float, data-free"
# the group the plan is told a float module has: the least-error group vLLM runs (finer never fits
# worse and vLLM's CPU W4A8 takes no group under 32); --group-size still picks another
REQUANT_GROUP = 32
NOT_INT4 = ("no module is lossless: the source values are not int4 values, so every linear is requantised "
            "(the report gives each module's error beside plain RTN's)")
# LinearSpec.fmt of the readers whose values are not int4 -> (their values, what users call them)
VALUES = {"float": ("float", "float"), "fp8": ("e4m3", "FP8"), "ct-fp8": ("e4m3", "FP8"),
          "mxfp4": ("e2m1", "MXFP4"), "nvfp4": ("e2m1", "NVFP4")}
_LAYER = re.compile(r"\.layers\.\d+\.")
_ROUTER = re.compile(r"\.(?:gate|router|shared_expert_gate)(?:\.layer)?$")
_NOT_LINEAR = re.compile(r"(?:embed|norm|wte|wpe|rotary|position)", re.I)


def float_spec(name: str, fmt: str, n: int, k: int, keys: tuple[str, ...], scale_dtype: str, *,
               has_bias: bool = False, notes: list[str] | None = None) -> LinearSpec:
    """The plan's record of a linear whose source values are not int4: never lossless (sym False),
    its group the least-error one vLLM runs (``REQUANT_GROUP``, or K when K is smaller). bits 4: a
    W4A8 target like an int4 module of the source (precision.py: dense ones follow --dense), not a
    float module beside int4 ones (bits 16, kept float by default)."""
    return LinearSpec(name, fmt, n, k, 4, min(REQUANT_GROUP, k) if k else 1, False, False, tuple(keys), scale_dtype,
                      has_bias=has_bias, notes=list(notes or []))


def float_linear(spec: LinearSpec, weight, bias=None) -> QuantLinear:
    """The record convert requantises: float32 weights [N, K] (``QuantLinear.dense``), no codes."""
    w = weight.float()
    if tuple(w.shape) != (spec.n, spec.k):
        raise InputError(f"{spec.name}: weights of shape {list(w.shape)}, expected [{spec.n}, {spec.k}]",
                         tensor=spec.name, hint="The checkpoint is corrupt or not the layout its config claims.")
    from .minifloat import finite

    if not finite(w):
        raise InputError(f"{spec.name}: the weights hold NaN or Inf", tensor=spec.name,
                         hint="The checkpoint is corrupt; re-download it.")
    return QuantLinear(spec, None, torch.empty(spec.n, 0), None, bias=bias, dense=w.contiguous())


def float_in_place(ckpt: Checkpoint, spec: LinearSpec, weight: str):
    """For convert's requant batches (batch.py): where a module's float weight [N, K] lies, read in
    place as ``float_linear`` reads it: (weight TensorInfo, block scales TensorInfo, block rows, block
    columns, global scale) -- here (weight, None, 0, 0, None); None where ``read`` is the only way (a
    bias, another dtype or shape)."""
    t = ckpt.tensors.get(weight)
    if spec.has_bias or t is None or t.dtype not in FLOAT_DTYPES or tuple(t.shape) != (spec.n, spec.k):
        return None
    return t, None, 0, 0, None


def stays_float(model_type: str, module: str) -> str | None:
    """Why a float linear of a source without per-module quantisation stays float, or None when it is
    quantised: outside the decoder layers (embeddings, lm_head, vision towers), routers, norms, and
    what the family keeps (vLLM builds it unquantised, or it is not part of the language model)."""
    fam = family(model_type)
    if fam is None:
        return f"model_type {model_type!r} is not a family int4pack knows"
    if not _LAYER.search(module + "."):
        return "outside the decoder layers (embeddings, lm_head, other towers)"
    if _ROUTER.search(module):
        return "a router"
    if _NOT_LINEAR.search(module.rsplit(".", 1)[-1]):
        return "a norm or embedding"
    why = fam.is_float_only(module) or fam.kept_reason(f"{module}.weight") or fam.kept_reason(module)
    return why or None


def float_weights(ckpt: Checkpoint) -> list[str]:
    """The 2-D float ``.weight`` tensors of a checkpoint."""
    return sorted(n for n, t in ckpt.tensors.items()
                  if n.endswith(".weight") and t.dtype in FLOAT_DTYPES and len(t.shape) == 2)


def is_float_source(ckpt: Checkpoint) -> bool:
    """No quantization_config and some float linear weights: what FloatReader reads."""
    return ckpt.quant_config is None and bool(float_weights(ckpt))


_FUSED = re.compile(r"^(?P<p>.+\.experts)\.gate_up_proj$")
_ROLES = ("gate_proj", "up_proj", "down_proj")


class FloatReader:
    """A bf16/fp16/fp32 checkpoint: the linears ``stays_float`` does not keep, as float records.

    Fused 3-D experts, as transformers 5 and the Qwen3.5/3.6 releases store them, are split per expert
    (``<moe>.experts.E.{gate,up,down}_proj``, N-major like nn.Linear): ``gate_up_proj`` [E, 2I, H] with
    gate the first I rows and ``down_proj`` [E, H, I] (Qwen3.5-MoE's ``chunk(2)``), or transposed,
    ``gate_up_proj`` [E, H, 2I] and ``down_proj`` [E, I, H] (Llama-4's ``bmm``), told apart by the shapes.
    """

    name = "float"

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt
        if family(ckpt.family_type) is None:
            raise RefusedError(
                f"{ckpt.folder}: a float checkpoint (no quantization_config) of model_type {ckpt.family_type!r}, "
                "which int4pack does not know as an MoE family", path=str(ckpt.folder / "config.json"),
                hint="int4pack quantises float checkpoints of the families it knows: "
                     + ", ".join(supported_types()) + ".")
        self._specs: dict[str, LinearSpec] | None = None
        self._fused: dict[str, tuple[str, int, int, bool]] = {}  # module -> (fused tensor, expert, role, transposed)

    def split_tensors(self) -> set[str]:
        """The fused expert tensors this reader splits per expert."""
        self.linears()
        return {v[0] for v in self._fused.values()}

    def _split(self, specs: dict[str, LinearSpec]) -> None:
        ck = self.ckpt
        for name in sorted(ck.tensors):
            m = _FUSED.match(name)
            t = ck.tensors[name]
            if not m or t.dtype not in FLOAT_DTYPES or len(t.shape) != 3:
                continue
            p, dn = m["p"], f"{m['p']}.down_proj"
            if stays_float(ck.family_type, f"{p}.0.gate_proj") or ck.family_type == "gpt_oss":
                continue  # an MTP block vLLM drops is copied; gpt-oss interleaves gate/up rows (discover refuses)
            d = ck.tensors.get(dn)
            if d is None or d.dtype not in FLOAT_DTYPES or len(d.shape) != 3 or d.shape[0] != t.shape[0]:
                raise InputError(f"{name}: fused float experts without a matching 3-D {dn}", tensor=name,
                                 hint="The checkpoint is incomplete or not a layout int4pack knows; re-download it.")
            e_n, a, b = t.shape
            if a == 2 * d.shape[2] and b == d.shape[1]:
                transposed, i, h = False, d.shape[2], b  # [E, 2I, H] and [E, H, I]
            elif b == 2 * d.shape[1] and a == d.shape[2]:
                transposed, i, h = True, d.shape[1], a  # [E, H, 2I] and [E, I, H]
            else:
                raise InputError(f"{name}: shape {list(t.shape)} and {dn} {list(d.shape)} are neither [E, 2I, H] / "
                                 "[E, H, I] nor [E, H, 2I] / [E, I, H]", tensor=name,
                                 hint="The fused experts disagree with each other; the checkpoint is corrupt.")
            for e in range(e_n):
                for role, (n, k) in enumerate(((i, h), (i, h), (h, i))):
                    mod = f"{p}.{e}.{_ROLES[role]}"
                    src = dn if role == 2 else name
                    # the fused tensor is named once (expert 0), so the plan counts its bytes once
                    keys = (src,) if e == 0 and role != 1 else ()
                    specs[mod] = float_spec(mod, "float", n, k, keys, t.dtype,
                                            notes=[f"expert {e} of the fused {src}"])
                    self._fused[mod] = (src, e, role, transposed)

    def linears(self) -> dict[str, LinearSpec]:
        if self._specs is None:
            ck = self.ckpt
            specs = {}
            self._split(specs)
            for name in float_weights(ck):
                mod = name[: -len(".weight")]
                if stays_float(ck.family_type, mod):
                    continue
                n, k = ck.tensors[name].shape
                bias = f"{mod}.bias"
                has_bias = bias in ck.tensors
                keys = (name, bias) if has_bias else (name,)
                specs[mod] = float_spec(mod, "float", n, k, keys, ck.tensors[name].dtype, has_bias=has_bias)
            self._specs = specs
        return self._specs

    def verdict(self) -> FormatVerdict:
        specs = self.linears()
        dtypes = sorted({s.scale_dtype for s in specs.values()})
        kinds = "/".join(d.lower().replace("f", "fp") if d != "BF16" else "bf16" for d in dtypes) or "float"
        return FormatVerdict(
            "float", f"{kinds} weights, {DATA_FREE}",
            evidence=["no quantization_config", f"{len(specs)} float linear(s) to quantise"],
            warnings=[f"{DATA_FREE}: each group's scale is searched on the weights alone (no calibration data); "
                      + NOT_INT4],
            extra={"source_kind": "float", "data_free": True})

    def float_in_place(self, spec: LinearSpec):
        """``float_in_place``: a 2-D weight, or an expert's rows of a fused [E, 2I, H] / [E, H, I]
        tensor (contiguous bytes there; the transposed layout goes through ``read``)."""
        if spec.name not in self._fused:
            return float_in_place(self.ckpt, spec, f"{spec.name}.weight")
        src, e, role, transposed = self._fused[spec.name]
        t = self.ckpt.tensors[src]
        if transposed or spec.has_bias:
            return None
        per = t.nbytes // t.shape[0]  # one expert's bytes
        row = per // t.shape[1]
        begin = t.begin + e * per + (spec.n * row if role == 1 else 0)
        return replace(t, shape=(spec.n, spec.k), begin=begin, end=begin + spec.n * row), None, 0, 0, None

    def read(self, spec: LinearSpec, *, unpack: bool = True) -> QuantLinear:
        ck = self.ckpt
        if spec.name in self._fused:
            src, e, role, transposed = self._fused[spec.name]
            t = read_expert(self.ckpt, src, e)
            t = t.T if transposed else t  # N-major: [2I, H] or [H, I]
            if role < 2:
                t = t[:spec.n] if role == 0 else t[spec.n:]
            return float_linear(spec, t)
        w = ck.get(spec.keys[0])
        bias = ck.get(f"{spec.name}.bias") if spec.has_bias else None
        return float_linear(spec, w, bias)


def claims(q: dict | None, header: Header) -> bool:
    """No quantization config and some 2-D float weights (the reader refuses a family it does not know)."""
    return q is None and any(n.endswith(".weight") and t.dtype in FLOAT_DTYPES and len(t.shape) == 2
                             for n, t in header.tensors.items())


FORMAT = Format(
    "float", claims, lambda ckpt, q, path: FloatReader(ckpt),
    reads="bf16/fp16/fp32 checkpoints (no quantization_config) of the families int4pack knows, quantised data-free",
    lossless="none (float values)",
    requant="every linear of the decoder layers but routers, norms and what vLLM keeps float")
