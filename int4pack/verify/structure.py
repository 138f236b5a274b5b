"""The structural half of ``verify``: is a converted checkpoint complete and well formed?

Reads the config, index and shard headers (and the int4 tensors' values) of a W4A8 output, plain
or in the packed serving format, and collects every problem instead of stopping at the first, so a
user sees the whole list at once. The numerical half (the package's __init__.py) runs the kernels on what this
module has found.

Long: the output view (Target) and the checks of what it reads share one problem list per module,
so a module's problems are gathered as its tensors are read, in one pass over the headers.
"""

from __future__ import annotations

import json
import math
from collections import Counter

import torch

from .. import _ext, blobs, kernels, kleidiai
from ..serving import expert_layout
from ..architectures import classify, moe_config, routers, vllm_module
from ..sources.checkpoint import Checkpoint
from ..errors import InputError
from ..formats.compressed_tensors import CompressedTensorsReader
from ..groups import check_group_size
from ..serve_spec import (BLOB_CHECKS, QUANT_METHOD, ROTARY, SUFFIX, is_row_parallel, read_record, record_problems,
                         tensor_parallel_size)
from ..w4a8 import dequantize_w4a8
from .threads import PerThread
from .tolerance import MAX_SCALE
from .checkpoint_checks import check_config_index, check_layers, layer_index
from .shard_scan import check_copy_checksums, check_hashes, finish_scan, scan

__all__ = ["Problems", "Target", "check_structure", "layer_index"]


class Problems:
    """Every structural problem found, each with where it is and what is wrong."""

    def __init__(self):
        self.items: list[dict] = []

    def add(self, where: str, message: str) -> None:
        self.items.append({"where": where, "message": message})

    def __bool__(self) -> bool:
        return bool(self.items)



