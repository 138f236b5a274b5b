"""verify's tolerances: how far each of its figures may be from its reference, and why.

The activation error of the W4A8 kernel is held to ``K_ACT`` times its prediction; each module's
weight error to a budget (``budget``: the bound of the path the source plans, tightened by
convert's own figure); each expert's and layer's output error to ``K_WEIGHT`` times what those
budgets predict.
"""

from __future__ import annotations

import math

import torch

from ..groups import block, group_scale, is_channel

__all__ = ["K_ACT", "K_WEIGHT", "LOSSLESS_BOUND", "REL_MARGIN", "MAX_BUDGET", "ABS_FLOOR", "rel", "cos", "rtn_rel",
           "report_figure", "budget", "sum_sq", "not_finite", "expert_prediction"]

K_ACT = 1.5  # measured/predicted activation error is 0.95-1.05 on random and real layers
K_WEIGHT = 2.0  # the isotropic weight-noise model is within ~1.5x on the fixtures
LOSSLESS_BOUND = 2.0**-8  # bf16 rounding of a scale: relative error <= 2^-8 per element
REL_MARGIN = 1e-3  # report values carry 6 digits; float32 vs float64 sums differ by ~1e-6
MAX_BUDGET = 0.35  # no module may be further than this from its source (int4 RTN is ~0.1 on real layers)
ABS_FLOOR = 1e-6
_FIGURES = ("rel_l2", "max_abs", "cosine", "act_rel", "act_pred", "weight_rel", "weight_pred", "weight_l2", "budget",
            "tolerance")


def not_finite(res: dict) -> list[str]:
    """A problem for each figure of a check that is NaN or infinite: such a figure compares with
    nothing (every comparison with NaN is false), so it fails the check instead of passing it."""
    bad = [f"{k} {res[k]}" for k in _FIGURES if isinstance(res.get(k), float) and not math.isfinite(res[k])]
    return [f"non-finite figure(s): {', '.join(bad)} (a NaN or infinity in the weights, scales or copied tensors "
            "such as the router)"] if bad else []


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    den = float(b.norm())
    num = float((a - b).norm())
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def sum_sq(w: torch.Tensor) -> float:
    """The sum of w^2, each square and the sums in float64, a slice at a time: a float64 copy of a
    whole weight matrix (and of its squares) costs more in fresh memory than the sum itself."""
    flat = w.reshape(-1)
    step = 1 << 18
    return math.fsum(float(flat[i:i + step].double().pow(2).sum()) for i in range(0, flat.numel(), step))


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    den = float(a.norm() * b.norm())
    return float(a @ b) / den if den > 0 else 1.0


def expert_prediction(w_var: torch.Tensor, wts: torch.Tensor, mask: torch.Tensor, ref_slots: torch.Tensor) -> float:
    """Predicted relative output error of one expert's (ungated) outputs from its weight budgets:
    ``w_var`` the predicted weight noise of each (token, slot), gated by the routing weight ``wts``
    squared; ``mask`` the expert's slots; ``ref_slots`` its reference outputs there."""
    v = w_var[mask] / (wts[mask] ** 2).clamp(min=1e-30)  # predicted_noise gated by g^2: undo it
    den = float(ref_slots.double().norm())
    return math.sqrt(float(v.sum())) / den if den > 0 else 0.0


def rtn_rel(w: torch.Tensor, g: int) -> float:
    """rel_l2 of plain absmax round-to-nearest at the target group (scales rounded as shipped)."""
    n, k = w.shape
    gg = block(k, g)
    wg = w.reshape(n, k // gg, gg)
    s = wg.abs().amax(2, keepdim=True) / 7
    s = (s.to(torch.bfloat16).float() if group_scale(g) else s).clamp(min=2.0**-126)
    q = (wg / s).round().clamp(-8, 7)
    return rel((q * s).reshape(n, k), w)


def report_figure(m: str, report: dict | None) -> tuple[float | None, str | None]:
    """Convert's measured rel_l2 of module m in the checkpoint's own report: (value, problem)."""
    mods = (report or {}).get("modules")
    rec = mods.get(m) if isinstance(mods, dict) else None
    if not isinstance(rec, dict) or rec.get("rel_l2") in (None, ""):
        return None, None
    try:
        v = float(rec["rel_l2"])
    except (TypeError, ValueError):
        v = math.nan
    if not (math.isfinite(v) and v >= 0):
        return None, f"int4pack_report.json: modules.{m}.rel_l2 is {rec['rel_l2']!r}, not a number >= 0"
    return v, None


def budget(m: str, w_src: torch.Tensor, g: int, report: dict | None, src) -> tuple[float, str]:
    """Allowed weight rel_l2 of module m against the source, and where the number comes from.

    The bound is the source's own: the path the source plans for m (``src.paths`` of a
    source.Source: recomputed from the source, never read from the output) and its error
    bound at g; the report's figure only tightens it, and MAX_BUDGET caps every budget. A forged
    report can make verify stricter, never looser.
    """
    path = src.paths.get(m, "requant")
    if path == "reemit":
        bound, why = ABS_FLOOR, "reemit (exact)"
    elif path in ("lossless", "fold"):
        bound, why = (ABS_FLOOR if is_channel(g) else LOSSLESS_BOUND), f"{path} (scale cast), from the source"
    else:
        bound, why = rtn_rel(w_src, g) * (1 + REL_MARGIN) + ABS_FLOOR, "requant (<= absmax RTN), from the source"
    if bound > MAX_BUDGET:
        bound, why = MAX_BUDGET, f"{why}, capped at {MAX_BUDGET}"
    fig, _ = report_figure(m, report)
    if fig is not None and fig * (1 + REL_MARGIN) + ABS_FLOOR < bound:
        bound, why = fig * (1 + REL_MARGIN) + ABS_FLOOR, "the report's figure (tighter than the source bound)"
    return bound, why
