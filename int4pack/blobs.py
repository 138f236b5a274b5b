"""The packed serving format on the converter's side: blobs planned, packed from a job's
outputs, read back and checked (verify). The records both sides read are in serve_spec.py.

The packed serving format (``convert --serve-format kleidiai``): each W4A8 linear stored as the
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
a multiple of 8. A dense vLLM module with a part of another N (Qwen3.5's linear-attention
``in_proj_a`` with N = 4, fused with ``in_proj_b`` into ``in_proj_ba``) stays plain W4A8: its int8
weights and scales are written as in the default format, named in the layout record's
``plain_modules``, and vLLM packs them at load (``plain_modules``); the rest is packed.

Tensor parallelism: vLLM splits each parallel linear and MoE layer either along N (column
parallel: q/k/v, gate/up, an expert's w13) or along K (row parallel: ``o_proj``, ``down_proj``, an
expert's w2). An N-split of a blob is a byte range when each rank's rows are a multiple of 8 (the
plugin slices it at load). A K-split is not: ``convert --tensor-parallel N`` stores every row
parallel module as ``[N, packed_size(rows, K/N)]``, rank r's blob in row r (the bias in rank 0's
only: vLLM adds a row parallel bias once), and records ``tensor_parallel_size`` in the layout
record so that the plugin refuses another size. With N = 1 nothing changes.
"""

from __future__ import annotations

import dataclasses
import json

from . import kleidiai
from .architectures import VLLM_FUSED, classify, vllm_module
from .families import moe_record
from ._lazy import torch
from .errors import InputError, RefusedError, UsageError
from .groups import block, channel_group, is_channelwise
from .plan import Job, OutTensor, Plan
from .serve_spec import (KLEIDIAI, PLAIN_MODULES, ROTARY, SUFFIX, crc, is_row_parallel, provenance,
                         provenance_problem, rotary_problem, rotary_rows, split_problem)

__all__ = ["pack_problem", "plain_modules", "plain_record", "moe_layers_record", "packed_plan", "job_packer", "blob_checks", "split_k", "pack_split", "PackedWeights"]


def blob_checks(packed: dict[str, dict], model_type: str | None = None) -> dict:
    """What the plugin checks at load, per module as vLLM builds it (``vllm_module``: one FusedMoE
    per MoE layer, qkv_proj, gate_up_proj, or the linear itself): the group each blob was packed
    with, and the CRC-32 of its stored bytes, in vLLM's shard order (experts: gate, up, down). A
    K-split blob's is the CRC-32 of its whole stored ``[tp, bytes]``, the tensor every rank is handed.
    ``packed``: output module name -> its provenance; ``model_type``: names modules by the prefix
    vLLM gives them (architectures.vllm_module)."""
    units: dict[str, dict] = {}
    for m, p in sorted(packed.items()):
        role, d = classify(m)
        unit = vllm_module(m, model_type)
        leaf = m.rsplit(".", 1)[-1]
        g = channel_group(p["k"], p["group_size"])
        if role == "expert":
            ent = units.setdefault(unit, {"group_size": g, "names": [None, None, None], "experts": {}})
            i = ("gate", "up", "down").index(d["proj"])
            ent["names"][i] = leaf
            ent["experts"].setdefault(d["e"], [None, None, None])[i] = p["crc32"]
        else:
            fused = unit.rsplit(".", 1)[-1]  # another leaf: vLLM's fused module (a prefix alone may differ)
            names = list(VLLM_FUSED.get(fused, ())) if fused != leaf else [leaf]
            ent = units.setdefault(unit, {"group_size": g, "names": names, "crc32": [None] * len(names)})
            ent["crc32"][names.index(leaf)] = p["crc32"]
            if ROTARY in p:  # the plugin undoes vLLM's reordering of this part's bytes
                ent.setdefault(ROTARY, [None] * len(names))[names.index(leaf)] = p[ROTARY]
        if ent["group_size"] != g:
            ent["group_size"] = "mixed"  # vLLM runs one scheme per module: the plugin refuses it
    for ent in units.values():
        if "experts" in ent:
            ex = ent.pop("experts")
            ent["crc32"] = [ex.get(e, [None, None, None]) for e in range(max(ex) + 1)]
    return {"algorithm": "crc32", "modules": units}


