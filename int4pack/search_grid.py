"""The scale search's candidate grid and report entry, without torch.

``scale_search`` holds the search's settings (``COARSE_RATIOS``, ``FINE_POINTS``: torch tensors and
counts that tests and benchmarks change) and imports torch. A convert whose requantised modules all
go through the C++ batches (batch.py) needs only the grid and the report entry, so it reads them
here: scale_search's settings once that module is imported (nothing else can have changed them),
else their default values, computed here as torch computes them (equal bit for bit:
tests/test_kernels.py), and never imports torch.
"""

from __future__ import annotations

import math
import sys

import numpy as np

__all__ = ["ZERO_GROUP_SCALE", "DEFAULT_FINE_POINTS", "default_points", "settings_loaded", "candidate_count",
           "requant_info"]

ZERO_GROUP_SCALE = 1.0
DEFAULT_FINE_POINTS = 4
_SETTINGS = "int4pack.scale_search"
_default: list = []


def default_points() -> tuple[np.ndarray, np.ndarray]:
    """(coarse ratios, fine offsets) as float32: scale_search's ``COARSE_RATIOS`` (1 + 0.06 k,
    k = -5..2, in float64 then float32) and ``torch.linspace(-step, step, FINE_POINTS + 2)[1:-1]``
    in float32, where torch's CPU kernel takes the first half from the start and the rest from the end."""
    if not _default:
        coarse = (1.0 + 0.06 * np.arange(-5, 3, dtype=np.float64)).astype(np.float32)
        step = float(coarse[1] - coarse[0])  # a float32 difference, as scale_search's
        n = DEFAULT_FINE_POINTS + 2
        lo, hi = np.float32(-step), np.float32(step)
        d = (hi - lo) / np.float32(n - 1)
        vals = [lo + d * np.float32(i) if i < n // 2 else hi - d * np.float32(n - 1 - i) for i in range(n)]
        _default.append((coarse, np.array(vals[1:-1], dtype=np.float32)))
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
