"""The scale search's candidate grid and report entry, without torch: the one place the grid is
computed (the coarse ratios' defaults and the fine offsets around a coarse winner), for the torch
search (scale_search.search_chunk), the C++ kernels (kernels.search_points) and the batches.

``scale_search`` holds the search's settings (``COARSE_RATIOS``, ``FINE_POINTS``: a torch tensor and
a count that tests and benchmarks change) and imports torch. A convert whose requantised modules all
go through the C++ batches (batch.py) needs only the grid and the report entry, so it reads them
here: scale_search's settings once that module is imported (nothing else can have changed them),
else the defaults, and never imports torch.
"""

from __future__ import annotations

import math
import sys

import numpy as np

__all__ = ["ZERO_GROUP_SCALE", "DEFAULT_FINE_POINTS", "default_coarse", "fine_offsets", "default_points",
           "settings_loaded", "candidate_count", "requant_info"]

ZERO_GROUP_SCALE = 1.0
DEFAULT_FINE_POINTS = 4
_SETTINGS = "int4pack.scale_search"
_default: list = []


def default_coarse() -> np.ndarray:
    """The coarse ratios' default, float32: 0.70 .. 1.12 in steps of 0.06 (1 + 0.06 k, k = -5..2, in
    float64 then float32), with 1.0 (clip nothing) exactly on the grid."""
    return (1.0 + 0.06 * np.arange(-5, 3, dtype=np.float64)).astype(np.float32)


def fine_offsets(coarse: np.ndarray, points: int) -> np.ndarray:
    """The fine pass's ``points`` offsets strictly inside one coarse step either side of the coarse
    winner, float32: ``torch.linspace(-step, step, points + 2)[1:-1]`` as torch's CPU kernel computes
    it in float32 (the first half from the start, the rest from the end); none for fewer than two
    coarse ratios."""
    if points <= 0 or len(coarse) < 2:
        return np.empty(0, dtype=np.float32)
    step = float(np.float32(coarse[1]) - np.float32(coarse[0]))  # a float32 difference
    n = points + 2
    lo, hi = np.float32(-step), np.float32(step)
    d = (hi - lo) / np.float32(n - 1)
    vals = [lo + d * np.float32(i) if i < n // 2 else hi - d * np.float32(n - 1 - i) for i in range(n)]
    return np.array(vals[1:-1], dtype=np.float32)


def default_points() -> tuple[np.ndarray, np.ndarray]:
    """(coarse ratios, fine offsets) of the default settings, as float32."""
    if not _default:
        coarse = default_coarse()
        _default.append((coarse, fine_offsets(coarse, DEFAULT_FINE_POINTS)))
    return _default[0]


def settings_loaded() -> bool:
    """Whether scale_search (and with it torch) is imported: then its settings decide. A module
    another thread is still importing does not count (its settings may not exist yet, and none
    can have been changed)."""
    mod = sys.modules.get(_SETTINGS)
    return mod is not None and not getattr(getattr(mod, "__spec__", None), "_initializing", False) \
        and hasattr(mod, "FINE_POINTS")


def candidate_count(search: bool) -> int:
    """How many scales a group is tried at: RTN, the coarse ratios and the fine points (or RTN alone)."""
    if not search:
        return 1
    if settings_loaded():
        S = sys.modules[_SETTINGS]
        return len(S.COARSE_RATIOS) + 1 + S.FINE_POINTS
    coarse, fine = default_points()
    return len(coarse) + 1 + len(fine)


def requant_info(search: bool, stats, baseline_sse: float, zero_groups: int) -> dict:
    """The requant path's report entry from its ``error_stats.ErrorStats``: the error against the
    source, plain RTN's, and the search."""
    err = stats.result()
    err["baseline_rel_l2"] = math.sqrt(baseline_sse / stats.ww) if stats.ww > 0 else 0.0
    return {"search": search, "candidates": candidate_count(search), "zero_groups": zero_groups,
            "zero_group_scale": ZERO_GROUP_SCALE, **err}
