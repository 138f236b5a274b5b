"""The checkpoint-wide half of verify's structural pass: every MoE layer has its router and all
its experts, each with gate, up and down under one config group; the config's ignore list, the
int8 weights without scales and the layers the config names against what the index holds."""

from __future__ import annotations

from ..architectures import layer_index

__all__ = ["layer_index", "check_layers", "check_config_index"]


def check_layers(t, problems) -> None:
    """Each MoE layer of the Target ``t`` complete and under one scheme; what is wrong into ``problems``."""
    want = t.num_experts
    prefixes = sorted(set(t.layers) | set(t.routers), key=lambda p: (layer_index(p), p))
    for p in prefixes:
        experts = t.layers.get(p, {})
        if not experts and any(n.startswith(f"{p}.experts.") for n in t.ckpt.tensors):
            continue  # experts kept in float (an MTP block the main model drops): not W4A8, nothing to check
        if p not in t.routers:
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
        schemes = {t.groups.get(m) for slot in experts.values() for m in slot.values()}
        if len(schemes) > 1:  # vLLM's MoE method runs one scheme for w13 and w2 of every expert
            problems.add(p, f"experts under several config groups (group sizes {sorted(map(str, schemes))}); "
                            "vLLM takes one scheme per MoE layer")


def check_config_index(t, problems) -> None:
    """The config's ignore list and layer count, and the int8 weights, against the index."""
    ck = t.ckpt
    quant = set(t.modules) | t.stored
    for m in t.ignore:
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
