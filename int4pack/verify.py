"""``verify``: prove a converted W4A8 checkpoint is complete and computes what its source computes.

The structural pass (verify_structure.py) runs first and always; this module runs the numerical
pass on what it found and renders one report.

Numerical pass, per MoE layer: unit-RMS random hidden states times the layer's input norm weight,
routed by the layer's own router (every sampled expert is guaranteed tokens), run through the W4A8
MoE op (``moe.moe_forward``) and through float32 references on the converted weights and (with
``against``) on the source checkpoint's own dequantised weights. The error splits into

* activation quantisation: kernel vs float on the converted weights. Its expected size is derived
  from the inputs (per-row int8 step^2/12, propagated through the layer: ``moe.predicted_noise``);
  the measured error must stay below ``K_ACT`` times that;
* weight requantisation: float on converted vs float on source weights. Each module's weight
  error must equal convert's own measurement in the report (or, without a report, stay below the
  path's bound: bf16 scale rounding 2^-8 for lossless/fold, plain absmax RTN for requant), and each
  expert's output error must stay below ``K_WEIGHT`` times the error those budgets predict.

Dense W4A8 linears get the same with ``_dyn_quant_matmul_4bit`` on a few random rows.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from . import kernels
from . import moe as moe_mod
from .checkpoint import Checkpoint, resolve_source
from .errors import InputError, Int4packError, UsageError, VerifyFailed
from .groups import block
from .serve_spec import BLOB_CHECKS, KLEIDIAI, PLAIN, SUFFIX
from .verify_structure import Problems, Target, _read_report, check_structure, layer_index
from .w4a8 import dequantize_w4a8

__all__ = ["verify", "K_ACT", "K_WEIGHT", "LOSSLESS_BOUND", "REL_MARGIN"]

K_ACT = 1.5  # measured/predicted activation error is 0.95-1.05 on random and real layers
K_WEIGHT = 2.0  # the isotropic weight-noise model is within ~1.5x on the fixtures
LOSSLESS_BOUND = 2.0**-8  # bf16 rounding of a scale: relative error <= 2^-8 per element
REL_MARGIN = 1e-3  # report values carry 6 digits; float32 vs float64 sums differ by ~1e-6
MAX_BUDGET = 0.35  # no module may be further than this from its source (int4 RTN is ~0.1 on real layers)
ABS_FLOOR = 1e-6
MIN_SLOTS_PER_EXPERT = 2
_NORMS = ("post_attention_layernorm", "pre_feedforward_layernorm", "ffn_norm")


@contextmanager
def _threads(n: int | None):
    if not n:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    den = float(b.norm())
    num = float((a - b).norm())
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    den = float(a.norm() * b.norm())
    return float(a @ b) / den if den > 0 else 1.0


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3g}"

# --------------------------------------------------------------------------------- the source


class _Source:
    """The source checkpoint read by int4pack's own readers, plus convert's per-module budgets."""

    def __init__(self, path, revision):
        from .architectures import vllm_output_names
        from .formats import open_reader

        self.label = str(path)
        self.ckpt = Checkpoint(resolve_source(path, revision=revision))
        self.reader = open_reader(self.ckpt)
        # keyed by the output's module names (convert renames some families for vLLM)
        ren = {k[:-7]: v[:-7] for k, v in vllm_output_names(
            self.ckpt.family_type, [f"{m}.weight" for m in self.reader.linears()]).items()}
        self.specs = {ren.get(m, m): s for m, s in self.reader.linears().items()}
        self.plan_error: str | None = None
        self.copies: dict[str, str] = {}  # output tensor -> the source tensor it is a copy of
        self.kept_bf16: dict[str, str] = {}  # output module kept in bf16 -> source module
        try:
            from .plan import make_plan

            plan = make_plan(self.ckpt)
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
        return self.reader.read(self.specs[m], unpack=False).bias

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


def _same_bytes(a: Checkpoint, an: str, b: Checkpoint, bn: str) -> str | None:
    """Why tensor an of a and bn of b differ (dtype, shape or bytes), or None."""
    ia, ib = a.tensors[an], b.tensors[bn]
    if ia.dtype != ib.dtype or tuple(ia.shape) != tuple(ib.shape):
        return f"{ia.dtype}{list(ia.shape)} here, {ib.dtype}{list(ib.shape)} in the source"
    va, vb = a.raw(an), b.raw(bn)
    step = 1 << 24
    for i in range(0, len(va), step):
        if va[i:i + step] != vb[i:i + step]:
            x = np.frombuffer(va[i:i + step], dtype=np.uint8) != np.frombuffer(vb[i:i + step], dtype=np.uint8)
            return f"bytes differ from the source's (first at byte {i + int(x.argmax())})"
    return None


def _check_copies(t: Target, src: _Source, clock) -> dict:
    """Every tensor the output should hold unchanged from the source (routers, norms, embeddings,
    lm_head, biases, bf16-kept linears...), compared byte for byte; and no tensor the source does
    not explain."""
    out = t.ckpt
    problems: list[dict] = []
    checked = 0
    if src.plan_error:
        problems.append({"where": "source", "message": f"the source's own plan fails ({src.plan_error}): "
                                                       "the copied tensors cannot be attributed"})
        return {"ok": False, "checked": 0, "problems": problems}
    quant = set(t.modules)
    explained = set(src.copies)
    with clock("read"):
        for name, sname in sorted(src.copies.items()):
            if name not in out.tensors:
                problems.append({"where": name, "message": f"missing (a copy of the source's {sname})"})
                continue
            why = _same_bytes(out, name, src.ckpt, sname)
            checked += 1
            if why:
                problems.append({"where": name, "message": f"not the source's {sname}: {why}"})
        for m, sm in sorted(src.kept_bf16.items()):
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
            if t.packed:
                explained.add(f"{m}.{SUFFIX}")
                continue  # a packed bias is inside the blob: compared there (_bias_vs_source)
            explained.update(n for n in t.stored_names(m) if bias is not None or not n.endswith(".bias"))
            if bias is None:
                continue
            checked += 1
            perm = src.g_idx_perm(m) if src.paths.get(m) == "fold" else None
            got = t.bias(m)
            if got is None:
                problems.append({"where": f"{m}.bias", "message": "missing (the source module has a bias)"})
            elif not _bias_matches(got, bias, perm):
                problems.append({"where": f"{m}.bias", "message": "differs from the source module's bias"})
        for name in sorted(set(out.tensors) - explained):
            mod = name.rsplit(".", 1)[0]
            if mod in quant and (t.packed or name.endswith((".weight", ".weight_scale", ".bias"))):
                continue  # a module the source does not quantise: the numerical pass names it
            problems.append({"where": name, "message": "not in the source and not written by convert from it"})
    return {"ok": not problems, "checked": checked, "problems": problems}


def _bias_vs_source(t: Target, src: _Source, m: str) -> list[str]:
    """A packed blob's bias (inside the blob) against the source module's."""
    if not t.packed:
        return []  # the plain output's biases are tensors of their own: _check_copies
    sb = src.read(m).bias
    has = bool(t.packed.prov.get(f"{m}.{SUFFIX}", {}).get("bias"))
    if has != (sb is not None):
        return [f"{m}: the blob {'holds' if has else 'lacks'} a bias, the source module "
                f"{'has none' if has else 'has one'}"]
    if sb is None:
        return []
    perm = src.g_idx_perm(m) if src.paths.get(m) == "fold" else None
    b = t.packed.decode(m, check=False)[2]
    return [] if _bias_matches(b, sb, perm) else [f"{m}: the bias inside the blob differs from the source's"]


def _tensor_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a.view(torch.uint8) if a.dtype ==
                                                                          torch.bfloat16 else a, b.view(torch.uint8)
                                                                          if b.dtype == torch.bfloat16 else b))


def _bias_matches(got: torch.Tensor, want: torch.Tensor, perm: torch.Tensor | None) -> bool:
    cands = [want] + ([want[perm]] if perm is not None and perm.numel() == want.numel() else [])
    return any(got.shape == w.shape and bool(torch.equal(got.float(), w.float())) and
               (got.dtype == w.dtype or got.dtype == torch.float32) for w in cands)


def _rtn_rel(w: torch.Tensor, g: int) -> float:
    """rel_l2 of plain absmax round-to-nearest at the target group (scales rounded as shipped)."""
    n, k = w.shape
    gg = block(k, g)
    wg = w.reshape(n, k // gg, gg)
    s = wg.abs().amax(2, keepdim=True) / 7
    s = (s.to(torch.bfloat16).float() if g != -1 else s).clamp(min=2.0**-126)
    q = (wg / s).round().clamp(-8, 7)
    return _rel((q * s).reshape(n, k), w)


def _report_figure(m: str, report: dict | None) -> tuple[float | None, str | None]:
    """Convert's measured rel_l2 of module m in the checkpoint's own report: (value, problem)."""
    mods = (report or {}).get("modules")
    rec = mods.get(m) if isinstance(mods, dict) else None
    if not isinstance(rec, dict) or rec.get("rel_l2") in (None, ""):
        return None, None
    try:
        v = float(rec["rel_l2"])
    except (TypeError, ValueError):
        v = math.nan
    if not (math.isfinite(v) and v >= 0):
        return None, f"int4pack_report.json: modules.{m}.rel_l2 is {rec['rel_l2']!r}, not a number >= 0"
    return v, None


def _budget(m: str, w_src: torch.Tensor, g: int, report: dict | None, src: _Source) -> tuple[float, str]:
    """Allowed weight rel_l2 of module m against the source, and where the number comes from.

    The bound is the source's own: the path the source plans for m (recomputed from the source,
    never read from the output) and its error bound at g; the report's figure only tightens it,
    and MAX_BUDGET caps every budget. A forged report can make verify stricter, never looser.
    """
    path = src.paths.get(m, "requant")
    if path == "reemit":
        bound, why = ABS_FLOOR, "reemit (exact)"
    elif path in ("lossless", "fold"):
        bound, why = (ABS_FLOOR if g == -1 else LOSSLESS_BOUND), f"{path} (scale cast), from the source"
    else:
        bound, why = _rtn_rel(w_src, g) * (1 + REL_MARGIN) + ABS_FLOOR, "requant (<= absmax RTN), from the source"
    if bound > MAX_BUDGET:
        bound, why = MAX_BUDGET, f"{why}, capped at {MAX_BUDGET}"
    fig, _ = _report_figure(m, report)
    if fig is not None and fig * (1 + REL_MARGIN) + ABS_FLOOR < bound:
        bound, why = fig * (1 + REL_MARGIN) + ABS_FLOOR, "the report's figure (tighter than the source bound)"
    return bound, why


# --------------------------------------------------------------------------------- inputs


def _norm_weight(ckpt: Checkpoint, prefix: str, names: tuple[str, ...], offset: float = 0.0) -> torch.Tensor | None:
    """The RMSNorm gain in front of ``prefix`` (``offset`` 1: the model scales by 1 + weight, as
    Qwen3-Next and Qwen3.5 do); None when absent or zero everywhere (it would zero the input)."""
    parent = prefix.rsplit(".", 1)[0]
    for n in names:
        key = f"{parent}.{n}.weight"
        if key in ckpt.tensors:
            g = ckpt.get(key).float() + offset
            return g if bool(g.abs().amax() > 0) else None
    return None


def _hidden(gen: torch.Generator, t: int, h: int, norm: torch.Tensor | None) -> torch.Tensor:
    x = torch.randn(t, h, generator=gen)
    x = x / x.pow(2).mean(1, keepdim=True).sqrt()
    return x * norm if norm is not None and norm.numel() == h else x


def _route(x, router_w, sampled: list[int], top_k: int, renorm: bool, gen, scoring: str = "softmax",
           bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k among the sampled experts from the real router, scored as the family scores (softmax, or
    sigmoid with the score bias choosing but not weighting); every sampled expert gets slots. The
    kernel and the float reference take the same ids and weights: routing picks the inputs, the
    comparison is of the experts."""
    t = x.shape[0]
    k = min(top_k, len(sampled))
    if router_w is not None:
        logits = x @ router_w.float()[sampled].t()
    else:
        logits = torch.randn(t, len(sampled), generator=gen)
    probs = torch.sigmoid(logits) if scoring == "sigmoid" else torch.softmax(logits, dim=1)
    choice = probs + bias.float()[sampled] if bias is not None else probs
    ids = choice.topk(k, dim=1).indices
    w = probs.gather(1, ids)
    # guarantee coverage: give an expert with too few slots slots of tokens lacking it, the last
    # (lowest-scored) slots first, taken from experts that keep enough without them; only when none
    # can spare one, the last slot of any token lacking it
    count = torch.bincount(ids.reshape(-1), minlength=len(sampled)).tolist()
    for e in range(len(sampled)):
        if count[e] >= MIN_SLOTS_PER_EXPERT:
            continue
        lacking = (~(ids == e).any(1)).tolist()
        order = [i for i in torch.randperm(t, generator=gen).tolist() if lacking[i]]
        for j, spare_only in [(j, True) for j in range(k - 1, -1, -1)] + [(k - 1, False)]:
            for i in order:
                had = int(ids[i, j])
                if count[e] >= MIN_SLOTS_PER_EXPERT:
                    break
                if not lacking[i] or (spare_only and count[had] <= MIN_SLOTS_PER_EXPERT):
                    continue
                count[had] -= 1
                count[e] += 1
                lacking[i] = False
                ids[i, j] = e
                w[i, j] = probs[i, e]
    if renorm:
        w = w / w.sum(1, keepdim=True)
    return ids, w


