"""The plugin's routing glue, torch only (tested without vLLM): the packed MoE method computes
``topk_weights`` / ``topk_ids`` from the layer's own routing, then calls vLLM's KleidiAI MoE op.

Releases are named by their constants in serving/vllm_releases.py (V019, V032, SNAPSHOT).

Which routing: ``routing.from_layer`` reads the MoE layer's attributes, set by the model class in
both vLLM versions. Its ``routed_scaling_factor`` is the layer's, so the factor lands where the
model class expects it: vLLM's DeepSeek-V2/V3 and GLM-4-MoE classes give the layer 1.0 and scale
the routed output themselves (V019 in the model's forward, V032 in the MoE runner), and the
shared experts run outside the MoE method in both. A routing type int4pack does not route is
refused when the layer is built, naming it.

Which function: vLLM's own CPU ``select_experts`` (V032 ``fused_moe/router/cpu_router.py``,
V019 ``fused_moe/cpu_fused_moe.py``), found by import; it does softmax top-k and grouped top-k
with sigmoid, bias and scaling, and MiniMax2 as the one-group case. int4pack's
``routing.select_experts`` (same arguments) serves where neither is importable.

Which op call: ``torch.ops._C.dynamic_4bit_int_moe`` takes ``(…, H, I, I2, group_size, …)`` in
V019 and ``(…, hidden_size, intermediate_size, group_size, …)`` in V032; the schema's
argument names pick the form.

Per layer (``moe_plan``, at load): the routing and the activation come from the layer's entry in
the layout record's ``moe_layers`` (the model's facts, ``int4pack.families``, written by convert)
or, for checkpoints written before it, from the vLLM layer. The tensors they need are the layer's:
``e_score_correction_bias``, Gemma-4's per-expert scale (found on the layer or its custom routing
function, whose closure or owner holds it), DeepSeek-V4's token-id hash table (on the layer or its
router, looked up after loading: V032's CPU model attaches it to the layer only after the layer's
method is built) and the token ids vLLM hands ``apply_monolithic``. Laguna's soft-cap is not applied again:
vLLM's class caps the logits before its MoE layer (``models/laguna.py``, ``LagunaMoE.forward``);
its score bias, which V032's loader drops, the packed method loads itself (``_score_bias.py``).
The kinds vLLM's CPU ``select_experts`` computes go to it; DeepseekV4 and the per-expert scale go
to ``Routing.select``. An activation the op computes goes to the op (SiLU·up; SwiGLU-OAI at its
hard-coded 1.702 / 7); any other runs in steps (``_experts.experts_in_steps``). What a layer needs
and this vLLM does not hand over is refused at load, naming the layer and the vLLM version.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from contextlib import contextmanager
from functools import lru_cache

import torch

from .. import activation as act
from .. import routing as rt
from ..serve_spec import MOE_LAYERS, QUANT_METHOD
from ._find import SELECT_EXPERTS, accepts, first, served, vllm_version
from ._layout import _checkpoint_names

__all__ = ["layer_routing", "route", "vllm_select", "moe_op_args", "backend_accepts", "backend_accepts_routing",
           "ACT_KIND", "MoEPlan", "moe_plan", "route_layer", "layer_activation", "takes_input_ids",
           "with_hash_table"]

_log = logging.getLogger(__name__)

# vLLM's MoEActivation names -> the op's activation_kind (0 SwiGLU_Gu, 1 SwiGLU_Ug, 2 SiLU)
ACT_KIND = {"SWIGLUSTEP": 0, "SWIGLUOAI": 1, "SILU": 2}

# what vLLM's CPU W4A8 backend (CPUExpertsInt4, V032 to SNAPSHOT) accepts when the method is built
_BACKEND_ROUTES = ("Default", "Renormalize", "RenormalizeNaive")
_BACKEND_ACTS = ("SILU", "SWIGLUOAI", "SWIGLUSTEP")
# the routing kinds vLLM's CPU select_experts computes from select_kwargs (the rest: Routing.select)
_VLLM_SELECTS = ("Default", "Renormalize", "RenormalizeNaive", "DeepSeekV3", "MiniMax2", "Llama4")
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
    fn, _ = first(SELECT_EXPERTS, want=lambda f: accepts(f, _KWARGS))
    if fn is not None:
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
    if sizes == ["H", "I", "I2"]:  # V019
        return (hidden, inter, 2 * inter, group_size)
    if sizes == ["hidden_size", "intermediate_size"]:  # V032
        return (hidden, inter, group_size)
    raise RuntimeError(f"{QUANT_METHOD}: torch.ops._C.dynamic_4bit_int_moe takes ({', '.join(arg_names)}), "
                       "a form this int4pack does not know; serve the default output of `int4pack convert`, "
                       f"or use {served()}")


@contextmanager
def backend_accepts(layer):
    """vLLM picks the W4A8 backend when the method is built (V032 on), and its CPUExpertsInt4
    takes only the routing types Default, Renormalize, RenormalizeNaive and the activations SILU,
    SWIGLUOAI, SWIGLUSTEP (``_supports_routing_method``, ``_supports_activation``), and no hash
    routing, which no monolithic kernel takes (V032 ``modular_kernel.py:570``, ``has_hash_routing``).
    The packed method routes and activates itself, so while vLLM builds it (and its kernel) the
    layer's MoE config names a type and an activation that backend takes, without hash routing; the
    real ones are back as soon as it exists. Whether int4pack computes the real ones is
    ``moe_plan``'s to say, with its own refusal."""
    cfg = getattr(layer, "moe_config", None)
    saved = []
    for field, ok, stand_in in (("routing_method", _BACKEND_ROUTES, "RenormalizeNaive"),
                                ("activation", _BACKEND_ACTS, "SILU")):
        real = getattr(cfg, field, None)
        name = getattr(real, "name", None)
        if name is not None and name not in ok:
            saved.append((field, real))
            setattr(cfg, field, type(real)[stand_in])
    if getattr(cfg, "has_hash_routing", False) is True:
        saved.append(("has_hash_routing", True))
        cfg.has_hash_routing = False
    try:
        yield
    finally:
        for field, real in saved:
            setattr(cfg, field, real)


