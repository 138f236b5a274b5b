"""The W4A8 target's numbers and the scale search in torch.

The int4 range, the candidate scales a group is tried at, the tie rule, the scale dtype that
ships, the error statistics every conversion path reports, and ``search_chunk``: the search
itself in torch, the reference that the C++ requant kernels reproduce byte for byte and hand
their too-close-to-call groups back to.

Scale search: with ``base = max(max(w)/7, -min(w)/8)`` (the smallest scale that clips nothing),
a coarse pass tries ``base * COARSE_RATIOS`` after plain absmax RTN (``amax/7``, first so that it
wins ties: never worse than RTN beyond a tie), then a fine pass tries FINE_POINTS ratios within
one coarse step of the winner. Every candidate is rounded to the shipped dtype before it is
judged, so the error is what ships. All-zero groups get scale ZERO_GROUP_SCALE and q = 0; other
candidates are clamped to >= TINY so 1/s is finite. Deterministic: errors within TIE (relative)
of the smallest tie, and ties go to the first candidate.
"""

from __future__ import annotations

import torch

from . import search_grid
from .error_stats import ErrorStats
from .errors import InputError
from .groups import block, group_scale, scale_dtype
from .search_grid import ZERO_GROUP_SCALE

__all__ = ["QMIN", "QMAX", "TINY", "ZERO_GROUP_SCALE", "COARSE_RATIOS", "FINE_POINTS", "TIE", "ErrorStats",
           "is_group_scale", "ship_scale", "out_scale_dtype", "check_finite", "not_finite", "eval_candidates",
           "first_within_tie", "search_chunk", "candidate_count", "workspace_width", "requant_info"]

QMIN, QMAX = -8, 7
TINY = 2.0**-126  # smallest normal fp32, exactly representable in bf16
# 0.70 .. 1.12 in steps of 0.06, with 1.0 (clip nothing) exactly on the grid (search_grid)
COARSE_RATIOS = torch.from_numpy(search_grid.default_coarse())
FINE_POINTS = search_grid.DEFAULT_FINE_POINTS
TIE = 2.0**-30  # candidate errors within this relative distance tie: the earlier candidate wins


def is_group_scale(g: int) -> bool:
    return group_scale(g)


def ship_scale(s: torch.Tensor, g: int) -> torch.Tensor:
    """Round float32 scales to the dtype that ships, back in float32."""
    return s.to(torch.bfloat16).float() if is_group_scale(g) else s


def out_scale_dtype(g: int) -> torch.dtype:
    return getattr(torch, scale_dtype(g))

def check_finite(t: torch.Tensor, what: str, name: str | None) -> None:
    if not bool(torch.isfinite(t).all()):
        raise not_finite(what, name)


def not_finite(what: str, name: str | None) -> InputError:
    return InputError(f"{what} of {name or 'a tensor'} contain NaN or Inf", tensor=name,
                      hint="the source checkpoint is corrupt or was saved with overflowing scales")


def eval_candidates(x: torch.Tensor, negx: torch.Tensor, cands: torch.Tensor,
                     ws: torch.Tensor) -> torch.Tensor:
    """x [r, G, 1, g], cands [r, G, C] (shipped values) -> sum of squared errors [r, G, C], float64.

    q comes from float32 (the same 1/s as the final quantisation: the error is what ships);
    ``s * q - x`` is then exact in float64 and only the squares and the sum round, so the C++
    twin (which sums in another order) takes the same ``first_within_tie`` decision unless an
    error lies within ~1e-13 (relative) of the tie threshold (see ``TieRule`` in
    csrc/convert_kernels/requant_search.h). ``ws`` is a flat float64 workspace reused across
    chunks: fresh multi-MB temporaries would page-fault on every chunk.
    """
    r, G, _, g = x.shape
    s = cands.unsqueeze(-1)
    t = ws[: r * G * cands.shape[-1] * g].view(r, G, cands.shape[-1], g)
    t.copy_(torch.mul(x, s.reciprocal()).round_().clamp_(QMIN, QMAX))  # float32 q, held in float64
    t.mul_(s.double()).add_(negx)  # s*q - w
    return t.square_().sum(dim=-1)


def first_within_tie(e: torch.Tensor) -> torch.Tensor:
    """Index [..., 1] of the first candidate whose error is within TIE (relative) of the smallest.

    Errors closer than that are ties, so the earlier candidate wins whatever order each
    implementation summed in (the C++ twin takes the same decision; see ``Group`` there).
    """
    t = e.amin(dim=-1, keepdim=True) * (1.0 + TIE)
    return (e <= t).to(torch.uint8).argmax(dim=-1, keepdim=True)  # argmax: the first maximum


def search_chunk(w: torch.Tensor, g: int, search: bool, ws: torch.Tensor):
    """w [r, K] float32 -> (q int8 [r, K], s float32 [r, G] shipped values, sse, baseline_sse, zero groups)."""
    r, k = w.shape
    gs = block(k, g)
    x = w.view(r, k // gs, 1, gs)
    wmin, wmax = torch.aminmax(x, dim=-1)  # [r, G, 1]
    amax = torch.maximum(wmax, -wmin)
    zero = (amax == 0).squeeze(-1)
    rtn = amax / 7
    negx = -x.double()
    if not search:
        s = ship_scale(rtn, g).clamp_min(TINY)
        e = eval_candidates(x, negx, s, ws)[..., 0]
        best_s, base_e = s[..., 0], e
        best_e = e
    else:
        base = torch.maximum(wmax / 7, wmin / -8)
        base = torch.where(base > 0, base, torch.ones_like(base))  # zero groups: any finite base
        ratios = torch.cat([(rtn / base), COARSE_RATIOS.expand(r, k // gs, -1)], dim=-1)
        cands = ship_scale(base * ratios, g).clamp_min(TINY)
        e = eval_candidates(x, negx, cands, ws)
        i = first_within_tie(e)  # RTN is first: it wins ties
        best_s = cands.gather(-1, i)[..., 0]
        best_e = e.gather(-1, i)[..., 0]
        base_e = e[..., 0]
    if search and FINE_POINTS > 0 and len(COARSE_RATIOS) > 1:
        # fine pass: FINE_POINTS ratios strictly inside one coarse step either side of the winner
        offs = torch.from_numpy(search_grid.fine_offsets(COARSE_RATIOS.float().numpy(), FINE_POINTS))
        rho = ratios.gather(-1, i)
        cands2 = ship_scale(base * (rho + offs), g).clamp_min(TINY)
        e2 = eval_candidates(x, negx, cands2, ws)
        # the coarse winner first: it keeps its place against a tie
        e2 = torch.cat([best_e.unsqueeze(-1), e2], dim=-1)
        j = first_within_tie(e2)
        best_s = torch.cat([best_s.unsqueeze(-1), cands2], dim=-1).gather(-1, j)[..., 0]
        best_e = e2.gather(-1, j)[..., 0]
    best_s = torch.where(zero, torch.full_like(best_s, ZERO_GROUP_SCALE), best_s)
    q = (x[:, :, 0, :] * best_s.unsqueeze(-1).reciprocal()).round_().clamp_(QMIN, QMAX)
    q = q.to(torch.int8).view(r, k)
    sse = float(best_e.sum())
    base_sse = float(base_e.sum())
    return q, best_s, sse, base_sse, int(zero.sum())


candidate_count = search_grid.candidate_count


def workspace_width(search: bool) -> int:
    """Candidates evaluated at once per element: the float64 workspace ``search_chunk`` takes."""
    return 1 + (max(len(COARSE_RATIOS), FINE_POINTS) if search else 0)


requant_info = search_grid.requant_info
