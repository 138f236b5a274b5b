"""MoE structure per model family: which linears are routed experts, shared experts,
dense MLPs, attention, and which tensors are routers.

Only families whose naming we know are accepted; fused-expert layouts and unknown
families are refused with the tensors named, never guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from itertools import islice

from .errors import InputError, RefusedError

__all__ = [
    "SUPPORTED",
    "FUSED",
    "MoELayer",
    "Layout",
    "classify",
    "discover",
    "vllm_output_names",
    "VLLM_FUSED",
    "vllm_module",
]

# model_type -> how routed experts are spelled (all accepted for every family; the table
# documents what the producers write)
SUPPORTED = {
    "mixtral": "block_sparse_moe.experts.E.{w1,w3,w2} or (block_sparse_moe|mlp).experts.E.{gate,up,down}_proj",
    "phimoe": "block_sparse_moe.experts.E.{w1,w3,w2}",
    "qwen2_moe": "mlp.experts.E.{gate,up,down}_proj + mlp.shared_expert.* + mlp.shared_expert_gate",
    "qwen3_moe": "mlp.experts.E.{gate,up,down}_proj (dense mlp_only_layers)",
    "olmoe": "mlp.experts.E.{gate,up,down}_proj",
    "deepseek_v2": "mlp.experts.E.* + mlp.shared_experts.* (first_k_dense_replace dense layers)",
    "deepseek_v3": "mlp.experts.E.* + mlp.shared_experts.* (first_k_dense_replace dense layers)",
    "glm4_moe": "mlp.experts.E.* + mlp.shared_experts.* (first_k_dense_replace dense layers)",
}
FUSED = {
    "granitemoe": "fused block_sparse_moe.input_linear/output_linear",
    "granitemoeshared": "fused block_sparse_moe.input_linear/output_linear",
    "llama4": "fused feed_forward.experts.gate_up_proj/down_proj",
    "llama4_text": "fused feed_forward.experts.gate_up_proj/down_proj",
    "gpt_oss": "fused, interleaved mlp.experts.gate_up_proj/down_proj",
    "qwen3_vl_moe": "fused mlp.experts.gate_up_proj/down_proj",
}

_ROLE = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
_EXPERT = re.compile(
    r"^(?P<moe>.+?\.(?:mlp|block_sparse_moe))\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)$")
_SHARED = re.compile(r"^(?P<mlp>.+?\.mlp\.shared_experts?)\.(?P<proj>gate_proj|up_proj|down_proj)$")
_DENSE = re.compile(r"^(?P<mlp>.+?\.(?:mlp|feed_forward))\.(?P<proj>gate_proj|up_proj|down_proj)$")
_ATTN = re.compile(r"\.(self_attn|attention|attn)\.")
_ROUTER = re.compile(r"\.(mlp|block_sparse_moe)\.(gate|shared_expert_gate|router)(\.layer)?$")
# tensor names that mean a fused (3-D) expert layout
_FUSED_TENSOR = re.compile(
    r"\.experts\.(gate_up_proj|down_proj)(_blocks|_scales|_bias|_scale|_packed)?$"
    r"|\.(input_linear|output_linear)\.(weight|weight_packed|qweight)$")
_LAYER = re.compile(r"\.layers\.(\d+)\.")

# vLLM loads these checkpoint linears into one fused module each (the model classes'
# packed_modules_mapping in vLLM 0.19.1 and 0.32.0): the shards of one fused module, like all
# experts of one MoE layer, run under one quantisation scheme
VLLM_FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),  # DeepSeek MLA with q_lora_rank
}
_FUSED_OF = {shard: fused for fused, shards in VLLM_FUSED.items() for shard in shards}


@dataclass
class MoELayer:
    """One sparse MoE block."""

    prefix: str  # e.g. "model.layers.0.mlp" or "model.layers.0.block_sparse_moe"
    experts: dict[int, dict[str, str]] = field(default_factory=dict)  # e -> role -> module name
    router: str | None = None  # router weight tensor name
    shared: dict[str, str] = field(default_factory=dict)  # role -> module name
    shared_gate: str | None = None

    @property
    def experts_prefix(self) -> str:
        return f"{self.prefix}.experts"

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    @property
    def layer(self) -> int:
        m = _LAYER.search(self.prefix + ".")
        return int(m.group(1)) if m else -1


@dataclass
class Layout:
    """Roles of every quantised linear, plus MoE layers and MLP triples."""

    model_type: str
    roles: dict[str, str]  # module -> "expert" | "shared_expert" | "dense_mlp" | "attention" | "linear"
    moe_layers: list[MoELayer]
    mlps: list[dict[str, str]]  # gate/up/down triples (experts, shared experts, dense MLPs)
    routers: list[str]  # float router tensors (names of .weight)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.roles.values():
            out[r] = out.get(r, 0) + 1
        return out


def classify(name: str) -> tuple[str, dict]:
    """Role of one linear module by its name: (role, details)."""
    m = _EXPERT.match(name)
    if m:
        return "expert", {"moe": m["moe"], "e": int(m["e"]), "proj": _ROLE[m["proj"]]}
    m = _SHARED.match(name)
    if m:
        return "shared_expert", {"mlp": m["mlp"], "proj": _ROLE[m["proj"]]}
    m = _DENSE.match(name)
    if m:
        return "dense_mlp", {"mlp": m["mlp"], "proj": _ROLE[m["proj"]]}
    if _ATTN.search(name):
        return "attention", {}
    return "linear", {}


def vllm_module(name: str) -> str:
    """The vLLM module a quantised linear loads into: ``<moe>.experts`` for a routed expert (one
    FusedMoE per layer), ``<parent>.qkv_proj`` for q_proj and the like, else the linear itself."""
    m = _EXPERT.match(name)
    if m:
        return f"{m['moe']}.experts"
    parent, _, leaf = name.rpartition(".")
    fused = _FUSED_OF.get(leaf)
    return f"{parent}.{fused}" if fused and parent else name


def _expected_experts(cfg: dict) -> int | None:
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        v = cfg.get(key)
        if isinstance(v, int) and v > 0:
            return v
    return None


def discover(model_type: str, text_config: dict, linears: list[str], tensor_names: list[str]) -> Layout:
    """Map the quantised linears and all tensors of a checkpoint onto MoE structure.

    Refuses unknown families and fused layouts; checks every MoE layer has every expert with
    gate, up and down.
    """
    fused = sorted(t for t in tensor_names if _FUSED_TENSOR.search(t))
    if model_type in FUSED or fused:
        shown = ", ".join(fused[:3]) + (f" (+{len(fused) - 3} more)" if len(fused) > 3 else "")
        raise RefusedError(
            f"model_type {model_type!r}: fused expert tensors ({FUSED.get(model_type, 'fused experts')})"
            + (f": {shown}" if shown else ""),
            tensor=fused[0] if fused else None,
            hint="int4pack converts per-expert layouts only; fused/3-D expert checkpoints are not supported yet.")
    if model_type not in SUPPORTED:
        stray = [n for n in linears if ".experts." in n][:3]
        raise RefusedError(
            f"model_type {model_type!r} is not a MoE family int4pack knows"
            + (f" (expert tensors such as {stray[0]})" if stray else ""),
            hint="Supported: " + ", ".join(sorted(SUPPORTED)) + ". Open an issue with the model's tensor names.")

    roles: dict[str, str] = {}
    layers: dict[str, MoELayer] = {}
    mlps: dict[str, dict[str, str]] = {}
    for name in linears:
        role, d = classify(name)
        if role == "linear" and ".experts." in name:
            raise RefusedError(f"{name}: an expert tensor whose naming int4pack does not know", tensor=name,
                               hint="Expected <prefix>.(mlp|block_sparse_moe).experts.<E>.(gate|up|down)_proj "
                                    "or w1/w3/w2.")
        roles[name] = role
        if role == "expert":
            lay = layers.setdefault(d["moe"], MoELayer(d["moe"]))
            slot = lay.experts.setdefault(d["e"], {})
            if d["proj"] in slot:
                raise InputError(f"{name}: expert {d['e']} has two {d['proj']} projections "
                                 f"({slot[d['proj']]} and {name})", tensor=name,
                                 hint="Mixed w1/w3/w2 and gate/up/down_proj names in one layer.")
            slot[d["proj"]] = name
            mlps.setdefault(f"{d['moe']}.experts.{d['e']}", {})[d["proj"]] = name
        elif role in ("shared_expert", "dense_mlp"):
            mlps.setdefault(d["mlp"], {})[d["proj"]] = name
            if role == "shared_expert":
                moe = d["mlp"].rsplit(".", 1)[0]
                layers.setdefault(moe, MoELayer(moe)).shared[d["proj"]] = name

    names = set(tensor_names)
    routers = sorted(t[: -len(".weight")] for t in names if t.endswith(".weight") and _ROUTER.search(t[:-7]))
    for lay in layers.values():
        for cand in (f"{lay.prefix}.gate", f"{lay.prefix}.router", f"{lay.prefix}.router.layer"):
            if f"{cand}.weight" in names:
                lay.router = cand
                break
        if f"{lay.prefix}.shared_expert_gate.weight" in names:
            lay.shared_gate = f"{lay.prefix}.shared_expert_gate"

    moe_layers = sorted((lay for lay in layers.values() if lay.experts),
                        key=lambda lay: (lay.layer, lay.prefix))
    want = _expected_experts(text_config)
    for lay in moe_layers:
        ids = sorted(lay.experts)
        n = want or (ids[-1] + 1)
        # first few gaps only: a corrupt config can claim billions of experts (never loop over them)
        missing = list(islice((e for e in range(n) if e not in lay.experts), 8))
        if missing:
            raise InputError(
                f"{lay.experts_prefix}: expert(s) {missing[:8]} missing (found {len(ids)} of {n})",
                tensor=f"{lay.experts_prefix}.{missing[0]}",
                hint="The checkpoint is incomplete, or some experts are not quantised; re-download or requantise.")
        extra = [e for e in ids if e >= n]
        if extra:
            raise InputError(f"{lay.experts_prefix}: expert {extra[0]} is beyond the config's {n} experts",
                             tensor=f"{lay.experts_prefix}.{extra[0]}")
        for e, slot in lay.experts.items():
            lack = [r for r in ("gate", "up", "down") if r not in slot]
            if lack:
                raise InputError(f"{lay.experts_prefix}.{e}: no quantised {'/'.join(lack)} projection",
                                 tensor=f"{lay.experts_prefix}.{e}",
                                 hint="Every expert needs gate, up and down projections in int4.")
        if lay.router is None:
            raise RefusedError(f"{lay.prefix}: experts without a float router (looked for {lay.prefix}.gate.weight)",
                               tensor=lay.prefix, hint="A quantised or missing router is not supported.")
    triples = [t for t in mlps.values()]
    return Layout(model_type, roles, moe_layers, triples, routers)


# vLLM's model classes load only the names they map. vLLM 0.19.1 MixtralForCausalLM takes experts
# through FusedMoE.make_expert_params_mapping(w1, w2, w3) under ``block_sparse_moe`` and the router
# as ``block_sparse_moe.gate``; GPTQModel (transformers 5 naming) writes ``mlp.experts.E.gate_proj``
# and ``mlp.gate``, which vLLM's loader cannot place (KeyError). Output tensors are renamed to what
# vLLM loads; the report and ``verify --against`` keep the source names.
_MIXTRAL_EXPERT = re.compile(r"\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)(?=\.|$)")
_MIXTRAL_ROUTER = re.compile(r"\.mlp\.gate(?=\.|$)")
_MIXTRAL_W = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w2": "w2", "w3": "w3"}


def vllm_output_names(model_type: str, names) -> dict[str, str]:
    """{source tensor name: output name} for the names vLLM would not load as they are (usually empty)."""
    if model_type != "mixtral":
        return {}
    out = {}
    for n in names:
        m = _MIXTRAL_EXPERT.sub(lambda x: f".block_sparse_moe.experts.{x[1]}.{_MIXTRAL_W[x[2]]}", n)
        m = _MIXTRAL_ROUTER.sub(".block_sparse_moe.gate", m)
        if m != n:
            out[n] = m
    clash = set(out.values()) & (set(names) - set(out))
    if clash or len(set(out.values())) != len(out):
        name = sorted(clash)[0] if clash else sorted(out)[0]
        raise RefusedError(f"{name}: the checkpoint spells one Mixtral module two ways "
                           "(mlp.experts.E.*_proj and block_sparse_moe.experts.E.w*)", tensor=name,
                           hint="Keep one naming per checkpoint.")
    return out