backend_accepts_routing = backend_accepts  # the name it had when it swapped the routing type only


@dataclasses.dataclass(frozen=True)
class MoEPlan:
    """What one packed MoE layer computes, decided at load."""

    routing: rt.Routing
    activation: act.Activation
    op_kind: int | None  # dynamic_4bit_int_moe's activation_kind, or None: the experts run in steps
    per_expert_scale: torch.Tensor | None = None  # the layer's own parameter (filled by the loader)
    hash_table: torch.Tensor | None = None


def _vllm_name(value) -> str | None:
    """An enum member's or a string's name, upper case (vLLM's MoEActivation, RoutingMethodType)."""
    if value is None:
        return None
    return str(getattr(value, "name", value)).upper()


def takes_input_ids(method_cls: type) -> bool:
    """Whether vLLM hands this MoE method's ``apply_monolithic`` the token ids (its own signature names them)."""
    fn = getattr(method_cls, "apply_monolithic", None)
    try:
        return fn is not None and "input_ids" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _tensor(*places) -> torch.Tensor | None:
    """The first tensor among (object, attribute name) places."""
    for obj, n in places:
        t = getattr(obj, n, None) if obj is not None else None
        if isinstance(t, torch.Tensor):
            return t
    return None


def _per_expert_scale(layer) -> torch.Tensor | None:
    """Gemma-4's per-expert scale where this vLLM keeps it: on the layer or its router, on the
    owner of its custom routing function, or in that function's closure."""
    fn = getattr(layer, "custom_routing_function", None)
    t = _tensor((layer, "per_expert_scale"), (getattr(layer, "router", None), "per_expert_scale"),
                (getattr(fn, "__self__", None), "per_expert_scale"))
    if t is None and fn is not None:
        code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
        for name, cell in zip(getattr(code, "co_freevars", ()), cells):
            if t is not None:
                break
            try:
                v = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            t = v if name == "per_expert_scale" and isinstance(v, torch.Tensor) else _tensor((v, "per_expert_scale"))
    return t


