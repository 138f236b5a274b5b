"""verify's structural checks of one module of a W4A8 output: its tensors' dtypes and shapes, its
int4 values in [-8, 7], its scales finite, positive and not absurdly large; a packed module's blob
against its provenance, the layout record and the config's group.

``ModuleChecks`` is the ``watch`` of a ``W4A8Output``: a module the numerical pass reads is checked
on the values it read, once (a packed module's blob is checked and decoded in one C++ call, and the
view computes on that decode); the structural pass asks it for every module (``of``), and the
modules nobody read yet are read and checked then (an int8 tensor's range from the shard scan,
``ranges``, instead of its bytes).
"""

from __future__ import annotations

import torch

from .. import _ext, kernels
from ..architectures import classify, vllm_module
from ..groups import MAX_SCALE, channel_group, check_group_size, group_name, is_channel, scale_st_dtype
from ..serve_spec import BLOB_CHECKS, SUFFIX, is_row_parallel, tensor_parallel_size
from .threads import PerThread
from .w4a8_output import ReadWatch, W4A8Output

__all__ = ["Problems", "ModuleChecks", "COUNTS"]

COUNTS = ("modules", "int_values", "blobs")  # what the module checks count, summed in the report


class Problems:
    """Every structural problem found, each with where it is and what is wrong."""

    def __init__(self):
        self.items: list[dict] = []

    def add(self, where: str, message: str) -> None:
        self.items.append({"where": where, "message": message})

    def __bool__(self) -> bool:
        return bool(self.items)