def split_k(q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, group_size: int, tp: int):
    """Rank r's (q, scales, bias, block) of a K-split: columns r*K/tp.., their groups' scales
    (channelwise: every rank keeps the row's scale), the bias on rank 0 only. A rank holding one
    group is channelwise for KleidiAI (group == K: torch packs and multiplies it so), its bf16
    scale as float32 (exact)."""
    n, k = q.shape
    kp = k // tp
    chan = is_channelwise(k, group_size)
    out = []
    for r in range(tp):
        qs = q[:, r * kp:(r + 1) * kp]
        ss = scales if chan else scales[:, r * kp // group_size:(r + 1) * kp // group_size]
        if not chan and kp == group_size:
            ss = ss.to(torch.float32)
        out.append((qs.contiguous(), ss.contiguous(), bias if r == 0 else None,
                    kp if chan or kp == group_size else group_size))
    return out


# --------------------------------------------------------------------------------- writing


def pack_problem(n: int, k: int, group_size: int, fused: bool = True) -> str | None:
    """Why an [N, K] W4A8 linear is not served as a KleidiAI blob, or None. ``fused``: vLLM loads it
    into one parameter with other modules (qkv_proj, in_proj_ba, an expert's w13)."""
    if n % kleidiai.NR:
        return (f"N={n} is not a multiple of {kleidiai.NR} (KleidiAI's row block), so its blob cannot be "
                + ("joined with the modules vLLM fuses it with" if fused else
                   "split into whole row blocks for tensor parallel ranks"))
    if group_size not in (-1, k) and k % group_size:
        return f"K={k} is not a multiple of the group size {group_size}"
    return None


def plain_modules(plan: Plan, model_type: str | None = None) -> dict[str, str]:
    """The dense W4A8 linears the packed format keeps as plain W4A8 (int8 weight and scale, packed by
    vLLM at load), each with why: every part of a vLLM module (qkv_proj, in_proj_ba...) one of whose
    parts KleidiAI cannot pack, since vLLM runs one method per module. A routed expert that cannot
    be packed is refused: the plugin's MoE method takes blobs only."""
    why: dict[str, str] = {}  # vLLM module -> the first part's problem
    units: dict[str, list[str]] = {}
    for j in plan.jobs:
        if j.kind not in ("linear", "fold"):
            continue
        for s in j.specs:
            role, _ = classify(s.name)
            unit = vllm_module(s.name, model_type)
            problem = pack_problem(s.n, s.k, j.group_size, fused=role == "expert" or vllm_module(s.name) != s.name)
            if problem and role == "expert":
                raise RefusedError(f"{s.name}: {problem}; int4pack's vLLM plugin serves routed experts as "
                                   "KleidiAI blobs only", tensor=s.name,
                                   hint="Use the default --serve-format compressed-tensors for this model.")
            units.setdefault(unit, []).append(s.name)
            if problem and unit not in why:
                why[unit] = f"{s.name.rsplit('.', 1)[-1]}: {problem}"
    return {m: why[u] for u, mods in units.items() if u in why for m in mods}


def _vllm_unit(module: str, model_type: str | None, rename: dict[str, str]) -> str:
    """The vLLM module a source module's tensors load into, after convert's renames for vLLM (of its
    plain weight or of its blob)."""
    for leaf in ("weight", SUFFIX):
        if f"{module}.{leaf}" in rename:
            return vllm_module(rename[f"{module}.{leaf}"][: -len(leaf) - 1], model_type)
    return vllm_module(module, model_type)


def plain_record(plain: dict[str, str], model_type: str | None, rename: dict[str, str]) -> dict[str, str]:
    """``plain_modules`` of the layout record: the vLLM modules kept as plain W4A8, with why."""
    return {_vllm_unit(m, model_type, rename): why for m, why in plain.items()}


def moe_layers_record(plan: Plan, model_type: str | None, text_config: dict, rename: dict[str, str]) -> dict:
    """``moe_layers`` of the layout record: each MoE layer's routing and activation as the model
    computes them (families.moe_record), by the vLLM module its experts load into; what the
    plugin routes and activates by."""
    facts = moe_record(model_type, text_config)
    out = {}
    for m in plan.layout.moe_layers:
        ent = facts.get(str(m.layer))
        if ent is not None and m.experts:
            out[_vllm_unit(next(iter(m.experts[min(m.experts)].values())), model_type, rename)] = ent
    return out


def packed_plan(plan: Plan, tensor_parallel: int = 1, model_type: str | None = None) -> Plan:
    """The plan with every W4A8 module's weight, weight_scale and bias replaced by one blob tensor
    (a row parallel module's: ``[tensor_parallel, bytes]``, one blob per rank, when > 1), but for
    the modules ``plain_modules`` names, whose outputs stay the plain format's (recorded in the
    plan's options as ``plain_modules``: module -> why)."""
    if tensor_parallel < 1:
        raise UsageError(f"--tensor-parallel {tensor_parallel}: must be at least 1")
    plain = plain_modules(plan, model_type)
    jobs = []
    for j in plan.jobs:
        if j.kind not in ("linear", "fold"):
            jobs.append(j)
            continue
        outs = []
        for s in j.specs:
            if s.name in plain:
                outs += [t for t in j.outputs if t.name.rsplit(".", 1)[0] == s.name]
                continue
            if tensor_parallel > 1 and is_row_parallel(s.name):
                why = split_problem(s.n, s.k, j.group_size, tensor_parallel)
                if why:
                    raise RefusedError(
                        f"{s.name}: [{s.n}, {s.k}] cannot be split along K for {tensor_parallel} tensor parallel "
                        f"ranks: {why}", tensor=s.name,
                        hint="Choose a --tensor-parallel size that divides K into whole groups, or a smaller "
                             "--group-size.")
                kp = s.k // tensor_parallel
                size = kleidiai.packed_size(s.n, kp, block(kp, j.group_size))
                outs.append(OutTensor(f"{s.name}.{SUFFIX}", "U8", (tensor_parallel, size)))
                continue
            size = kleidiai.packed_size(s.n, s.k, block(s.k, j.group_size))
            outs.append(OutTensor(f"{s.name}.{SUFFIX}", "U8", (size,)))
        jobs.append(dataclasses.replace(j, outputs=outs))
    opts = {**plan.options, "serve_format": KLEIDIAI}
    if tensor_parallel > 1:
        opts["tensor_parallel"] = tensor_parallel
    if plain:
        opts[PLAIN_MODULES] = plain
    return dataclasses.replace(plan, jobs=jobs, options=opts)


def pack_split(q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, group_size: int, tp: int,
               threads: int = 1) -> torch.Tensor:
    """uint8 [tp, bytes]: rank r's KleidiAI blob of the K-split matrix in row r."""
    blobs = [kleidiai.pack_portable(qs, ss, bs, block, threads=threads)
             for qs, ss, bs, block in split_k(q, scales, bias, group_size, tp)]
    return torch.stack(blobs)


def job_packer(tensor_parallel: int = 1, rotary=None, plain=()):
    """run_job outputs -> packed outputs: each W4A8 module's (weight, weight_scale[, bias]) becomes
    one blob, packed at its job's group (a row parallel module's: one per rank with
    ``tensor_parallel`` > 1); the module's stats gain its provenance (written to the shard header and
    report). ``rotary(module)``: the heads whose rows vLLM's model class reorders on load (Llama-4's
    q_proj / k_proj), or None; such a blob holds its rows in that order (``ROTARY`` in its provenance).
    ``plain``: modules whose tensors pass as they are (``plain_modules``)."""

    def pack(job: Job, tensors: list, stats: dict) -> list:
        if job.kind not in ("linear", "fold"):
            return tensors
        parts: dict[str, dict] = {}
        for name, t in tensors:
            mod, leaf = name.rsplit(".", 1)
            parts.setdefault(mod, {})[leaf] = t
        out = []
        for mod, p in parts.items():
            if mod in plain:
                out += [(f"{mod}.{leaf}", t) for leaf, t in p.items()]
                continue
            q, s, b = p["weight"], p["weight_scale"], p.get("bias")
            bias = None if b is None else b.to(torch.float32)
            heads = rotary(mod) if rotary is not None else None
            if heads is not None:
                why = rotary_problem(q.shape[0], None, heads) or (
                    "a bias (vLLM reorders none)" if b is not None else None)
                if why:
                    raise RefusedError(f"{mod}: vLLM reorders its rows for the rotary embedding on load, but {why}",
                                       tensor=mod, hint="Convert without --serve-format kleidiai.")
                q, s = rotary_rows(q, heads), rotary_rows(s, heads)
            tp = tensor_parallel if tensor_parallel > 1 and is_row_parallel(mod) else 1
            if tp > 1:
                blob = pack_split(q, s, bias, job.group_size, tp)
            else:
                blob = kleidiai.pack_portable(q, s, bias, block(q.shape[1], job.group_size), threads=1)
            prov = provenance(q, s, bias, job.group_size, blob, tp)
            if heads is not None:
                prov[ROTARY] = heads
            stats.setdefault(mod, {})["packed"] = prov
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
        return channel_group(k, g)

    def block(self, m: str) -> int:
        """Module m's group as the packer takes it (channelwise: its K, per rank for a K-split)."""
        n, k = self.shape(m)
        return block(k // self.split(m), self.group(m))

    def split(self, m: str) -> int:
        """How many rank blobs module m is stored as (1: one blob of the whole matrix)."""
        v = self.prov.get(f"{m}.{SUFFIX}", {}).get("tensor_parallel", 1)
        return int(v) if isinstance(v, int) and v >= 1 else 1

    def blob_shape(self, m: str) -> tuple[int, ...]:
        n, k = self.shape(m)
        tp = self.split(m)
        size = kleidiai.packed_size(n, k // tp, self.block(m))
        return (size,) if tp == 1 else (tp, size)

    def blob(self, m: str) -> torch.Tensor:
        return self.ckpt.get(f"{m}.{SUFFIX}")

    def decode(self, m: str, blob: torch.Tensor | None = None, check: bool = True, out: tuple | None = None):
        """(q int8 [N, K], scales bf16 [N, K/g] | fp32 [N, 1], bias fp32 [N] | None) of module m; of
        the whole matrix for a K-split one (its ranks' blobs joined along K). ``out``: (q, scales)
        buffers to decode into where it can (kleidiai.unpack); use what is returned."""
        n, k = self.shape(m)
        blob = self.blob(m) if blob is None else blob
        has_bias = bool(self.prov[f"{m}.{SUFFIX}"].get("bias"))
        tp = self.split(m)
        if tp == 1:
            return kleidiai.unpack(blob, n, k, self.block(m), has_bias, check=check, out=out)
        parts = [kleidiai.unpack(blob[r], n, k // tp, self.block(m), has_bias and r == 0, check=check)
                 for r in range(tp)]
        q = torch.cat([p[0] for p in parts], dim=1)
        if self.group(m) == -1:
            s = parts[0][1]
            if check and not all(torch.equal(p[1], s) for p in parts):
                raise InputError(f"{m}.{SUFFIX}: the rank blobs of a channelwise matrix hold different scales",
                                 tensor=f"{m}.{SUFFIX}", hint="Convert again.")
        else:  # a rank of one group decodes as channelwise (float32 [N, 1]): back to the bf16 it was
            s = torch.cat([p[1].to(torch.bfloat16) for p in parts], dim=1)
        return q, s, parts[0][2]

    def check_blob(self, m: str, scratch: dict | None = None, into: tuple | None = None
                   ) -> tuple[list[str], tuple | None]:
        """Problems of module m's blob (size, inner consistency, provenance, repacking) and its decode.
        ``scratch``: a dict of the calling thread's buffers (verify_blob's): the read, decode, repack
        and comparison then run in them, in one C++ call, and the decode returned lives there (or in
        ``into``, (q, scales) buffers of the caller's, where the one call runs)."""
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
        tp = self.split(m)
        want = self.blob_shape(m)
        if info.dtype != "U8" or tuple(info.shape) != want:
            split = f", split along K for {tp} ranks" if tp > 1 else ""
            return [f"{info.dtype}{list(info.shape)}, expected U8{list(want)} (the KleidiAI size for N={n}, K={k}, "
                    f"block {g}{split}): truncated or another layout"], None
        lib = _kernels() if scratch is not None and tp == 1 else None
        if lib is not None:
            by_size = scratch.setdefault("blobs", {})  # the blobs as read, one buffer per size
            if info.nbytes not in by_size and len(by_size) >= 8:
                by_size.clear()
            by_size[info.nbytes] = blob = self.ckpt.get(name, out=by_size.get(info.nbytes))
            return self._checked_in_one(lib, m, blob, scratch, into)
        blob = self.blob(m)
        want = self.prov[name].get("crc32")
        stored = [f"stored bytes differ from the ones convert wrote (CRC-32 {crc(blob)} != {want})"] \
            if want is not None and crc(blob) != want else []
        try:
            q, s, b = self.decode(m, blob)
        except InputError as e:
            return stored + [str(e)], None
        prov = self.prov[name]
        problems = stored + [f"decoded {what} differ from the ones it was packed from (CRC-32 {got} != {want})"
                    for what, got, want in (("int4 values", crc(q), prov.get("crc32_q")),
                                            ("scales", crc(s), prov.get("crc32_scales")),
                                            ("bias", crc(b), prov.get("crc32_bias"))) if got != want]
        again = (kleidiai.pack_portable(q, s, b, g, threads=1) if tp == 1
                 else pack_split(q, s, b, self.group(m), tp))
        if not torch.equal(again, blob):
            problems.append("repacking the decoded values does not give the same bytes")
        return problems, (q, s, b)

    def _checked_in_one(self, lib, m: str, blob: torch.Tensor, scratch: dict,
                        into: tuple | None = None) -> tuple[list[str], tuple | None]:
        """check_blob of a one-rank blob, its CRC-32s, decode with its checks, repack and comparison in
        one C++ call: the same checks, in the same order, with the same messages."""
        n, k = self.shape(m)
        g = self.block(m)
        prov = self.prov[f"{m}.{SUFFIX}"]
        try:
            kleidiai.check_blob(blob, n, k, g)  # what unpack refuses first
        except InputError as e:
            return [str(e)], None  # (check_blob's size check makes this unreachable)
        bad, crcs, q, s, b = lib.verify_blob(blob, n, k, g, bool(prov.get("bias")), scratch.setdefault("decode", {}),
                                             into=into)
        want = prov.get("crc32")
        problems = [f"stored bytes differ from the ones convert wrote (CRC-32 {crcs[0]} != {want})"] \
            if want is not None and crcs[0] != want else []
        if bad & ~_REPACK_DIFFERS:
            return problems + [kleidiai.unpack_problem(bad, n, k, g)], None
        problems += [f"decoded {what} differ from the ones it was packed from (CRC-32 {got} != {want})"
                     for what, got, want in (("int4 values", crcs[1], prov.get("crc32_q")),
                                             ("scales", crcs[2], prov.get("crc32_scales")),
                                             ("bias", crcs[3], prov.get("crc32_bias"))) if got != want]
        if bad & _REPACK_DIFFERS:
            problems.append("repacking the decoded values does not give the same bytes")
        return problems, (q, s, b)


_REPACK_DIFFERS = 64  # verify_blob's bit: the decode's checks passed, its repacked bytes differ


def _kernels():
    from . import _ext  # here: the plugin reads blobs without the C++ library

    return _ext.load("kleidiai_pack")
