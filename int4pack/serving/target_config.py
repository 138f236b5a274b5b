"""The compressed-tensors ``quantization_config`` of a W4A8 output, as vLLM's CPU backend reads it.

vLLM (CompressedTensorsConfig._is_dynamic_token_w4a8_int) takes weights int, 4 bits,
symmetric, static, strategy group or channel, and input activations int, 8 bits, dynamic,
strategy token; the format is ``int-quantized`` (int4 values stored as int8).

One scheme: one config group targeting the class ``Linear`` (vLLM adds FusedMoE to it). Several
schemes: one config group per scheme whose targets are anchored ``re:`` patterns naming exactly
its modules, in the names vLLM resolves (vLLM V019 and V032, compressed_tensors/utils.py:
``find_matched_target`` tries the layer's own name first, with ``re.match``):

* a fused module (``qkv_proj``, ``gate_up_proj``, ``fused_qkv_a_proj``) is looked up by its
  fused name, so the pattern names it besides its shards;
* an MoE layer is looked up as ``<layer>.experts.0.<gate>/<up>/<down>``, spelled
  gate_proj/up_proj/down_proj by vLLM V019 for every model and w1/w3/w2 by V032 for
  Mixtral, so an experts pattern takes every expert index and both spellings.

No class name appears among them: a linear that no pattern names and ``ignore`` does not list
makes vLLM V019 refuse to load, instead of taking another module's scheme.
"""

from __future__ import annotations

import json
import re

from ..architectures import VLLM_FUSED, vllm_module, vllm_output_names
from ..families import family
from ..groups import is_channel

__all__ = ["w4a8_quant_config", "output_config", "ignore_list", "scheme_targets", "CT_VERSION"]

# the compressed-tensors version whose schema we write (the fields have been stable since 0.11)
CT_VERSION = "0.20.0"
_EXPERT_LEAVES = ("gate_proj", "up_proj", "down_proj")  # how vLLM V019 looks up every MoE layer
_LAYER = re.compile(r"^(?P<head>.*?\.layers\.)(?P<n>\d+)(?P<tail>\..*)$")
_NOT_LINEAR = re.compile(r"(embed|norm|wte|wpe|rotary|position)", re.I)


def scheme_targets(modules: list[str]) -> list[str]:
    """Anchored ``re:`` targets that match exactly ``modules`` (and the vLLM modules they load into).

    Layers holding the same modules share one pattern, e.g. ``re:^model\\.layers\\.(?:1|2)\\.mlp\\.
    experts\\.\\d+\\.(?:down_proj|gate_proj|up_proj)$``."""
    names = set(modules)
    leaves: dict[str, set[str]] = {}  # parent module -> leaf names
    experts: set[str] = set()  # parents that are an MoE layer's experts
    for m in names:
        unit = vllm_module(m)
        if unit.endswith(".experts") and m.startswith(unit + "."):
            experts.add(unit)
            leaves.setdefault(unit, set(_EXPERT_LEAVES)).add(m.rsplit(".", 1)[1])
            continue
        parent, _, leaf = m.rpartition(".")
        leaves.setdefault(parent, set()).add(leaf)
        if unit != m:  # a shard of a fused module: name the fused module once all its shards are here
            fused = unit.rsplit(".", 1)[1]
            if all(f"{parent}.{sh}" in names for sh in VLLM_FUSED[fused]):
                leaves[parent].add(fused)
    templates: dict[tuple[str, str, str], set[int]] = {}
    for parent, alts in leaves.items():
        leaf = _alternation(alts)
        if parent in experts:
            leaf = r"\d+\." + leaf
        m = _LAYER.match(parent)
        if m:
            templates.setdefault((re.escape(m["head"]), re.escape(m["tail"]), leaf), set()).add(int(m["n"]))
        else:
            templates[(re.escape(parent), "", leaf)] = set()
    out = []
    for (head, tail, leaf), layers in templates.items():
        num = _alternation(sorted(layers), escape=False) if layers else ""
        dot = "\\." if head else ""  # a top-level module has no parent
        out.append(f"re:^{head}{num}{tail}{dot}{leaf}$")
    return sorted(out)


