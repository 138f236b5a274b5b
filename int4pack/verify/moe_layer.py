"""verify's numerical check of one MoE layer: its sampled experts through the W4A8 MoE op
(vLLM's algorithm, ``moe.MoeRun``) and through float32 references on the converted weights and,
with a source, on the source's own dequantised weights; the errors against their predictions."""

from __future__ import annotations

import math
from functools import partial

import torch

from .. import _ext, kernels
from .. import moe as moe_mod
from . import matmul
from ..errors import InputError
from .threads import PerThread, parallel
from .exact_ints import exact_expert, exact_reference, exact_stats
from .source import Source, bias_vs_source, weights_vs_source
from .w4a8_output import W4A8Output
from .tolerance import ABS_FLOOR, K_ACT, K_WEIGHT, cos, not_finite, rel, sum_sq
from ..w4a8 import dequantize_w4a8

__all__ = ["check_layer"]


def check_layer(output: W4A8Output, prefix: str, src: Source | None, report, inputs: dict, clock, tick=None,
               pool=None, work: PerThread | None = None) -> dict:
    """``work``: each thread's expert buffers (``PerThread(dict)``), kept from one layer to the next."""
    experts = output.layers[prefix]
    ids_all = sorted(experts)
    res, sampled, x, ids, wts = (inputs[k] for k in ("res", "sampled", "x", "ids", "wts"))
    e_s = len(sampled)
    n_tok = x.shape[0]
    for e in sampled:
        lack = [r for r in ("gate", "up", "down") if r not in experts[e]]
        if lack:
            raise InputError(f"{prefix}: expert {e} has no W4A8 {'/'.join(lack)} projection (it has "
                             f"{', '.join(sorted(experts[e].values()))})", tensor=f"{prefix}.experts.{e}",
                             hint="The checkpoint lost a tensor; convert again.")

    use_blobs = output.blob(experts[ids_all[0]]["gate"]) is not None
    hidden = x.shape[1]
    k_slots = ids.shape[1]
    slots_c = torch.zeros(n_tok, k_slots, hidden)
    slots_s = torch.zeros(n_tok, k_slots, hidden) if src is not None else slots_c
    act_var = torch.zeros(n_tok, k_slots)
    w_var = torch.zeros(n_tok, k_slots)
    wstats: dict[int, dict] = {}
    g = output.moe_group(experts[sampled[-1]])
    inter = output.shape(experts[sampled[0]]["down"])[1]
    # vLLM's MoE algorithm (moe.moe_forward), its experts' matmuls run by the tasks below
    none = torch.empty(e_s, 1)
    moe_mod._check(x, ids, wts, none, none, hidden, inter, g, output.activation)  # moe_forward's own checks
    kernel = moe_mod.MoeRun(x, ids, wts, e_s, hidden, inter, g, False, output.activation)
    # where torch's op is not KleidiAI, its reference kernel's twin on the int4 values (matmul.py)
    twin = matmul.twin() if not use_blobs and kernel.cdt == torch.float32 else None
    res["weights"] = ("the checkpoint's KleidiAI blobs" if use_blobs else
                      "the int4 values as read" if twin is not None else "packed on the fly")
    ran: set[str] = set()  # which matmul ran, per expert (the twin unless an expert's weights do not fit it)

    vk = _ext.load("verify_kernels")
    buffers = work if work is not None else PerThread(dict)

    def one(i: int, e: int) -> dict:
        """Expert e (the i-th sampled): its packed weights through the kernel, its float references
        and predicted errors on its routed rows. One thread, one expert: nothing shared but reads;
        a 128-expert layer's float weights would be ~2.4 GB at once, one expert's are ~20 MB, in
        buffers the thread reuses for the next expert (``_ExpertBuffers``)."""
        slot = experts[e]
        if i in after:
            output.prefetch(experts[sampled[after[i]]].values())
        out: dict = {"problems": []}
        tt, jj = (ids == i).nonzero(as_tuple=True)
        xe = x[tt]
        g2 = wts[tt, jj] ** 2
        with kernels.threads_here(1):
            bufs = _ExpertBuffers.of(output, slot, g, vk, buffers.get())
            exact = None  # a lossless expert equal to its source: {role: source scales} (exact_ints.py)
            if bufs is not None:  # each weight read or decoded once, into this thread's buffers
                with clock("read"):
                    bufs.fill(output, slot)
                if src is not None:
                    with clock("compare"):
                        exact = exact_expert(output, src, slot, bufs.views())
            # without a source, or with one whose ints these are, the float weights are only
            # multiplied: the references read the int4 values
            from_int4 = bufs is not None and (src is None or exact is not None)
            if bufs is not None:
                if not from_int4:
                    with clock("read"):
                        bufs.dequant()
                w13c, w2c = bufs.w13, bufs.w2
                cw = {"gate": w13c[:bufs.inter], "up": w13c[bufs.inter:], "down": w2c}
            else:
                with clock("read"):  # each blob decoded once, for the kernel and the references alike
                    qs = {r: output.weight(m) for r, m in slot.items()}
                    cw = {r: dequantize_w4a8(*qs[r]) for r in slot}
                w13c, w2c = torch.cat([cw["gate"], cw["up"]]), cw["down"]
            w13q = w2q = None  # (int4 values, scales) for the twin
            if twin is not None:
                if bufs is not None:
                    w13q, w2q = (bufs.q13, bufs.s13), (bufs.q2, bufs.s2)
                else:
                    (qg, sg, _), (qu, su, _), (qd, sd, _) = (qs[r] for r in ("gate", "up", "down"))
                    w13q, w2q = (torch.cat([qg, qu]), torch.cat([sg, su])), (qd, sd)
                if not (matmul.fits(*w13q, kernel.g13) and matmul.fits(*w2q, kernel.g2)):
                    w13q = w2q = None
            if w13q is None and use_blobs:
                # vLLM's w13 of an expert is its gate blob then its up blob (8-row blocks: blobs.py)
                with clock("read"):
                    w13p = torch.cat([output.blob(slot["gate"]), output.blob(slot["up"])])
                    w2p = output.blob(slot["down"])
            elif w13q is None and bufs is not None:
                with clock("pack"):
                    w13p = moe_mod.pack_for_matmul(bufs.q13, bufs.s13, g, out=bufs.p13)
                    w2p = moe_mod.pack_for_matmul(bufs.q2, bufs.s2, g, out=bufs.p2)
            elif w13q is None:
                (qg, sg, _), (qu, su, _), (qd, sd, _) = (qs[r] for r in ("gate", "up", "down"))
                with clock("pack"):
                    w13p = moe_mod.pack_for_matmul(torch.cat([qg, qu]), torch.cat([sg, su]), g)
                    w2p = moe_mod.pack_for_matmul(qd, sd, g)
            with clock("kernel"):
                if w13q is not None:
                    kernel.expert_with(i, partial(matmul.matmul, twin), w13q, w2q)
                    out["matmul"] = matmul.TWIN
                else:
                    kernel.expert(i, w13p, w2p)
                    out["matmul"] = matmul.TORCH
                    del w13p, w2p
            del w13q, w2q
            if exact is not None:
                with clock("reference"):
                    sref = exact_reference(vk, xe.float().contiguous(), bufs.q13, bufs.q2, exact, output.activation)
                with clock("compare"):
                    st, probs, wv = exact_stats(output, src, slot, report, vk, bufs.views(), exact, sref)
                    probs += [p for m in slot.values() for p in bias_vs_source(output, src, m)]
                out["problems"] = [f"expert {e}: {p}" for p in probs]
                out["stats"] = st
                out["s"] = sref["y"]
            elif src is not None:
                if bufs is not None:
                    ints = {"gate": (bufs.q13[:bufs.inter], bufs.s13[:bufs.inter]),
                            "up": (bufs.q13[bufs.inter:], bufs.s13[bufs.inter:]), "down": (bufs.q2, bufs.s2)}
                else:
                    ints = {r: qs[r][:2] for r in slot}
                cw, sw, probs, st = weights_vs_source(output, src, slot, report, clock, cw, ints)
                del ints
                out["problems"] = [f"expert {e}: {p}" for p in probs]
                out["stats"] = st
                wv = [st[r]["budget"] ** 2 * sum_sq(sw[r]) / sw[r].numel() for r in ("gate", "up", "down")]
            if bufs is None:
                del qs
            with clock("reference"):  # moe.expert_forward's operations, its y13 and act kept for the prediction
                if from_int4:  # and the squared weight sums on the way
                    y13 = vk.w4a8_reference(xe.float().contiguous(), bufs.q13, bufs.s13, row_sq=bufs.sq13)
                    act = moe_mod.activation(y13[:, :inter], y13[:, inter:], output.activation).contiguous()
                    out["c"] = vk.w4a8_reference(act, bufs.q2, bufs.s2, col_sq=bufs.sq2)
                else:
                    y13 = xe.float() @ w13c.t()
                    act = moe_mod.activation(y13[:, :inter], y13[:, inter:], output.activation)
                    out["c"] = act @ w2c.t()
                if src is not None and exact is None:
                    w13s = torch.cat([sw["gate"], sw["up"]])
                    out["s"] = moe_mod.expert_forward(xe, w13s, sw["down"], output.activation)
            with clock("prediction"):
                if bufs is not None:
                    sq13, sq2 = bufs.sq13, bufs.sq2
                else:
                    sq13, sq2 = (w13c * w13c).sum(1), (w2c * w2c).sum(0)
                if vk is not None and isinstance(output.activation, int):  # one call without the GIL: 16 threads
                    # queue for it on small torch ops (the native kernel knows the op's activations only)
                    out["act_var"] = vk.act_noise(xe.float().contiguous(), y13.contiguous(), act.contiguous(),
                                                  sq13.float().contiguous(), sq2.float().contiguous(),
                                                  output.activation) * g2
                else:
                    out["act_var"] = moe_mod.propagated_noise(xe.float(), y13, act, sq13, sq2, hidden,
                                                              output.activation) * g2
                if exact is not None:  # expert_noise's, from the source reference's own passes
                    out["w_var"] = moe_mod.propagated_noise(xe.float(), sref["y13"], sref["act"], sref["sq13"],
                                                            sref["sq2"], hidden, output.activation, activations=False,
                                                            weight_var=wv) * g2
                elif src is not None:
                    out["w_var"] = moe_mod.expert_noise(xe, w13s, sw["down"], output.activation, activations=False,
                                                        weight_var=wv) * g2
        if src is not None:
            src.forget(slot.values())
            out["exact"] = exact is not None
        out["at"] = (tt, jj)
        return out

    # the experts in the order their bytes lie in the shards (names sort 0, 1, 10, 100, ...): each
    # thread's or worker's reads then stream through the file, which the kernel reads ahead
    order = sorted(range(e_s), key=lambda i: min(output.place(m) for m in experts[sampled[i]].values()))
    after = dict(zip(order, order[1:]))  # each expert asks for the next one's bytes as it starts
    by_i = dict(zip(order, parallel(pool, one, [(i, sampled[i]) for i in order])))
    for i, e in enumerate(sampled):
        r = by_i[i]
        tt, jj = r["at"]
        res["problems"] += r["problems"]
        ran.add(r["matmul"])
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
    res["matmul"] = ", ".join(sorted(ran))
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
            if not we <= K_WEIGHT * pe + ABS_FLOOR:
                res["problems"].append(
                    f"expert {e}: output on its {int(mask.sum())} routed token(s) deviates from the source by "
                    f"{we:.4g} (allowed {K_WEIGHT} x {pe:.4g} from the weight budgets)")
        # how many sampled experts were found equal to their source as integers (exact_ints.py);
        # the others were compared as floats, and any int that differs named
        res["experts_exact"] = sum(by_i[i]["exact"] for i in range(e_s))
        if worst:
            res["worst_expert"] = {"expert": worst[0], "output_rel": worst[2], "output_pred": worst[3]}
        res["expert_stats"] = {str(e): s for e, s in wstats.items()}
    res["tolerance"] = tol
    if not res["rel_l2"] <= tol + ABS_FLOOR:
        res["problems"].append(f"layer output error {res['rel_l2']:.4g} exceeds the tolerance {tol:.4g}")
    res["problems"] += not_finite(res)
    res["ok"] = not res["problems"]
    return res