def _hash_table(layer) -> torch.Tensor | None:
    """DeepSeek-V4's token-id -> experts table where this vLLM keeps it: on the layer or its router."""
    names = ("hash_indices_table", "_hash_indices_table", "tid2eid")
    return _tensor(*[(obj, n) for obj in (layer, getattr(layer, "router", None)) for n in names])


def layer_activation(layer, entry: dict | None, prefix: str = "MoE layer") -> act.Activation:
    """The layer's activation: the record's, checked against the limit vLLM's layer carries; else
    what vLLM's layer names (its SWIGLUOAI with the layer's alpha and limit, gpt-oss's where it
    has none; SWIGLUSTEP with the layer's limit). Anything else is refused."""
    name = _vllm_name(getattr(layer, "activation", None)) or "SILU"
    limit, alpha = getattr(layer, "swiglu_limit", None), getattr(layer, "swiglu_alpha", None)
    if entry is not None and isinstance(entry.get("activation"), dict):
        a = act.from_record(entry["activation"])
        if limit is not None and a.limit is not None and float(limit) != a.limit:
            raise ValueError(f"{QUANT_METHOD}: {prefix}: the checkpoint records activation {a.describe()}, but "
                             f"vLLM's layer clamps at swiglu_limit {limit}; convert again or report it")
        return a
    if name == "SILU":
        return act.SILU
    if name == "SWIGLUOAI":
        return act.Activation("swigluoai", alpha=1.702 if alpha is None else float(alpha),
                              limit=7.0 if limit is None else float(limit))
    if name == "SWIGLUSTEP" and limit is not None:
        return act.Activation("swiglustep", limit=float(limit))
    why = "without its swiglu_limit" if name == "SWIGLUSTEP" else "which int4pack does not compute"
    raise ValueError(f"{QUANT_METHOD}: {prefix}: vLLM's layer names activation {name} {why}; the packed "
                     "experts run SILU, SWIGLUOAI and SWIGLUSTEP with their limits, or what the checkpoint's "
                     f"{MOE_LAYERS} record names. Convert again with this int4pack, or serve the default format.")


def _entry(record: dict, prefix: str) -> dict | None:
    layers = record.get(MOE_LAYERS) if isinstance(record, dict) else None
    if not isinstance(layers, dict):
        return None
    name = prefix if prefix in layers else _checkpoint_names(prefix, layers)
    ent = layers.get(name) if name else None
    return ent if isinstance(ent, dict) else None