class Target:
    """The converted checkpoint: W4A8 scheme from its config, quantised modules, MoE layers."""

    def __init__(self, ckpt: Checkpoint, problems: Problems):
        self.ckpt = ckpt
        q = ckpt.quant_config or {}
        groups = q.get("config_groups") or {}
        rec = read_record(q)
        if q.get("quant_method") not in ("compressed-tensors", QUANT_METHOD) or not groups:
            raise InputError(f"{ckpt.folder}: not a compressed-tensors W4A8 checkpoint "
                             f"(quant_method {q.get('quant_method')!r})",
                             hint="verify checks int4pack's output: convert this checkpoint first "
                                  "(int4pack convert SRC OUT), then run int4pack verify OUT --against SRC.")
        if not isinstance(groups, dict):
            raise InputError(f"{ckpt.folder}: quantization_config.config_groups is a {type(groups).__name__}, "
                             "not an object", hint="verify checks int4pack's output; the config was edited.")
        for gname, grp in groups.items():
            if not isinstance(grp, dict) or not all(isinstance(grp.get(f) or {}, dict)
                                                    for f in ("weights", "input_activations")):
                raise InputError(f"{ckpt.folder}: quantization_config.config_groups.{gname} is not an object of "
                                 "objects (weights, input_activations)", hint="The config was edited; convert again.")
            w = grp.get("weights") or {}
            a = grp.get("input_activations") or {}
            fmt = grp.get("format") or q.get("format")
            where = "config" if len(groups) == 1 else f"config group {gname}"
            if fmt != "int-quantized":
                problems.add(where, f"format {fmt!r}, expected 'int-quantized' (vLLM's W4A8 int layout)")
            if w.get("num_bits") != 4 or w.get("type") != "int" or not w.get("symmetric", False):
                problems.add(where, f"weights must be 4-bit symmetric int, config says {w}")
            if a.get("num_bits") != 8 or a.get("strategy") != "token" or not a.get("dynamic"):
                problems.add(where, "input_activations must be 8-bit dynamic per token (vLLM's W4A8 detection)")
        self.ignore = list(q.get("ignore") or [])
        for why in record_problems(rec) if rec else []:
            problems.add("config", f"quantization_config.kleidiai: {why}")
        self.packed = blobs.PackedWeights(ckpt, rec) if rec else None  # None: int8 weights and scales
        self.ranges: dict[str, tuple[int, int]] = {}  # int8 tensor -> (min, max), from the shard scan
        # a packed checkpoint keeps as int8 weights and scales the modules KleidiAI cannot pack
        # (the layout record's plain_modules): each module is checked as it is stored
        self.blobs = set(self.packed.modules) if self.packed else set()
        self.modules = sorted(self.blobs | {n[: -len(".weight_scale")] for n in ckpt.tensors
                                            if n.endswith(".weight_scale")})
        # a model class's own per-expert layout (gpt-oss: expert_layout.py): checked as int4pack's modules
        self.views = {} if self.packed else expert_layout.views(
            self.modules, {n: tuple(i.shape) for n, i in ckpt.tensors.items() if n.endswith(".weight")})
        if self.views:
            self.stored = {v.stored for v in self.views.values()}
            self.modules = sorted((set(self.modules) - self.stored) | set(self.views))
        else:
            self.stored = set()
        self.groups = _module_groups(ckpt, q, self.modules, problems)
        moe, unusable = moe_config(ckpt.model_type, ckpt.family_type, ckpt.text_config)
        for why in unusable:
            problems.add("config", why)
        self.num_experts, self.top_k, self.routing = moe.num_experts, moe.top_k, moe.routing
        self.norm_offset, self.norm_topk, self.activation = moe.norm_offset, moe.renormalize, moe.activation
        self.layers: dict[str, dict[int, dict[str, str]]] = {}
        self.roles: dict[str, str] = {}
        for m in self.modules:
            role, d = classify(m)
            self.roles[m] = role
            if role == "expert":
                self.layers.setdefault(d["moe"], {}).setdefault(d["e"], {})[d["proj"]] = m
        self.routers = routers(ckpt.tensors)
        self.scratch = PerThread(dict)  # each thread's blob buffers (PackedWeights.check_blob)
        self.checked: dict[str, tuple[list[dict], dict]] = {}  # module -> its structural check, run on the way

    def is_blob(self, m: str) -> bool:
        """Whether module m is stored as a KleidiAI blob (else int8 weight and scales)."""
        return m in self.blobs

    def group_for(self, m: str) -> int:
        """Module m's group from its config group; a group equal to K is channelwise."""
        g, k = self.groups.get(m, -1), self.shape(m)[1]
        return -1 if g in (-1, k) else g

    def moe_group(self, slot: dict[str, str]) -> int:
        """The one group vLLM's MoE kernel runs for an expert's w13 and w2 (channel only if both are)."""
        a, b = self.group_for(slot["gate"]), self.group_for(slot["down"])
        return a if a == b else self.groups.get(slot["gate"], -1)

    def weight(self, m: str) -> tuple[torch.Tensor, torch.Tensor, int]:
        if self.is_blob(m):
            dec = self._checked_decode(m)
            # (copies: the decode lives in the thread's scratch, which the next module reuses)
            q, s = (dec[0].clone(), dec[1].clone()) if dec is not None else \
                self.packed.decode(m, check=False)[:2]  # checked in the structural pass
        elif m in self.views:
            v = self.views[m]
            q, s = (v.rows(self.ckpt.get(f"{v.stored}.{x}")) for x in ("weight", "weight_scale"))
        else:
            q = self.ckpt.get(f"{m}.weight")
            s = self.ckpt.get(f"{m}.weight_scale")
            self._check_read(m, q, s)
        return q, s, self.group_for(m)

    def weight_spec(self, m: str) -> tuple[int, int, torch.dtype, int] | None:
        """(N, K, scale dtype, scale columns) of module m's ``weight`` as ``weight_into`` writes it; None
        where it does not (a model's own per-expert layout, a blob split for tensor parallelism)."""
        if self.is_blob(m):
            if self.packed.split(m) != 1:
                return None
            n, k = self.packed.shape(m)
            g = self.packed.group(m)
            return (n, k, torch.float32, 1) if g == -1 else (n, k, torch.bfloat16, k // g)
        if m in self.views:
            return None
        wi, si = self.ckpt.tensors.get(f"{m}.weight"), self.ckpt.tensors.get(f"{m}.weight_scale")
        if wi is None or si is None or wi.dtype != "I8" or len(wi.shape) != 2 or len(si.shape) != 2 \
                or si.dtype not in ("BF16", "F32") or si.shape[0] != wi.shape[0]:
            return None
        return wi.shape[0], wi.shape[1], torch.bfloat16 if si.dtype == "BF16" else torch.float32, si.shape[1]

    def weight_into(self, m: str, q: torch.Tensor, s: torch.Tensor, scratch: dict | None = None) -> None:
        """``weight(m)``'s int4 values and scales written into q and s (shaped as ``weight_spec`` says):
        read or decoded straight into them, copied where that cannot be. ``scratch``: a dict whose
        uint8 buffers (by size) a packed module's blob is read into."""
        dec = self._checked_decode(m, (q, s)) if self.is_blob(m) and scratch is not None else None
        if dec is not None:
            qq, ss = dec[0], dec[1]
        elif self.is_blob(m):
            blob = None
            if scratch is not None:
                info = self.ckpt.tensors[f"{m}.{SUFFIX}"]
                blob = scratch[info.nbytes] = self.ckpt.get(f"{m}.{SUFFIX}", out=scratch.get(info.nbytes))
            qq, ss, _ = self.packed.decode(m, blob, check=False, out=(q, s))  # checked in the structural pass
        else:
            qq, ss = self.ckpt.get(f"{m}.weight", out=q), self.ckpt.get(f"{m}.weight_scale", out=s)
            self._check_read(m, qq, ss)
        for dst, src in ((q, qq), (s, ss)):
            if src.data_ptr() != dst.data_ptr():
                dst.copy_(src.reshape(dst.shape))

    def _check_read(self, m: str, q: torch.Tensor, s: torch.Tensor) -> None:
        """The structural pass's check of plain module m, run on its values and scales as read here."""
        if m not in self.checked:
            items, counts, _ = _module_problems(self, m, (q, s))
            self.checked[m] = (items, counts)

    def _checked_decode(self, m: str, into: tuple | None = None) -> tuple | None:
        """The structural pass's check of packed module m, run here on the blob as read (recorded in
        ``checked``): its decode (into ``into`` where it can), or None (a blob split for tensor
        parallelism, or one that fails)."""
        if self.packed.split(m) != 1 or m in self.checked:
            return None
        items, counts, dec = _module_problems(self, m, into=into)
        self.checked[m] = (items, counts)
        return dec

    def shape(self, m: str) -> tuple[int, int]:
        if m in self.views:
            v = self.views[m]
            return v.hi - v.lo, self.ckpt.tensors[f"{v.stored}.weight"].shape[0]
        if self.is_blob(m):
            return self.packed.shape(m)
        info = self.ckpt.tensors.get(f"{m}.weight")
        if info is None:
            raise InputError(f"{m}.weight: missing (its weight_scale is there)", tensor=f"{m}.weight",
                             hint="The checkpoint lost a tensor; convert again.")
        return tuple(info.shape)

    def stored_names(self, m: str) -> set[str]:
        """The output tensors module m's weight, scales and bias live in."""
        return self.views[m].names() if m in self.views else {f"{m}.{x}" for x in ("weight", "weight_scale", "bias")}

    def read_names(self, m: str) -> set[str]:
        """The output tensors the numerical pass reads for module m (its blob, or weight and scales)."""
        if self.is_blob(m):
            return {f"{m}.{SUFFIX}"}
        return self.views[m].names() if m in self.views else {f"{m}.weight", f"{m}.weight_scale"}

    def prefetch(self, mods) -> None:
        """Start reading what the numerical pass will read of these modules (a hint; a ``Tapped``
        checkpoint takes it)."""
        hint = getattr(self.ckpt, "prefetch", None)
        if hint is not None:
            hint([n for m in mods for n in self.read_names(m)])

    def place(self, m: str) -> tuple[str, int]:
        """(shard, offset) of the first byte of module m the numerical pass reads."""
        tensors = self.ckpt.tensors
        return min(((tensors[n].file, tensors[n].begin) for n in self.read_names(m) if n in tensors),
                   default=("", 0))

    def bias(self, m: str) -> torch.Tensor | None:
        """Module m's bias as stored (plain output), or None."""
        v = self.views.get(m)
        name = f"{v.stored}.bias" if v else f"{m}.bias"
        if name not in self.ckpt.tensors:
            return None
        return v.rows(self.ckpt.get(name)) if v else self.ckpt.get(name)

    def rotary_heads(self, m: str) -> int | None:
        """The heads whose rows module m's blob holds in vLLM's Llama-4 rotary order (its provenance's
        ``ROTARY``), or None: the source's rows compare to it in that order."""
        if not self.is_blob(m):
            return None
        return self.packed.prov.get(f"{m}.{SUFFIX}", {}).get(ROTARY)

    def blob(self, m: str) -> torch.Tensor | None:
        """Module m's blob as stored, where torch's KleidiAI path can run it; else None (pack on the fly).
        Not one with a bias inside: the references here leave biases out; none of a checkpoint split
        for tensor parallelism: its row parallel blobs are per rank (the kernel runs whole matrices)."""
        if not (self.is_blob(m) and kleidiai.native_kleidiai_available()) or tensor_parallel_size(self.packed.record) != 1:
            return None
        return None if self.packed.prov.get(f"{m}.{SUFFIX}", {}).get("bias") else self.packed.blob(m)

    def dequant(self, m: str) -> torch.Tensor:
        q, s, g = self.weight(m)
        return dequantize_w4a8(q, s, g)


def _module_groups(ckpt: Checkpoint, q: dict, modules: list[str], problems: Problems) -> dict[str, int]:
    """Each module's group from the config group whose targets name it (vLLM resolves one per module:
    a module named by two groups, or by none, is a problem)."""
    schemes = CompressedTensorsReader(ckpt, q).schemes
    out = {}
    for m in modules:
        ranked = sorted((r, i) for i, sc in enumerate(schemes) if (r := sc.match_rank(m)) is not None)
        if not ranked:
            problems.add(m, "no quantization_config group targets this module (vLLM would not quantise it)")
            continue
        if len(ranked) > 1 and ranked[1][0] == ranked[0][0]:
            problems.add(m, f"targeted by config groups {schemes[ranked[0][1]].name} and "
                            f"{schemes[ranked[1][1]].name}: one scheme per module")
        sc = schemes[ranked[0][1]]
        out[m] = -1 if sc.strategy == "channel" else int(sc.group_size or -1)
    return out


# --------------------------------------------------------------------------------- structural


def _check_module(t: Target, m: str, problems: Problems, counts: dict, got: tuple | None = None,
                  into: tuple | None = None) -> tuple | None:
    """Module m's structural checks; a packed module's decode (values, scales, bias) when it decodes.
    ``got``: a plain module's (int4 values, scales) as the caller read them; ``into``: (q, scales)
    buffers a packed module's blob may decode into."""
    ck = t.ckpt
    if t.is_blob(m):
        probs, dec = t.packed.check_blob(m, t.scratch.get(), into)
        tp = tensor_parallel_size(t.packed.record)
        want = tp if is_row_parallel(m) else 1  # vLLM splits only row parallel modules along K
        if t.packed.split(m) != want:
            probs.append(f"stored for {t.packed.split(m)} tensor parallel rank(s), the config records "
                         f"tensor_parallel_size {tp or 'unreadable'} (row parallel modules split, others whole)")
        for p in probs:
            problems.add(f"{m}.{SUFFIX}", p)
        if dec is not None:
            counts["blobs"] += 1
            rg = t.packed.record.get("group_size")
            if type(rg) is int and rg != t.packed.group(m) and not (rg == t.packed.shape(m)[1]
                                                                    and t.packed.group(m) == -1):
                problems.add(f"{m}.{SUFFIX}", f"packed with group {t.packed.group(m)}, but the layout record's "
                                                 f"group_size is {rg}")
            why = _blob_check_problem(t, m)
            if why:
                problems.add(f"{m}.{SUFFIX}", why)
            if t.packed.group(m) != t.group_for(m):
                problems.add(f"{m}.{SUFFIX}", f"packed with group {t.packed.group(m)}, but the config's group "
                                                 f"for the module is {t.group_for(m)} (-1: channel)")
            # a blob's values are 4-bit fields minus 8: in [-8, 7] by construction, no range to check
            _check_values(m, f"{m}.{SUFFIX}", f"{m}.{SUFFIX} (scales)", None, dec[1], problems, counts,
                          dec[0].numel())
        return dec
    if m in t.views:
        _check_view(t, m, problems, counts)
        return
    wn, sn = f"{m}.weight", f"{m}.weight_scale"
    if wn not in ck.tensors:
        problems.add(m, f"{sn} present but {wn} missing")
        return
    wi, si = ck.tensors[wn], ck.tensors[sn]
    if wi.dtype != "I8" or len(wi.shape) != 2:
        problems.add(m, f"{wn}: {wi.dtype}{list(wi.shape)}, expected int8 [N, K]")
        return
    n, k = wi.shape
    g = t.group_for(m)
    want_dt, groups = _want_scales(m, g, k, problems)
    want_shape = (n, groups)
    if si.dtype != want_dt or tuple(si.shape) != want_shape:
        problems.add(m, f"{sn}: {si.dtype}{list(si.shape)}, expected {want_dt}{list(want_shape)} "
                        f"({'channel' if g == -1 else f'group {g}'}); another dtype makes torch fall back silently")
        return
    q, s = got or (t.ranges.get(wn) or ck.get(wn), ck.get(sn))
    _check_values(m, wn, sn, q, s, problems, counts, wi.numel)
    return None


def _want_scales(m: str, g: int, k: int, problems: Problems) -> tuple[str, int]:
    """The scale dtype and the number of scale groups along K of a module of group g (-1: channel)."""
    if g == -1:
        return "F32", 1
    why = check_group_size(g, k)
    if why:
        problems.add(m, f"group size {g} invalid for K={k}: {why}")
    return "BF16", (k // g if k % g == 0 else -1)


def _check_view(t: Target, m: str, problems: Problems, counts: dict) -> None:
    """A module stored transposed inside a per-expert tensor of its model's own layout (expert_layout.py)."""
    ck, v = t.ckpt, t.views[m]
    wn, sn = f"{v.stored}.weight", f"{v.stored}.weight_scale"
    if sn not in ck.tensors:
        problems.add(m, f"{wn} present but {sn} missing")
        return
    wi, si = ck.tensors[wn], ck.tensors[sn]
    if wi.dtype != "I8" or len(wi.shape) != 2:
        problems.add(m, f"{wn}: {wi.dtype}{list(wi.shape)}, expected int8 [K, N] (stored transposed)")
        return
    k = wi.shape[0]
    g = t.group_for(m)
    want_dt, want_rows = _want_scales(m, g, k, problems)
    if si.dtype != want_dt or tuple(si.shape) != (want_rows, wi.shape[1]):
        problems.add(m, f"{sn}: {si.dtype}{list(si.shape)}, expected {want_dt}{[want_rows, wi.shape[1]]} "
                        f"({'channel' if g == -1 else f'group {g}'}, stored transposed)")
        return
    q, s, _ = t.weight(m)
    _check_values(m, wn, sn, q, s, problems, counts)


def _blob_check_problem(t: Target, m: str) -> str | None:
    """The layout record's blob_checks entry of module m (what the plugin checks at load) against
    the blob's provenance; None when they agree or the record has no checks (noted by verify)."""
    checks = t.packed.record.get(BLOB_CHECKS)
    if not isinstance(checks, dict):
        return None
    prov = t.packed.prov[f"{m}.{SUFFIX}"]
    unit = vllm_module(m, t.ckpt.family_type)
    ent = (checks.get("modules") or {}).get(unit) if isinstance(checks.get("modules"), dict) else None
    if not isinstance(ent, dict):
        return f"quantization_config.kleidiai.{BLOB_CHECKS} has no entry {unit!r} (the plugin refuses it)"
    try:
        role, d = classify(m)
        leaf = m.rsplit(".", 1)[-1]
        if role == "expert":
            i = ("gate", "up", "down").index(d["proj"])
            want, name_ok = ent["crc32"][d["e"]][i], ent["names"][i] == leaf
        else:
            i = ent["names"].index(leaf)
            want, name_ok = ent["crc32"][i], True
    except (KeyError, IndexError, TypeError, ValueError):
        return f"quantization_config.kleidiai.{BLOB_CHECKS}[{unit!r}] does not list this blob"
    g = -1 if prov["group_size"] in (-1, prov["k"]) else prov["group_size"]
    if not name_ok or ent.get("group_size") != g or (prov.get("crc32") is not None and want != prov["crc32"]):
        return (f"quantization_config.kleidiai.{BLOB_CHECKS}[{unit!r}] disagrees with the blob's provenance "
                f"(group {ent.get('group_size')!r} vs {g}, CRC-32 {want!r} vs {prov.get('crc32')!r})")
    return None


def _check_values(m: str, wn: str, sn: str, q, s: torch.Tensor, problems: Problems, counts: dict,
                  numel: int = 0) -> None:
    """q: the int4 values, or (min, max) of the int8 tensor ``wn`` (of ``numel`` values) as the
    shard scan found them, or None for values that cannot leave [-8, 7] (``numel`` of them)."""
    vk = _ext.load("verify_kernels")
    if q is None:
        lo, hi = -8, 7
    elif isinstance(q, tuple):
        lo, hi = q
    elif vk is not None and q.dtype == torch.int8 and q.is_contiguous():
        lo, hi = vk.int8_range(q)
    else:
        lo, hi = (int(v) for v in torch.aminmax(q)) if q.numel() else (0, 0)
    if lo < -8 or hi > 7:
        problems.add(m, f"{wn}: values in [{lo}, {hi}], outside int4 [-8, 7]")
    # one reduction when all is well (a NaN makes both bounds NaN): the counts only for a problem
    lo_s, hi_s = (float(v) for v in torch.aminmax(s)) if s.numel() else (1.0, 1.0)
    if lo_s > 0 and hi_s <= MAX_SCALE:
        pass
    elif not bool(torch.isfinite(s).all()):
        problems.add(m, f"{sn}: {int((~torch.isfinite(s)).sum())} non-finite scale(s)")
    elif float(s.min()) <= 0:
        problems.add(m, f"{sn}: {int((s <= 0).sum())} scale(s) <= 0 (symmetric scales must be positive)")
    else:
        problems.add(m, f"{sn}: {int((s > MAX_SCALE).sum())} scale(s) above {MAX_SCALE:g} (largest {hi_s:.3g}): no "
                        "model's weights are that large; the scales are damaged")
    counts["modules"] += 1
    counts["int_values"] += numel if q is None or isinstance(q, tuple) else q.numel()


def _read_report(ckpt: Checkpoint, problems: Problems) -> dict | None:
    """convert's int4pack_report.json, or None (a problem when it is there but unusable)."""
    rp = ckpt.folder / "int4pack_report.json"
    if not rp.is_file():
        return None
    try:
        report = json.loads(rp.read_text())
    except (OSError, json.JSONDecodeError) as e:
        problems.add("int4pack_report.json", f"unreadable ({e})")
        return None
    if not isinstance(report, dict):
        problems.add("int4pack_report.json", f"a JSON {type(report).__name__}, not an object")
        return None
    return report


def _module_problems(t: Target, m: str, got: tuple | None = None,
                     into: tuple | None = None) -> tuple[list[dict], dict, tuple | None]:
    """One module's structural problems, counts and decode (on its own: modules are checked in parallel)."""
    problems = Problems()
    counts = {"modules": 0, "int_values": 0, "blobs": 0}
    with kernels.threads_here(1):
        dec = _check_module(t, m, problems, counts, got, into)
    return problems.items, counts, dec


def _module_check(t: Target, m: str, checked: dict) -> tuple[list[dict], dict]:
    if m in checked:
        return checked[m]
    items, counts, _ = _module_problems(t, m)
    return items, counts


def check_structure(ckpt: Checkpoint, pool=None, scanned: dict | None = None,
                    checked: dict | None = None, say=None) -> tuple[Target, Problems, dict, dict | None]:
    """Run every structural check on an opened checkpoint: (target, problems, counts, convert's report).
    ``pool`` (a ThreadPoolExecutor): modules and shards are checked on its threads; the problems
    are listed in the same order as one thread lists them. ``scanned``: what ``scan`` read while
    the numerical pass ran (the rest comes from a ``Tapped`` checkpoint's taps, or is read now);
    ``checked``: modules the numerical pass checked on its way (``Target.checked``); ``say``: called
    with a line of where the pass is (the shards' checksums, then each layer whose modules are done)."""
    say = say or (lambda what: None)
    problems = Problems()
    t = Target(ckpt, problems)
    counts = {"modules": 0, "int_values": 0, "blobs": 0, "moe_layers": len(t.layers),
              "experts": sum(len(v) for v in t.layers.values())}
    problems_before = len(problems.items)
    report = _read_report(ckpt, problems)
    # every byte read once: the checksums and int8 ranges from the numerical pass's reads (taps)
    # and the scan of the rest; a module the numerical pass checked where it read it is not
    # checked again (the others read their small tensors, or blobs from the page cache)
    scanned = scanned or scan(ckpt, report, pool)
    digests, t.ranges = finish_scan(ckpt, pool, scanned, getattr(ckpt, "taps", {}))
    report_problems = problems.items[problems_before:]
    del problems.items[problems_before:]
    left = Counter(i for i in map(layer_index, t.modules) if i >= 0)  # each layer's modules not yet checked
    done, n_layers = 0, len(left)
    say(f"structure: checking {len(t.modules)} modules")
    for m, (items, c) in zip(t.modules, _each(pool, _module_check, [(t, m, checked or {}) for m in t.modules])):
        problems.items += items
        for key, v in c.items():
            counts[key] += v
        i = layer_index(m)
        left[i] -= 1
        if i >= 0 and not left[i]:
            done += 1
            say(f"structure: layers {done}/{n_layers}")
    check_layers(t, problems)
    check_config_index(t, problems)
    problems.items += report_problems  # listed where they always were: after the module checks
    check_hashes(ckpt, problems, report, digests)
    check_copy_checksums(ckpt, problems, scanned)
    return t, problems, counts, report



def _each(pool, fn, items: list):
    """fn(*item) for each item, in order, each result as it is ready (on the pool's threads)."""
    if pool is None:
        for it in items:
            yield fn(*it)
        return
    futs = [pool.submit(fn, *it) for it in items]
    try:
        for f in futs:
            yield f.result()
    finally:
        for f in futs:
            f.cancel()
