"""verify's source side (``--against``): the source checkpoint read by int4pack's own readers,
the tensors the output holds unchanged from it, and each module's weights against it."""

from __future__ import annotations

import json

import numpy as np
import torch

from ..architectures import vllm_output_names
from ..sources.checkpoint import Checkpoint, resolve_source
from ..sources.containers import open_checkpoint
from ..errors import InputError, Int4packError
from ..formats import open_reader
from ..plan import DENSE_MODES, make_plan
from ..serve_spec import SUFFIX
from .exact_ints import exact_expert, exact_reference, exact_stats, ints_vs_source, lossless_values
from .tolerance import budget, rel, sum_sq
from .w4a8_output import W4A8Output

__all__ = ["Source", "recorded_dense", "same_bytes", "check_copies", "bias_vs_source", "expert_vs_source",
           "weights_vs_source"]

# the int4 readers (gptq, awq, compressed-tensors) return a bias exactly when their spec's has_bias
# says so; check_copies asks every module for its bias, and reading one (unpack=False) maps the
# module's packed weights: the whole source, for a question the spec answers
_BIAS_IFF_SPEC = ("gptq", "awq", "ct-pack", "ct-int")


class Source:
    """The source checkpoint read by int4pack's own readers, plus convert's per-module budgets.

    It plans the source again instead of reading the output's report: the report is written by
    whoever wrote the output, so every budget and copy verify checks against comes from the source."""

    def __init__(self, path, revision, dense: str = "w4a8"):
        self.label = str(path)
        self.dense = dense  # convert's --dense, as the output records it: the plan depends on it
        self.ckpt = open_checkpoint(resolve_source(path, revision=revision))
        self.reader = open_reader(self.ckpt)
        # keyed by the output's module names (convert renames some families for vLLM)
        ren = {k[:-7]: v[:-7] for k, v in vllm_output_names(
            self.ckpt.family_type, [f"{m}.weight" for m in self.reader.linears()]).items()}
        self.specs = {ren.get(m, m): s for m, s in self.reader.linears().items()}
        self.plan_error: str | None = None
        self.copies: dict[str, str] = {}  # output tensor -> the source tensor it is a copy of
        self.kept_bf16: dict[str, str] = {}  # output module kept in bf16 -> source module
        try:
            plan = make_plan(self.ckpt, dense=dense)
            self.paths = {ren.get(m, m): p for j in plan.jobs for m, p in j.paths.items()}
            tren = vllm_output_names(self.ckpt.model_type, [j.source for j in plan.jobs if j.kind == "copy"])
            for j in plan.jobs:
                if j.kind == "copy":
                    self.copies[tren.get(j.source, j.source)] = j.source
                elif j.kind == "dequant":
                    self.kept_bf16[ren.get(j.specs[0].name, j.specs[0].name)] = j.specs[0].name
        except Int4packError as e:
            self.paths = {}
            self.plan_error = str(e)
        self._cache: dict[str, object] = {}

    def read(self, m: str):
        if m not in self._cache:
            if m not in self.specs:
                raise InputError(f"{m}: not a quantised module of the source {self.label}", tensor=m,
                                 hint="--against must be the checkpoint this output was converted from.")
            with self.ckpt.faults_named():
                self._cache[m] = self.reader.read(self.specs[m])
        return self._cache[m]

    def dequant(self, m: str) -> torch.Tensor:
        return self.read(m).dequantize()

    def bias(self, m: str) -> torch.Tensor | None:
        """Module m's bias, without unpacking (or keeping) its weights."""
        if m in self._cache:
            return self._cache[m].bias
        if m not in self.specs:
            return self.read(m).bias  # the error read() gives
        spec = self.specs[m]
        if spec.fmt in _BIAS_IFF_SPEC and not spec.has_bias:
            return None  # these readers read a bias exactly when the spec has one: no weight bytes mapped
        return self.reader.read(spec, unpack=False).bias

    def forget(self, mods) -> None:
        """Drop what was read of ``mods`` (one expert's, once checked): the cache stays one expert per thread."""
        for m in mods:
            self._cache.pop(m, None)

    def g_idx_perm(self, m: str) -> torch.Tensor | None:
        ql = self.read(m)
        if ql.g_idx is None or ql.has_trivial_g_idx():
            return None
        return torch.argsort(ql.g_idx.long(), stable=True)

    def close(self):
        self._cache.clear()
        self.ckpt.close()


