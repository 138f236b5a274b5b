"""The packed serving format's specification, shared by the converter and the vLLM plugin.

The layout record (config.json's ``quantization_config.kleidiai``), the config record around it,
the per-blob provenance kept in shard headers and the CRC-32s of both. It imports only the
KleidiAI layout (kleidiai.py) and the error types, so the plugin reads and checks packed
checkpoints without loading int4pack's readers or planner. The format itself is described in
blobs.py and docs/serve-format.md.
"""

from __future__ import annotations

import ctypes
import zlib

from . import kleidiai
from ._lazy import torch
from .errors import InputError, UsageError
from .groups import MULTIPLE, check_group_size, is_channel, is_channelwise, scale_dtype

__all__ = ["FORMATS", "PLAIN", "KLEIDIAI", "QUANT_METHOD", "SUFFIX", "BLOB_CHECKS", "MOE_LAYERS", "PLAIN_MODULES", "ROTARY", "rotary_rows",
           "unshuffle_rotary_bytes", "rotary_problem", "PROVENANCE_BYTES",
           "ROW_PARALLEL", "is_row_parallel", "parse_format", "layout_record", "serve_config",
           "tensor_parallel_size", "split_problem", "read_record", "record_problems", "provenance_problem",
           "crc", "provenance"]

QUANT_METHOD = "int4pack-kleidiai"  # config.json quant_method: what the vLLM plugin registers
SUFFIX = "weight_packed"
BLOB_CHECKS = "blob_checks"  # the layout record's per-blob group and CRC-32, checked by the plugin at load
MOE_LAYERS = "moe_layers"  # the layout record's routing and activation per MoE layer (vLLM module -> facts)
PLAIN_MODULES = "plain_modules"  # the layout record's vLLM modules kept as plain W4A8 (module -> why)
ROTARY = "vllm_rotary_heads"  # provenance and blob checks: rows stored in vLLM's Llama-4 rotary order
VERIFIED_TORCH = ("2.9.1", "2.10.0")  # torch releases whose packer the portable one was proven against
PROVENANCE_BYTES = 180  # header room per blob for its provenance entry (~150 bytes of JSON)


PLAIN = "compressed-tensors"  # int8 weights, packed by vLLM at load (needs nothing but vLLM)
KLEIDIAI = "kleidiai"  # KleidiAI blobs, served by int4pack's vLLM plugin
FORMATS = (PLAIN, KLEIDIAI)

# module leaves vLLM splits along K under tensor parallelism (RowParallelLinear: o_proj, a dense or
# shared MLP's down_proj; FusedMoE's w2: an expert's down_proj / w2) in the supported families
ROW_PARALLEL = ("o_proj", "down_proj", "w2")