def moe_plan(layer, prefix: str, record: dict, input_ids: bool = True) -> MoEPlan:
    """How the packed method routes and activates MoE layer ``prefix``; a ValueError naming the
    layer where int4pack does not compute it or this vLLM does not hand over what it needs.
    ``input_ids``: whether vLLM hands the method the token ids (``takes_input_ids``)."""
    entry = _entry(record, prefix)
    if entry is not None:
        try:
            r = rt.from_record(entry["routing"])
            if isinstance(entry.get("activation"), dict):
                act.from_record(entry["activation"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{QUANT_METHOD}: quantization_config.kleidiai.{MOE_LAYERS}[{prefix!r}] is not what "
                             f"convert writes ({type(e).__name__}: {e}). Convert again.") from None
        top_k = getattr(layer, "top_k", None)
        if top_k is not None and int(top_k) != r.top_k:
            raise ValueError(f"{QUANT_METHOD}: {prefix}: the checkpoint records top-{r.top_k} routing, vLLM's "
                             f"layer top-{top_k}: the config was edited. Convert again.")
        if r.custom and getattr(layer, "custom_routing_function", None) is not None:
            r = dataclasses.replace(r, custom=rt.from_layer(layer).custom)  # Llama-4: the layer's own function
    else:
        r = layer_routing(layer, prefix)
    if r.softcap:  # vLLM's class caps the logits before they reach the MoE layer
        r = dataclasses.replace(r, softcap=None)
    why = r.problem(getattr(layer, "global_num_experts", None))
    if why:
        raise ValueError(f"{QUANT_METHOD}: {prefix}: {why}. The packed format is served only with a routing "
                         "int4pack computes; serve the model unquantised or with another backend.")
    if r.bias and getattr(layer, "e_score_correction_bias", None) is None:
        raise ValueError(f"{QUANT_METHOD}: {prefix}: routing {r.describe()} needs the layer's "
                         f"e_score_correction_bias, which {vllm_version()}'s layer does not carry")
    pes = table = None
    if r.per_expert_scale:
        pes = _per_expert_scale(layer)
        if pes is None:
            raise ValueError(f"{QUANT_METHOD}: {prefix}: routing {r.describe()} needs the model's per-expert "
                             f"scale, which {vllm_version()} keeps neither on the MoE layer nor with its custom "
                             "routing function; serve the default format")
    if r.hash_routed:
        table = _hash_table(layer)
        if not input_ids:
            raise ValueError(_no_hash_input(prefix, r, "no token ids (its apply_monolithic takes no input_ids)"))
        if table is None and getattr(getattr(layer, "moe_config", None), "has_hash_routing", None) is False:
            raise ValueError(_no_hash_input(prefix, r, "no token-id hash table (vLLM built the layer without one)"))
        # else the table may come later: V032's CPU model attaches it to the layer after its quantisation
        # method is built (models/deepseek_v4/cpu/model.py:223); with_hash_table looks again after loading
    a = layer_activation(layer, entry, prefix)
    kind = a.kernel_kind
    op = None if kind is None else ACT_KIND["SILU"] if kind == 0 else ACT_KIND["SWIGLUOAI"]
    return MoEPlan(r, a, op, pes, table)


def _no_hash_input(prefix: str, r: rt.Routing, lack: str) -> str:
    return (f"{QUANT_METHOD}: {prefix}: a hash-routed layer ({r.describe()}): {vllm_version()} gives its W4A8 MoE "
            f"method {lack}; serve the default format, or a vLLM that hands the MoE method both")


def with_hash_table(plan: MoEPlan, layer, prefix: str) -> MoEPlan:
    """``plan`` with the layer's token-id hash table, looked up once the weights are loaded (the
    table is loaded in place, so the tensor found is the one served); a ValueError naming the layer
    and the vLLM version where the layer still carries none."""
    if not plan.routing.hash_routed or plan.hash_table is not None:
        return plan
    table = _hash_table(layer)
    if table is None:
        raise ValueError(_no_hash_input(prefix, plan.routing, "no token-id hash table (after loading, neither its "
                                                              "MoE layer nor the layer's router carries one)"))
    return dataclasses.replace(plan, hash_table=table)


def route_layer(plan: MoEPlan, layer, x: torch.Tensor, router_logits: torch.Tensor, input_ids=None,
                select=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights, topk_ids) as ``plan`` routes, with the layer's tensors at forward time and
    the layer's own routed_scaling_factor (1.0 where the model class scales the output itself)."""
    r = plan.routing
    scale = getattr(layer, "routed_scaling_factor", None)
    bias = getattr(layer, "e_score_correction_bias", None)
    if r.kind in _VLLM_SELECTS:
        return route(r, x, router_logits, bias, scale, select, getattr(layer, "custom_routing_function", None))
    return r.select(router_logits, bias=bias if r.bias else None, per_expert_scale=plan.per_expert_scale,
                    hash_table=plan.hash_table, input_ids=input_ids, scale=1.0 if scale is None else float(scale),
                    hidden_states=x)
