"""Source format readers: one module per format behind one small interface.

A reader is built from a Checkpoint; it only parses headers and config until ``read``:

    reader = open_reader(ckpt)
    reader.verdict()            -> FormatVerdict (format, version, v1/v2 evidence, warnings)
    reader.linears()            -> {module prefix: LinearSpec} for every quantised linear
    reader.read(spec)           -> QuantLinear in the canonical convention (records.py)
"""

from __future__ import annotations

import json
from typing import Protocol

from ..checkpoint import Checkpoint
from ..errors import InputError, Int4packError, RefusedError
from ..records import FormatVerdict, LinearSpec, QuantLinear
from ..serve_spec import QUANT_METHOD

__all__ = ["Reader", "open_reader"]


class Reader(Protocol):
    name: str

    def verdict(self) -> FormatVerdict: ...

    def linears(self) -> dict[str, LinearSpec]: ...

    def read(self, spec: LinearSpec, *, unpack: bool = True) -> QuantLinear:
        """The module's data. unpack=False may leave the codes packed (QuantLinear.packed)."""
        ...


PACKED = QUANT_METHOD  # the packed serving format: not a source


def open_reader(ckpt: Checkpoint) -> Reader:
    """Pick the reader for the checkpoint's quant_method; refuse anything else clearly."""
    q = ckpt.quant_config
    if q is None:
        from .float import FloatReader, is_float_source

        if is_float_source(ckpt):  # bf16/fp16/fp32 weights: quantised data-free (float.py)
            return FloatReader(ckpt)
        raise RefusedError(
            f"{ckpt.folder}: no quantization_config (config.json, quantize_config.json or quant_config.json) "
            "and no float linear weights",
            path=str(ckpt.folder),
            hint="int4pack converts int4 GPTQ, AWQ, compressed-tensors, FP8 and FP4 checkpoints, and float "
                 "(bf16/fp16/fp32) ones of the MoE families it knows.")
    qpath = str(getattr(ckpt, "quant_config_path", None) or ckpt.folder / "config.json")
    _check_types(q, qpath)
    method = str(q.get("quant_method", "")).lower()
    if method == PACKED:
        raise RefusedError(
            f"{ckpt.folder}: int4pack's packed serving format (quant_method {PACKED!r}, written by convert "
            "--serve-format kleidiai): it is for serving through int4pack's vLLM plugin and cannot be a source",
            path=str(ckpt.folder), hint="Convert from the original int4 checkpoint; int4pack verify checks this one.")
    try:
        if method == "gptq" or (not method and "bits" in q and "desc_act" in q):
            from .gptq import GPTQReader
            return GPTQReader(ckpt, q)
        if method == "awq":
            from .awq import AWQReader
            return AWQReader(ckpt, q)
        if method == "fp8":  # the official FP8 layout (weight_scale_inv): dequantised, requantised
            from .fp8 import FP8Reader
            return FP8Reader(ckpt, q)
        if method == "modelopt":
            from .fp4 import ModelOptNVFP4Reader, is_modelopt_nvfp4
            if is_modelopt_nvfp4(q):
                return ModelOptNVFP4Reader(ckpt, q)
        if method in {"compressed-tensors", "compressed_tensors"} or "config_groups" in q:
            from .fp4 import CT_FP4_FORMATS, CTFP4Reader, ct_formats
            fmts = ct_formats(q)
            if fmts and fmts <= {"float-quantized"}:
                from .fp8 import CTFP8Reader
                return CTFP8Reader(ckpt, q)
            if fmts and fmts <= set(CT_FP4_FORMATS):
                return CTFP4Reader(ckpt, q)
            from .compressed_tensors import CompressedTensorsReader
            return CompressedTensorsReader(ckpt, q)
        if method == "mxfp4" and ckpt.family_type == "gpt_oss":  # fused experts in gpt-oss's own layout
            from .mxfp4 import MXFP4Reader
            return MXFP4Reader(ckpt, q)
        if method == "mxfp4":
            from ..families import family
            from .mxfp4 import MXFP4LinearReader
            if family(ckpt.family_type) is not None:
                return MXFP4LinearReader(ckpt, q)
    except Int4packError as e:  # a config value the reader could not parse: name the file it is in
        e.path = e.path or qpath
        raise
    from ..families import family

    fam = family(ckpt.family_type)
    if fam is not None and fam.refuse:  # say why the family is refused, not only that its format is
        raise RefusedError(f"model_type {ckpt.family_type!r} ({fam.name}), quant_method "
                           f"{q.get('quant_method')!r}: {fam.refuse}", path=qpath,
                           hint="int4pack converts int4 GPTQ, AWQ or compressed-tensors checkpoints.")
    raise RefusedError(
        f"quant_method {q.get('quant_method')!r} is not supported", path=qpath,
        hint="Supported: gptq, awq (gemm), compressed-tensors (pack-quantized, int-quantized).")


