"""The experts' forward where vLLM's CPU W4A8 MoE op cannot apply the model's activation, torch only.

``torch.ops._C.dynamic_4bit_int_moe`` computes three activations (vLLM's ``_activation_kind``):
SiLU·up, SwiGLU-OAI with gpt-oss's alpha 1.702 and limit 7 written into the kernel, and SiLU
again for vLLM's ``SWIGLUSTEP`` (its clamp dropped); it never reads a model's ``swiglu_limit``.
For any other activation (DeepSeek-V4's and GLM-5.3-Flash's SwiGLU clamped at 10, Step-3.5's
SWIGLUSTEP, SwiGLU-OAI at another limit, Gemma-4's GELU-tanh) the packed method runs each expert
as three steps on the same blobs: ``_dyn_quant_matmul_4bit`` with the expert's ``w13`` row (its
gate blob then its up blob: the blob of the [gate; up] matrix, blobs.py), the activation
(``int4pack.activation``), ``_dyn_quant_matmul_4bit`` with its ``w2`` row, then the routing
weight, summed per token as the op sums. Slower than the op (one pair of calls per expert used),
exact in what it computes.
"""

from __future__ import annotations

import torch

from .. import activation as act
from ..groups import block

__all__ = ["work_dtype", "experts_in_steps"]


def work_dtype(dtype: torch.dtype, group_size: int) -> torch.dtype:
    """The activations' dtype ``_dyn_quant_matmul_4bit`` takes for blobs of this group, as vLLM's
    ``Dynamic4bitLinearKernel`` feeds it: groupwise bf16 and any fp16 go through float32."""
    if dtype == torch.float16 or (group_size != -1 and dtype == torch.bfloat16):
        return torch.float32
    return dtype


def experts_in_steps(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                     w2: torch.Tensor, hidden: int, inter: int, group_size: int, activation: act.Activation,
                     apply_router_weight_on_input: bool = False) -> torch.Tensor:
    """out [T, H] in x's dtype: sum over each token's experts of weight * W2(activation(W13 x)).
    ``w13`` [E, bytes of (2I, H)] and ``w2`` [E, bytes of (H, I)]: the layer's packed parameters."""
    mm = torch.ops.aten._dyn_quant_matmul_4bit
    work = work_dtype(x.dtype, group_size)
    xw = x.reshape(-1, hidden).to(work)
    ids, wts = topk_ids.long(), topk_weights.float()
    out = torch.zeros(xw.shape[0], hidden, dtype=torch.float32)
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        w = wts[tok, slot].unsqueeze(1)
        xe = (xw[tok].float() * w).to(work) if apply_router_weight_on_input else xw[tok]
        gate_up = mm(xe.contiguous(), w13[e], block(hidden, group_size), hidden, 2 * inter)
        a = act.apply(activation, gate_up.float()).to(work)
        y = mm(a.contiguous(), w2[e], block(inter, group_size), inter, hidden).float()
        out.index_add_(0, tok, y if apply_router_weight_on_input else y * w)
    return out.to(x.dtype).reshape(*x.shape[:-1], hidden)
