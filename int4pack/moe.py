"""The CPU W4A8 MoE forward (vLLM's ``dynamic_4bit_int_moe_cpu`` algorithm) and its references.

``moe_forward`` checks its inputs and runs ``moe_forward_twin``: the algorithm as a loop over
experts, each expert's two matmuls through torch's ``_dyn_quant_matmul_4bit`` (KleidiAI on Arm,
torch's reference kernel elsewhere; each call uses torch's threads). ``moe_reference`` is a
float32 per-token computation on dequantised weights.

Weights go in as one packed tensor per expert, stacked ``[E, ...]``: ``w13`` is ``[2I, H]`` (gate
rows then up rows), ``w2`` is ``[H, I]``. ``pack_for_matmul`` makes them from int4 values and
scales: KleidiAI blobs where torch's KleidiAI path is live, torch's float32 reference layout
elsewhere (the only format torch's matmul takes there).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from . import _ext, kleidiai
from .activation import Activation
from .errors import InputError
from .groups import block, groupwise_problem, is_channel

__all__ = [
    "ACTIVATIONS",
    "moe_forward",
    "moe_forward_twin",
    "MoeRun",
    "moe_reference",
    "predicted_noise",
    "expert_forward",
    "expert_noise",
    "propagated_noise",
    "int8_step",
    "activation",
    "pack_for_matmul",
    "pack_experts_for_matmul",
]

ACTIVATIONS = {0: "silu", 1: "swigluoai", 2: "silu"}
_SWIGLU_ALPHA, _SWIGLU_LIMIT = 1.702, 7.0


def activation(gate: torch.Tensor, up: torch.Tensor, kind: int | Activation) -> torch.Tensor:
    """kind 0/2: silu(gate) * up; kind 1: gpt-oss SwiGLU (gate clamped above at 7, up to [-7, 7]);
    an ``activation.Activation``: that one (the model's, where the W4A8 op has none: the expert's
    two matmuls then run apart with it between them, as ``MoeRun`` does)."""
    if isinstance(kind, Activation):
        return kind(gate, up)
    if kind == 1:
        gc = gate.clamp(max=_SWIGLU_LIMIT)
        uc = up.clamp(-_SWIGLU_LIMIT, _SWIGLU_LIMIT)
        return (uc + 1.0) * (gc * torch.sigmoid(gc * _SWIGLU_ALPHA))
    if kind in (0, 2):
        return torch.nn.functional.silu(gate) * up
    raise InputError(f"activation kind {kind} is not 0 (silu), 1 (swigluoai) or 2 (silu)")


def _check(x, topk_ids, topk_weights, w13, w2, hidden, inter, group_size, activation_kind):
    if x.dim() != 2 or x.shape[1] != hidden:
        raise InputError(f"x must be [T, H={hidden}], got {tuple(x.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise InputError("topk_ids and topk_weights must both be [T, K] with T = x.shape[0]")
    if w13.dim() != 2 or w2.dim() != 2 or w13.shape[0] != w2.shape[0]:
        raise InputError("w13_packed and w2_packed must be [E, ...] with the same E")
    if not is_channel(group_size) and (groupwise_problem(group_size, hidden) or groupwise_problem(group_size, inter)):
        raise InputError(f"group size {group_size} must be -1 or a multiple of 32 dividing and smaller than "
                         f"H={hidden} and I={inter}")
    if not isinstance(activation_kind, Activation) and activation_kind not in ACTIVATIONS:
        raise InputError(f"activation kind {activation_kind} is not 0, 1 or 2")
    e = w13.shape[0]
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= e):
        raise InputError(f"expert ids must lie in [0, {e})")


def moe_forward(x, topk_ids, topk_weights, w13_packed, w2_packed, hidden: int, inter: int, group_size: int,
                apply_router_weight_on_input: bool = False, activation: int = 0) -> torch.Tensor:
    """out [T, H] in x's dtype. ``group_size`` as groups.py has it (channelwise: one block of H for w13, of I for w2)."""
    _check(x, topk_ids, topk_weights, w13_packed, w2_packed, hidden, inter, group_size, activation)
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise InputError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    return moe_forward_twin(x, topk_ids, topk_weights, w13_packed, w2_packed, hidden, inter, group_size,
                            apply_router_weight_on_input, activation)


def _compute_dtype(dtype: torch.dtype, channelwise: bool) -> torch.dtype:
    return dtype if dtype == torch.float32 or (dtype == torch.bfloat16 and channelwise) else torch.float32


