"""Mixed precision in one checkpoint: what a linear that is not int4 becomes, and why (the plan says it).

vLLM's W4A8 MoE layer (Arm CPU, compressed-tensors int-quantized or int4pack's packed format) takes
one scheme for all the experts of a layer (compressed-tensors' ``get_moe_method`` refuses projections
of different schemes; a layer whose experts are all in ``ignore`` loads unquantised), so an expert
held in 8 bits or in float beside int4 siblings is requantised to int4 from its own values, with the same error-minimising search as any
requantised module (its error is reported with the rest). A dense linear (attention, shared expert,
dense MLP, MTP) is loaded by vLLM's Arm path either as W4A8 or unquantised in bf16 (listed in the
output's ``ignore``): int4 ones follow ``--dense`` (W4A8 unless it says bf16); 8-bit ones are
dequantised to bf16 (each value rounded to bf16, no other error) unless ``--dense w4a8`` asks for
int4 (requantised, lossy); float ones stay as they are, in ``ignore``. The output holds W4A8 and
bf16 linears only (its quantization_config has int4 config groups), so no 8-bit module is kept as
it is. The shards of one module vLLM fuses (q/k/v into qkv_proj, gate/up into gate_up_proj, ...)
share one fate (``tie_fused``).
"""

from __future__ import annotations

from .records import LinearSpec

__all__ = ["DENSE_MODES", "Fate", "decide", "summary", "tie_fused"]

DENSE_MODES = ("w4a8", "bf16")


class Fate:
    """What one linear becomes: W4A8 (``w4a8`` True) or bf16, and the reason printed in the plan."""

    __slots__ = ("w4a8", "why", "tied")

    def __init__(self, w4a8: bool, why: str, tied: bool = False):
        self.w4a8, self.why = w4a8, why
        self.tied = tied  # decided by a sibling shard of its fused module (tie_fused)


def _width(spec: LinearSpec) -> str:
    return "float" if spec.bits >= 16 else f"{spec.bits}-bit"


def decide(spec: LinearSpec, role: str, dense: str | None, float_only: bool = False) -> Fate:
    """``dense`` is --dense as given: None when left at its default (int4 dense linears to W4A8)."""
    if float_only:
        return Fate(False, "vLLM builds it unquantised: dequantised to bf16")
    if role == "expert":
        if spec.bits == 4:
            return Fate(True, "int4 expert")
        return Fate(True, f"{_width(spec)} expert beside int4 ones: requantised to int4 (vLLM's W4A8 MoE layer "
                          "takes int4 experts only)")
    if spec.bits == 4:
        return (Fate(False, "int4 dense linear, --dense bf16: dequantised to bf16") if dense == "bf16"
                else Fate(True, "int4 dense linear"))
    if dense == "w4a8":
        return Fate(True, f"{_width(spec)} dense linear, --dense w4a8: requantised to int4")
    return Fate(False, f"{_width(spec)} dense linear: dequantised to bf16 (vLLM loads it unquantised, "
                       "listed in ignore; --dense w4a8 requantises it to int4 instead)")


def tie_fused(fates: dict[str, Fate], shards: dict[str, list[str]]) -> None:
    """One fate per module vLLM fuses (``shards``: vLLM module -> its dense linears,
    architectures.fused_shards): vLLM runs a fused module's shards under one scheme and refuses a
    checkpoint that lists some of them in ``ignore`` and not the others ("Detected some but not all
    shards of ... are quantized", its compressed-tensors ``should_ignore_layer``). Where the shards of
    one dense module were decided apart, all of them go to bf16: the values of the int4 ones, none
    made lossier."""
    for unit, names in shards.items():
        if len({fates[n].w4a8 for n in names}) < 2:
            continue
        first = min(n for n in names if not fates[n].w4a8)
        for n in names:
            if fates[n].w4a8:
                fates[n] = Fate(False, f"shard of vLLM's fused {unit.rsplit('.', 1)[-1]} beside "
                                       f"{first.rsplit('.', 1)[-1]} in bf16: dequantised to bf16 (vLLM runs "
                                       "one scheme per fused module)", tied=True)


def summary(specs: dict[str, LinearSpec], roles: dict[str, str], fates: dict[str, Fate]) -> list[dict]:
    """The modules that are not int4, grouped by role, width and decision: one row each, with a count
    and the first module's name."""
    rows: dict[tuple, dict] = {}
    for name in sorted(fates):
        s = specs[name]
        if s.bits == 4 and not fates[name].tied:
            continue
        key = (roles[name], _width(s), fates[name].why)
        row = rows.setdefault(key, {"role": key[0], "source": key[1], "decision": key[2], "modules": 0,
                                    "first": name, "path": "requant" if fates[name].w4a8 else "dequant"})
        row["modules"] += 1
    return list(rows.values())
