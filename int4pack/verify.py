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
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from . import moe as moe_mod
from . import serve_format as sf
from .checkpoint import Checkpoint, resolve_source
from .errors import InputError, Int4packError, VerifyFailed
from .verify_structure import Target, check_structure, layer_index
from .w4a8 import dequantize_w4a8

__all__ = ["verify", "K_ACT", "K_WEIGHT", "LOSSLESS_BOUND", "REL_MARGIN"]

K_ACT = 1.5  # measured/predicted activation error is 0.95-1.05 on random and real layers
K_WEIGHT = 2.0  # the isotropic weight-noise model is within ~1.5x on the fixtures
LOSSLESS_BOUND = 2.0**-8  # bf16 rounding of a scale: relative error <= 2^-8 per element
REL_MARGIN = 1e-3  # report values carry 6 digits; float32 vs float64 sums differ by ~1e-6
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
        try:
            from .plan import make_plan

            plan = make_plan(self.ckpt)
            self.paths = {ren.get(m, m): p for j in plan.jobs for m, p in j.paths.items()}
        except Int4packError:
            self.paths = {}
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

    def g_idx_perm(self, m: str) -> torch.Tensor | None:
        ql = self.read(m)
        if ql.g_idx is None or ql.has_trivial_g_idx():
            return None
        return torch.argsort(ql.g_idx.long(), stable=True)

    def close(self):
        self._cache.clear()
        self.ckpt.close()


