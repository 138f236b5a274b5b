"""The packed serving format (``convert --serve-format kleidiai``): each W4A8 linear stored as the
KleidiAI blob that torch's ``_dyn_quant_pack_4bit_weight`` writes on Arm, inside the checkpoint.

The default output (compressed-tensors W4A8, ``int-quantized``) stores one int8 per int4 weight,
and vLLM packs every matrix when it loads (all experts resident as int8 first). Here each W4A8
module ``M`` becomes one tensor ``M.weight_packed``: uint8 ``[packed_size(N, K, g)]``, the exact
bytes of torch's packer for the module's int4 values, scales and bias, written by int4pack's
portable packer (byte-identical to torch's: tests/arm64). No int8 weight, scale or bias is kept
beside a blob; everything else (norms, embeddings, routers, bf16 linears) is as in the plain output.

``config.json``: the plain output's compressed-tensors ``quantization_config`` with ``quant_method``
``int4pack-kleidiai`` and a ``kleidiai`` record (layout, version, nr/kr/sr, group size, scale
dtype, packer). ``int4pack.vllm_plugin`` serves it in vLLM.

Provenance: a blob's entry in its shard header (``int4pack.tensors``) records N, K, the group,
whether a bias is packed in, and CRC-32s of the int4 values, scales and bias it was packed from.
``check_blob`` (verify) decodes the blob, compares those, and repacks it byte for byte.

vLLM loads one packed parameter per fused module (gate+up of each expert, q/k/v, gate/up of dense
MLPs) by placing the blobs of its parts one after the other. KleidiAI packs rows in independent
blocks of 8 (nr), so that concatenation is the fused matrix's blob exactly when every part's N is
a multiple of 8; ``packed_plan`` refuses other shapes.
"""

from __future__ import annotations

import dataclasses
import json
import zlib

import torch

from . import kleidiai
from .errors import InputError, RefusedError, UsageError
from .plan import Job, OutTensor, Plan

__all__ = ["FORMATS", "PLAIN", "KLEIDIAI", "QUANT_METHOD", "SUFFIX", "parse_format", "packed_plan", "job_packer",
           "serve_config", "layout_record", "read_record", "record_problems", "PackedWeights"]

QUANT_METHOD = "int4pack-kleidiai"  # config.json quant_method: what the vLLM plugin registers
SUFFIX = "weight_packed"
BLOB_CHECKS = "blob_checks"  # the layout record's per-blob group and CRC-32, checked by the plugin at load
VERIFIED_TORCH = ("2.9.1", "2.10.0")  # torch releases whose packer the portable one was proven against
PROVENANCE_BYTES = 180  # header room per blob for its provenance entry (~150 bytes of JSON)


PLAIN = "compressed-tensors"  # int8 weights, packed by vLLM at load (needs nothing but vLLM)
KLEIDIAI = "kleidiai"  # KleidiAI blobs, served by int4pack's vLLM plugin
FORMATS = (PLAIN, KLEIDIAI)


def parse_format(value) -> str:
    value = getattr(value, "value", value) or PLAIN  # the CLI passes its enum
    if value not in FORMATS:
        raise UsageError(f"--serve-format {value!r}: expected one of {', '.join(FORMATS)}")
    return value


def _block(k: int, group_size: int) -> int:
    return k if group_size == -1 else group_size


def layout_record(group_size: int | None) -> dict:
    """What the blobs are: recorded in config.json and checked by the plugin and verify.
    ``group_size`` None: per module (the config groups and each blob's provenance say which)."""
    scales = "per module" if group_size is None else "float32" if group_size == -1 else "bfloat16"
    return {"layout": kleidiai.LAYOUT_NAME, "layout_version": kleidiai.LAYOUT_VERSION,
            "nr": kleidiai.NR, "kr": kleidiai.KR, "sr": kleidiai.SR, "group_size": group_size,
            "scale_dtype": scales, "tensor_suffix": SUFFIX,
            "packer": "int4pack portable (the bytes of torch's _dyn_quant_pack_4bit_weight on Arm)",
            "verified_against_torch": list(VERIFIED_TORCH)}


