"""MoE structure per model family: which linears are routed experts, shared experts,
dense MLPs, attention, and which tensors are routers.

Only families whose naming we know are accepted; fused-expert layouts and unknown
families are refused with the tensors named, never guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from itertools import islice

from .activation import Activation
from .errors import InputError, RefusedError, report_to
from .families import BY_TYPE, FAMILIES, FUSED_ONLY, Family, family, layer_moe, name_summary, supported_types
from .routing import Routing

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
    "fused_shards",
    "name_summary",
    "bug_report_hint",
    "routing_from_config",
    "ROUTER",
    "LAYER",
    "layer_index",
    "routers",
    "MoEConfig",
    "moe_config",
    "expert_count",
]

# model_type -> how routed experts are spelled (the families package holds the facts)
SUPPORTED = {t: f.experts for t, f in BY_TYPE.items() if not f.refuse}
# families known only in a fused layout int4pack does not split (named in refusals)
FUSED = FUSED_ONLY

_ROLE = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
# an MoE block: mlp, block_sparse_moe, feed_forward, DeepSeek-V4's on-disk ffn, or the decoder layer
# itself (Gemma-4: layers.N.experts beside the dense layers.N.mlp)
_BLOCK = r"(?:mlp|block_sparse_moe|feed_forward|ffn|moe|layers\.\d+)"  # moe: Step-3.5 (vLLM step3p5.py)
_EXPERT = re.compile(
    rf"^(?P<moe>.+?\.{_BLOCK})\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)$")
_SHARED = re.compile(r"^(?P<mlp>.+?\.(?:(?:mlp|feed_forward|ffn|block_sparse_moe)\.shared_experts?|share_expert))\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)$")
_DENSE = re.compile(r"^(?P<mlp>.+?\.(?:mlp|feed_forward))\.(?P<proj>gate_proj|up_proj|down_proj)$")
_ATTN = re.compile(r"\.(self_attn|attention|attn|linear_attn)\.")
# an MoE block's router weight (less ".weight"): mlp.gate (Qwen, DeepSeek), block_sparse_moe.gate
# (Mixtral), feed_forward.router (Llama 4), mlp.router (gpt-oss), router.layer, Gemma-4's
# layers.N.router.proj; and Qwen's shared_expert_gate, a float linear kept like the routers
ROUTER = re.compile(rf"\.(?P<block>{_BLOCK})\.(?P<leaf>gate|shared_expert_gate|router)(?P<sub>\.layer|\.proj)?$")
# tensor names that mean a fused (3-D) expert layout
_FUSED_TENSOR = re.compile(
    r"\.experts\.(gate_up_proj|down_proj|gate_proj|up_proj)"
    r"(_blocks|_scales|_bias|_scale|_packed|\.weight|\.weight_packed|\.qweight|\.weight_scale|\.scales)?$"
    r"|\.(input_linear|output_linear)\.(weight|weight_packed|qweight)$"
    r"|\.moe\.(gate_proj|up_proj|down_proj)\.(weight|weight_packed|qweight)$")  # Step-3.5's stacked experts
_FUSED_INT = re.compile(r"(_blocks|_packed|\.weight_packed|\.qweight|\.input_linear\.weight|\.output_linear\.weight)$")
LAYER = re.compile(r"\.layers\.(\d+)\.")  # the layer index in a module or tensor name


def layer_index(name: str) -> int:
    """The decoder layer a module or tensor name lies in (``...layers.<n>....``), or -1."""
    m = LAYER.search(f".{name}.")
    return int(m.group(1)) if m else -1

# vLLM loads these checkpoint linears into one fused module each (the model classes'
# packed_modules_mapping in vLLM V019 and V032): the shards of one fused module, like all
# experts of one MoE layer, run under one quantisation scheme
VLLM_FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),  # DeepSeek MLA with q_lora_rank
    **{k: v for f in FAMILIES for k, v in f.vllm_fused.items()},  # Gated DeltaNet, DSA indexer
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
        return layer_index(self.prefix)


@dataclass
class Layout:
    """Roles of every quantised linear, plus MoE layers and MLP triples."""

    model_type: str
    # module -> "expert" | "shared_expert" | "dense_mlp" | "attention" | "linear" | "float_only"
    roles: dict[str, str]
    moe_layers: list[MoELayer]
    mlps: list[dict[str, str]]  # gate/up/down triples (experts, shared experts, dense MLPs)
    routers: list[str]  # float router tensors (names of .weight)
    family: str = ""  # the family's name (families/)
    routing: dict = field(default_factory=dict)  # families.routing_facts of the text config
    kept: dict[str, int] = field(default_factory=dict)  # non-expert tensors kept as they are: reason -> count

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


def fused_shards(names) -> dict[str, list[str]]:
    """Dense linears grouped by the vLLM module each loads into (``vllm_module``): q/k/v under their
    qkv_proj, gate/up under gate_up_proj, any other alone. vLLM runs one scheme per such module."""
    out: dict[str, list[str]] = {}
    for name in names:
        out.setdefault(vllm_module(name), []).append(name)
    return out


def vllm_module(name: str, model_type: str | None = None) -> str:
    """The vLLM module a quantised linear loads into: ``<moe>.experts`` for a routed expert (one
    FusedMoE per layer), ``<parent>.qkv_proj`` for q_proj and the like, else the linear itself.
    With ``model_type``: named by the prefix vLLM gives the module (its quant method's name)."""
    fam = family(model_type) if model_type else None
    m = _EXPERT.match(name)
    if m:
        unit = f"{m['moe']}.experts"
    else:
        parent, _, leaf = name.rpartition(".")
        fused = _FUSED_OF.get(leaf)
        unit = f"{parent}.{fused}" if fused and parent and not (fam and fused in fam.vllm_apart) else name
    return fam.vllm_prefix(unit) if fam else unit


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
    fam = family(model_type)
    _refuse_fused(model_type, fam, tensor_names)
    if fam is None:
        raise RefusedError(unknown_type_message(model_type, linears), hint=bug_report_hint())
    if fam.refuse:
        shown = next((t for t in tensor_names if ".experts." in t), None)
        raise RefusedError(f"model_type {model_type!r} ({fam.name}): {fam.refuse}", tensor=shown,
                           hint="Supported: " + ", ".join(supported_types()) + ".")

    roles: dict[str, str] = {}
    layers: dict[str, MoELayer] = {}
    mlps: dict[str, dict[str, str]] = {}
    for name in linears:
        role, d = classify(name)
        if role == "linear" and ".experts." in name:
            raise RefusedError(f"{name}: an expert tensor whose naming int4pack does not know", tensor=name,
                               hint="Expected <prefix>.(mlp|block_sparse_moe).experts.<E>.(gate|up|down)_proj "
                                    "or w1/w3/w2.")
        if role != "expert" and fam.is_float_only(name):
            role = "float_only"  # vLLM builds it unquantised: dequantised to bfloat16 by convert
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
                parent, leaf = d["mlp"].rsplit(".", 1)
                moe = f"{parent}.moe" if leaf == "share_expert" else parent  # Step-3.5: moe beside share_expert
                layers.setdefault(moe, MoELayer(moe)).shared[d["proj"]] = name

    names = set(tensor_names)
    routers = sorted(t[: -len(".weight")] for t in names if t.endswith(".weight") and ROUTER.search(t[:-7]))
    for lay in layers.values():
        for cand in (f"{lay.prefix}.gate", f"{lay.prefix}.router", f"{lay.prefix}.router.layer",
                     f"{lay.prefix}.router.proj"):
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
    kept: dict[str, int] = {}
    for t in tensor_names:
        why = fam.kept_reason(t)
        if why:
            kept[why] = kept.get(why, 0) + 1
    return Layout(model_type, roles, moe_layers, triples, routers, fam.name, fam.facts(text_config), kept)


def bug_report_hint() -> str:
    """How to ask for a model family int4pack does not know, and where."""
    return (f"To ask for it, send {report_to()} the model's name and the tensor-name summary that "
            "`int4pack inspect <folder>` prints (the 'Tensor names' table; `--json` has it as "
            "tensor_names): names only, no weights.")


def unknown_type_message(model_type: str, linears: list[str]) -> str:
    stray = [n for n in linears if ".experts." in n][:1]
    return (f"model_type {model_type!r} is not a MoE family int4pack knows"
            + (f" (expert tensors such as {stray[0]})" if stray else "")
            + "; supported model types: " + ", ".join(supported_types()))


def _refuse_fused(model_type: str, fam: Family | None, tensor_names: list[str]) -> None:
    """Fused (3-D) expert tensors: decided by the tensors present, never by the model type alone.

    Float fused experts in a block vLLM's main model drops (an MTP block) are copied as they are;
    int4 fused tensors are refused naming the tensor: no producer documents a 3-D int4 layout
    (packing axis, gate/up order or interleave) that a split could follow without guessing."""
    fused = sorted(t for t in tensor_names if _FUSED_TENSOR.search(t)
                   and not (fam is not None and fam.is_dropped(t) and not _FUSED_INT.search(t))
                   and not (fam is not None and fam.is_converted(t)))
    if not fused:
        return
    if fam is not None and fam.refuse:
        raise RefusedError(f"model_type {model_type!r} ({fam.name}): {fam.refuse}: {fused[0]}", tensor=fused[0],
                           hint="Supported: " + ", ".join(supported_types()) + ".")
    shown = ", ".join(fused[:3]) + (f" (+{len(fused) - 3} more)" if len(fused) > 3 else "")
    ints = [t for t in fused if _FUSED_INT.search(t)]
    what = FUSED.get(model_type, "fused experts")
    if ints:
        raise RefusedError(
            f"model_type {model_type!r}: fused expert tensors ({what}) stored as 3-D int4: {shown}",
            tensor=ints[0],
            hint="int4pack splits no 3-D int4 expert tensor: no producer documents its packing axis and gate/up "
                 "order, and a guess would convert without error into a wrong model. Requantise per expert "
                 "(llm-compressor's oneshot writes experts.E.{gate,up,down}_proj).")
    raise RefusedError(
        f"model_type {model_type!r}: fused expert tensors ({what}) in float, not int4: {shown}",
        tensor=fused[0],
        hint="These experts are not quantised; int4pack converts int4 checkpoints. "
             + ((fam.fused_hint + ".") if fam is not None and fam.fused_hint else
                "Quantise per expert first (llm-compressor's oneshot splits fused experts into "
                "experts.E.{gate,up,down}_proj)."))


def vllm_output_names(model_type: str, names) -> dict[str, str]:
    """{source tensor name: output name} for the names vLLM would not load as they are (usually empty):
    the family's renames (Mixtral and MiniMax-M2 checkpoints in transformers 5 names). The report and
    ``verify --against`` keep the source names."""
    fam = family(model_type)
    if fam is None or not fam.renames:
        return {}
    out = {}
    for n in names:
        m = fam.rename(n)
        if m != n:
            out[n] = m
    clash = set(out.values()) & (set(names) - set(out))
    if clash or len(set(out.values())) != len(out):
        name = sorted(clash)[0] if clash else sorted(out)[0]
        raise RefusedError(f"{name}: the checkpoint spells one {fam.name} module two ways "
                           "(mlp.experts.E.*_proj and block_sparse_moe.experts.E.w*)", tensor=name,
                           hint="Keep one naming per checkpoint.")
    return out


def routing_from_config(model_type: str, cfg: dict) -> Routing | None:
    """The routing vLLM's model class gives this model's first MoE layer (the family table in
    int4pack/families/), with the model's routed_scaling_factor; None for a family not known here."""
    row = layer_moe(model_type, cfg)
    return row.routing if row else None


_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def routers(names) -> dict[str, str]:
    """MoE block prefix -> its router's weight tensor, among tensor ``names``."""
    out = {}
    for n in names:
        m = ROUTER.search(n[:-7]) if n.endswith(".weight") else None
        if m and m["leaf"] != "shared_expert_gate":
            out[n[: m.start()] + "." + m["block"]] = n
    return out


def expert_count(text_config: dict) -> int | None:
    """The routed experts per MoE layer as the config names them (None when it does not)."""
    return next((text_config[k] for k in _EXPERT_COUNT_KEYS if isinstance(text_config.get(k), int)), None)


@dataclass(frozen=True)
class MoEConfig:
    """What a model config says about its MoE layers' forward (verify's reference, the lane's)."""

    num_experts: int | None
    top_k: int
    routing: dict  # the family's routing facts (families/): scoring function, score bias, groups, scale
    renormalize: bool  # top-k weights renormalised to sum 1
    # the W4A8 MoE op's activation kind (0 SiLU-gated, 1 gpt-oss's clamped SwiGLU), or the model's
    # activation.Activation where that op has none
    activation: int | Activation
    norm_offset: float  # the family's RMSNorm weight offset (1.0 where weights are stored minus one)


def moe_config(model_type: str, family_type: str, text_config: dict) -> tuple[MoEConfig, list[str]]:
    """The MoE facts of a model config, and what in it is unusable (a default is taken instead)."""
    tc = text_config
    problems = []
    top_k = (tc.get("num_experts_per_tok") or tc.get("moe_topk") or tc.get("top_k_experts")
             or tc.get("num_experts_per_token") or 2)
    if type(top_k) is not int or top_k < 1:
        problems.append(f"num_experts_per_tok is {top_k!r}, not a positive integer")
        top_k = 2
    fam = family(family_type)
    row = fam.first_moe(tc) if fam else None
    facts = fam.facts(tc) if fam else {"scoring": "softmax", "bias": False}
    # the table's renormalisation (the model class's: Mixtral always, whatever norm_topk_prob says)
    renorm = row.routing.renormalize if row else bool(tc.get("norm_topk_prob", False))
    # the W4A8 op's activation number where it computes the model's activation, else the model's
    # Activation: verify then runs each expert's two matmuls apart with it between them
    kind = (row.activation if row.activation.kernel_kind is None else row.activation.kernel_kind) if row else 0
    return MoEConfig(expert_count(tc), top_k, facts, renorm, kind,
                     fam.rmsnorm_offset if fam else 0.0), problems
