"""verify's numerical check of one MoE layer: its sampled experts through the W4A8 MoE op
(vLLM's algorithm, ``moe.MoeRun``) and through float32 references on the converted weights and,
with a source, on the source's own dequantised weights (each expert: expert_check.py); the
layer's errors against their predictions."""

from __future__ import annotations

import math

import torch

from .expert_check import LayerRun, check_expert
from .source import Source
from .threads import PerThread, parallel
from .tolerance import ABS_FLOOR, K_ACT, K_WEIGHT, cos, expert_prediction, not_finite, rel
from .w4a8_output import W4A8Output

__all__ = ["check_layer"]


def check_layer(output: W4A8Output, prefix: str, src: Source | None, report, inputs: dict, clock, tick=None,
                pool=None, work: PerThread | None = None) -> dict:
    """The layer ``prefix`` on its random ``inputs`` (random_inputs.moe_inputs): its result, ``inputs``'s
    "res" filled in. ``tick``: called once per expert done; ``pool``: the experts run on its threads;
    ``work``: each thread's expert buffers (``PerThread(dict)``), kept from one layer to the next."""
    layer = LayerRun(output, prefix, src, report, inputs, clock, work)
    by_i = dict(zip(layer.order, parallel(pool, check_expert, [(layer, i) for i in layer.order])))
    # each expert's reference rows and predicted noise back in the routing's (token, slot) places
    n_tok, k_slots = layer.ids.shape
    slots_c = torch.zeros(n_tok, k_slots, layer.hidden)
    slots_s = torch.zeros(n_tok, k_slots, layer.hidden) if src is not None else slots_c
    act_var, w_var = torch.zeros(n_tok, k_slots), torch.zeros(n_tok, k_slots)
    for i in range(len(layer.sampled)):
        r = by_i[i]
        tt, jj = r["at"]
        layer.res["problems"] += r["problems"]
        slots_c[tt, jj] = r["c"]
        act_var[tt, jj] = r["act_var"]
        if src is not None:
            slots_s[tt, jj] = r["s"]
            w_var[tt, jj] = r["w_var"]
        if tick is not None:
            tick()
    with clock("kernel"):
        y_k = layer.kernel.finish()
    return _verdict(layer, by_i, y_k, slots_c, slots_s, act_var, w_var)


def _verdict(layer: LayerRun, by_i: dict, y_k: torch.Tensor, slots_c, slots_s, act_var, w_var) -> dict:
    """The layer's output error against the float references, split into its activation and weight
    parts, each against its prediction; with a source, each expert's too."""
    res, wts, src = layer.res, layer.wts, layer.src
    experts = _experts_vs_source(layer, by_i, slots_c, slots_s, w_var) if src is not None else None
    res["matmul"] = ", ".join(sorted({r["matmul"] for r in by_i.values()}))
    y_c = (slots_c * wts.unsqueeze(2)).sum(1)
    y_s = (slots_s * wts.unsqueeze(2)).sum(1) if src is not None else y_c
    ref_norm = float(y_s.double().norm())
    if ref_norm == 0.0:  # an all-zero reference compares nothing
        res["problems"].append("the float reference output is zero everywhere: nothing was compared")
    act_rel = rel(y_k, y_c)
    act_pred = math.sqrt(float(act_var.sum())) / max(float(y_c.double().norm()), 1e-30)
    res.update(rel_l2=rel(y_k, y_s), max_abs=float((y_k - y_s).abs().max()), cosine=cos(y_k, y_s),
               act_rel=act_rel, act_pred=act_pred, act_ratio=act_rel / act_pred if act_pred > 0 else None)
    if not act_rel <= K_ACT * act_pred + ABS_FLOOR:
        res["problems"].append(f"activation-quantisation error {act_rel:.4g} exceeds {K_ACT} x its predicted "
                               f"{act_pred:.4g}: the kernel or the packed weights disagree with the int4 tensors")
    tol = K_ACT * act_pred
    if experts is not None:
        w_pred = math.sqrt(float(w_var.sum())) / max(ref_norm, 1e-30)
        res.update(weight_rel=rel(y_c, y_s), weight_pred=w_pred)
        tol = math.hypot(K_ACT * act_pred, K_WEIGHT * w_pred)
        res["problems"] += experts.pop("problems")
        res.update(experts)
    res["tolerance"] = tol
    if not res["rel_l2"] <= tol + ABS_FLOOR:
        res["problems"].append(f"layer output error {res['rel_l2']:.4g} exceeds the tolerance {tol:.4g}")
    res["problems"] += not_finite(res)
    res["ok"] = not res["problems"]
    return res


def _experts_vs_source(layer: LayerRun, by_i: dict, slots_c, slots_s, w_var) -> dict:
    """Each sampled expert's output on its routed rows against the source's, within ``K_WEIGHT`` times
    what its weight budgets predict: the layer result's problems and figures of the experts (the
    worst one named, how many were equal to the source as integers, each one's figures)."""
    problems, worst, wstats = [], None, {}
    for i, e in enumerate(layer.sampled):
        mask = layer.ids == i
        a, b = slots_c[mask], slots_s[mask]
        we, pe = rel(a, b), expert_prediction(w_var, layer.wts, mask, b)
        wstats[e] = {**by_i[i]["stats"], "output_rel": we, "output_pred": pe, "slots": int(mask.sum())}
        if worst is None or we / max(pe, 1e-30) > worst[1]:
            worst = (e, we / max(pe, 1e-30), we, pe)
        if not we <= K_WEIGHT * pe + ABS_FLOOR:
            problems.append(f"expert {e}: output on its {int(mask.sum())} routed token(s) deviates from the source "
                            f"by {we:.4g} (allowed {K_WEIGHT} x {pe:.4g} from the weight budgets)")
    # how many sampled experts were found equal to their source as integers (exact_ints.py); the
    # others were compared as floats, and any int that differs named
    out = {"problems": problems, "experts_exact": sum(by_i[i]["exact"] for i in range(len(layer.sampled)))}
    if worst:
        out["worst_expert"] = {"expert": worst[0], "output_rel": worst[2], "output_pred": worst[3]}
    return {**out, "expert_stats": {str(e): s for e, s in wstats.items()}}