def serve_config(quant_config: dict, group_size: int | None, checks: dict | None = None) -> dict:
    """The plain output's quantization_config, renamed to this format, with the layout record
    (and the per-blob checks the plugin runs at load: ``blob_checks``)."""
    rec = layout_record(group_size)
    if checks is not None:
        rec[BLOB_CHECKS] = checks
    return {**quant_config, "quant_method": QUANT_METHOD, "kleidiai": rec}


def blob_checks(packed: dict[str, dict]) -> dict:
    """What the plugin checks at load, per module as vLLM builds it (``vllm_module``: one FusedMoE
    per MoE layer, qkv_proj, gate_up_proj, or the linear itself): the group each blob was packed
    with, and the CRC-32 of its stored bytes, in vLLM's shard order (experts: gate, up, down).
    ``packed``: output module name -> its provenance."""
    from .architectures import VLLM_FUSED, classify, vllm_module

    units: dict[str, dict] = {}
    for m, p in sorted(packed.items()):
        role, d = classify(m)
        unit = vllm_module(m)
        leaf = m.rsplit(".", 1)[-1]
        g = -1 if p["group_size"] in (-1, p["k"]) else p["group_size"]
        if role == "expert":
            ent = units.setdefault(unit, {"group_size": g, "names": [None, None, None], "experts": {}})
            i = ("gate", "up", "down").index(d["proj"])
            ent["names"][i] = leaf
            ent["experts"].setdefault(d["e"], [None, None, None])[i] = p["crc32"]
        else:
            names = list(VLLM_FUSED.get(unit.rsplit(".", 1)[-1], ())) if unit != m else [leaf]
            ent = units.setdefault(unit, {"group_size": g, "names": names, "crc32": [None] * len(names)})
            ent["crc32"][names.index(leaf)] = p["crc32"]
        if ent["group_size"] != g:
            ent["group_size"] = "mixed"  # vLLM runs one scheme per module: the plugin refuses it
    for ent in units.values():
        if "experts" in ent:
            ex = ent.pop("experts")
            ent["crc32"] = [ex.get(e, [None, None, None]) for e in range(max(ex) + 1)]
    return {"algorithm": "crc32", "modules": units}


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
    if g is not None and (type(g) is not int or not (g == -1 or (g > 0 and g % 32 == 0))):
        out.append(f"group_size is {g!r}: expected -1 (channel), a multiple of 32, or null (per module)")
    elif sd != layout_record(g)["scale_dtype"]:
        out.append(f"scale_dtype is {sd!r}, but group_size {g!r} means {layout_record(g)['scale_dtype']!r}")
    blobs = rec.get(BLOB_CHECKS)
    if blobs is not None and not isinstance(blobs, dict):
        out.append(f"{BLOB_CHECKS} is a {type(blobs).__name__}, not an object")
    return out


def _int(v) -> int | None:
    return v if type(v) is int else None


def provenance_problem(name: str, ent) -> str | None:
    """Why a blob's provenance entry (its shard header's int4pack.tensors) cannot be used, or None."""
    if not isinstance(ent, dict):
        return f"{name}: provenance is a {type(ent).__name__}, not an object"
    for field in ("n", "k"):
        v = _int(ent.get(field))
        if v is None or v <= 0:
            return f"{name}: provenance field {field!r} is {ent.get(field)!r}, not a positive integer"
    g = _int(ent.get("group_size"))
    if g is None or not (g == -1 or g == ent["k"] or (g > 0 and ent["k"] % g == 0 and g % 32 == 0)):
        return (f"{name}: provenance field 'group_size' is {ent.get('group_size')!r}: expected -1 or a multiple "
                f"of 32 dividing K={ent['k']}")
    if not isinstance(ent.get("bias", False), bool):
        return f"{name}: provenance field 'bias' is {ent.get('bias')!r}, not true or false"
    for field in ("crc32_q", "crc32_scales", "crc32_bias", "crc32"):
        v = ent.get(field)
        if v is not None and not (isinstance(v, str) and len(v) == 8 and all(c in "0123456789abcdef" for c in v)):
            return f"{name}: provenance field {field!r} is {v!r}, not 8 hex digits"
    return None