def _pick(seq: list, n: int | None, gen: torch.Generator) -> list:
    if n is None or n >= len(seq):
        return list(seq)
    idx = sorted(torch.randperm(len(seq), generator=gen)[:n].tolist())
    return [seq[i] for i in idx]


# --------------------------------------------------------------------------------- numerics


class _Clock:
    """Seconds per stage, summed over the threads that ran it (so their sum can exceed the wall time)."""

    def __init__(self):
        self.s = {"reference": 0.0, "kernel": 0.0, "pack": 0.0, "read": 0.0, "prediction": 0.0}
        self._lock = threading.Lock()

    @contextmanager
    def __call__(self, what: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            with self._lock:
                self.s[what] += dt


def _timed(fn, *args):
    t0 = time.perf_counter()
    return fn(*args), time.perf_counter() - t0


@contextmanager
def _shutting(pool):
    try:
        yield
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _parallel(pool, fn, items: list):
    """fn(*item) for each item, in order; on ``pool`` (a ThreadPoolExecutor) when there is one.
    torch and the C++ kernels let go of the GIL, so threads run the experts side by side."""
    if pool is None or len(items) < 2:
        return [fn(*it) for it in items]
    return [f.result() for f in [pool.submit(fn, *it) for it in items]]


def _weights_vs_source(t: Target, src: _Source, mods: dict[str, str], report, clock, conv=None):
    """Source float weights aligned with the converted ones (undoing an act-order fold), per-module
    measured rel_l2 and budget. mods: role -> module name of one MLP; conv: their converted float
    weights, when already read."""
    with clock("read"):
        conv = conv or {r: t.dequant(m) for r, m in mods.items()}
        srcw = {r: src.dequant(m) for r, m in mods.items()}
    perm = src.g_idx_perm(mods["down"]) if "down" in mods else None
    if perm is not None:
        # a fold permuted the intermediate dim: keep it only if it explains the converted weights
        alt = {"gate": srcw["gate"][perm], "up": srcw["up"][perm], "down": srcw["down"][:, perm]}
        if _rel(conv["down"], alt["down"]) < _rel(conv["down"], srcw["down"]):
            srcw = alt
    stats, problems = {}, []
    for r, m in mods.items():
        g = t.group_for(m)
        meas = _rel(conv[r], srcw[r])
        bud, why = _budget(m, srcw[r], g, report, src)
        stats[r] = {"module": m, "rel_l2": meas, "budget": bud, "budget_from": why}
        if not meas <= bud:
            problems.append(f"{m}: weight rel_l2 {meas:.4g} vs the source exceeds its budget {bud:.4g} ({why})")
        problems += _bias_vs_source(t, src, m)
    return conv, srcw, problems, stats


def _moe_inputs(t: Target, prefix: str, experts_n, tokens, gen, clock) -> dict:
    """Everything random about one MoE layer's check: its sampled experts, hidden states and routing
    (drawn layer after layer from one generator, so a seed gives the same check however many
    layers then run at once)."""
    experts = t.layers[prefix]
    ids_all = sorted(experts)
    sampled = _pick(ids_all, experts_n, gen)
    e_s = len(sampled)
    ck = t.ckpt
    res: dict = {"layer": prefix, "kind": "moe", "experts": len(ids_all), "experts_checked": e_s,
                 "experts_sampled": list(sampled), "problems": []}
    router = t.routers.get(prefix)
    with clock("read"):
        rw = ck.get(router).float() if router else None
        norm = _norm_weight(ck, prefix, _NORMS, t.norm_offset)
        bias_name = next((n for n in (f"{prefix}.gate.e_score_correction_bias", f"{prefix}.e_score_correction_bias")
                          if n in ck.tensors), None) if t.routing.get("bias") else None
        bias = ck.get(bias_name).float() if bias_name else None
    k_top = min(t.top_k, e_s)
    n_tok = tokens or default_tokens(e_s, k_top)
    x = _hidden(gen, n_tok, t.shape(experts[ids_all[0]]["gate"])[1], norm)
    scoring = t.routing.get("scoring") or "softmax"
    ids, wts = _route(x, rw, sampled, t.top_k, t.norm_topk, gen, scoring, bias)
    res["tokens"] = n_tok
    res["min_slots"] = int(torch.bincount(ids.reshape(-1), minlength=e_s).min()) if e_s else 0
    res["router"] = "real" if rw is not None else "random logits"
    res["scoring"] = scoring + (" + score bias" if bias is not None else "")
    res["input_norm"] = norm is not None
    return {"res": res, "sampled": sampled, "x": x, "ids": ids, "wts": wts}


def default_tokens(experts: int, top_k: int) -> int:
    """Rows per MoE layer by default: a quarter more slots than MIN_SLOTS_PER_EXPERT for each sampled
    expert (the routing gives the short ones slots of experts with more to spare), at least 32.
    Each slot costs a row through torch's matmul, the scalar reference kernel on x86."""
    return max(32, -(-5 * MIN_SLOTS_PER_EXPERT * experts // (4 * top_k)))


def _moe_layer(t: Target, prefix: str, src: _Source | None, report, inputs: dict, clock, tick=None,
               pool=None) -> dict:
    experts = t.layers[prefix]
    ids_all = sorted(experts)
    res, sampled, x, ids, wts = (inputs[k] for k in ("res", "sampled", "x", "ids", "wts"))
    e_s = len(sampled)
    n_tok = x.shape[0]

    use_blobs = t.blob(experts[ids_all[0]]["gate"]) is not None
    res["weights"] = "the checkpoint's KleidiAI blobs" if use_blobs else "packed on the fly"
    hidden = x.shape[1]
    k_slots = ids.shape[1]
    slots_c = torch.zeros(n_tok, k_slots, hidden)
    slots_s = torch.zeros(n_tok, k_slots, hidden) if src is not None else slots_c
    act_var = torch.zeros(n_tok, k_slots)
    w_var = torch.zeros(n_tok, k_slots)
    wstats: dict[int, dict] = {}
    g = t.moe_group(experts[sampled[-1]])
    inter = t.shape(experts[sampled[0]]["down"])[1]
    # vLLM's MoE algorithm (moe.moe_forward), its experts' matmuls run by the tasks below
    none = torch.empty(e_s, 1)
    moe_mod._check(x, ids, wts, none, none, hidden, inter, g, t.activation)  # moe_forward's own checks
    kernel = moe_mod.MoeRun(x, ids, wts, e_s, hidden, inter, g, False, t.activation)

    def one(i: int, e: int) -> dict:
        """Expert e (the i-th sampled): its packed weights through the kernel, its float references
        and predicted errors on its routed rows. One thread, one expert: nothing shared but reads;
        a 128-expert layer's float weights would be ~2.4 GB at once, one expert's are ~20 MB."""
        slot = experts[e]
        out: dict = {"problems": []}
        with kernels.threads_here(1):
            with clock("read"):  # each blob decoded once, for the kernel and the references alike
                qs = {r: t.weight(m) for r, m in slot.items()}
                cw = {r: dequantize_w4a8(*qs[r]) for r in slot}
            if use_blobs:
                # vLLM's w13 of an expert is its gate blob then its up blob (8-row blocks: blobs.py)
                with clock("read"):
                    w13p = torch.cat([t.blob(slot["gate"]), t.blob(slot["up"])])
                    w2p = t.blob(slot["down"])
            else:
                (qg, sg, _), (qu, su, _), (qd, sd, _) = (qs[r] for r in ("gate", "up", "down"))
                with clock("pack"):
                    w13p = moe_mod.pack_for_matmul(torch.cat([qg, qu]), torch.cat([sg, su]), g)
                    w2p = moe_mod.pack_for_matmul(qd, sd, g)
            del qs
            with clock("kernel"):
                kernel.expert(i, w13p, w2p)
            del w13p, w2p
            if src is not None:
                cw, sw, probs, st = _weights_vs_source(t, src, slot, report, clock, cw)
                out["problems"] = [f"expert {e}: {p}" for p in probs]
                out["stats"] = st
                wv = [st[r]["budget"] ** 2 * float(sw[r].double().pow(2).mean()) for r in ("gate", "up", "down")]
            tt, jj = (ids == i).nonzero(as_tuple=True)
            xe = x[tt]
            g2 = wts[tt, jj] ** 2
            w13c = torch.cat([cw["gate"], cw["up"]])
            with clock("reference"):
                out["c"] = moe_mod.expert_forward(xe, w13c, cw["down"], t.activation)
                if src is not None:
                    w13s = torch.cat([sw["gate"], sw["up"]])
                    out["s"] = moe_mod.expert_forward(xe, w13s, sw["down"], t.activation)
            with clock("prediction"):
                out["act_var"] = moe_mod.expert_noise(xe, w13c, cw["down"], t.activation) * g2
                if src is not None:
                    out["w_var"] = moe_mod.expert_noise(xe, w13s, sw["down"], t.activation, activations=False,
                                                        weight_var=wv) * g2
        if src is not None:
            src.forget(slot.values())
        out["at"] = (tt, jj)
        return out

    for i, (e, r) in enumerate(zip(sampled, _parallel(pool, one, list(enumerate(sampled))))):
        tt, jj = r["at"]
        res["problems"] += r["problems"]
        slots_c[tt, jj] = r["c"]
        act_var[tt, jj] = r["act_var"]
        if src is not None:
            wstats[e] = r["stats"]
            slots_s[tt, jj] = r["s"]
            w_var[tt, jj] = r["w_var"]
        if tick is not None:
            tick()
    with clock("kernel"):
        y_k = kernel.finish()
    y_c = (slots_c * wts.unsqueeze(2)).sum(1)
    y_s = (slots_s * wts.unsqueeze(2)).sum(1) if src is not None else y_c

    ref_norm = float(y_s.double().norm())
    if ref_norm == 0.0:  # an all-zero reference compares nothing
        res["problems"].append("the float reference output is zero everywhere: nothing was compared")
    act_rel = _rel(y_k, y_c)
    act_pred = math.sqrt(float(act_var.sum())) / max(float(y_c.double().norm()), 1e-30)
    res.update(rel_l2=_rel(y_k, y_s), max_abs=float((y_k - y_s).abs().max()), cosine=_cos(y_k, y_s),
               act_rel=act_rel, act_pred=act_pred, act_ratio=act_rel / act_pred if act_pred > 0 else None)
    if act_rel > K_ACT * act_pred + ABS_FLOOR:
        res["problems"].append(f"activation-quantisation error {act_rel:.4g} exceeds {K_ACT} x its predicted "
                               f"{act_pred:.4g}: the kernel or the packed weights disagree with the int4 tensors")
    tol = K_ACT * act_pred
    if src is not None:
        w_rel = _rel(y_c, y_s)
        w_pred = math.sqrt(float(w_var.sum())) / max(ref_norm, 1e-30)
        res.update(weight_rel=w_rel, weight_pred=w_pred)
        tol = math.hypot(K_ACT * act_pred, K_WEIGHT * w_pred)
        worst = None
        for i, e in enumerate(sampled):
            mask = ids == i
            a, b = slots_c[mask], slots_s[mask]
            we = _rel(a, b)
            pe = _expert_pred(w_var, wts, mask, b)
            wstats[e]["output_rel"] = we
            wstats[e]["output_pred"] = pe
            wstats[e]["slots"] = int(mask.sum())
            if worst is None or we / max(pe, 1e-30) > worst[1]:
                worst = (e, we / max(pe, 1e-30), we, pe)
            if we > K_WEIGHT * pe + ABS_FLOOR:
                res["problems"].append(
                    f"expert {e}: output on its {int(mask.sum())} routed token(s) deviates from the source by "
                    f"{we:.4g} (allowed {K_WEIGHT} x {pe:.4g} from the weight budgets)")
        if worst:
            res["worst_expert"] = {"expert": worst[0], "output_rel": worst[2], "output_pred": worst[3]}
        res["expert_stats"] = {str(e): s for e, s in wstats.items()}
    res["tolerance"] = tol
    if res["rel_l2"] > tol + ABS_FLOOR:
        res["problems"].append(f"layer output error {res['rel_l2']:.4g} exceeds the tolerance {tol:.4g}")
    res["ok"] = not res["problems"]
    return res


def _expert_pred(w_var: torch.Tensor, wts: torch.Tensor, mask: torch.Tensor, ref_slots: torch.Tensor) -> float:
    """Predicted relative output error of one expert's (ungated) outputs from its weight budgets."""
    v = w_var[mask] / (wts[mask] ** 2).clamp(min=1e-30)  # predicted_noise gated by g^2: undo it
    den = float(ref_slots.double().norm())
    return math.sqrt(float(v.sum())) / den if den > 0 else 0.0


def _dense_input(t: Target, m: str, tokens: int, gen) -> torch.Tensor:
    """The random rows a dense module is checked on (drawn in module order, before any runs)."""
    k = t.shape(m)[1]
    norm = None
    if m.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value"):
        norm = _norm_weight(t.ckpt, m.rsplit(".", 1)[0], ("input_layernorm",), t.norm_offset)
    elif m.rsplit(".", 1)[-1] in ("gate_proj", "up_proj"):
        norm = _norm_weight(t.ckpt, m.rsplit(".", 1)[0], _NORMS, t.norm_offset)
    return _hidden(gen, tokens, k, norm)


def _dense(t: Target, m: str, src: _Source | None, report, x: torch.Tensor, clock) -> dict:
    with kernels.threads_here(1):
        return _dense_run(t, m, src, report, x, clock)


def _dense_run(t: Target, m: str, src: _Source | None, report, x: torch.Tensor, clock) -> dict:
    res: dict = {"module": m, "kind": "dense", "problems": []}
    with clock("read"):
        q, s, g = t.weight(m)
        w_c = dequantize_w4a8(q, s, g)
    n, k = q.shape
    if x.shape[1] != k:
        raise InputError(f"{m}: K={k} in its weights, {x.shape[1]} recorded", tensor=m)
    with clock("pack"):
        wp = t.blob(m)
        if wp is None:
            wp = moe_mod.pack_for_matmul(q, s, g)
    with clock("kernel"):
        y_k = torch.ops.aten._dyn_quant_matmul_4bit(x, wp, block(k, g), k, n)
    with clock("reference"):
        y_c = x @ w_c.t()
    step2 = moe_mod.int8_step(x) ** 2 / 12
    act_pred = math.sqrt(float(step2.sum()) * float(w_c.double().pow(2).sum())) / max(float(y_c.double().norm()), 1e-30)
    act_rel = _rel(y_k, y_c)
    res.update(act_rel=act_rel, act_pred=act_pred, act_ratio=act_rel / act_pred if act_pred else None)
    if act_rel > K_ACT * act_pred + ABS_FLOOR:
        res["problems"].append(
            f"activation-quantisation error {act_rel:.4g} exceeds {K_ACT} x predicted {act_pred:.4g}")
    tol = K_ACT * act_pred
    y_s = y_c
    if src is not None:
        with clock("read"):
            w_s = src.dequant(m)
        meas = _rel(w_c, w_s)
        bud, why = _budget(m, w_s, g, report, src)
        if not meas <= bud:
            res["problems"].append(f"weight rel_l2 {meas:.4g} vs the source exceeds its budget {bud:.4g} ({why})")
        res["problems"] += _bias_vs_source(t, src, m)
        with clock("reference"):
            y_s = x @ w_s.t()
        w_pred = bud * math.sqrt(float(w_s.double().pow(2).mean()) * float(x.double().pow(2).sum()) * n) \
            / max(float(y_s.double().norm()), 1e-30)
        w_rel = _rel(y_c, y_s)
        res.update(weight_rel=w_rel, weight_pred=w_pred, weight_l2=meas, budget=bud)
        tol = math.hypot(K_ACT * act_pred, K_WEIGHT * w_pred)
        if w_rel > K_WEIGHT * w_pred + ABS_FLOOR:
            res["problems"].append(
                f"output deviates from the source by {w_rel:.4g} (allowed {K_WEIGHT} x {w_pred:.4g})")
    res.update(rel_l2=_rel(y_k, y_s), max_abs=float((y_k - y_s).abs().max()), cosine=_cos(y_k, y_s), tolerance=tol)
    if res["rel_l2"] > tol + ABS_FLOOR:
        res["problems"].append(f"output error {res['rel_l2']:.4g} exceeds the tolerance {tol:.4g}")
    res["ok"] = not res["problems"]
    return res


# --------------------------------------------------------------------------------- entry point


_LAYERS_HELP = "--layers takes all, a count N for a seeded sample, or layer indices such as 0,12,47 (one index as 12,)."


def _parse_layers(layers) -> int | list[int] | None:
    """``layers`` as given (None, "all", a count, "0,3", [0, 3]) -> None (all), a count, or sorted indices.
    Anything else is a usage error: verify must never check less than it was asked to."""
    if layers is None:
        return None
    spec = layers
    if isinstance(layers, str):
        s = layers.replace(" ", "")
        if s == "all":
            return None
        if s.isdigit():
            layers = int(s)
        elif "," in s:
            parts = [x for x in s.split(",") if x]
            bad = [x for x in parts if not x.lstrip("-").isdigit()]
            if bad or not parts:
                why = f"{bad[0]} is not a layer index" if bad else "no layer index given"
                raise UsageError(f"--layers {spec}: {why}", hint=_LAYERS_HELP)
            layers = [int(x) for x in parts]
        else:
            raise UsageError(f"--layers {spec}: not all, a count or a list of layer indices", hint=_LAYERS_HELP)
    if isinstance(layers, bool) or not isinstance(layers, (int, list, tuple, set)):
        raise UsageError(f"layers={spec!r}: not all, a count or a list of layer indices", hint=_LAYERS_HELP)
    if isinstance(layers, int):
        if layers < 1:
            raise UsageError(f"--layers {spec}: a sample needs at least 1 layer (layer 0 alone is --layers 0,)",
                             hint=_LAYERS_HELP)
        return layers
    try:
        idx = sorted({int(v) for v in layers})
    except (TypeError, ValueError):
        raise UsageError(f"layers={spec!r}: not a list of layer indices", hint=_LAYERS_HELP) from None
    if not idx:
        raise UsageError("layers=[]: no layer to check", hint=_LAYERS_HELP)
    return idx


def _spans(idx) -> str:
    """[0, 1, 2, 5] -> '0-2, 5': a 48-layer model's list stays short."""
    out, run = [], []
    for i in sorted(idx):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)))
        run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)))
    return ", ".join(out) or "none"