def _expert_pred(w_var: torch.Tensor, wts: torch.Tensor, mask: torch.Tensor, ref_slots: torch.Tensor) -> float:
    """Predicted relative output error of one expert's (ungated) outputs from its weight budgets."""
    v = w_var[mask] / (wts[mask] ** 2).clamp(min=1e-30)  # predicted_noise gated by g^2: undo it
    den = float(ref_slots.double().norm())
    return math.sqrt(float(v.sum())) / den if den > 0 else 0.0


class _ExpertBuffers:
    """One thread's buffers for an expert's weights, reused from one expert to the next: int4 values
    and scales (gate and up rows in one matrix, w13, as the kernel takes them), their float32 values
    and squared sums, and the kernel's packed tensors."""

    def __init__(self, spec13: tuple, spec2: tuple):
        (n13, h, dt13, c13), (h2, inter, dt2, c2) = spec13, spec2
        self.inter = n13 // 2
        self.q13, self.s13 = torch.empty(n13, h, dtype=torch.int8), torch.empty(n13, c13, dtype=dt13)
        self.q2, self.s2 = torch.empty(h2, inter, dtype=torch.int8), torch.empty(h2, c2, dtype=dt2)
        self.w13, self.w2 = torch.empty(n13, h), torch.empty(h2, inter)
        self.sq13, self.sq2 = torch.empty(n13), torch.empty(inter)
        # torch's float32 reference layout (moe.pack_for_matmul off Arm): bytes as floats, then scales
        self.p13 = torch.empty(n13 * h // 2 + n13 * c13)
        self.p2 = torch.empty(h2 * inter // 2 + h2 * c2)
        self.blobs: dict = {}  # a packed checkpoint's blobs as read, by size

    @staticmethod
    def of(output: W4A8Output, slot: dict[str, str], g: int, vk, mine: dict) -> _ExpertBuffers | None:
        """This thread's buffers for the expert ``slot`` (made, or remade for another shape); None where
        the expert's weights do not fit them (another layout, mixed scales: read as before)."""
        if vk is None:
            return None
        specs = [output.weight_spec(slot[r]) for r in ("gate", "up", "down")]
        if any(sp is None for sp in specs) or specs[0] != specs[1]:
            return None
        for m, sp in zip((slot["gate"], slot["down"]), (specs[0], specs[2])):
            if sp[3] != (1 if output.group_for(m) == -1 else sp[1] // output.group_for(m)):
                return None  # scales that are not one per group of the module's group: dequantize_w4a8 decides
        key = (specs[0][0] * 2, *specs[0][1:], *specs[2])
        if mine.get("key") != key:
            mine.clear()
            n, k, dt, c = specs[0]
            mine.update(key=key, bufs=_ExpertBuffers((2 * n, k, dt, c), specs[2]))
        bufs = mine["bufs"]
        bufs.vk = vk
        return bufs

    def views(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """role -> (int4 values, scales) of the expert in the buffers."""
        i = self.inter
        return {"gate": (self.q13[:i], self.s13[:i]), "up": (self.q13[i:], self.s13[i:]), "down": (self.q2, self.s2)}

    def fill(self, output: W4A8Output, slot: dict[str, str]) -> None:
        """The expert's int4 values and scales."""
        into = self.views()
        for r in sorted(into, key=lambda r: output.place(slot[r])):  # in file order
            output.weight_into(slot[r], *into[r], self.blobs)

    def dequant(self) -> None:
        """Their float32 values and squared sums."""
        self.vk.dequant_sq(self.q13, self.s13, self.w13, row_sq=self.sq13)
        self.vk.dequant_sq(self.q2, self.s2, self.w2, col_sq=self.sq2)
