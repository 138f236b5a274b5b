"""verify --against's exact path for an expert its source plans lossless: the source's int4 codes
compared with the output's int4 values as integers, its scales with the output's as stored, and,
where all three projections are equal, the source's float32 reference and its error prediction
computed from those same integers with the source's own scales (``w4a8_reference``), so that no
float32 copy of any weight matrix is made, on either side.

Where anything differs (one int, one scale, a NaN), the expert goes the general way
(source.weights_vs_source), which names the module, the row and the column: this path only
ever passes what the general one would pass, faster.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .. import moe as moe_mod
from ..groups import block, channel_group, check_group_size, nests
from ..scale_search import out_scale_dtype
from .tolerance import budget
from ..w4a8 import target_source_groups

__all__ = ["source_groups", "exact_module", "exact_expert", "scale_error_sq", "scale_error_sq_groups", "rel_from", "exact_reference",
           "exact_stats", "lossless_values", "ints_vs_source"]

ROLES = ("gate", "up", "down")


def source_groups(ql, g: int, gi: torch.Tensor | None = None) -> torch.Tensor | None:
    """For a lossless conversion of the source record ``ql`` at target group ``g``: the source
    group of each target group (its scales are ``ql.scales[:, index]``), or None where the module
    is not lossless from its source (signed or asymmetric scales, a target group across source
    groups, no int4 codes). ``gi``: the source's group of each input column (permuted by an
    act-order fold), else its own. The rule of w4a8.lossless_possible."""
    if (ql.codes is None and ql.packed is None) or ql.spec.signed_scales or not ql.is_symmetric():
        return None  # signed scales (auto-round's full-range grid): requantised, not kept
    k = ql.spec.k
    g = channel_group(k, g)
    if check_group_size(g, k) is not None:
        return None
    gs = block(k, g)
    if gi is None and ql.g_idx is None:  # contiguous source groups: nested or not, no index to build
        src_gs = ql.spec.group_size
        return torch.arange(0, k, gs) // src_gs if nests(src_gs, k, g) and ql.scales.shape[1] == -(-k // src_gs) \
            else None
    return target_source_groups(ql, g, gi)


def exact_module(t, src, m: str, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor | None:
    """The source's scales of module m, float32 [N, groups] at the output's group, where m is
    planned lossless from the source and its int4 values and scales as read (q int8 [N, K], s) are
    exactly the source's codes - 8 and its scales cast to the output's dtype; else None (the general
    path then checks it and names what differs). The source record stays in ``src``'s cache for
    the bias check: ``src.forget`` drops it."""
    if src.paths.get(m) != "lossless":
        return None  # a fold permutes, a requant rounds anew: the float comparison decides
    ql = src.read(m)
    if ql.g_idx is not None and not ql.has_trivial_g_idx():
        return None
    g = t.group_for(m)
    grp = source_groups(ql, g)
    if grp is None or ql.codes is None or tuple(ql.codes.shape) != tuple(q.shape):
        return None
    want = ql.scales[:, grp]
    if s.dtype != out_scale_dtype(g) or tuple(s.shape) != tuple(want.shape):
        return None
    # codes are 0..15, the values -8..7: one int8 sum and a comparison, no float anywhere
    if not (_same_bytes(ql.codes, q + 8) and torch.equal(s, want.to(s.dtype))):
        return None
    return want.float().contiguous()


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors of one size hold the same bytes: compared 8 at a time as
    uint64 (torch.equal on int8 measured 5-10x slower, numpy on bytes 4x)."""
    x, y = a.contiguous().view(torch.uint8).numpy().reshape(-1), b.contiguous().view(torch.uint8).numpy().reshape(-1)
    if x.size != y.size:
        return False
    w = x.size // 8 * 8
    return bool(np.array_equal(x[:w].view(np.uint64), y[:w].view(np.uint64)) and np.array_equal(x[w:], y[w:]))


def exact_expert(t, src, slot: dict[str, str], views: dict[str, tuple]) -> dict[str, torch.Tensor] | None:
    """{role: ``exact_module``'s source scales} where each of the expert's projections (``views``:
    role -> (int8 [N, K], scales) as read) passes it; else None."""
    out = {}
    for r in ROLES:
        sc = exact_module(t, src, slot[r], *views[r])
        if sc is None:
            return None
        out[r] = sc
    return out


def scale_error_sq(vk, q: torch.Tensor, s: torch.Tensor, s_src: torch.Tensor) -> float:
    """||q * s - q * s_src||^2 over the whole matrix, for ints equal on both sides: the scales'
    difference (exact in float32: two floats within a factor 2, Sterbenz) times the ints, squared
    and summed by the kernel row by row, from the int8 values (no float matrix)."""
    ds = (s.float().reshape(s_src.shape) - s_src).contiguous()
    rows = torch.empty(q.shape[0])
    vk.w4a8_reference(torch.empty(0, q.shape[1]), q, ds, row_sq=rows)
    return float(rows.double().sum())


def scale_error_sq_groups(group_sq: torch.Tensor, s: torch.Tensor, s_src: torch.Tensor) -> float:
    """``scale_error_sq`` from each group's sum of q^2 (``group_sq`` [N, G], as w4a8_reference makes
    it on its way through the same ints): sum over groups of (s - s_src)^2 times it, in double,
    with no second pass over the ints."""
    ds = (s.float().reshape(s_src.shape) - s_src).reshape(group_sq.shape).double()
    return float((ds * ds * group_sq.double()).sum())