def recorded_dense(ckpt: Checkpoint) -> str:
    """The ``--dense`` an output was converted with, as its shards record it (``int4pack.target``);
    the default where none says."""
    for meta in ckpt.shard_metadata.values():
        try:
            got = json.loads(meta.get("int4pack.target") or "{}").get("dense")
        except (ValueError, AttributeError):
            continue
        if got in DENSE_MODES:
            return got
    return "w4a8"


def same_bytes(a: Checkpoint, an: str, b: Checkpoint, bn: str) -> str | None:
    """Why tensor an of a and bn of b differ (dtype, shape or bytes), or None."""
    ia, ib = a.tensors[an], b.tensors[bn]
    if ia.dtype != ib.dtype or tuple(ia.shape) != tuple(ib.shape):
        return f"{ia.dtype}{list(ia.shape)} here, {ib.dtype}{list(ib.shape)} in the source"
    # read in steps (pread), not compared in the mapped files: a page of a file cut under a mapped
    # compare would end the process (SIGBUS), a short read is the error naming the file
    step = 1 << 24
    bufs = bytearray(min(step, ia.nbytes)), bytearray(min(step, ia.nbytes))
    for i in range(0, ia.nbytes, step):
        n = min(step, ia.nbytes - i)
        a.read_into(an, memoryview(bufs[0])[:n], i)
        b.read_into(bn, memoryview(bufs[1])[:n], i)
        va, vb = np.frombuffer(bufs[0], dtype=np.uint8, count=n), np.frombuffer(bufs[1], dtype=np.uint8, count=n)
        if not np.array_equal(va, vb):
            return f"bytes differ from the source's (first at byte {i + int((va != vb).argmax())})"
    return None


def check_copies(output: W4A8Output, src: Source, clock) -> dict:
    """Every tensor the output should hold unchanged from the source (routers, norms, embeddings,
    lm_head, biases, bf16-kept linears...), compared byte for byte; and no tensor the source does
    not explain."""
    out = output.ckpt
    problems: list[dict] = []
    checked = 0
    if src.plan_error:
        problems.append({"where": "source", "message": f"the source's own plan fails ({src.plan_error}): "
                                                       "the copied tensors cannot be attributed"})
        return {"ok": False, "checked": 0, "problems": problems}
    other = _not_the_source(out, src.ckpt)
    if other:
        problems.append({"where": "source", "message": f"{src.label} is not the checkpoint this output was converted "
                                                       f"from ({other}): pass that checkpoint to --against"})
        return {"ok": False, "checked": 0, "problems": problems}
    quant = set(output.modules)
    explained = set(src.copies)
    with clock("read"):
        for name, sname in sorted(src.copies.items()):
            if name not in out.tensors:
                problems.append({"where": name, "message": f"missing (a copy of the source's {sname})"})
                continue
            why = same_bytes(out, name, src.ckpt, sname)
            checked += 1
            if why:
                problems.append({"where": name, "message": f"not the source's {sname}: {why}"})
        # the source's plan keeps these in bf16 by default; --dense says otherwise for dense linears: an
        # output module in W4A8 is checked by the numerical pass, one in bf16 against the source dequantised
        kept = {m: sm for m, sm in src.kept_bf16.items() if m not in quant}
        kept.update({m: s.name for m, s in src.specs.items() if m not in quant and m not in kept
                     and getattr(out.tensors.get(f"{m}.weight"), "dtype", None) == "BF16"})
        for m, sm in sorted(kept.items()):
            with src.ckpt.faults_named():
                ql = src.reader.read(src.reader.linears()[sm])
            want = {f"{m}.weight": ql.dequantize().to(torch.bfloat16)}
            if ql.bias is not None:
                want[f"{m}.bias"] = ql.bias
            explained.update(want)
            for name, w in want.items():
                checked += 1
                if name not in out.tensors:
                    problems.append({"where": name, "message": "missing (the source module kept in bf16)"})
                elif not _tensor_equal(out.get(name), w):
                    problems.append({"where": name, "message": f"differs from the source's {sm} dequantised"})
        for m in sorted(quant):
            if m not in src.specs:
                continue  # reported by the numerical pass (not a quantised module of the source)
            bias = src.bias(m)
            if output.is_blob(m):
                explained.add(f"{m}.{SUFFIX}")
                continue  # a packed bias is inside the blob: compared there (bias_vs_source)
            explained.update(n for n in output.stored_names(m) if bias is not None or not n.endswith(".bias"))
            if bias is None:
                continue
            checked += 1
            perm = src.g_idx_perm(m) if src.paths.get(m) == "fold" else None
            got = output.bias(m)
            if got is None:
                problems.append({"where": f"{m}.bias", "message": "missing (the source module has a bias)"})
            elif not _bias_matches(got, bias, perm):
                problems.append({"where": f"{m}.bias", "message": "differs from the source module's bias"})
        for name in sorted(set(out.tensors) - explained):
            mod = name.rsplit(".", 1)[0]
            if mod in quant and (output.is_blob(mod) or name.endswith((".weight", ".weight_scale", ".bias"))):
                continue  # a module the source does not quantise: the numerical pass names it
            problems.append({"where": name, "message": "not in the source and not written by convert from it"})
    return {"ok": not problems, "checked": checked, "problems": problems}