# --------------------------------------------------------------------------------- writing


def packed_plan(plan: Plan) -> Plan:
    """The plan with every W4A8 module's weight, weight_scale and bias replaced by one blob tensor."""
    jobs = []
    for j in plan.jobs:
        if j.kind not in ("linear", "fold"):
            jobs.append(j)
            continue
        outs = []
        for s in j.specs:
            if s.n % kleidiai.NR:
                raise RefusedError(
                    f"{s.name}: N={s.n} is not a multiple of {kleidiai.NR}, so its KleidiAI blob cannot be "
                    "joined with the modules vLLM fuses it with", tensor=s.name,
                    hint="Use the default --serve-format compressed-tensors for this model.")
            size = kleidiai.packed_size(s.n, s.k, _block(s.k, j.group_size))
            outs.append(OutTensor(f"{s.name}.{SUFFIX}", "U8", (size,)))
        jobs.append(dataclasses.replace(j, outputs=outs))
    return dataclasses.replace(plan, jobs=jobs, options={**plan.options, "serve_format": KLEIDIAI})


def _crc(t: torch.Tensor | None) -> str | None:
    if t is None:
        return None
    t = t.contiguous().reshape(-1)
    return f"{zlib.crc32(t.view(torch.uint8).numpy()):08x}"


def provenance(q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, group_size: int,
               blob: torch.Tensor | None = None) -> dict:
    """What a blob was packed from (kept in its shard header): shape, group, CRC-32s of the inputs,
    and (``crc32``) the CRC-32 of the blob's own bytes, which the plugin checks at load."""
    n, k = q.shape
    out = {"n": n, "k": k, "group_size": group_size, "bias": bias is not None, "crc32_q": _crc(q),
           "crc32_scales": _crc(scales.reshape(n, -1)),
           "crc32_bias": _crc(None if bias is None else bias.to(torch.float32))}
    if blob is not None:
        out["crc32"] = _crc(blob)
    return out


def job_packer():
    """run_job outputs -> packed outputs: each W4A8 module's (weight, weight_scale[, bias]) becomes
    one blob, packed at its job's group; the module's stats gain its provenance (written to the
    shard header and report)."""

    def pack(job: Job, tensors: list, stats: dict) -> list:
        if job.kind not in ("linear", "fold"):
            return tensors
        parts: dict[str, dict] = {}
        for name, t in tensors:
            mod, leaf = name.rsplit(".", 1)
            parts.setdefault(mod, {})[leaf] = t
        out = []
        for mod, p in parts.items():
            q, s, b = p["weight"], p["weight_scale"], p.get("bias")
            bias = None if b is None else b.to(torch.float32)
            blob = kleidiai.pack_portable(q, s, bias, _block(q.shape[1], job.group_size), threads=1)
            stats.setdefault(mod, {})["packed"] = provenance(q, s, bias, job.group_size, blob)
            out.append((f"{mod}.{SUFFIX}", blob))
        return out

    return pack


# --------------------------------------------------------------------------------- reading


