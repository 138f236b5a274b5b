"""One sampled expert of an MoE layer through verify's numerical check, on one thread: its weights
read once (into the thread's buffers where they fit), its routed rows through the W4A8 kernel on
them, the float32 references on the converted weights and, with a source, on the source's own
(as integers where the source plans the expert lossless: exact_ints.py), and the errors both
references predict. One thread, one expert: nothing shared but reads; a 128-expert layer's float
weights would be ~2.4 GB at once, one expert's are ~20 MB, in buffers the thread reuses for the
next expert (``ExpertBuffers``).
"""

from __future__ import annotations

import torch

from .. import _ext, kernels
from .. import moe as moe_mod
from ..errors import InputError
from ..groups import scales_per_row
from ..w4a8 import dequantize_w4a8
from . import matmul
from .source import Source, expert_vs_source
from .threads import PerThread
from .w4a8_output import W4A8Output

__all__ = ["LayerRun", "ExpertBuffers", "check_expert"]

ROLES = ("gate", "up", "down")


class LayerRun:
    """What the sampled experts of one MoE layer share: the layer's rows and routing
    (random_inputs.moe_inputs), the kernel run their matmuls feed (vLLM's algorithm, ``moe.MoeRun``),
    which matmul runs, the experts in the order their bytes lie in the shards, and each thread's
    buffers (``work``: ``PerThread(dict)``, kept from one layer to the next)."""

    def __init__(self, output: W4A8Output, prefix: str, src: Source | None, report, inputs: dict, clock,
                 work: PerThread | None = None):
        self.output, self.src, self.report, self.clock = output, src, report, clock
        self.experts = output.layers[prefix]
        self.res, self.sampled, self.x, self.ids, self.wts = (inputs[k] for k in ("res", "sampled", "x", "ids", "wts"))
        for e in self.sampled:
            lack = [r for r in ROLES if r not in self.experts[e]]
            if lack:
                raise InputError(f"{prefix}: expert {e} has no W4A8 {'/'.join(lack)} projection (it has "
                                 f"{', '.join(sorted(self.experts[e].values()))})", tensor=f"{prefix}.experts.{e}",
                                 hint="The checkpoint lost a tensor; convert again.")
        slots = [self.experts[e] for e in self.sampled]
        self.vk = _ext.load("verify_kernels")
        self.buffers = work if work is not None else PerThread(dict)
        # which experts the threads' buffers take, and their shapes (without the C++ kernels, none)
        self.buffer_keys = [ExpertBuffers.key(output, slot) if self.vk is not None else None for slot in slots]
        self.use_blobs = output.blob(self.experts[min(self.experts)]["gate"]) is not None
        self.g = output.moe_group(slots[-1])
        self.hidden, self.inter = self.x.shape[1], output.shape(slots[0]["down"])[1]
        # the experts in the order their bytes lie in the shards (names sort 0, 1, 10, 100, ...): each
        # thread's or worker's reads then stream through the file, which the kernel reads ahead
        self.order = sorted(range(len(slots)), key=lambda i: min(output.place(m) for m in slots[i].values()))
        self.after = dict(zip(self.order, self.order[1:]))  # each expert asks for the next one's bytes as it starts
        none = torch.empty(len(slots), 1)
        moe_mod._check(self.x, self.ids, self.wts, none, none, self.hidden, self.inter, self.g,
                       output.activation)  # moe_forward's own checks
        self.kernel = moe_mod.MoeRun(self.x, self.ids, self.wts, len(slots), self.hidden, self.inter, self.g, False,
                                     output.activation)
        # where torch's op is not KleidiAI, its reference kernel's twin on the int4 values (matmul.py)
        self.twin = matmul.twin() if not self.use_blobs and self.kernel.cdt == torch.float32 else None
        self.res["weights"] = ("the checkpoint's KleidiAI blobs" if self.use_blobs else
                               "the int4 values as read" if self.twin is not None else "packed on the fly")