def _missing(spec, want: list[int], have: set[int], what: str, out) -> None:
    miss = [i for i in want if i not in have]
    if miss:
        raise UsageError(f"--layers {spec}: no layer {', '.join(map(str, miss))} to check in {out} ({what}: "
                         f"{_spans(have)})",
                         hint="Pick layer indices from that list, a count N for a seeded sample, or all.")


def _select_layers(prefixes: list[str], sel, gen) -> list[str]:
    if sel is None:
        return prefixes
    if isinstance(sel, int):
        return _pick(prefixes, sel, gen)
    want = set(sel)
    return [p for p in prefixes if layer_index(p) in want]


class NullProgress:
    """verify's progress protocol: the CLI passes a rich implementation (output.VerifyProgress)."""

    def phase(self, what: str) -> None: ...

    def start(self, layers: int, experts: int, dense: int) -> None: ...

    def advance(self, *, layers: int = 0, experts: int = 0, dense: int = 0, what: str = "") -> None: ...

    def stop(self) -> None: ...


def verify(out, against=None, *, tokens: int | None = None, layers=None, experts: int | None = None,
           seed: int = 0, threads: int | None = None, structural_only: bool = False, dense: bool = True,
           dense_tokens: int = 8, revision: str | None = None, raise_on_failure: bool = True,
           progress: NullProgress | None = None) -> dict:
    """Check a converted W4A8 checkpoint; returns the report, raises VerifyFailed when it fails.

    ``layers``: None/"all", a count (seeded sample) or layer indices ("0,3" or [0, 3]); an index the
    model does not have is a UsageError, and a run that checks nothing fails;
    ``experts``: per-layer sample size (default all); ``tokens``: rows per MoE layer (default enough
    for every sampled expert to get >= 2 slots, at least 32). The VerifyFailed carries ``.report``;
    the report's ``checked`` lists exactly what the numerical pass ran.
    """
    t0 = time.perf_counter()
    progress = progress or NullProgress()
    sel = _parse_layers(layers)
    if experts is not None and experts < 1:
        raise UsageError(f"--experts {experts}: must be at least 1")
    if tokens is not None and tokens < 1:
        raise UsageError(f"--tokens {tokens}: must be at least 1")
    folder = resolve_source(out, revision=revision)
    if not (Path(folder) / "config.json").is_file():
        raise InputError(f"{folder}: no config.json", path=str(folder))
    report: dict = {"output": str(out), "against": None if against is None else str(against), "seed": seed,
                    "threads": threads or torch.get_num_threads(), "tolerance": {
                        "k_act": K_ACT, "k_weight": K_WEIGHT, "lossless_bound": LOSSLESS_BOUND,
                        "rule": "act_rel <= k_act * predicted int8 noise; module weight rel_l2 <= budget "
                                "(report, or 2^-8 lossless / absmax RTN requant); expert output error <= "
                                "k_weight * predicted from budgets; layer rel_l2 <= hypot of both"}}
    clock = _Clock()
    try:
        ckpt = Checkpoint(folder)
    except InputError as e:
        report.update(ok=False, structural={"ok": False, "problems": [{"where": "checkpoint", "message": str(e)}]},
                      layers=[], dense=[])
        return _finish(report, t0, clock, raise_on_failure)
    workers = max(1, int(threads or torch.get_num_threads()))
    # one expert (module, shard) per thread, each single-threaded in torch: nothing nests
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="int4pack-verify") if workers > 1 else None
    with _threads(1), ckpt, _shutting(pool):
        n_hidden = ckpt.text_config.get("num_hidden_layers")
        if isinstance(sel, list) and isinstance(n_hidden, int):  # before the structural pass: it reads every byte
            _missing(layers, sel, set(range(n_hidden)), f"num_hidden_layers {n_hidden}, layers", out)
        progress.phase("structure")
        try:
            # the numerical pass's view of the checkpoint (check_structure builds the same one): the
            # numbers are computed while the structural pass reads every byte, and a layer the
            # structural pass flags is reported as not run, whatever its numbers were
            te = Target(ckpt, Problems())
        except InputError as e:  # a checkpoint value that leaves nothing to check (a config not W4A8...)
            report.update(ok=False, layers=[], dense=[], structural={
                "ok": False, "problems": [{"where": e.tensor or "config", "message": str(e)}]})
            return _finish(report, t0, clock, raise_on_failure)
        moe_prefixes = sorted(te.layers, key=lambda p: (layer_index(p), p))
        dense_mods = [m for m in te.modules if te.roles[m] != "expert"] if dense else []
        if isinstance(sel, list):  # every index must name something verify can run
            have = {layer_index(p) for p in moe_prefixes} | {layer_index(m) for m in dense_mods}
            _missing(layers, sel, have - {-1}, "layers with MoE experts" + (" or dense W4A8 linears" if dense else ""),
                     out)
        gen = torch.Generator().manual_seed(seed)
        chosen = _select_layers(moe_prefixes, sel, gen)
        if sel is not None:
            idx = {layer_index(p) for p in chosen} if isinstance(sel, int) else set(sel)
            dense_mods = [m for m in dense_mods if layer_index(m) in idx]
        # the structural pass on threads of its own (it waits on the disk), the numbers on the pool
        spool = ThreadPoolExecutor(max_workers=max(1, workers // 2), thread_name_prefix="int4pack-scan") \
            if workers > 1 else None
        with _shutting(spool), ThreadPoolExecutor(max_workers=1) as bg:
            st_f = bg.submit(_timed, check_structure, ckpt, spool) if spool is not None else None
            numbers = src = None
            if not structural_only:
                src = _Source(against, revision) if against is not None else None
                progress.start(len(chosen), sum(min(len(te.layers[p]), experts or len(te.layers[p])) for p in chosen),
                               len(dense_mods))
                try:
                    numbers = _numerical(te, chosen, dense_mods, src, _read_report(ckpt, Problems()), experts,
                                         tokens, dense_tokens, gen, clock, progress, pool)
                finally:
                    progress.stop()
                    if src is not None:
                        src.close()
            try:
                (t, problems, counts, conv_report), st_s = st_f.result() if st_f is not None else \
                    _timed(check_structure, ckpt, pool)
            except InputError as e:
                report.update(ok=False, layers=[], dense=[], structural={
                    "ok": False, "problems": [{"where": e.tensor or "config", "message": str(e)}]})
                return _finish(report, t0, clock, raise_on_failure)
        report["structural"] = {"ok": not problems, "problems": problems.items, "counts": counts,
                                "seconds": round(st_s, 3),
                                "serve_format": KLEIDIAI if t.packed else PLAIN}
        report["layers"], report["dense"] = [], []
        report["kernel"] = _kernel_info()
        report["trust"] = _trust_notes(t, counts, conv_report, against is not None and not structural_only)
        bad = {p["where"] for p in problems.items}
        # a config-wide problem (scheme, group, layout record) leaves no layer whose numbers can be trusted
        everywhere = any(w == "config" or w.startswith("config ") for w in bad)

        def flagged(name: str) -> bool:
            return everywhere or any(w == name or w.startswith(name + ".") for w in bad)

        chosen = [p for p in chosen if p in t.layers]  # what the structural pass found
        dense_mods = [m for m in dense_mods if m in t.roles and not flagged(m)]
        notes = []  # a sample larger than the model checks all of it: say so rather than drop it silently
        if isinstance(sel, int) and sel > len(moe_prefixes):
            notes.append(f"--layers {sel}: the model has {len(moe_prefixes)} MoE layer(s); all are checked")
        most = max((len(v) for v in t.layers.values()), default=0)
        if experts is not None and experts > most:
            notes.append(f"--experts {experts}: the MoE layers have {most} experts; all are checked")
        report["checked"] = {"layers": None if sel is None else (sel if isinstance(sel, list) else f"sample of {sel}"),
                             "numerical": not structural_only, "moe_layers": [], "experts": 0, "dense": [],
                             "notes": notes}
        if not structural_only:
            if numbers["copies"] is not None:
                report["copies"] = numbers["copies"]
            for p in chosen:
                report["layers"].append(numbers["layers"][p] if not flagged(p) else {
                    "layer": p, "kind": "moe", "ok": False, "skipped": True,
                    "problems": ["structural problems (see above): not run"]})
            report["dense"] = [numbers["dense"][m] for m in dense_mods]
            ran = [r for r in report["layers"] if not r.get("skipped")]
            report["checked"].update(
                moe_layers=[layer_index(r["layer"]) for r in ran],
                experts=sum(r["experts_checked"] for r in ran),
                experts_by_layer={r["layer"]: r["experts_sampled"] for r in ran},
                dense=[d["module"] for d in report["dense"] if not d.get("skipped")])
    report["ok"] = (report["structural"]["ok"] and all(r["ok"] for r in report["layers"] + report["dense"])
                    and report.get("copies", {}).get("ok", True))
    if not structural_only and not report["layers"] and not report["dense"]:
        report["ok"] = False  # a pass must mean something was checked
        report["nothing_checked"] = True
    return _finish(report, t0, clock, raise_on_failure)


def _numerical(t: Target, chosen: list[str], dense_mods: list[str], src: _Source | None, conv_report, experts,
               tokens, dense_tokens: int, gen, clock, progress, pool) -> dict:
    """Every chosen MoE layer and dense module through the kernel and the references:
    {"layers": {prefix: result}, "dense": {module: result}, "copies": the copied tensors' check}."""
    copies = _check_copies(t, src, clock) if src is not None else None
    # every random draw first, in the order one layer after the other makes them
    layer_in: dict = {}
    for p in chosen:
        r = _guarded(p, "moe", lambda: layer_in.__setitem__(p, _moe_inputs(t, p, experts, tokens, gen, clock)))
        if r is not None:
            layer_in[p] = r  # could not even be read: reported as such
    dense_in: dict = {}
    for m in dense_mods:
        r = _guarded(m, "dense", lambda: dense_in.__setitem__(m, _dense_input(t, m, dense_tokens, gen)))
        if r is not None:
            dense_in[m] = r

    def dense_one(m):
        x = dense_in[m]
        return x if isinstance(x, dict) else _guarded(m, "dense", lambda: _dense(t, m, src, conv_report, x, clock))

    def layer_one(p):
        ins = layer_in[p]
        if "res" not in ins:
            return ins
        progress.advance(what=p)
        return _guarded(p, "moe", lambda: _moe_layer(
            t, p, src, conv_report, ins, clock, tick=lambda: progress.advance(experts=1), pool=pool))

    # the dense modules queue on the pool first; two layers at a time feed it their experts,
    # so that one layer's own serial steps (routing, sums) overlap the other's experts
    dense_f = [pool.submit(dense_one, m) for m in dense_mods] if pool is not None else None
    layers_pool = ThreadPoolExecutor(max_workers=2) if pool is not None and len(chosen) > 1 else None
    out: dict = {"layers": {}, "dense": {}, "copies": copies}
    with _shutting(layers_pool):
        for p, r in zip(chosen, _parallel(layers_pool, layer_one, [(p,) for p in chosen])):
            out["layers"][p] = r
            progress.advance(layers=1)
    for i, m in enumerate(dense_mods):
        progress.advance(what=m)
        out["dense"][m] = dense_one(m) if dense_f is None else dense_f[i].result()
        progress.advance(dense=1)
    return out


def _guarded(name: str, kind: str, run) -> dict:
    """One layer's numerical pass; a checkpoint value that makes it fail (a shape or group the
    structural pass let through) fails that layer, naming it, instead of ending verify."""
    try:
        return run()
    except Int4packError as e:
        why = str(e)
    except (RuntimeError, ValueError, IndexError) as e:
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    key = "layer" if kind == "moe" else "module"
    return {key: name, "kind": kind, "ok": False, "skipped": True,
            "problems": [f"the numerical pass could not run on what the checkpoint holds ({why})"]}


def _trust_notes(t: Target, counts: dict, conv_report: dict | None, against: bool) -> list[str]:
    """Which checks rest on figures the checkpoint records about itself (a forger can edit those)."""
    notes = []
    if not against:
        notes.append("weights were checked against themselves, not against a source: pass --against SRC to "
                     "compare every module and copied tensor with the checkpoint it came from")
        if conv_report is not None:
            notes.append("shard checksums are compared with int4pack_report.json, which the checkpoint carries: "
                         "they detect damage, not a consistent forgery")
    else:
        notes.append("error budgets come from the source (the report's figures only tighten them); copied "
                     "tensors are compared byte for byte with the source")
    if conv_report is None:
        notes.append("no int4pack_report.json: shard checksums could not be checked")
    if t.packed:
        notes.append("each blob is checked against the provenance in its own shard header (CRCs of the values "
                     "it was packed from) and repacked byte for byte")
        if BLOB_CHECKS not in t.packed.record:
            notes.append(f"the layout record has no {BLOB_CHECKS} (written by an older int4pack): the vLLM "
                         "plugin serves these blobs unchecked; convert again to have them checked at load")
    return notes



def _kernel_info() -> dict:
    from . import kleidiai

    # the MoE op is vLLM's algorithm in Python (moe.moe_forward) over torch's matmul op
    return {"matmul": "kleidiai" if kleidiai.native_kleidiai_available() else "torch reference (x86 fallback)",
            "moe_op": "python"}


def _finish(report: dict, t0: float, clock: _Clock, raise_on_failure: bool) -> dict:
    report["timing"] = {k: round(v, 4) for k, v in clock.s.items()}
    report["timing"]["total"] = round(time.perf_counter() - t0, 4)
    fails = [r for r in report.get("layers", []) + report.get("dense", []) if not r.get("ok")]
    st = report.get("structural", {})
    n_l = len(report.get("layers", []))
    worst = max((r.get("rel_l2") or 0 for r in report.get("layers", [])), default=None)
    if report.get("ok") and not report.get("checked", {}).get("numerical", True):
        report["verdict"] = "PASS: structure ok (numerical pass not run: structural only)"
    elif report.get("ok"):
        report["verdict"] = (f"PASS: structure ok, {n_l} MoE layer(s) and {len(report.get('dense', []))} dense "
                             "linear(s) within tolerance" + (f" (worst layer rel_l2 {_fmt(worst)})" if n_l else ""))
    else:
        parts = []
        if report.get("nothing_checked"):
            parts.append("nothing was checked (no MoE layer and no dense W4A8 linear selected)")
        if not st.get("ok", False):
            parts.append(f"{len(st.get('problems', []))} structural problem(s)")
        if not report.get("copies", {}).get("ok", True):
            parts.append(f"{len(report['copies']['problems'])} tensor(s) not as copied from the source")
        if fails:
            names = [r.get("layer") or r.get("module") for r in fails]
            parts.append(f"{len(fails)} layer(s)/linear(s) out of tolerance ({', '.join(names[:3])}"
                         f"{' ...' if len(names) > 3 else ''})")
        report["verdict"] = "FAIL: " + "; ".join(parts)
    if not report.get("ok") and raise_on_failure:
        first = next((p for p in st.get("problems", []) + report.get("copies", {}).get("problems", [])), None)
        detail = f"{first['where']}: {first['message']}" if first else next(
            (f"{r.get('layer') or r.get('module')}: {r['problems'][0]}" for r in fails if r.get("problems")), "")
        hint = ("Re-run convert (the output is damaged or differs from its source), or see --json for every "
                "per-layer figure.")
        if report.get("nothing_checked") and not detail:
            hint = "Select layers that hold MoE experts or dense W4A8 linears (without --no-dense for the latter)."
        err = VerifyFailed(f"{report['verdict']}." + (f" First: {detail}" if detail else ""), hint=hint)
        err.report = report
        raise err
    return report