def moe_forward_twin(x, topk_ids, topk_weights, w13_packed, w2_packed, hidden: int, inter: int, group_size: int,
                     apply_router_weight_on_input: bool = False, activation_kind: int = 0) -> torch.Tensor:
    """vLLM's algorithm, one expert at a time: a stable sort of the (token, slot) pairs by expert,
    per expert y13 = x_e @ w13_e, act(gate, up) @ w2_e, the gate weights, index_add into out."""
    run = MoeRun(x, topk_ids, topk_weights, w13_packed.shape[0], hidden, inter, group_size,
                 apply_router_weight_on_input, activation_kind)
    for e in range(w13_packed.shape[0]):
        run.expert(e, w13_packed[e], w2_packed[e])
    return run.finish()


class MoeRun:
    """``moe_forward_twin`` in three steps, so that a caller can run the experts' matmuls itself:
    in parallel threads (``expert`` writes its own rows only), each expert's packed weights made
    just before and dropped just after. The same operations in the same order: the same output."""

    def __init__(self, x, topk_ids, topk_weights, e_count: int, hidden: int, inter: int, group_size: int,
                 apply_router_weight_on_input: bool = False, activation_kind: int = 0):
        t, k = topk_ids.shape
        chan = is_channel(group_size)
        self.g13, self.g2 = (hidden, inter) if chan else (group_size, group_size)
        self.hidden, self.inter, self.kind = hidden, inter, activation_kind
        self.on_input = apply_router_weight_on_input
        self.x_dtype, self.t = x.dtype, t
        cdt = self.cdt = _compute_dtype(x.dtype, chan)
        flat = topk_ids.reshape(-1).long()
        # stable sort by expert == counting sort with ascending (token, slot) order inside an expert
        order = torch.sort(flat, stable=True).indices
        self.tok = order // k
        self.gates = topk_weights.reshape(-1).float()[order].to(cdt).unsqueeze(1)
        self.counts = torch.bincount(flat, minlength=e_count).tolist()
        self.begin = [0]
        for n in self.counts:
            self.begin.append(self.begin[-1] + n)
        x_all = x.index_select(0, self.tok).to(cdt)
        self.x_all = x_all * self.gates if apply_router_weight_on_input else x_all
        self.y_all = torch.zeros(t * k, hidden, dtype=cdt)

    def expert(self, e: int, w13, w2) -> None:
        """Expert e's rows through its packed w13 and w2 (nothing to do when no token chose it)."""
        mm = torch.ops.aten._dyn_quant_matmul_4bit
        self._run(e, lambda x: mm(x, w13, self.g13, self.hidden, 2 * self.inter),
                  lambda a: mm(a, w2, self.g2, self.inter, self.hidden))

    def expert_with(self, e: int, matmul, w13, w2) -> None:
        """``expert`` through another matmul: ``matmul(x, q, scales, block)`` computing what torch's op
        computes on ``pack_for_matmul(q, scales)``, given w13 and w2 as (int4 values, scales)."""
        self._run(e, lambda x: matmul(x, *w13, self.g13), lambda a: matmul(a, *w2, self.g2))

    def _run(self, e: int, mm13, mm2) -> None:
        b, n = self.begin[e], self.counts[e]
        if n:
            y13 = mm13(self.x_all[b:b + n].contiguous())
            act = activation(y13[:, :self.inter], y13[:, self.inter:], self.kind)
            self.y_all[b:b + n] = mm2(act.contiguous())

    def finish(self) -> torch.Tensor:
        y_all = self.y_all if self.on_input else self.y_all * self.gates
        out = torch.zeros(self.t, self.hidden, dtype=self.cdt)
        out.index_add_(0, self.tok, y_all)
        return out.to(self.x_dtype)


def moe_reference(x, topk_ids, topk_weights, w13_float, w2_float, apply_router_weight_on_input: bool = False,
                  activation_kind: int = 0, *, per_slot: bool = False):
    """float32 per-token MoE on dequantised weights: w13 [E, 2I, H] (gate; up), w2 [E, H, I].

    Returns out [T, H]; with ``per_slot`` also y [T, K, H], each slot's expert output before its
    gate weight is applied on the output (the inputs are gated first when that is asked for).
    """
    xf = x.float()
    t, k = topk_ids.shape
    out = torch.zeros(t, xf.shape[1])
    slots = torch.zeros(t, k, xf.shape[1]) if per_slot else None
    ids = topk_ids.long()
    wts = topk_weights.float()
    # group (token, slot) pairs by expert only to batch the float matmuls; each row is independent
    for e in torch.unique(ids).tolist():
        tt, jj = (ids == e).nonzero(as_tuple=True)
        g = wts[tt, jj].unsqueeze(1)
        xe = xf[tt] * g if apply_router_weight_on_input else xf[tt]
        y = expert_forward(xe, w13_float[e], w2_float[e], activation_kind)
        if per_slot:
            slots[tt, jj] = y
        out.index_add_(0, tt, y if apply_router_weight_on_input else y * g)
    return (out, slots) if per_slot else out