# JSON types the readers rely on for the keys they read (None is always allowed: "not set")
_NUM = (int, float, str)
_QCFG_TYPES = {
    "quant_method": (str,), "format": (str,), "checkpoint_format": (str,), "version": _NUM, "pack_dtype": (str,),
    "bits": _NUM, "w_bit": _NUM, "group_size": _NUM, "q_group_size": _NUM, "sym": (bool, int),
    "desc_act": (bool, int), "zero_point": (bool, int), "is_marlin_format": (bool, int), "dynamic": (dict,),
    "config_groups": (dict,), "ignore": (list,), "sparsity_config": (dict,), "transform_config": (dict,),
    "modules_to_not_convert": (list,), "modules_in_block_to_quantize": (list,), "quantization_status": (str,),
}
_GROUP_TYPES = {"targets": (list,), "format": (str,), "weights": (dict,)}
_WEIGHT_TYPES = {"num_bits": (int,), "type": (str,), "symmetric": (bool, int), "strategy": (str,),
                 "group_size": _NUM, "dynamic": (bool, str)}


def _check_types(q: dict, qpath: str) -> None:
    """Refuse a quantization_config whose known keys have the wrong JSON type, naming the key, so
    the readers never meet e.g. a list where they expect a string."""
    def check(obj: dict, types: dict, where: str) -> None:
        for key, allowed in types.items():
            v = obj.get(key)
            if v is not None and not isinstance(v, allowed):
                want = " or ".join(sorted({"number" if t in (int, float) else {str: "string", bool: "boolean",
                                                                                 dict: "object", list: "list"}[t]
                                           for t in allowed}))
                raise InputError(f"{where}.{key} is {json.dumps(v)[:60]}; expected a {want}", path=qpath,
                                 hint="Fix or re-download the config; int4pack reads it as its producer wrote it.")

    def strings(v, where: str) -> None:  # lists of names, possibly nested (modules_in_block_to_quantize)
        if isinstance(v, list):
            for x in v:
                strings(x, where)
        elif not isinstance(v, str):
            raise InputError(f"{where} holds {json.dumps(v)[:60]}; expected module names (strings)", path=qpath,
                             hint="Fix or re-download the config.")

    check(q, _QCFG_TYPES, "quantization_config")
    for key in ("ignore", "modules_to_not_convert", "modules_in_block_to_quantize"):
        strings(q.get(key) or [], f"quantization_config.{key}")
    for name, group in (q.get("config_groups") or {}).items():
        where = f"quantization_config.config_groups.{name}"
        if not isinstance(group, dict):
            raise InputError(f"{where} is {json.dumps(group)[:60]}; expected an object", path=qpath,
                             hint="Fix or re-download the config.")
        check(group, _GROUP_TYPES, where)
        strings(group.get("targets") or [], f"{where}.targets")
        check(group.get("weights") or {}, _WEIGHT_TYPES, f"{where}.weights")