def check_expert(layer: LayerRun, i: int) -> dict:
    """The i-th sampled expert's check: {"problems", "matmul" (which ran), "c" (the float reference on
    the converted weights, per routed row), "act_var" (its predicted activation noise), "at" (its
    rows and slots); with a source "s", "w_var", "stats" and "exact" too}."""
    output, clock, src = layer.output, layer.clock, layer.src
    e = layer.sampled[i]
    slot = layer.experts[e]
    tt, jj = (layer.ids == i).nonzero(as_tuple=True)
    xe = layer.x[tt]
    out: dict = {"problems": [], "at": (tt, jj)}
    with kernels.threads_here(1):
        with clock("read"):
            w = _read(layer, i, layer.buffers.get())
        out["matmul"] = matmul.run_expert(layer.kernel, i, layer.twin, w.w13, w.w2, w.packed, clock)
        cmp = None
        if src is not None:
            cmp = expert_vs_source(output, src, slot, layer.report, clock, w.ints, w.floats, xe, layer.vk,
                                   output.activation, w.bufs.q13 if w.bufs is not None else None)
            out.update(problems=[f"expert {e}: {p}" for p in cmp["problems"]], stats=cmp["stats"],
                       exact=cmp["exact"] is not None)
        # without a source, or with one whose ints these are, the float weights are only multiplied:
        # the references read the int4 values
        from_int4 = w.bufs is not None and (src is None or cmp["exact"] is not None)
        _references(layer, w, xe, layer.wts[tt, jj] ** 2, from_int4, cmp, out)
    return out


def _read(layer: LayerRun, i: int, mine: dict) -> _Weights:
    """The i-th sampled expert's int4 values and scales, each weight read or decoded once: into this
    thread's buffers (``mine``), or (another layout, mixed scales) as read, with their float values
    at once. The next expert's bytes are asked for first (a hint to the kernel)."""
    output, slot = layer.output, layer.experts[layer.sampled[i]]
    if i in layer.after:
        output.prefetch(layer.experts[layer.sampled[layer.after[i]]].values())
    bufs = ExpertBuffers.of(layer.buffer_keys[i], layer.vk, mine)
    if bufs is None:
        return _Weights(layer, slot, None, {r: output.weight(m) for r, m in slot.items()})
    w = _Weights(layer, slot, bufs, None)
    bufs.fill(output, slot)
    return w


class _Weights:
    """One expert's weights as read: in the thread's ``ExpertBuffers``, or ``qs`` (role -> (int4
    values, scales, group)) with their float values. ``ints``: role -> (int4 values, scales);
    ``w13``, ``w2``: the same with gate and up rows in one matrix, as the kernel takes them."""

    def __init__(self, layer: LayerRun, slot: dict[str, str], bufs: ExpertBuffers | None, qs: dict | None):
        self.layer, self.slot, self.bufs = layer, slot, bufs
        if bufs is not None:
            self.ints = bufs.views()
            self.cw = {"gate": bufs.w13[:bufs.inter], "up": bufs.w13[bufs.inter:], "down": bufs.w2}
            self.w13, self.w2 = (bufs.q13, bufs.s13), (bufs.q2, bufs.s2)
            self.dequantised = False
        else:
            self.ints = {r: qs[r][:2] for r in slot}
            self.cw = {r: dequantize_w4a8(*qs[r]) for r in slot}
            g, u = self.ints["gate"], self.ints["up"]
            self.w13, self.w2 = (torch.cat([g[0], u[0]]), torch.cat([g[1], u[1]])), self.ints["down"]
            self.dequantised = True

    def packed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """w13 and w2 as torch's op takes them: vLLM's w13 of an expert is its gate blob then its up
        blob (8-row blocks: blobs.py); without blobs, packed now (into the buffers where they are)."""
        lay, bufs, slot = self.layer, self.bufs, self.slot
        if lay.use_blobs:
            with lay.clock("read"):
                return torch.cat([lay.output.blob(slot["gate"]), lay.output.blob(slot["up"])]), \
                    lay.output.blob(slot["down"])
        with lay.clock("pack"):
            if bufs is not None:
                return (moe_mod.pack_for_matmul(bufs.q13, bufs.s13, lay.g, out=bufs.p13),
                        moe_mod.pack_for_matmul(bufs.q2, bufs.s2, lay.g, out=bufs.p2))
            return moe_mod.pack_for_matmul(*self.w13, lay.g), moe_mod.pack_for_matmul(*self.w2, lay.g)

    def floats(self) -> dict[str, torch.Tensor]:
        """role -> the converted float32 weights (the buffers' dequantised now, once)."""
        if not self.dequantised:
            with self.layer.clock("read"):
                self.bufs.dequant()
            self.dequantised = True
        return self.cw