def expert_forward(xe: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, activation_kind: int = 0) -> torch.Tensor:
    """float32 rows through one expert: act(x @ gate^T, x @ up^T) @ down^T."""
    inter = w2.shape[1]
    y13 = xe.float() @ w13.float().t()
    return activation(y13[:, :inter], y13[:, inter:], activation_kind) @ w2.float().t()


# ------------------------------------------------------------------------- error propagation


def int8_step(rows: torch.Tensor) -> torch.Tensor:
    """Per-row step of torch/KleidiAI's dynamic asymmetric int8 (docs/kleidiai.md §2.3):
    (max(0, max x) - min(0, min x)) / 255."""
    return (rows.amax(1).clamp(min=0) - rows.amin(1).clamp(max=0)) / 255.0


def _act_jacobian(g: torch.Tensor, u: torch.Tensor, kind: int | Activation) -> tuple[torch.Tensor, torch.Tensor]:
    """d act / d gate and d act / d up, elementwise (an Activation's by autograd: it is elementwise)."""
    if isinstance(kind, Activation):
        with torch.enable_grad():
            gg, uu = g.detach().clone().requires_grad_(), u.detach().clone().requires_grad_()
            dg, du = torch.autograd.grad(kind(gg, uu).sum(), (gg, uu))
        return dg, du
    if kind == 1:
        gc = g.clamp(max=_SWIGLU_LIMIT)
        s = torch.sigmoid(gc * _SWIGLU_ALPHA)
        uc = u.clamp(-_SWIGLU_LIMIT, _SWIGLU_LIMIT)
        dg = (uc + 1.0) * (s + _SWIGLU_ALPHA * gc * s * (1 - s)) * (g < _SWIGLU_LIMIT)
        du = gc * s * (u.abs() < _SWIGLU_LIMIT)
        return dg, du
    s = torch.sigmoid(g)
    return u * s * (1 + g * (1 - s)), g * s


def predicted_noise(x, topk_ids, topk_weights, w13_float, w2_float, apply_router_weight_on_input: bool = False,
                    activation_kind: int = 0, *, activations: bool = True,
                    weight_var: torch.Tensor | None = None) -> torch.Tensor:
    """Expected squared output error per (token, slot) [T, K], to first order.

    ``activations``: both matmul inputs are rounded to the per-row int8 grid, each value off by
    an independent uniform error of variance step^2/12; that noise goes through w13 (variance
    step^2/12 * sum_k W[n,k]^2 per output), the activation's Jacobian, the second rounding and w2.
    ``weight_var`` [E, 3] (gate, up, down): per-element variance of independent weight errors,
    which add ``var * ||input||^2`` to every output of that matmul. Slots are independent, so a
    token's expected error is the sum over its slots (times gate^2 when gated on the output).
    """
    xf = x.float()
    ids = topk_ids.long()
    wts = topk_weights.float()
    out = torch.zeros(ids.shape)
    for e in torch.unique(ids).tolist():
        tt, jj = (ids == e).nonzero(as_tuple=True)
        g = wts[tt, jj]
        xe = xf[tt] * g.unsqueeze(1) if apply_router_weight_on_input else xf[tt]
        tot = expert_noise(xe, w13_float[e], w2_float[e], activation_kind, activations=activations,
                           weight_var=None if weight_var is None else weight_var[e].tolist())
        out[tt, jj] = tot if apply_router_weight_on_input else tot * g * g
    return out


def expert_noise(xe: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, activation_kind: int = 0, *,
                 activations: bool = True, weight_var: list[float] | None = None) -> torch.Tensor:
    """Expected squared output error of each row of one expert (see ``predicted_noise``)."""
    xe = xe.float()
    w13 = w13.float()
    w2 = w2.float()
    inter = w2.shape[1]
    y13 = xe @ w13.t()
    act = activation(y13[:, :inter], y13[:, inter:], activation_kind)
    return propagated_noise(xe, y13, act, (w13 * w13).sum(1), (w2 * w2).sum(0), w2.shape[0], activation_kind,
                            activations=activations, weight_var=weight_var)