_SHAPE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "num_experts", "num_local_experts",
               "n_routed_experts", "moe_intermediate_size", "intermediate_size", "num_attention_heads")


def _not_the_source(out: Checkpoint, src: Checkpoint) -> str | None:
    """How the output's model config differs from the source's in what convert keeps, or None."""
    a, b = out.text_config, src.text_config
    diff = [f"{k} {a.get(k)!r} here, {b.get(k)!r} there" for k in _SHAPE_KEYS if a.get(k) != b.get(k)]
    return "; ".join(diff[:3]) or None


def bias_vs_source(output: W4A8Output, src: Source, m: str) -> list[str]:
    """A packed blob's bias (inside the blob) against the source module's."""
    if not output.is_blob(m):
        return []  # the plain output's biases are tensors of their own: check_copies
    sb = src.read(m).bias
    has = bool(output.packed.prov.get(f"{m}.{SUFFIX}", {}).get("bias"))
    if has != (sb is not None):
        return [f"{m}: the blob {'holds' if has else 'lacks'} a bias, the source module "
                f"{'has none' if has else 'has one'}"]
    if sb is None:
        return []
    perm = src.g_idx_perm(m) if src.paths.get(m) == "fold" else None
    b = output.packed.decode(m, check=False)[2]
    return [] if _bias_matches(b, sb, perm) else [f"{m}: the bias inside the blob differs from the source's"]


def _tensor_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a.view(torch.uint8) if a.dtype ==
                                                                          torch.bfloat16 else a, b.view(torch.uint8)
                                                                          if b.dtype == torch.bfloat16 else b))


def _bias_matches(got: torch.Tensor, want: torch.Tensor, perm: torch.Tensor | None) -> bool:
    cands = [want] + ([want[perm]] if perm is not None and perm.numel() == want.numel() else [])
    return any(got.shape == w.shape and bool(torch.equal(got.float(), w.float())) and
               (got.dtype == w.dtype or got.dtype == torch.float32) for w in cands)