def _rtn_rel(w: torch.Tensor, g: int) -> float:
    """rel_l2 of plain absmax round-to-nearest at the target group (scales rounded as shipped)."""
    n, k = w.shape
    gg = k if g == -1 else g
    wg = w.reshape(n, k // gg, gg)
    s = wg.abs().amax(2, keepdim=True) / 7
    s = (s.to(torch.bfloat16).float() if g != -1 else s).clamp(min=2.0**-126)
    q = (wg / s).round().clamp(-8, 7)
    return _rel((q * s).reshape(n, k), w)


def _budget(m: str, w_src: torch.Tensor, g: int, report: dict | None, src: _Source) -> tuple[float, str]:
    """Allowed weight rel_l2 of module m against the source, and where the number comes from."""
    rec = ((report or {}).get("modules") or {}).get(m)
    if isinstance(rec, dict) and rec.get("rel_l2") not in (None, ""):
        return float(rec["rel_l2"]) * (1 + REL_MARGIN) + ABS_FLOOR, "report"
    path = src.paths.get(m, "requant")
    if path == "reemit":
        return ABS_FLOOR, "reemit (exact)"
    if path in ("lossless", "fold"):
        return (ABS_FLOOR if g == -1 else LOSSLESS_BOUND), f"{path} (scale cast)"
    return _rtn_rel(w_src, g) * (1 + REL_MARGIN) + ABS_FLOOR, "requant (<= absmax RTN)"


# --------------------------------------------------------------------------------- inputs


def _norm_weight(ckpt: Checkpoint, prefix: str, names: tuple[str, ...]) -> torch.Tensor | None:
    parent = prefix.rsplit(".", 1)[0]
    for n in names:
        key = f"{parent}.{n}.weight"
        if key in ckpt.tensors:
            return ckpt.get(key).float()
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
    # guarantee coverage: give an expert with too few slots the last slot of tokens lacking it
    for e in range(len(sampled)):
        have = int((ids == e).sum())
        if have >= MIN_SLOTS_PER_EXPERT:
            continue
        cand = [i for i in torch.randperm(t, generator=gen).tolist() if not bool((ids[i] == e).any())]
        for i in cand[: MIN_SLOTS_PER_EXPERT - have]:
            ids[i, k - 1] = e
            w[i, k - 1] = probs[i, e]
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
    def __init__(self):
        self.s = {"reference": 0.0, "kernel": 0.0, "pack": 0.0, "read": 0.0, "prediction": 0.0}

    @contextmanager
    def __call__(self, what: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.s[what] += time.perf_counter() - t0


def _weights_vs_source(t: Target, src: _Source, mods: dict[str, str], report, clock):
    """Source float weights aligned with the converted ones (undoing an act-order fold), per-module
    measured rel_l2 and budget. mods: role -> module name of one MLP."""
    with clock("read"):
        conv = {r: t.dequant(m) for r, m in mods.items()}
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
    return conv, srcw, problems, stats


def _moe_layer(t: Target, prefix: str, src: _Source | None, report, experts_n, tokens, gen, clock) -> dict:
    experts = t.layers[prefix]
    ids_all = sorted(experts)
    sampled = _pick(ids_all, experts_n, gen)
    e_s = len(sampled)
    ck = t.ckpt
    res: dict = {"layer": prefix, "kind": "moe", "experts": len(ids_all), "experts_checked": e_s, "problems": []}
    router = t.routers.get(prefix)
    with clock("read"):
        rw = ck.get(router).float() if router else None
        norm = _norm_weight(ck, prefix, _NORMS)
        bias_name = next((n for n in (f"{prefix}.gate.e_score_correction_bias", f"{prefix}.e_score_correction_bias")
                          if n in ck.tensors), None) if t.routing.get("bias") else None
        bias = ck.get(bias_name).float() if bias_name else None
    k_top = min(t.top_k, e_s)
    n_tok = tokens or max(32, -(-MIN_SLOTS_PER_EXPERT * 2 * e_s // k_top))
    x = _hidden(gen, n_tok, t.shape(experts[ids_all[0]]["gate"])[1], norm)
    scoring = t.routing.get("scoring_func") or "softmax"
    ids, wts = _route(x, rw, sampled, t.top_k, t.norm_topk, gen, scoring, bias)
    res["tokens"] = n_tok
    res["router"] = "real" if rw is not None else "random logits"
    res["scoring"] = scoring + (" + score bias" if bias is not None else "")
    res["input_norm"] = norm is not None

    use_blobs = t.blob(experts[ids_all[0]]["gate"]) is not None
    res["weights"] = "the checkpoint's KleidiAI blobs" if use_blobs else "packed on the fly"
    hidden = x.shape[1]
    k_slots = ids.shape[1]
    slots_c = torch.zeros(n_tok, k_slots, hidden)
    slots_s = torch.zeros(n_tok, k_slots, hidden) if src is not None else slots_c
    act_var = torch.zeros(n_tok, k_slots)
    w_var = torch.zeros(n_tok, k_slots)
    w13p = w2p = None
    wstats: dict[int, dict] = {}
    inter = None
    # one expert at a time: a 128-expert layer's float weights would be ~2.4 GB at once
    for i, e in enumerate(sampled):
        slot = experts[e]
        if not use_blobs:
            with clock("read"):
                qg, sg, _ = t.weight(slot["gate"])
                qu, su, _ = t.weight(slot["up"])
                qd, sd, _ = t.weight(slot["down"])
            inter = qd.shape[1]
            g = t.moe_group(slot)
            with clock("pack"):
                b13 = moe_mod.pack_for_matmul(torch.cat([qg, qu]), torch.cat([sg, su]), g,
                                              None if w13p is None else w13p[i])
                b2 = moe_mod.pack_for_matmul(qd, sd, g, None if w2p is None else w2p[i])
                if w13p is None:
                    w13p = torch.empty((e_s, b13.numel()), dtype=b13.dtype)
                    w2p = torch.empty((e_s, b2.numel()), dtype=b2.dtype)
                if b13.data_ptr() != w13p[i].data_ptr():
                    w13p[i] = b13
                if b2.data_ptr() != w2p[i].data_ptr():
                    w2p[i] = b2
        if src is not None:
            cw, sw, probs, st = _weights_vs_source(t, src, slot, report, clock)
            res["problems"] += [f"expert {e}: {p}" for p in probs]
            wstats[e] = st
            wv = [st[r]["budget"] ** 2 * float(sw[r].double().pow(2).mean()) for r in ("gate", "up", "down")]
        else:
            with clock("read"):
                cw = {r: t.dequant(m) for r, m in slot.items()}
        inter = cw["down"].shape[1]
        tt, jj = (ids == i).nonzero(as_tuple=True)
        xe = x[tt]
        g2 = wts[tt, jj] ** 2
        w13c = torch.cat([cw["gate"], cw["up"]])
        with clock("reference"):
            slots_c[tt, jj] = moe_mod.expert_forward(xe, w13c, cw["down"], t.activation)
            if src is not None:
                w13s = torch.cat([sw["gate"], sw["up"]])
                slots_s[tt, jj] = moe_mod.expert_forward(xe, w13s, sw["down"], t.activation)
        with clock("prediction"):
            act_var[tt, jj] = moe_mod.expert_noise(xe, w13c, cw["down"], t.activation) * g2
            if src is not None:
                w_var[tt, jj] = moe_mod.expert_noise(xe, w13s, sw["down"], t.activation, activations=False,
                                                     weight_var=wv) * g2
    g = t.moe_group(experts[sampled[-1]])
    if use_blobs:
        # vLLM's w13 of an expert is its gate blob then its up blob (8-row blocks: serve_format.py)
        with clock("read"):
            w13p = torch.stack([torch.cat([t.blob(experts[e]["gate"]), t.blob(experts[e]["up"])]) for e in sampled])
            w2p = torch.stack([t.blob(experts[e]["down"]) for e in sampled])
    with clock("kernel"):
        y_k = moe_mod.moe_forward(x, ids, wts, w13p, w2p, hidden, inter, g, False, t.activation)
    y_c = (slots_c * wts.unsqueeze(2)).sum(1)
    y_s = (slots_s * wts.unsqueeze(2)).sum(1) if src is not None else y_c

    ref_norm = float(y_s.double().norm())
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


def _dense(t: Target, m: str, src: _Source | None, report, tokens: int, gen, clock) -> dict:
    res: dict = {"module": m, "kind": "dense", "problems": []}
    with clock("read"):
        q, s, g = t.weight(m)
        w_c = dequantize_w4a8(q, s, g)
    n, k = q.shape
    norm = None
    if m.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value"):
        norm = _norm_weight(t.ckpt, m.rsplit(".", 1)[0], ("input_layernorm",))
    elif m.rsplit(".", 1)[-1] in ("gate_proj", "up_proj"):
        norm = _norm_weight(t.ckpt, m.rsplit(".", 1)[0], _NORMS)
    x = _hidden(gen, tokens, k, norm)
    with clock("pack"):
        wp = t.blob(m)
        if wp is None:
            wp = moe_mod.pack_for_matmul(q, s, g)
    with clock("kernel"):
        y_k = torch.ops.aten._dyn_quant_matmul_4bit(x, wp, k if g == -1 else g, k, n)
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


def _select_layers(prefixes: list[str], layers, gen) -> list[str]:
    if layers is None or layers == "all":
        return prefixes
    if isinstance(layers, int):
        return _pick(prefixes, layers, gen)
    if isinstance(layers, str):
        layers = [int(s) for s in layers.replace(" ", "").split(",") if s]
    want = {int(v) for v in layers}
    return [p for p in prefixes if layer_index(p) in want]


def verify(out, against=None, *, tokens: int | None = None, layers=None, experts: int | None = None,
           seed: int = 0, threads: int | None = None, structural_only: bool = False, dense: bool = True,
           dense_tokens: int = 8, revision: str | None = None, raise_on_failure: bool = True) -> dict:
    """Check a converted W4A8 checkpoint; returns the report, raises VerifyFailed when it fails.

    ``layers``: None/"all", a count (seeded sample) or layer indices ("0,3" or [0, 3]);
    ``experts``: per-layer sample size (default all); ``tokens``: rows per MoE layer (default enough
    for every sampled expert to get >= 2 slots, at least 32). The VerifyFailed carries ``.report``.
    """
    t0 = time.perf_counter()
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
    with _threads(threads), ckpt:
        ts = time.perf_counter()
        t, problems, counts, conv_report = check_structure(ckpt)
        report["structural"] = {"ok": not problems, "problems": problems.items, "counts": counts,
                                "seconds": round(time.perf_counter() - ts, 3),
                                "serve_format": sf.KLEIDIAI if t.packed else sf.PLAIN}
        report["layers"], report["dense"] = [], []
        report["kernel"] = _kernel_info()
        if not structural_only:
            src = _Source(against, revision) if against is not None else None
            gen = torch.Generator().manual_seed(seed)
            bad = {p["where"] for p in problems.items}
            try:
                moe_prefixes = sorted(t.layers, key=lambda p: (layer_index(p), p))
                chosen = _select_layers(moe_prefixes, layers, gen)
                for p in chosen:
                    if any(w == p or w.startswith(p + ".") for w in bad):
                        report["layers"].append({"layer": p, "kind": "moe", "ok": False, "skipped": True,
                                                 "problems": ["structural problems (see above): not run"]})
                        continue
                    report["layers"].append(_moe_layer(t, p, src, conv_report, experts, tokens, gen, clock))
                if dense:
                    idx = {layer_index(p) for p in chosen}
                    for m in t.modules:
                        if t.roles[m] == "expert" or (layers is not None and layer_index(m) not in idx):
                            continue
                        if any(w == m for w in bad):
                            continue
                        report["dense"].append(_dense(t, m, src, conv_report, dense_tokens, gen, clock))
            finally:
                if src is not None:
                    src.close()
    report["ok"] = report["structural"]["ok"] and all(r["ok"] for r in report["layers"] + report["dense"])
    return _finish(report, t0, clock, raise_on_failure)


def _kernel_info() -> dict:
    from . import kleidiai

    ext = moe_mod.extension()
    return {"matmul": "kleidiai" if kleidiai.native_kleidiai_available() else "torch reference (x86 fallback)",
            "moe_op": "csrc/moe.cpp" if ext is not None else "python twin"}


def _finish(report: dict, t0: float, clock: _Clock, raise_on_failure: bool) -> dict:
    report["timing"] = {k: round(v, 4) for k, v in clock.s.items()}
    report["timing"]["total"] = round(time.perf_counter() - t0, 4)
    fails = [r for r in report.get("layers", []) + report.get("dense", []) if not r.get("ok")]
    st = report.get("structural", {})
    n_l = len(report.get("layers", []))
    worst = max((r.get("rel_l2") or 0 for r in report.get("layers", [])), default=None)
    if report.get("ok"):
        report["verdict"] = (f"PASS: structure ok, {n_l} MoE layer(s) and {len(report.get('dense', []))} dense "
                             f"linear(s) within tolerance (worst layer rel_l2 {_fmt(worst)})")
    else:
        parts = []
        if not st.get("ok", False):
            parts.append(f"{len(st.get('problems', []))} structural problem(s)")
        if fails:
            names = [r.get("layer") or r.get("module") for r in fails]
            parts.append(f"{len(fails)} layer(s)/linear(s) out of tolerance ({', '.join(names[:3])}"
                         f"{' ...' if len(names) > 3 else ''})")
        report["verdict"] = "FAIL: " + "; ".join(parts)
    if not report.get("ok") and raise_on_failure:
        first = next((p for p in st.get("problems", [])), None)
        detail = f"{first['where']}: {first['message']}" if first else next(
            (f"{r.get('layer') or r.get('module')}: {r['problems'][0]}" for r in fails if r.get("problems")), "")
        err = VerifyFailed(f"{report['verdict']}. First: {detail}",
                           hint="Re-run convert (the output is damaged or differs from its source), or see "
                                "--json for every per-layer figure.")
        err.report = report
        raise err
    return report