def rel_from(num_sq: float, den_sq: float) -> float:
    """tolerance.rel's figure from its squared numerator and denominator."""
    return math.sqrt(num_sq) / math.sqrt(den_sq) if den_sq > 0 else (0.0 if num_sq == 0 else math.inf)


def exact_reference(vk, xe: torch.Tensor, q13, q2, scales: dict[str, torch.Tensor], activation) -> dict:
    """The source's float32 expert on rows ``xe``, from the output's int4 values (equal to the
    source's codes - 8) and the source's scales: what moe.expert_forward gives on the source's
    dequantised weights, the same products, summed in the kernel's order. Also its y13 and
    activation (the weight-noise prediction's), the squared row sums of its gate and up and the
    squared column sums of its down, and each group's sum of q^2 (``gsq13``, ``gsq2``: the scale
    error's weights, exact_stats)."""
    inter = q2.shape[1]
    s13 = torch.cat([scales["gate"], scales["up"]])
    sq13, sq2 = torch.empty(q13.shape[0]), torch.empty(inter)
    gsq13 = torch.empty(q13.shape[0], s13.reshape(q13.shape[0], -1).shape[1])
    gsq2 = torch.empty(q2.shape[0], scales["down"].reshape(q2.shape[0], -1).shape[1])
    y13 = vk.w4a8_reference(xe, q13, s13, row_sq=sq13, group_sq=gsq13)
    act = moe_mod.activation(y13[:, :inter], y13[:, inter:], activation).contiguous()
    y = vk.w4a8_reference(act, q2, scales["down"], col_sq=sq2, group_sq=gsq2)
    return {"y": y, "y13": y13, "act": act, "sq13": sq13, "sq2": sq2, "gsq13": gsq13, "gsq2": gsq2}


def exact_stats(t, src, slot: dict[str, str], report, views: dict[str, tuple], scales: dict[str, torch.Tensor],
                ref: dict) -> tuple[dict, list[str], list[float]]:
    """Each projection's rel_l2 against the source and its budget (tolerance.budget), as
    weights_vs_source gives them, without either float matrix: the ints are equal, so the difference
    is the scales' alone, ||q * (s_out - s_src)|| over ||q * s_src||, each squared row sum made by
    the kernel from the int8 values. Returns (stats, problems, the weight variances of the
    prediction: budget^2 * sum of squares / elements, per role)."""
    inter = views["gate"][0].shape[0]
    den = {"gate": ref["sq13"][:inter], "up": ref["sq13"][inter:], "down": ref["sq2"]}
    gsq = {"gate": ref["gsq13"][:inter], "up": ref["gsq13"][inter:], "down": ref["gsq2"]}
    stats, problems, wv = {}, [], []
    for r in ROLES:
        m = slot[r]
        q, s = views[r]
        d = float(den[r].double().sum())
        meas = rel_from(scale_error_sq_groups(gsq[r], s, scales[r]), d)
        bud, why = budget(m, None, t.group_for(m), report, src)  # lossless: the bound needs no weights
        stats[r] = {"module": m, "rel_l2": meas, "budget": bud, "budget_from": why, "exact_ints": True}
        if not meas <= bud:
            problems.append(f"{m}: weight rel_l2 {meas:.4g} vs the source exceeds its budget {bud:.4g} ({why})")
        wv.append(bud ** 2 * d / q.numel())
    return stats, problems, wv


def lossless_values(ql, g: int, cols: torch.Tensor | None = None, rows: torch.Tensor | None = None):
    """(int4 values int8 [N, K], scales) that a lossless conversion of the source record ``ql`` at
    target group ``g`` writes: ``codes - 8`` and the source scales cast to the W4A8 dtype, with the
    act-order fold's permutation applied (``cols`` of a down projection, ``rows`` of its gate and
    up); None where the module is not lossless from its source (asymmetric, a target group across
    source groups, no int4 codes). The rule of w4a8.lossless_possible, on the permuted record."""
    if ql.codes is None:
        return None
    gi, codes, scales = ql.group_index(), ql.codes, ql.scales
    if gi.numel() != ql.spec.k:
        return None
    if cols is not None:
        codes, gi = codes[:, cols], gi[cols]
    if rows is not None:
        codes, scales = codes[rows], scales[rows]
    grp = source_groups(ql, g, gi)
    if grp is None:
        return None
    return (codes.to(torch.int8) - 8), scales[:, grp].to(out_scale_dtype(g))


def ints_vs_source(m: str, got: tuple, want: tuple | None) -> list[str]:
    """A lossless module's int4 values and scales as read (``got``) against what its source gives
    (``lossless_values``): equal, or a problem naming the first difference. A changed int is found
    whatever the report says and however small its float error."""
    if want is None:
        return []
    out = []
    for what, a, b in (("int4 value", got[0], want[0]), ("scale", got[1], want[1])):
        a = a.reshape(b.shape) if a.numel() == b.numel() else a
        if a.shape != b.shape:
            out.append(f"{m}: {what}s shaped {list(a.shape)}, its source gives {list(b.shape)}")
            continue
        same = a.to(b.dtype) == b if a.dtype != b.dtype else a == b
        if not bool(same.all()):
            r, c = (int(v) for v in (~same).nonzero()[0])
            out.append(f"{m}: lossless from the source, but {int((~same).sum())} {what}(s) differ from the "
                       f"source's (the first at row {r}, column {c}: {a[r, c].item():g} here, {b[r, c].item():g} "
                       "there)")
    return out