class PackedWeights:
    """The blobs of a packed checkpoint, with their provenance from the shard headers."""

    def __init__(self, ckpt, record: dict):
        self.ckpt = ckpt
        self.record = record
        self.prov: dict[str, dict] = {}
        self.bad: dict[str, str] = {}  # blob -> why its provenance entry is unusable
        for meta in ckpt.shard_metadata.values():
            try:
                entries = json.loads(meta.get("int4pack.tensors") or "{}")
            except json.JSONDecodeError:
                continue
            if not isinstance(entries, dict):
                continue
            for name, ent in entries.items():
                if isinstance(ent, dict) and "packed" in ent:
                    why = provenance_problem(name, ent["packed"])
                    if why:
                        self.bad[name] = why
                    else:
                        self.prov[name] = ent["packed"]
        self.modules = sorted(n[: -len(SUFFIX) - 1] for n in ckpt.tensors if n.endswith(f".{SUFFIX}"))

    def shape(self, m: str) -> tuple[int, int]:
        """(N, K) of module m, from its provenance."""
        p = self.prov.get(f"{m}.{SUFFIX}")
        if p is None and f"{m}.{SUFFIX}" in self.bad:
            raise InputError(self.bad[f"{m}.{SUFFIX}"], tensor=f"{m}.{SUFFIX}",
                             hint="The shard header was edited or damaged; convert again.")
        if p is None:
            raise InputError(f"{m}.{SUFFIX}: no provenance in its shard header (int4pack.tensors)",
                             tensor=f"{m}.{SUFFIX}",
                             hint="The shard was not written by int4pack convert, or its header was rewritten.")
        return int(p["n"]), int(p["k"])

    def group(self, m: str) -> int:
        """Module m's group as packed (-1: channelwise), from its provenance."""
        n, k = self.shape(m)
        g = int(self.prov[f"{m}.{SUFFIX}"]["group_size"])
        return -1 if g in (-1, k) else g

    def block(self, m: str) -> int:
        return _block(self.shape(m)[1], self.group(m))

    def blob(self, m: str) -> torch.Tensor:
        return self.ckpt.get(f"{m}.{SUFFIX}")

    def decode(self, m: str, blob: torch.Tensor | None = None, check: bool = True):
        """(q int8 [N, K], scales bf16 [N, K/g] | fp32 [N, 1], bias fp32 [N] | None) of module m."""
        n, k = self.shape(m)
        blob = self.blob(m) if blob is None else blob
        return kleidiai.unpack(blob, n, k, self.block(m), bool(self.prov[f"{m}.{SUFFIX}"].get("bias")), check=check)

    def check_blob(self, m: str) -> tuple[list[str], tuple | None]:
        """Problems of module m's blob (size, inner consistency, provenance, repacking) and its decode."""
        name = f"{m}.{SUFFIX}"
        info = self.ckpt.tensors[name]
        twice = [f"{m}.{leaf}" for leaf in ("weight", "weight_scale", "bias") if f"{m}.{leaf}" in self.ckpt.tensors]
        if twice:
            return [f"stored twice: {', '.join(twice)} beside the blob (the packed format keeps the blob only)"], None
        try:
            n, k = self.shape(m)
        except InputError as e:
            return [str(e)], None
        g = self.block(m)
        size = kleidiai.packed_size(n, k, g)
        if info.dtype != "U8" or tuple(info.shape) != (size,):
            return [f"{info.dtype}{list(info.shape)}, expected U8[{size}] (the KleidiAI size for N={n}, K={k}, "
                    f"block {g}): truncated or another layout"], None
        blob = self.blob(m)
        want = self.prov[name].get("crc32")
        stored = [f"stored bytes differ from the ones convert wrote (CRC-32 {_crc(blob)} != {want})"] \
            if want is not None and _crc(blob) != want else []
        try:
            q, s, b = self.decode(m, blob)
        except InputError as e:
            return stored + [str(e)], None
        prov = self.prov[name]
        problems = stored + [f"decoded {what} differ from the ones it was packed from (CRC-32 {got} != {want})"
                    for what, got, want in (("int4 values", _crc(q), prov.get("crc32_q")),
                                            ("scales", _crc(s), prov.get("crc32_scales")),
                                            ("bias", _crc(b), prov.get("crc32_bias"))) if got != want]
        if not torch.equal(kleidiai.pack_portable(q, s, b, g, threads=1), blob):
            problems.append("repacking the decoded values does not give the same bytes")
        return problems, (q, s, b)