def expert_vs_source(output: W4A8Output, src: Source, slot: dict[str, str], report, clock, ints: dict, floats,
                     xe: torch.Tensor, vk, activation, w13q: torch.Tensor | None = None) -> dict:
    """One expert's weights (``slot``: role -> module) against the source's, and the source's own
    output on the expert's rows ``xe``. Where the source plans each projection lossless and its ints
    and scales as read (``ints``: role -> (int4 values, scales)) are exactly the source's, as integers
    throughout (exact_ints.py): the source's float32 reference from those ints (``w13q``: the gate and
    up values in one matrix) and the source's scales, each projection's error from the scales alone.
    Else the converted float weights (``floats()``: role -> float weights) against the source's
    dequantised ones (``weights_vs_source``). Returns {"problems", "stats", "wv" (the weight
    variances the prediction takes: budget^2 * sum of squares / elements, per role), "exact" (the
    source's scales, or None) and "ref" (the exact path's reference) or "sw" (the source's float
    weights)}. The source's records of the expert are dropped once compared."""
    with clock("read"):
        for m in slot.values():
            src.read(m)
    exact = None
    with clock("compare"):
        bias = {m: bias_vs_source(output, src, m) for m in slot.values()}
        if w13q is not None and all(src.paths.get(m) == "lossless" for m in slot.values()):
            exact = exact_expert(output, src, slot, ints)
    if exact is not None:
        with clock("reference"):
            ref = exact_reference(vk, xe.float().contiguous(), w13q, ints["down"][0], exact, activation)
        with clock("compare"):
            stats, problems, wv = exact_stats(output, src, slot, report, ints, exact, ref)
        out = {"problems": problems + [p for m in slot.values() for p in bias[m]], "ref": ref}
    else:
        sw, problems, stats, wv = weights_vs_source(output, src, slot, report, clock, floats(), ints, bias)
        out = {"problems": problems, "sw": sw}
    src.forget(slot.values())
    return {**out, "stats": stats, "wv": wv, "exact": exact}


def weights_vs_source(output: W4A8Output, src: Source, mods: dict[str, str], report, clock, conv=None, ints=None,
                      bias: dict[str, list[str]] | None = None):
    """(source float weights aligned with the converted ones (undoing an act-order fold), problems,
    per-module measured rel_l2 and budget, the weight variances the budgets give, gate, up and down:
    budget^2 * sum of squares / elements); a lossless module's ints and scales compared exactly. mods: role -> module
    name of one MLP; conv: their converted float weights, when already read; ints: role -> their
    (int4 values, scales) as read; bias: each module's ``bias_vs_source``, when already compared."""
    with clock("read"):
        conv = conv or {r: output.dequant(m) for r, m in mods.items()}
        srcw = {r: src.dequant(m) for r, m in mods.items()}
    perm = src.g_idx_perm(mods["down"]) if "down" in mods else None
    if perm is not None:
        # a fold permuted the intermediate dim: keep it only if it explains the converted weights
        alt = {"gate": srcw["gate"][perm], "up": srcw["up"][perm], "down": srcw["down"][:, perm]}
        if rel(conv["down"], alt["down"]) < rel(conv["down"], srcw["down"]):
            srcw = alt
        else:
            perm = None
    stats, problems, wv = {}, [], {}
    for r, m in mods.items():
        g = output.group_for(m)
        meas = rel(conv[r], srcw[r])
        bud, why = budget(m, srcw[r], g, report, src)
        wv[r] = bud ** 2 * sum_sq(srcw[r]) / srcw[r].numel()
        stats[r] = {"module": m, "rel_l2": meas, "budget": bud, "budget_from": why}
        if not meas <= bud:
            problems.append(f"{m}: weight rel_l2 {meas:.4g} vs the source exceeds its budget {bud:.4g} ({why})")
        if ints is not None and r in ints:
            with clock("compare"):
                want = lossless_values(src.read(m), g, perm if r == "down" else None,
                                       perm if r in ("gate", "up") else None)
                stats[r]["exact_ints"] = want is not None
                problems += ints_vs_source(m, ints[r], want)
        problems += bias[m] if bias is not None else bias_vs_source(output, src, m)
    return srcw, problems, stats, [wv[r] for r in ("gate", "up", "down") if r in wv]
