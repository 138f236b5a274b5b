"""Source format readers: one module per format, listed in one table, ``READERS``.

Each row (``_api.Format``) names its reader and says which sources it claims, from the
quantization config and the tensor headers only. The planner, verify and inspect open every
source through ``open_reader``, which asks the rows in order; a source no row claims is refused
naming its quant_method (or file type) and the formats of the table. A reader only parses headers
and config until ``read``:

    reader = open_reader(ckpt)
    reader.verdict()            -> FormatVerdict (format, version, v1/v2 evidence, warnings)
    reader.linears()            -> {module prefix: LinearSpec} for every quantised linear
    reader.read(spec)           -> QuantLinear in the canonical convention (records.py)
"""

from __future__ import annotations

import json

from ..sources.checkpoint import Checkpoint
from ..errors import InputError, Int4packError, RefusedError
from ..serve_spec import QUANT_METHOD
from ..sources.source_folder import load_json
from . import autoround, awq, compressed_tensors, gptq, mxfp4
from . import gguf, mlx
from ._api import Format, Header, Reader, quant_method
from . import float_source, fp4, fp8
from .float_experts import with_float_experts

__all__ = ["READERS", "Format", "Header", "Reader", "open_reader", "supported", "header_of", "value_kind"]

# Asked in order; the first row that claims a source reads it.
READERS: tuple[Format, ...] = (
    gptq.FORMAT,
    autoround.FORMAT,
    awq.FORMAT,
    # rows that claim part of what a row below claims (float config groups of compressed-tensors): above it
    fp8.CT_FORMAT,
    fp4.CT_FORMAT,
    compressed_tensors.FORMAT,
    mxfp4.FORMAT,
    # rows of containers other than safetensors, and of layouts of their own: after the int4 rows
    gguf.FORMAT,
    mlx.FORMAT,
    # rows of float sources (BF16, FP8, FP4): last, for they claim what no row above did
    fp8.FORMAT,
    fp4.MODELOPT_FORMAT,
    mxfp4.LINEAR_FORMAT,
    float_source.FORMAT,
)

PACKED = QUANT_METHOD  # the packed serving format: not a source


def supported() -> str:
    """The table's formats, as a refusal lists them."""
    return "; ".join(f"{r.name}: {r.reads}" for r in READERS)


def header_of(ckpt: Checkpoint) -> Header:
    """What the rows' ``claims`` see of a source."""
    return Header(getattr(ckpt, "container", "safetensors"), ckpt.tensors, ckpt.family_type, tuple(ckpt.shards))


def _config(ckpt: Checkpoint) -> tuple[dict | None, str]:
    """The quantization config and the file it is in: the checkpoint's own (config.json, the GPTQ and
    AWQ side files), else a side file a row names (AutoRound's quantization_config.json)."""
    q = ckpt.quant_config
    if q is not None:
        return q, str(getattr(ckpt, "quant_config_path", None) or ckpt.folder / "config.json")
    for name in dict.fromkeys(f for r in READERS for f in r.config_files):
        p = ckpt.folder / name
        ckpt.check_link(p)
        if p.is_file():
            side = load_json(p)
            if not isinstance(side, dict):
                raise InputError(f"{p}: holds a {type(side).__name__}, not a quantization config object",
                                 path=str(p), hint="Fix or re-download the file.")
            return side, str(p)
    return None, str(ckpt.folder / "config.json")


def open_reader(ckpt: Checkpoint) -> Reader:
    """The reader of the first row of READERS that claims the checkpoint; refuse anything else clearly."""
    q, qpath = _config(ckpt)
    if q is not None:
        _check_types(q, qpath)
    method = quant_method(q)
    if method == PACKED:
        raise RefusedError(
            f"{ckpt.folder}: int4pack's packed serving format (quant_method {PACKED!r}, written by convert "
            "--serve-format kleidiai): it is for serving through int4pack's vLLM plugin and cannot be a source",
            path=str(ckpt.folder), hint="Convert from the original int4 checkpoint; int4pack verify checks this one.")
    header = header_of(ckpt)
    for row in READERS:
        try:
            if row.claims(q, header):
                reader = row.reader(ckpt, q, qpath)
                return with_float_experts(reader, ckpt) if row.float_siblings else reader
        except Int4packError as e:  # a config value the reader could not parse: name the file it is in
            e.path = e.path or qpath
            raise
    if q is None:
        raise RefusedError(
            f"{ckpt.folder}: no quantization_config (config.json, quantize_config.json, quant_config.json or "
            "quantization_config.json)", path=str(ckpt.folder),
            hint=f"int4pack reads {supported()}. Quantise the model first.")
    from ..families import family

    fam = family(ckpt.family_type)
    if fam is not None and fam.refuse:  # say why the family is refused, not only that its format is
        raise RefusedError(f"model_type {ckpt.family_type!r} ({fam.name}), quant_method "
                           f"{q.get('quant_method')!r}: {fam.refuse}", path=qpath,
                           hint=f"int4pack reads {supported()}.")
    raise RefusedError(
        f"quant_method {q.get('quant_method')!r} is not supported", path=qpath,
        hint=f"Supported: {supported()}.")


# JSON types the readers rely on for the keys they read (None is always allowed: "not set")
_NUM = (int, float, str)
_QCFG_TYPES = {
    "quant_method": (str,), "format": (str,), "checkpoint_format": (str,), "version": _NUM, "pack_dtype": (str,),
    "bits": _NUM, "w_bit": _NUM, "group_size": _NUM, "q_group_size": _NUM, "sym": (bool, int),
    "desc_act": (bool, int), "zero_point": (bool, int), "is_marlin_format": (bool, int), "dynamic": (dict,),
    "config_groups": (dict,), "ignore": (list,), "sparsity_config": (dict,), "transform_config": (dict,),
    "modules_to_not_convert": (list,), "modules_in_block_to_quantize": (list,), "quantization_status": (str,),
    "packing_format": (str,), "extra_config": (dict,), "data_type": (str,), "act_bits": _NUM,
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


def value_kind(fmt: str, bits: int) -> str | None:
    """What a source module holds when it is not int4 integers (FP8, E2M1, a GGUF codebook, 5- or
    8-bit ints: convert requantises them all), else None; as inspect names it."""
    if fmt in float_source.VALUES:
        return float_source.VALUES[fmt][1]
    return gguf.NOT_INT4.get(fmt) or (f"{bits}-bit" if bits != 4 else None)

