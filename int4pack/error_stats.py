"""Running sums of a weight's error (rel_l2, max_abs, cosine), kept apart from scale_search so
that a convert whose modules all go through the C++ batches (which return the sums) never
imports torch."""

from __future__ import annotations

import math

from ._lazy import torch

__all__ = ["ErrorStats"]


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