def _alternation(items, escape: bool = True) -> str:
    parts = [re.escape(str(i)) if escape else str(i) for i in (sorted(items) if escape else items)]
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def _scheme(group_size: int, targets: list[str]) -> dict:
    channel = is_channel(group_size)
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": True,
        "strategy": "channel" if channel else "group",
        "group_size": None if channel else group_size,
        "dynamic": False,
        "actorder": None,
        "block_structure": None,
        "observer": None,
        "observer_kwargs": {},
    }
    acts = {
        "num_bits": 8,
        "type": "int",
        "symmetric": True,
        "strategy": "token",
        "group_size": None,
        "dynamic": True,
        "observer": None,
        "observer_kwargs": {},
    }
    return {
        "targets": targets,
        "format": "int-quantized",
        "weights": weights,
        "input_activations": acts,
        "output_activations": None,
    }


def w4a8_quant_config(group_size: int | dict[str, int], ignore: list[str]) -> dict:
    """``group_size``: the one target group (-1 channel), or {module (vLLM's name): group}."""
    if isinstance(group_size, dict):
        by_group: dict[int, list[str]] = {}
        for m, g in group_size.items():
            by_group.setdefault(g, []).append(m)
        if len(by_group) == 1:
            group_size = next(iter(by_group))
    if isinstance(group_size, dict):
        order = sorted(by_group, key=lambda g: (-len(by_group[g]), g))  # most modules first
        groups = {f"group_{i}": _scheme(g, scheme_targets(by_group[g])) for i, g in enumerate(order)}
    else:
        groups = {"group_0": _scheme(group_size, ["Linear"])}
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": sorted(set(ignore)),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
        "version": CT_VERSION,
    }


def ignore_list(tensors: dict, text_config: dict, quantized, dequantized) -> list[str]:
    """Every linear-like module left in float: routers, lm_head, unquantised and bf16-kept linears.
    ``tensors``: the source's name -> info (with ``shape``); ``dequantized``: int4 linears kept in bf16."""
    quant = set(quantized)
    ignore = set(dequantized)
    for name, t in tensors.items():
        if name.endswith(".weight") and len(t.shape) == 2:
            mod = name[: -len(".weight")]
            if mod not in quant and not _NOT_LINEAR.search(mod.rsplit(".", 1)[-1]):
                ignore.add(mod)
    if "lm_head.weight" in tensors or text_config.get("tie_word_embeddings"):
        ignore.add("lm_head")
    return sorted(ignore)


def output_config(config: dict, family_type: str, tensors: dict, quantized, dequantized, group_size: int | None,
                  groups: dict[str, int]) -> dict:
    """The output's config.json: the source's, without its compression records, with the W4A8
    ``quantization_config`` (one scheme, or with ``group_size`` None one config group per scheme
    over ``groups``, module -> group), every name in the names vLLM loads."""
    cfg = json.loads(json.dumps(config))
    cfg.pop("compression_config", None)
    if isinstance(cfg.get("text_config"), dict):
        cfg["text_config"].pop("quantization_config", None)
    tc = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    ignore = ignore_list(tensors, tc, quantized, dequantized)
    rename = vllm_output_names(family_type, [f"{m}.weight" for m in ignore])
    ignore = [rename.get(f"{m}.weight", f"{m}.weight")[: -len(".weight")] for m in ignore]
    # vLLM matches ``ignore`` against its module prefixes, mapping each entry by the model's
    # WeightsMapper, whose substring rules (".mlp.fc1." -> ".fc1.") need a trailing dot a module
    # name lacks: the family's vLLM prefixes name the module as vLLM's class registers it
    fam = family(family_type)
    ignore = [fam.vllm_prefix(m) for m in ignore] if fam else ignore
    if group_size is not None:
        cfg["quantization_config"] = w4a8_quant_config(group_size, ignore)
    else:  # one config group per scheme, targets in the names vLLM loads
        by_module = {rename.get(f"{m}.weight", f"{m}.weight")[: -len(".weight")]: g for m, g in groups.items()}
        cfg["quantization_config"] = w4a8_quant_config(by_module, ignore)
    return cfg