class ModuleChecks(ReadWatch):
    """The module checks of one ``W4A8Output``, run on what it reads (it becomes the output's watch)."""

    def __init__(self, output: W4A8Output):
        self.output = output
        self.ranges: dict[str, tuple[int, int]] = {}  # int8 tensor -> (min, max), from the shard scan
        self.scratch = PerThread(dict)  # each thread's blob buffers (PackedWeights.check_blob)
        self.done: dict[str, tuple[list[dict], dict]] = {}  # module -> its problems and counts, checked on the way
        output.watch = self

    def values(self, m: str, q: torch.Tensor, s: torch.Tensor) -> None:
        if m not in self.done:
            self.done[m] = self._run(m, (q, s))[:2]

    def decode(self, m: str, into: tuple | None = None) -> tuple | None:
        if m in self.done:
            return None
        items, counts, dec = self._run(m, into=into)
        self.done[m] = (items, counts)
        return dec

    def of(self, m: str) -> tuple[list[dict], dict]:
        """Module m's problems and counts: as checked on the way, or checked now."""
        return self.done[m] if m in self.done else self._run(m)[:2]

    def _run(self, m: str, got: tuple | None = None,
             into: tuple | None = None) -> tuple[list[dict], dict, tuple | None]:
        """One module's problems, counts and decode (on its own: modules are checked in parallel).
        ``got``: a plain module's (int4 values, scales) as read; ``into``: (q, scales) buffers a
        packed module's blob may decode into."""
        problems = Problems()
        counts = dict.fromkeys(COUNTS, 0)
        with kernels.threads_here(1):
            if self.output.is_blob(m):
                return problems.items, counts, self._blob(m, problems, counts, into)
            self._stored(m, problems, counts, got)
        return problems.items, counts, None

    def _blob(self, m: str, problems: Problems, counts: dict, into: tuple | None) -> tuple | None:
        """A packed module's blob (size, decode, provenance, repacking), its tensor parallel split, its
        group against the layout record and the config; its decode (values, scales, bias)."""
        packed, name = self.output.packed, f"{m}.{SUFFIX}"
        probs, dec = packed.check_blob(m, self.scratch.get(), into)
        tp = tensor_parallel_size(packed.record)
        want = tp if is_row_parallel(m) else 1  # vLLM splits only row parallel modules along K
        if packed.split(m) != want:
            probs.append(f"stored for {packed.split(m)} tensor parallel rank(s), the config records "
                         f"tensor_parallel_size {tp or 'unreadable'} (row parallel modules split, others whole)")
        for p in probs:
            problems.add(name, p)
        if dec is None:
            return None
        counts["blobs"] += 1
        rg, g = packed.record.get("group_size"), packed.group(m)
        if type(rg) is int and channel_group(packed.shape(m)[1], rg) != g:
            problems.add(name, f"packed with group {g}, but the layout record's group_size is {rg}")
        why = _blob_check_problem(self.output, m)
        if why:
            problems.add(name, why)
        if g != self.output.group_for(m):
            problems.add(name, f"packed with group {g}, but the config's group for the module is "
                               f"{self.output.group_for(m)} (-1: channel)")
        # a blob's values are 4-bit fields minus 8: in [-8, 7] by construction, no range to check
        _check_values(m, name, f"{name} (scales)", None, dec[1], problems, counts, dec[0].numel())
        return dec

    def _stored(self, m: str, problems: Problems, counts: dict, got: tuple | None) -> None:
        """An int8 weight and its scales, of the dtype and shape the module's group takes: [N, K] and
        [N, K/g] as int4pack writes them, or [K, N] and [K/g, N] inside a per-expert tensor of the
        model's own layout (expert_layout.py: stored transposed)."""
        ck, v = self.output.ckpt, self.output.views.get(m)
        wn, sn = f"{v.stored if v else m}.weight", f"{v.stored if v else m}.weight_scale"
        have, lack = (wn, sn) if v else (sn, wn)  # a module is found by its scales, a layout's by its weight
        if lack not in ck.tensors:
            problems.add(m, f"{have} present but {lack} missing")
            return
        wi, si = ck.tensors[wn], ck.tensors[sn]
        if wi.dtype != "I8" or len(wi.shape) != 2:
            problems.add(m, f"{wn}: {wi.dtype}{list(wi.shape)}, expected int8 " +
                         ("[K, N] (stored transposed)" if v else "[N, K]"))
            return
        g = self.output.group_for(m)
        want_dt, groups = _want_scales(m, g, wi.shape[0] if v else wi.shape[1], problems)
        want = [groups, wi.shape[1]] if v else [wi.shape[0], groups]
        if si.dtype != want_dt or list(si.shape) != want:
            problems.add(m, f"{sn}: {si.dtype}{list(si.shape)}, expected {want_dt}{want} ({group_name(g)}" +
                         (", stored transposed)" if v else "); another dtype makes torch fall back silently"))
            return
        if v:
            q, s, _ = self.output.weight(m)
            _check_values(m, wn, sn, q, s, problems, counts)
        else:
            tap = getattr(ck, "taps", {}).get((wi.file, wn))  # the range its read already found
            if got is not None and tap is not None and tap[1] is not None:
                got = (tap[1], got[1])
            q, s = got or (self.ranges.get(wn) or ck.get(wn), ck.get(sn))
            _check_values(m, wn, sn, q, s, problems, counts, wi.numel)


def _want_scales(m: str, g: int, k: int, problems: Problems) -> tuple[str, int]:
    """The scale dtype and the number of scale groups along K of a module of group g (-1: channel)."""
    if is_channel(g):
        return scale_st_dtype(g), 1
    why = check_group_size(g, k)
    if why:
        problems.add(m, f"group size {g} invalid for K={k}: {why}")
    return scale_st_dtype(g), (k // g if k % g == 0 else -1)


def _blob_check_problem(output: W4A8Output, m: str) -> str | None:
    """The layout record's blob_checks entry of module m (what the plugin checks at load) against
    the blob's provenance; None when they agree or the record has no checks (noted by verify)."""
    checks = output.record.get(BLOB_CHECKS)
    if not isinstance(checks, dict):
        return None
    prov = output.packed.prov[f"{m}.{SUFFIX}"]
    unit = vllm_module(m, output.ckpt.family_type)
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
    g = channel_group(prov["k"], prov["group_size"])
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
