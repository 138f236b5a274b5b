"""The checkpoint-wide half of verify's structural pass: the config's W4A8 scheme, its layout
record and one config group per module; every MoE layer has its router and all its experts, each
with gate, up and down under one config group; the config's ignore list, the int8 weights without
scales and the layers the config names against what the index holds; the shards of each module
vLLM fuses all W4A8 or all in the ignore list. Each check reads a
``W4A8Output`` and adds what is wrong to ``problems`` (module_checks.Problems)."""

from __future__ import annotations

from ..architectures import classify, fused_shards, layer_index
from ..serve_spec import record_problems

__all__ = ["layer_index", "check_config", "check_layers", "check_config_index", "check_fused_ignore"]


def check_config(output, problems) -> None:
    """Each config group a W4A8 scheme vLLM detects (int-quantized, 4-bit symmetric int weights,
    8-bit dynamic per-token activations); the packed format's layout record; each module named by
    exactly one config group; the MoE facts the model's config gives."""
    q, groups = output.quant_config, output.config_groups
    for gname, grp in groups.items():
        w = grp.get("weights") or {}
        a = grp.get("input_activations") or {}
        fmt = grp.get("format") or q.get("format")
        where = "config" if len(groups) == 1 else f"config group {gname}"
        if fmt != "int-quantized":
            problems.add(where, f"format {fmt!r}, expected 'int-quantized' (vLLM's W4A8 int layout)")
        if w.get("num_bits") != 4 or w.get("type") != "int" or not w.get("symmetric", False):
            problems.add(where, f"weights must be 4-bit symmetric int, config says {w}")
        if a.get("num_bits") != 8 or a.get("strategy") != "token" or not a.get("dynamic"):
            problems.add(where, "input_activations must be 8-bit dynamic per token (vLLM's W4A8 detection)")
    for why in record_problems(output.record) if output.record else []:
        problems.add("config", f"quantization_config.kleidiai: {why}")
    for m in output.modules:  # vLLM resolves one config group per module
        named = output.targeted_by[m]
        if not named:
            problems.add(m, "no quantization_config group targets this module (vLLM would not quantise it)")
        elif len(named) > 1:
            problems.add(m, f"targeted by config groups {named[0]} and {named[1]}: one scheme per module")
    for why in output.moe_unusable:
        problems.add("config", why)


def check_layers(output, problems) -> None:
    """Each MoE layer of the output complete and under one scheme."""
    want = output.num_experts
    prefixes = sorted(set(output.layers) | set(output.routers), key=lambda p: (layer_index(p), p))
    for p in prefixes:
        experts = output.layers.get(p, {})
        if not experts and any(n.startswith(f"{p}.experts.") for n in output.ckpt.tensors):
            continue  # experts kept in float (an MTP block the main model drops): not W4A8, nothing to check
        if p not in output.routers:
            problems.add(p, "experts without a router weight")
        n = want or ((max(experts) + 1) if experts else 0)
        missing = [e for e in range(n) if e not in experts]
        if missing:
            problems.add(p, f"expert(s) {missing[:8]}{' ...' if len(missing) > 8 else ''} missing "
                            f"({len(experts)} of {n} present; config says {want})")
        extra = [e for e in experts if e >= n]
        if extra:
            problems.add(p, f"expert(s) {extra[:8]} beyond the config's {n} experts")
        for e, slot in sorted(experts.items()):
            lack = [r for r in ("gate", "up", "down") if r not in slot]
            if lack:
                problems.add(f"{p}.experts.{e}", f"no W4A8 {'/'.join(lack)} projection")
        schemes = {output.groups.get(m) for slot in experts.values() for m in slot.values()}
        if len(schemes) > 1:  # vLLM's MoE method runs one scheme for w13 and w2 of every expert
            problems.add(p, f"experts under several config groups (group sizes {sorted(map(str, schemes))}); "
                            "vLLM takes one scheme per MoE layer")


def check_config_index(output, problems) -> None:
    """The config's ignore list and layer count, and the int8 weights, against the index."""
    ck = output.ckpt
    quant = set(output.modules) | output.stored
    for m in output.ignore:
        if m in quant:
            problems.add(m, "listed in quantization_config.ignore but stored as W4A8 (vLLM would misload it)")
    for name, info in ck.tensors.items():
        if name.endswith(".weight") and info.dtype == "I8" and name[:-7] not in quant:
            problems.add(name, "int8 weight without a weight_scale")
    nl = ck.text_config.get("num_hidden_layers")
    if isinstance(nl, int):
        seen = {layer_index(n) for n in ck.tensors} - {-1}
        missing = sorted(set(range(nl)) - seen)
        if missing:
            problems.add("config", f"num_hidden_layers={nl} but no tensors for layer(s) {missing[:8]}")


def check_fused_ignore(output, problems) -> None:
    """vLLM runs the shards of a module it fuses (q/k/v as qkv_proj, gate/up as gate_up_proj) under
    one scheme and refuses a checkpoint that lists some of them in ``ignore`` and not the others
    ("Detected some but not all shards of ... are quantized"); convert never writes one
    (precision.tie_fused), an edited config or a hand-made output can."""
    ignored = {m for m in output.ignore if not m.startswith("re:")}
    dense = (m for m in ignored | set(output.modules) if classify(m)[0] != "expert")
    for unit, names in sorted(fused_shards(dense).items()):
        ign = {m for m in names if m in ignored}
        quant = set(names) - ign
        if quant and ign:
            leaf = lambda names: ", ".join(sorted(n.rsplit(".", 1)[-1] for n in names))  # noqa: E731
            problems.add(unit, f"vLLM fuses {leaf(quant | ign)} into {unit.rsplit('.', 1)[-1]} and runs one scheme: "
                               f"{leaf(ign)} listed in quantization_config.ignore, {leaf(quant)} W4A8 (vLLM refuses it: "
                               "\"Detected some but not all shards ... are quantized\"). Convert again, or dequantise "
                               "the W4A8 shards to bf16 and list them in ignore too")
