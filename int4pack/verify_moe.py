"""verify's numerical check of one MoE layer: its sampled experts through the W4A8 MoE op
(vLLM's algorithm, ``moe.MoeRun``) and through float32 references on the converted weights and,
with a source, on the source's own dequantised weights; the errors against their predictions."""

from __future__ import annotations

import math

import torch

from . import kernels
from . import moe as moe_mod
from .verify_pool import parallel
from .verify_source import Source, weights_vs_source
from .verify_structure import Target
from .verify_tolerance import ABS_FLOOR, K_ACT, K_WEIGHT, cos, rel
from .w4a8 import dequantize_w4a8

__all__ = ["check_layer"]


def check_layer(t: Target, prefix: str, src: Source | None, report, inputs: dict, clock, tick=None,
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
                cw, sw, probs, st = weights_vs_source(t, src, slot, report, clock, cw)
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

    for i, (e, r) in enumerate(zip(sampled, parallel(pool, one, list(enumerate(sampled))))):
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
    act_rel = rel(y_k, y_c)
    act_pred = math.sqrt(float(act_var.sum())) / max(float(y_c.double().norm()), 1e-30)
    res.update(rel_l2=rel(y_k, y_s), max_abs=float((y_k - y_s).abs().max()), cosine=cos(y_k, y_s),
               act_rel=act_rel, act_pred=act_pred, act_ratio=act_rel / act_pred if act_pred > 0 else None)
    if act_rel > K_ACT * act_pred + ABS_FLOOR:
        res["problems"].append(f"activation-quantisation error {act_rel:.4g} exceeds {K_ACT} x its predicted "
                               f"{act_pred:.4g}: the kernel or the packed weights disagree with the int4 tensors")
    tol = K_ACT * act_pred
    if src is not None:
        w_rel = rel(y_c, y_s)
        w_pred = math.sqrt(float(w_var.sum())) / max(ref_norm, 1e-30)
        res.update(weight_rel=w_rel, weight_pred=w_pred)
        tol = math.hypot(K_ACT * act_pred, K_WEIGHT * w_pred)
        worst = None
        for i, e in enumerate(sampled):
            mask = ids == i
            a, b = slots_c[mask], slots_s[mask]
            we = rel(a, b)
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
