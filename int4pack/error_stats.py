"""Running sums of a weight's error (rel_l2, max_abs, cosine), kept apart from scale_search so
that a convert whose modules all go through the C++ batches (which return the sums) never
imports torch; and the one builder of a converted module's report entry (``module_stats``) with
the two ways its figures are written (``report_number``: the report's, ``short_number``: a
terminal's)."""

from __future__ import annotations

import math

from ._lazy import torch

__all__ = ["ErrorStats", "module_stats", "report_number", "short_number"]


def report_number(x: float | None) -> str | None:
    """A figure as the report writes it: 6 significant digits (None stays None)."""
    return None if x is None else f"{x:.6g}"


def short_number(x) -> str:
    """A figure as a terminal shows it: 3 significant digits, "-" where there is none."""
    return "-" if x in (None, "") else f"{float(x):.3g}"


def module_stats(path: str, role, group_size: int, error: dict) -> dict:
    """A converted module's entry in the report's ``stats`` (every path: the torch jobs and the C++
    batches): its path, role and target group, then its error figures, floats as ``report_number``."""
    return {"path": path, "role": role, "group_size": group_size,
            **{k: report_number(v) if isinstance(v, float) else v for k, v in error.items()}}


class ErrorStats:
    """Running sums for rel_l2 / max_abs / cosine, accumulated in float64."""

    def __init__(self):
        self.dd = self.ww = self.vv = self.wv = 0.0
        self.max_abs = 0.0

    def add(self, w: torch.Tensor, v: torch.Tensor) -> None:
        if not w.numel():
            return
        d = (v - w).reshape(-1)
        w = w.reshape(-1)
        v = v.reshape(-1)
        # float32 reductions (torch sums pairwise) are plenty for a report; totals go to float64
        sums = [float(torch.dot(d, d)), float(torch.dot(w, w)), float(torch.dot(v, v)), float(torch.dot(w, v))]
        if not all(map(math.isfinite, sums)):  # squares past float32's range (|w| ~ 1e19 and up)
            d, w, v = d.double(), w.double(), v.double()
            sums = [float(torch.dot(d, d)), float(torch.dot(w, w)), float(torch.dot(v, v)), float(torch.dot(w, v))]
        self.dd += sums[0]
        self.ww += sums[1]
        self.vv += sums[2]
        self.wv += sums[3]
        lo, hi = torch.aminmax(d)
        self.max_abs = max(self.max_abs, float(-lo), float(hi))

    def result(self) -> dict:
        ref = math.sqrt(self.ww)
        if ref > 0:
            rel = math.sqrt(self.dd) / ref
        else:
            rel = 0.0 if self.dd == 0 else math.inf
        den = math.sqrt(self.ww * self.vv)
        if den > 0:
            cos = self.wv / den
        else:
            cos = 1.0 if self.ww == 0 and self.vv == 0 else 0.0
        return {"rel_l2": rel, "max_abs": self.max_abs, "cosine": cos}