def propagated_noise(xe: torch.Tensor, y13: torch.Tensor, act: torch.Tensor, w13_sq: torch.Tensor,
                     w2_sq: torch.Tensor, hidden: int, activation_kind: int = 0, *, activations: bool = True,
                     weight_var: list[float] | None = None) -> torch.Tensor:
    """``expert_noise`` from the expert's forward pass (y13 = xe @ w13^T, act) and its weights' squared
    sums: w13_sq [2I] over each row of w13, w2_sq [I] over each column of w2 (``hidden`` rows).

    Only each row's total over the H outputs is returned, so the output variance
    var_act @ (w2 * w2)^T summed over H is var_act @ w2_sq, and the down projection's weight term
    var * ||act||^2, the same for each of the H outputs, is H times it: no squared matrix."""
    inter = act.shape[1]
    gate, up = y13[:, :inter], y13[:, inter:]
    var13 = torch.zeros_like(y13)
    var_in2 = torch.zeros(xe.shape[0])
    if activations:
        var13 += (int8_step(xe) ** 2 / 12).unsqueeze(1) * w13_sq.unsqueeze(0)
        var_in2 += int8_step(act) ** 2 / 12
    if weight_var is not None:
        xx = (xe * xe).sum(1, keepdim=True)
        var13[:, :inter] += weight_var[0] * xx
        var13[:, inter:] += weight_var[1] * xx
    dg, du = _act_jacobian(gate, up, activation_kind)
    var_act = dg * dg * var13[:, :inter] + du * du * var13[:, inter:] + var_in2.unsqueeze(1)
    tot = var_act @ w2_sq
    if weight_var is not None:
        tot = tot + hidden * weight_var[2] * (act * act).sum(1)
    return tot


# ------------------------------------------------------------------------------------ packing


def _torch_pack(q, scales, g, bias=None):
    return kleidiai.torch_pack(q, scales, bias, g)


def _fallback_pack(q, scales, g, out=None):
    # torch's reference layout (docs/kleidiai.md §1.6): bytes as floats, then scales as floats.
    # torch writes it with a scalar loop; this writes the same bytes with tensor operations.
    n, k = q.shape
    vk = _ext.load("verify_kernels")
    if vk is not None and q.dtype == torch.int8 and q.is_contiguous() and scales.dtype in (torch.float32,
                                                                                          torch.bfloat16):
        ok = out is not None and out.dtype == torch.float32 and out.is_contiguous() and out.dim() == 1
        from .kernels import kernel_threads

        return vk.ref_pack(q, scales.contiguous().reshape(n, -1), out if ok else None, kernel_threads())
    if out is None:
        out = torch.empty(n * k // 2 + scales.numel(), dtype=torch.float32)
    # (q_odd << 4 | q_even & 0xF) ^ 0x88 == (q_even + 8) | (q_odd + 8) << 4, in one int8 pass
    b = ((q[:, 1::2] << 4) | (q[:, 0::2] & 0xF)) ^ -0x78
    out[: n * k // 2].view(n, k // 2).copy_(b.view(torch.uint8))
    out[n * k // 2:].copy_(scales.reshape(-1))
    return out


@lru_cache(maxsize=None)
def _fallback_layout_ok() -> bool:
    """Our fallback construction equals torch's packer output here (checked once, both layouts)."""
    for g in (32, 64):
        q, sc, _ = kleidiai.probe_matrix(g, n=24, k=64, seed=1)
        ref = _torch_pack(q, sc, g)
        if ref.dtype != torch.float32 or not torch.equal(ref, _fallback_pack(q, sc, g)):
            return False
    return True


def pack_for_matmul(q: torch.Tensor, scales: torch.Tensor, group_size: int, out: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """One [N, K] int4 matrix -> the tensor ``_dyn_quant_matmul_4bit`` takes on this host.

    ``scales``: bf16 [N, K/g] for groups, fp32 [N, 1] for channel (``group_size`` -1). ``out``: a
    preallocated row to fill (used when its size and dtype match)."""
    n, k = q.shape
    g = block(k, group_size)
    if kleidiai.native_kleidiai_available():
        blob, _ = kleidiai.pack(q.to(torch.int8), scales, None, g, packer="native")
        return blob
    if _fallback_layout_ok():
        ok = out is not None and out.dtype == torch.float32 and out.numel() == q.numel() // 2 + scales.numel()
        return _fallback_pack(q.to(torch.int8), scales, g, out if ok else None)
    return _torch_pack(q.to(torch.int8), scales, g)


def pack_experts_for_matmul(q: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """[E, N, K] int4 values (+ scales [E, N, K/g] or [E, N, 1]) -> stacked [E, ...] packed tensors."""
    out = None
    for e in range(q.shape[0]):
        blob = pack_for_matmul(q[e], scales[e], group_size)
        if out is None:
            out = torch.empty((q.shape[0], blob.numel()), dtype=blob.dtype)
        out[e] = blob
    return out