def is_row_parallel(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ROW_PARALLEL


def parse_format(value) -> str:
    value = getattr(value, "value", value) or PLAIN  # the CLI passes its enum
    if value not in FORMATS:
        raise UsageError(f"--serve-format {value!r}: expected one of {', '.join(FORMATS)}")
    return value


def layout_record(group_size: int | None, tensor_parallel: int = 1) -> dict:
    """What the blobs are: recorded in config.json and checked by the plugin and verify.
    ``group_size`` None: per module (the config groups and each blob's provenance say which).
    ``tensor_parallel`` > 1: the row parallel modules are stored split for that many ranks (only then
    recorded: a checkpoint for one rank keeps the record it always had)."""
    scales = "per module" if group_size is None else scale_dtype(group_size)
    rec = {"layout": kleidiai.LAYOUT_NAME, "layout_version": kleidiai.LAYOUT_VERSION,
           "nr": kleidiai.NR, "kr": kleidiai.KR, "sr": kleidiai.SR, "group_size": group_size,
           "scale_dtype": scales, "tensor_suffix": SUFFIX,
           "packer": "int4pack portable (the bytes of torch's _dyn_quant_pack_4bit_weight on Arm)",
           "verified_against_torch": list(VERIFIED_TORCH)}
    if tensor_parallel > 1:
        rec["tensor_parallel_size"] = tensor_parallel
    return rec


def serve_config(quant_config: dict, group_size: int | None, checks: dict | None = None,
                 tensor_parallel: int = 1, plain: dict[str, str] | None = None,
                 moe_layers: dict[str, dict] | None = None) -> dict:
    """The plain output's quantization_config, renamed to this format, with the layout record
    (and the per-blob checks the plugin runs at load: ``blob_checks``; the vLLM modules written as
    plain W4A8, with why: ``plain_modules``; each MoE layer's routing and activation as the model
    computes them, which the plugin serves: ``moe_layers``)."""
    rec = layout_record(group_size, tensor_parallel)
    if checks is not None:
        rec[BLOB_CHECKS] = checks
    if plain:
        rec[PLAIN_MODULES] = dict(sorted(plain.items()))
    if moe_layers:
        rec[MOE_LAYERS] = dict(sorted(moe_layers.items()))
    return {**quant_config, "quant_method": QUANT_METHOD, "kleidiai": rec}


def tensor_parallel_size(rec: dict) -> int:
    """The tensor parallel size a packed checkpoint's row parallel modules were split for (1: not split)."""
    v = rec.get("tensor_parallel_size", 1)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else 0  # 0: unreadable


def split_problem(n: int, k: int, group_size: int, tp: int) -> str | None:
    """Why an [N, K] matrix cannot be split along K into ``tp`` KleidiAI blobs, or None."""
    if k % tp:
        return f"K={k} is not divisible by {tp}"
    kp = k // tp
    if not is_channelwise(k, group_size) and kp % group_size:
        return f"each rank's K={kp} is not a multiple of the group size {group_size}"
    if kp % 2:
        return f"each rank's K={kp} is odd"
    return None


def read_record(quant_config: dict | None) -> dict | None:
    """The layout record of a packed checkpoint's quantization_config; None for any other config."""
    if not isinstance(quant_config, dict) or quant_config.get("quant_method") != QUANT_METHOD:
        return None
    rec = quant_config.get("kleidiai")
    if not isinstance(rec, dict):
        raise InputError(f"quantization_config: quant_method {QUANT_METHOD!r} without its 'kleidiai' record",
                         hint="The config was edited or truncated; convert again with --serve-format kleidiai.")
    return rec


def record_problems(rec: dict) -> list[str]:
    """How a recorded layout differs from the one this int4pack (and torch's packer) writes, and
    which of its fields hold values no conversion writes."""
    want = {k: v for k, v in layout_record(0).items() if k in ("layout", "layout_version", "nr", "kr", "sr")}
    out = [f"{k} is {rec.get(k)!r}, this int4pack reads {v!r}" for k, v in want.items() if rec.get(k) != v]
    g, sd = rec.get("group_size"), rec.get("scale_dtype")
    if g is not None and (type(g) is not int or not (is_channel(g) or (g > 0 and g % MULTIPLE == 0))):
        out.append(f"group_size is {g!r}: expected -1 (channel), a multiple of 32, or null (per module)")
    elif sd != layout_record(g)["scale_dtype"]:
        out.append(f"scale_dtype is {sd!r}, but group_size {g!r} means {layout_record(g)['scale_dtype']!r}")
    blobs = rec.get(BLOB_CHECKS)
    if blobs is not None and not isinstance(blobs, dict):
        out.append(f"{BLOB_CHECKS} is a {type(blobs).__name__}, not an object")
    plain = rec.get(PLAIN_MODULES)
    if plain is not None and not (isinstance(plain, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                                  for k, v in plain.items())):
        out.append(f"{PLAIN_MODULES} is not an object of module names and reasons")
    layers = rec.get(MOE_LAYERS)
    if layers is not None and not (isinstance(layers, dict) and all(
            isinstance(v, dict) and isinstance(v.get("routing"), dict) for v in layers.values())):
        out.append(f"{MOE_LAYERS} is not an object of MoE layers, each with its routing")
    return out


def _int(v) -> int | None:
    return v if type(v) is int else None


def rotary_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows [N, ...] reordered as vLLM's Llama-4 class reorders q_proj/k_proj on load: within each
    of ``heads`` blocks of rows, the even rows first, then the odd ones (the checkpoint's interleaved
    rotary pairs to vLLM's halves)."""
    n = t.shape[0]
    return t.reshape(heads, n // heads // 2, 2, -1).transpose(1, 2).reshape(t.shape).contiguous()


def unshuffle_rotary_bytes(b: torch.Tensor, heads: int) -> torch.Tensor:
    """A 1-D blob as stored, from the bytes vLLM's Llama-4 class hands on: it reorders any q_proj /
    k_proj ``weight_packed`` as rows, and a blob's rows are its bytes (undone here, the inverse map)."""
    return b.reshape(heads, 2, b.numel() // heads // 2).transpose(1, 2).reshape(-1).contiguous()


def rotary_problem(n: int | None, nbytes: int | None, heads) -> str | None:
    """Why ``heads`` cannot be a module's rotary heads (N rows, a blob of ``nbytes``; None: not
    known here), or None."""
    if type(heads) is not int or heads <= 0:
        return f"{heads!r} is not a positive integer"
    for what, size in (("rows", n), ("blob bytes", nbytes)):
        if size is not None and size % (2 * heads):
            return f"its {size} {what} do not split into {heads} heads of row pairs"
    return None


def provenance_problem(name: str, ent) -> str | None:
    """Why a blob's provenance entry (its shard header's int4pack.tensors) cannot be used, or None."""
    if not isinstance(ent, dict):
        return f"{name}: provenance is a {type(ent).__name__}, not an object"
    for field in ("n", "k"):
        v = _int(ent.get(field))
        if v is None or v <= 0:
            return f"{name}: provenance field {field!r} is {ent.get(field)!r}, not a positive integer"
    g = _int(ent.get("group_size"))
    if g is None or not (is_channelwise(ent["k"], g) or check_group_size(g, ent["k"]) is None):
        return (f"{name}: provenance field 'group_size' is {ent.get('group_size')!r}: expected -1 or a multiple "
                f"of 32 dividing K={ent['k']}")
    if not isinstance(ent.get("bias", False), bool):
        return f"{name}: provenance field 'bias' is {ent.get('bias')!r}, not true or false"
    if ROTARY in ent and (why := rotary_problem(ent["n"], None, ent[ROTARY])):
        return f"{name}: provenance field {ROTARY!r}: {why}"
    for field in ("crc32_q", "crc32_scales", "crc32_bias", "crc32"):
        v = ent.get(field)
        if v is not None and not (isinstance(v, str) and len(v) == 8 and all(c in "0123456789abcdef" for c in v)):
            return f"{name}: provenance field {field!r} is {v!r}, not 8 hex digits"
    return None


def crc(t: torch.Tensor | None) -> str | None:
    if t is None:
        return None
    t = t.contiguous()
    n = t.nbytes
    # the bytes in place, through ctypes: a fifth of the cost of reshape/view/numpy, paid per blob 3-4 times
    # (t stays referenced here, so its memory outlives the call)
    data = (ctypes.c_char * n).from_address(t.data_ptr()) if n and t.device.type == "cpu" else \
        t.reshape(-1).view(torch.uint8).numpy()
    return f"{zlib.crc32(data):08x}"


def provenance(q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, group_size: int,
               blob: torch.Tensor | None = None, tensor_parallel: int = 1) -> dict:
    """What a blob was packed from (kept in its shard header): shape, group, CRC-32s of the inputs
    (of the whole matrix for a K-split one, with ``tensor_parallel``: its number of ranks), and
    (``crc32``) the CRC-32 of the blob's own stored bytes (a K-split one's whole ``[tp, bytes]``),
    which verify and the plugin check."""
    n, k = q.shape
    out = {"n": n, "k": k, "group_size": group_size, "bias": bias is not None, "crc32_q": crc(q),
           "crc32_scales": crc(scales.reshape(n, -1)),
           "crc32_bias": crc(None if bias is None else bias.to(torch.float32))}
    if tensor_parallel > 1:
        out["tensor_parallel"] = tensor_parallel
    if blob is not None:
        out["crc32"] = crc(blob)
    return out