def _references(layer: LayerRun, w: _Weights, xe: torch.Tensor, g2: torch.Tensor, from_int4: bool, cmp: dict | None,
                out: dict) -> None:
    """moe.expert_forward's operations on the converted weights into ``out["c"]`` (from the int4
    values, with the squared weight sums on the way, where ``from_int4``), and with a source compared
    as floats on the source's weights into ``out["s"]``; then the noise each predicts per routed row,
    gated by ``g2``: the activation noise of the kernel's int8 rows (``act_var``) and with a source
    the weight noise of the budgets (``w_var``)."""
    vk, bufs, act_kind, inter, clock = layer.vk, w.bufs, layer.output.activation, layer.inter, layer.clock
    sw = cmp.get("sw") if cmp is not None else None
    with clock("reference"):
        if from_int4:
            y13 = vk.w4a8_reference(xe.float().contiguous(), bufs.q13, bufs.s13, row_sq=bufs.sq13)
            act = moe_mod.activation(y13[:, :inter], y13[:, inter:], act_kind).contiguous()
            out["c"] = vk.w4a8_reference(act, bufs.q2, bufs.s2, col_sq=bufs.sq2)
        else:
            cw = w.floats()
            w13c = bufs.w13 if bufs is not None else torch.cat([cw["gate"], cw["up"]])
            y13 = xe.float() @ w13c.t()
            act = moe_mod.activation(y13[:, :inter], y13[:, inter:], act_kind)
            out["c"] = act @ cw["down"].t()
        if sw is not None:
            w13s = torch.cat([sw["gate"], sw["up"]])
            out["s"] = moe_mod.expert_forward(xe, w13s, sw["down"], act_kind)
        elif cmp is not None:
            out["s"] = cmp["ref"]["y"]
    with clock("prediction"):
        if bufs is not None:
            sq13, sq2 = bufs.sq13, bufs.sq2
        else:
            sq13, sq2 = (w13c * w13c).sum(1), (cw["down"] * cw["down"]).sum(0)
        if vk is not None and isinstance(act_kind, int):  # one call without the GIL: 16 threads
            # queue for it on small torch ops (the native kernel knows the op's activations only)
            out["act_var"] = vk.act_noise(xe.float().contiguous(), y13.contiguous(), act.contiguous(),
                                          sq13.float().contiguous(), sq2.float().contiguous(), act_kind) * g2
        else:
            out["act_var"] = moe_mod.propagated_noise(xe.float(), y13, act, sq13, sq2, layer.hidden, act_kind) * g2
        if sw is not None:
            out["w_var"] = moe_mod.expert_noise(xe, w13s, sw["down"], act_kind, activations=False,
                                                weight_var=cmp["wv"]) * g2
        elif cmp is not None:  # expert_noise's, from the source reference's own passes
            r = cmp["ref"]
            out["w_var"] = moe_mod.propagated_noise(xe.float(), r["y13"], r["act"], r["sq13"], r["sq2"], layer.hidden,
                                                    act_kind, activations=False, weight_var=cmp["wv"]) * g2


class ExpertBuffers:
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
    def key(output: W4A8Output, slot: dict[str, str]) -> tuple | None:
        """What buffers the expert ``slot`` takes (their shapes and scale dtypes), from the headers; None
        where its weights do not fit them (another layout, mixed scales: read as they are)."""
        specs = [output.weight_spec(slot[r]) for r in ROLES]
        if any(sp is None for sp in specs) or specs[0] != specs[1]:
            return None
        for m, sp in zip((slot["gate"], slot["down"]), (specs[0], specs[2])):
            if sp[3] != scales_per_row(sp[1], output.group_for(m)):
                return None  # scales that are not one per group of the module's group: dequantize_w4a8 decides
        return (specs[0][0] * 2, *specs[0][1:], *specs[2])

    @staticmethod
    def of(key: tuple | None, vk, mine: dict) -> ExpertBuffers | None:
        """This thread's buffers (``mine``) for an expert of ``key`` (made, or remade for another
        shape); None without the C++ kernels or a key."""
        if vk is None or key is None:
            return None
        if mine.get("key") != key:
            mine.clear()
            n13, k, dt, c = key[:4]
            mine.update(key=key, bufs=ExpertBuffers((n13, k, dt, c), key[4:]))
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
