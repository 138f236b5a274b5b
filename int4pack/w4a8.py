"""Symmetric W4A8 target: lossless re-emit, exact act-order fold, error-minimising requant.

Target layout (what vLLM's CPU W4A8 path and KleidiAI take): ``q`` int8 [N, K] in [-8, 7],
contiguous groups along K, scales bf16 [N, K/g] (group) or fp32 [N, 1] (channel, g = -1),
``W' = q * scales[:, k // g]``.

Three ways to get there from a ``QuantLinear``:

* **lossless** -- the source is symmetric in its data (every zero point is 8) and every
  contiguous target group lies inside one source group: ``q = codes - 8`` bit for bit, only
  the scales are cast (fp16 -> bf16 rounds; fp16/bf16 -> fp32 is exact).
* **fold** -- act-order on a down projection whose groups all hold exactly g columns: permute
  down's columns by ``argsort(g_idx)`` (its groups become contiguous, ints unchanged) and the
  rows of gate/up by the same permutation. The MLP computes the same function.
* **requant** -- anything else (asym, AWQ, act-order on gate/up/attention, a group change):
  dequantise to float32 and search, per contiguous group, the scale that minimises
  ``||w - s * clamp(round(w / s), -8, 7)||^2`` with ``s`` already rounded to the shipped dtype.

Scale search (``requantize``): with ``base = max(max(w)/7, -min(w)/8)`` (the smallest scale
that clips nothing), a coarse pass tries ``base * [0.70, 0.76, ..., 1.00, ..., 1.12]`` plus plain absmax
RTN (``amax/7``, tried first so it wins ties, hence never worse than RTN beyond a tie), then a fine pass
tries 4 ratios within one coarse step of the winner. These 13 evaluations land within ~0.3 %
(relative rel_l2) of a 40-point grid and of a brute force over every bf16 scale (bf16 itself
only resolves 0.4-0.8 % steps), at a third of the cost. Everything is vectorised over all
groups of a row chunk; chunks bound the temporaries to a few MB (cache-sized, also fastest).

All-zero groups get scale 1.0 and q = 0 (a neutral, finite, positive bf16/fp32 value); other
candidate scales are clamped to >= 2**-126 (smallest normal, exact in bf16) so 1/s is finite.
Everything is deterministic: no randomness; candidate errors within ``TIE`` (2**-30, relative) of
the smallest tie, and ties go to the first candidate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from . import kernels as _kernels
from .errors import InputError, RefusedError, UsageError
from .records import QuantLinear

__all__ = [
    "W4A8Linear",
    "parse_group_size",
    "resolve_group_size",
    "check_group_size",
    "target_group_problem",
    "lossless_possible",
    "lossless_fast",
    "to_w4a8",
    "requantize",
    "fold_act_order",
    "dequantize_w4a8",
    "error_stats",
]

QMIN, QMAX = -8, 7
TINY = 2.0**-126  # smallest normal fp32, exactly representable in bf16
ZERO_GROUP_SCALE = 1.0
# 0.70 .. 1.12 in steps of 0.06, with 1.0 (clip nothing) exactly on the grid
COARSE_RATIOS = (1.0 + 0.06 * torch.arange(-5, 3, dtype=torch.float64)).float()
FINE_POINTS = 4
TIE = 2.0**-30  # candidate errors within this relative distance tie: the earlier candidate wins
# elements of w per chunk: 1 MB of float32, so the widest temporary (9 candidates) is ~9 MB;
# bigger chunks amortise per-op overhead better than cache-sized ones did (measured)
CHUNK_ELEMS = 1 << 18
_VALID_AUTO = (128, 64, 32)
_NO_ZEROS = torch.empty(0, dtype=torch.uint8)


@dataclass
class W4A8Linear:
    name: str
    q: torch.Tensor  # int8 [N, K], values in [-8, 7]
    scales: torch.Tensor  # bf16 [N, K//g] (group) or fp32 [N, 1] (channel)
    group_size: int  # g, or -1 for channel
    bias: torch.Tensor | None
    path: str  # "lossless" | "fold" | "requant" | "reemit"
    error: dict = field(default_factory=dict)  # vs the source float weights
    perm: torch.Tensor | None = None  # permutation applied to K (down) or N (gate/up) by a fold

    def dequantize(self) -> torch.Tensor:
        return dequantize_w4a8(self.q, self.scales, self.group_size)


# --------------------------------------------------------------------------- group size rules


def check_group_size(g: int, k: int) -> str | None:
    """Why ``g`` cannot be a W4A8 group size for in_features ``k`` (None when it can).

    -1 (channel) always works; ``g == k`` is channelwise too (KleidiAI prefers it).
    """
    if isinstance(g, bool) or not isinstance(g, int):
        return f"group size {g!r} is not an integer"
    if g == -1:
        return None
    if g <= 0:
        return f"group size {g} must be positive (or -1 for channel)"
    if g % 32:
        return f"group size {g} is not a multiple of 32 (KleidiAI needs 32, 64, 128, ...)"
    if g > k:
        return f"group size {g} is larger than K={k}"
    if k % g:
        return f"group size {g} does not divide K={k}"
    return None


def target_group_problem(g: int, k: int) -> str | None:
    """Why a module with in_features ``k`` cannot run as W4A8 group ``g`` on KleidiAI in vLLM (None
    when it can). Stricter than ``check_group_size``: ``g == k`` is refused, because vLLM would pack
    it with bf16 scales and block == K, which KleidiAI's gate refuses (torch silently takes its 4x
    larger float reference path); such a module runs as channel (-1) instead."""
    reason = check_group_size(g, k)
    if reason is None and g == k:
        return f"group size {g} equals K={k} (vLLM would take torch's slow fallback for this module)"
    return reason


def parse_group_size(requested) -> int | None:
    """A --group-size value: None/'auto' -> None (auto); 'channel'/-1 -> -1; else the integer asked for."""
    if requested is None:
        return None
    if isinstance(requested, str):
        r = requested.strip().lower()
        if r in ("", "auto"):
            return None
        if r in ("channel", "-1", "per-channel", "channelwise"):
            return -1
        try:
            return int(r)
        except ValueError:
            pass
    elif isinstance(requested, int) and not isinstance(requested, bool):
        return requested
    raise UsageError(f"--group-size {requested!r}: expected auto, channel, or a multiple of 32 such as 128",
                     hint="Leave it at auto to keep the source's group when vLLM can run it.")


def resolve_group_size(requested: int | str | None, source_group: int, k: int) -> int:
    """The W4A8 group size for one linear: g (multiple of 32, divides k, < k) or -1 (channel)."""
    try:
        req = parse_group_size(requested)
    except UsageError as e:  # name the linear's K, as every other refusal here does
        raise UsageError(f"{e} (K={k})", hint=e.hint) from None
    if req is None:
        if source_group == -1 or source_group >= k:
            return -1
        if check_group_size(source_group, k) is None:
            return source_group
        for c in _VALID_AUTO:
            if c < k and k % c == 0:
                return c
        return -1
    if req == -1 or req == k:
        return -1
    reason = check_group_size(req, k)
    if reason is None:
        return req
    hint = "use a multiple of 32 that divides K, 'auto', or 'channel'"
    if req > 0 and req % 32 == 0:
        # a sane value that this layer's K cannot take: refuse the layer, not the command line
        raise RefusedError(f"W4A8 group size {req} is invalid for K={k}: {reason}", hint=hint)
    raise UsageError(f"W4A8 group size {req} is invalid for K={k}: {reason}", hint=hint)


def _normalize_group(g: int, k: int) -> int:
    if g == k:
        return -1
    reason = check_group_size(g, k)
    if reason is not None:
        raise UsageError(f"W4A8 group size {g} is invalid for K={k}: {reason}",
                         hint="resolve it with resolve_group_size first")
    return g


# --------------------------------------------------------------------------- helpers


def _is_group_scale(g: int) -> bool:
    return g != -1


def _ship_scale(s: torch.Tensor, g: int) -> torch.Tensor:
    """Round float32 scales to the dtype that ships, back in float32."""
    return s.to(torch.bfloat16).float() if _is_group_scale(g) else s


def _out_scale_dtype(g: int) -> torch.dtype:
    return torch.bfloat16 if _is_group_scale(g) else torch.float32


def _rows_per_chunk(k: int) -> int:
    return max(1, CHUNK_ELEMS // max(k, 1))


def dequantize_w4a8(q: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """float32 [N, K] = q * scales[:, k // g] (channel: q * scales[:, 0])."""
    n, k = q.shape
    s = scales.float()
    if group_size == -1 or group_size == k:
        return q.float() * s.reshape(n, 1)
    return (q.float().view(n, k // group_size, group_size) * s.view(n, -1, 1)).view(n, k)


class _Stats:
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


def error_stats(w: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group_size: int) -> dict:
    """rel_l2, max_abs, cosine of dequantize_w4a8(q, scales) against float ``w`` (row chunks)."""
    n, k = w.shape
    st = _Stats()
    step = _rows_per_chunk(k)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        st.add(w[r0:r1].float(), dequantize_w4a8(q[r0:r1], scales[r0:r1], group_size))
    return st.result()


def _source_rows(ql: QuantLinear, gi: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """Rows r0:r1 of ql.dequantize(), same arithmetic, without building all of [N, K]."""
    s = ql.scales[r0:r1].float()[:, gi]
    z = 8.0 if ql.zeros is None else ql.zeros[r0:r1].float()[:, gi]
    return (ql.codes[r0:r1].float() - z) * s


def _check_finite(t: torch.Tensor, what: str, name: str | None) -> None:
    if not bool(torch.isfinite(t).all()):
        raise InputError(f"{what} of {name or 'a tensor'} contain NaN or Inf", tensor=name,
                         hint="the source checkpoint is corrupt or was saved with overflowing scales")


# --------------------------------------------------------------------------- scale search


def _eval_candidates(x: torch.Tensor, negx: torch.Tensor, cands: torch.Tensor,
                     ws: torch.Tensor) -> torch.Tensor:
    """x [r, G, 1, g], cands [r, G, C] (shipped values) -> sum of squared errors [r, G, C], float64.

    q comes from float32 (the same 1/s as the final quantisation: the error is what ships);
    ``s * q - x`` is then exact in float64 and only the squares and the sum round, so the C++
    twin (which sums in another order) takes the same ``_first_within_tie`` decision unless an
    error lies within ~1e-13 (relative) of the tie threshold (see ``Group`` and ``TieRule`` in
    csrc/convert_kernels.cpp). ``ws`` is a flat float64 workspace reused across
    chunks: fresh multi-MB temporaries would page-fault on every chunk.
    """
    r, G, _, g = x.shape
    s = cands.unsqueeze(-1)
    t = ws[: r * G * cands.shape[-1] * g].view(r, G, cands.shape[-1], g)
    t.copy_(torch.mul(x, s.reciprocal()).round_().clamp_(QMIN, QMAX))  # float32 q, held in float64
    t.mul_(s.double()).add_(negx)  # s*q - w
    return t.square_().sum(dim=-1)


def _first_within_tie(e: torch.Tensor) -> torch.Tensor:
    """Index [..., 1] of the first candidate whose error is within TIE (relative) of the smallest.

    Errors closer than that are ties, so the earlier candidate wins whatever order each
    implementation summed in (the C++ twin takes the same decision; see ``Group`` there).
    """
    t = e.amin(dim=-1, keepdim=True) * (1.0 + TIE)
    return (e <= t).to(torch.uint8).argmax(dim=-1, keepdim=True)  # argmax: the first maximum


def _search_chunk(w: torch.Tensor, g: int, search: bool, ws: torch.Tensor):
    """w [r, K] float32 -> (q int8 [r, K], s float32 [r, G] shipped values, sse, baseline_sse, zero groups)."""
    r, k = w.shape
    gs = k if g == -1 else g
    x = w.view(r, k // gs, 1, gs)
    wmin, wmax = torch.aminmax(x, dim=-1)  # [r, G, 1]
    amax = torch.maximum(wmax, -wmin)
    zero = (amax == 0).squeeze(-1)
    rtn = amax / 7
    negx = -x.double()
    if not search:
        s = _ship_scale(rtn, g).clamp_min(TINY)
        e = _eval_candidates(x, negx, s, ws)[..., 0]
        best_s, base_e = s[..., 0], e
        best_e = e
    else:
        base = torch.maximum(wmax / 7, wmin / -8)
        base = torch.where(base > 0, base, torch.ones_like(base))  # zero groups: any finite base
        ratios = torch.cat([(rtn / base), COARSE_RATIOS.expand(r, k // gs, -1)], dim=-1)
        cands = _ship_scale(base * ratios, g).clamp_min(TINY)
        e = _eval_candidates(x, negx, cands, ws)
        i = _first_within_tie(e)  # RTN is first: it wins ties
        best_s = cands.gather(-1, i)[..., 0]
        best_e = e.gather(-1, i)[..., 0]
        base_e = e[..., 0]
    if search and FINE_POINTS > 0 and len(COARSE_RATIOS) > 1:
        # fine pass: FINE_POINTS ratios strictly inside one coarse step either side of the winner
        step = float(COARSE_RATIOS[1] - COARSE_RATIOS[0])
        offs = torch.linspace(-step, step, FINE_POINTS + 2)[1:-1]
        rho = ratios.gather(-1, i)
        cands2 = _ship_scale(base * (rho + offs), g).clamp_min(TINY)
        e2 = _eval_candidates(x, negx, cands2, ws)
        # the coarse winner first: it keeps its place against a tie
        e2 = torch.cat([best_e.unsqueeze(-1), e2], dim=-1)
        j = _first_within_tie(e2)
        best_s = torch.cat([best_s.unsqueeze(-1), cands2], dim=-1).gather(-1, j)[..., 0]
        best_e = e2.gather(-1, j)[..., 0]
    best_s = torch.where(zero, torch.full_like(best_s, ZERO_GROUP_SCALE), best_s)
    q = (x[:, :, 0, :] * best_s.unsqueeze(-1).reciprocal()).round_().clamp_(QMIN, QMAX)
    q = q.to(torch.int8).view(r, k)
    sse = float(best_e.sum())
    base_sse = float(base_e.sum())
    return q, best_s, sse, base_sse, int(zero.sum())


def _requant_rows(n: int, k: int, g: int, rows, search: bool, name: str | None):
    """Drive the search over row chunks supplied by ``rows(r0, r1)`` (float32 [r, K])."""
    gcount = 1 if g == -1 else k // g
    q = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, gcount, dtype=_out_scale_dtype(g))
    st = _Stats()
    sse = base_sse = 0.0
    zero_groups = 0
    step = _rows_per_chunk(k)
    width = 1 + (max(len(COARSE_RATIOS), FINE_POINTS) if search else 0)
    ws = torch.empty(min(n, step) * k * width, dtype=torch.float64)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        w = rows(r0, r1).float().contiguous()
        qc, sc, e, be, zg = _search_chunk(w, g, search, ws)
        # a NaN/Inf weight makes every candidate scale of its group non-finite: cheap to spot here
        _check_finite(sc, "weights", name)
        q[r0:r1] = qc
        scales[r0:r1] = sc.to(scales.dtype)
        st.add(w, dequantize_w4a8(qc, sc, g))
        sse += e
        base_sse += be
        zero_groups += zg
    err = st.result()
    err["baseline_rel_l2"] = math.sqrt(base_sse / st.ww) if st.ww > 0 else 0.0
    info = {
        "search": search,
        "candidates": 1 if not search else len(COARSE_RATIOS) + 1 + FINE_POINTS,
        "zero_groups": zero_groups,
        "zero_group_scale": ZERO_GROUP_SCALE,
        **err,
    }
    return q, scales, info


def requantize(w: torch.Tensor, group_size: int, *, search: bool = True):
    """float [N, K] -> (q int8 [N, K], scales bf16 [N, K/g] | fp32 [N, 1], info).

    ``info`` holds rel_l2 / max_abs / cosine against ``w`` and ``baseline_rel_l2`` (plain absmax
    RTN with bf16-rounded scales on the same tensor), plus search details.
    """
    if w.dim() != 2:
        raise UsageError(f"requantize expects a 2-D weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    g = _normalize_group(group_size, k)
    if not w.is_floating_point():
        raise UsageError(f"requantize expects a float weight, got {w.dtype}")
    fast = _kernels.requant(n, k, g, search=search, name=None, w=w)  # C++ twin, or None
    if fast is not None:
        return fast
    return _requant_rows(n, k, g, lambda r0, r1: w[r0:r1], search, None)


# --------------------------------------------------------------------------- lossless / dispatch


def _target_source_groups(ql: QuantLinear, g: int) -> torch.Tensor | None:
    """Source group of each contiguous target group, or None if some target group spans two."""
    k = ql.spec.k
    gi = ql.group_index()
    if gi.numel() != k:
        return None
    gs = k if g == -1 else g
    blocks = gi.view(k // gs, gs)
    if not bool((blocks == blocks[:, :1]).all()):
        return None
    return blocks[:, 0].contiguous()


def lossless_possible(ql: QuantLinear, g: int) -> bool:
    """True when q = codes - 8 with the source scales reproduces the source exactly.

    Needs: zero points all 8 in the data, a valid W4A8 group, and every contiguous target group
    inside one source group (equal groups and trivial g_idx is the usual case; a finer target
    group, or channel -> group, also qualifies).
    """
    k = ql.spec.k
    if g == k:
        g = -1
    if check_group_size(g, k) is not None:
        return False
    if tuple(ql.codes.shape) != (ql.spec.n, k):
        return False
    if not ql.is_symmetric():
        return False
    return _target_source_groups(ql, g) is not None


def _lossless(ql: QuantLinear, g: int) -> W4A8Linear:
    n, k = ql.codes.shape
    src_groups = _target_source_groups(ql, g)
    scales = ql.scales[:, src_groups].to(_out_scale_dtype(g)).contiguous()
    _check_finite(scales, "scales (after the cast to the W4A8 dtype)", ql.spec.name)
    fast = _kernels.lossless(ql, scales, src_groups, g)  # C++ twin of the code below, or None
    if fast is not None:
        q, err = fast
    else:
        q = (ql.codes.to(torch.int8) - 8).contiguous()
        gi = ql.group_index()
        st = _Stats()
        step = _rows_per_chunk(k)
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            st.add(_source_rows(ql, gi, r0, r1), dequantize_w4a8(q[r0:r1], scales[r0:r1], g))
        err = st.result()
    return _lossless_result(ql, q, scales, g, err)


def lossless_fast(ql: QuantLinear, group_size: int) -> W4A8Linear | None:
    """The common lossless case in one C++ pass, scale checks included; None when it does not apply.

    ``ql`` may still hold its codes packed (``ql.packed``): the kernel then reads the words directly.

    Applies to a symmetric source without g_idx whose target groups each sit inside one source
    group, with scales that are finite and positive. Anything else (or no extension) returns None
    and the general path (``check_scales`` + ``to_w4a8``) decides and explains. Same bytes as
    ``_lossless`` (tests/test_w4a8.py compares them).
    """
    m = _kernels.ext()
    n, k = ql.spec.n, ql.spec.k
    if m is None or ql.g_idx is not None or ql.scales.dim() != 2 or not ql.scales.is_floating_point():
        return None
    if ql.codes is None and ql.packed[0] == 3:  # AWQ words: the lossless kernel does not read them
        if ql.zeros is not None:
            return None  # asymmetric (the readers drop zeros that are all 8)
        ql = ql.unpacked()
    job_data = _job_data(ql)  # still packed: the kernel reads the words
    if job_data is None:
        return None
    layout, data = job_data
    g = _normalize_group(group_size, k)
    zeros = _NO_ZEROS if ql.zeros is None else ql.zeros
    if zeros.dtype != torch.uint8:
        return None
    src_group = ql.spec.group_size if ql.spec.group_size > 0 else k
    status, q, s, tot = m.lossless_job(layout, data, n, k, ql.scales, zeros.contiguous(), src_group,
                                       k if g == -1 else g, g != -1, _kernels.kernel_threads())
    if int(status) != 0:
        return None
    st = _Stats()
    st.dd, st.ww, st.vv, st.wv, st.max_abs = tot.tolist()
    return _lossless_result(ql, q, s.to(_out_scale_dtype(g)), g, st.result())


def _job_data(ql: QuantLinear) -> tuple[int, torch.Tensor] | None:
    """(layout, tensor) as the one-pass kernels take a source's codes: its packed words, or
    (0, codes); None when the codes are not contiguous uint8 [N, K]."""
    if ql.codes is None:
        return ql.packed
    c = ql.codes
    if c.dtype != torch.uint8 or tuple(c.shape) != (ql.spec.n, ql.spec.k) or not c.is_contiguous():
        return None
    return 0, c


def requant_fast(ql: QuantLinear, group_size: int, *, search: bool = True) -> W4A8Linear | None:
    """An asymmetric source's requant in one C++ pass; None when it does not apply.

    ``ql`` may still hold its codes packed. Scale checks, unpack (64 rows at a time, in cache), the
    scale search, the error sums and the scale cast run in one call without the GIL. Applies to a
    source with zero points other than 8, no g_idx, and scales that are finite and positive, and
    returns None for anything else, including the rare job with a NaN/Inf weight or a decision
    left to the torch twin: the general path (``check_scales`` + ``to_w4a8``) decides and explains.
    Same bytes as ``to_w4a8`` (tests/test_kernels.py compares them).
    """
    m = _kernels.ext()
    n, k = ql.spec.n, ql.spec.k
    if (m is None or ql.zeros is None or ql.zeros.dtype != torch.uint8 or ql.g_idx is not None
            or ql.scales.dim() != 2 or not ql.scales.is_floating_point()):
        return None
    job_data = _job_data(ql)
    if job_data is None:
        return None
    layout, data = job_data
    g = _normalize_group(group_size, k)
    gs = k if g == -1 else g
    src_group = ql.spec.group_size if ql.spec.group_size > 0 else k
    coarse, fine = _kernels.search_points(search)
    status, q, s, sums, zero_groups = m.requant_job(layout, data, n, k, ql.scales, ql.zeros.contiguous(), src_group,
                                                    gs, g != -1, search, coarse, fine, _kernels.kernel_threads())
    if int(status) != 0:
        return None
    info = _kernels.requant_info(search, sums.tolist(), int(zero_groups))
    info["exact_ints"] = False
    return W4A8Linear(ql.spec.name, q, s, g, ql.bias, "requant", info)


def _lossless_result(ql: QuantLinear, q: torch.Tensor, scales: torch.Tensor, g: int, err: dict) -> W4A8Linear:
    err["baseline_rel_l2"] = None
    err["exact_ints"] = True
    # an int-quantized W4A8 source is already the target: its tensors are re-emitted
    path = "reemit" if ql.spec.fmt == "ct-int" else "lossless"
    return W4A8Linear(ql.spec.name, q, scales, g, ql.bias, path, err)


def to_w4a8(ql: QuantLinear, group_size: int, *, search: bool = True) -> W4A8Linear:
    """Lossless when the data allows it (see ``lossless_possible``), else requant."""
    n, k = ql.spec.n, ql.spec.k
    ql = ql.unpacked()
    if tuple(ql.codes.shape) != (n, k):
        raise InputError(f"{ql.spec.name}: codes shape {tuple(ql.codes.shape)} != spec [{n}, {k}]",
                         tensor=ql.spec.name)
    g = _normalize_group(group_size, k)
    fast = lossless_fast(ql, g)
    if fast is None:
        fast = requant_fast(ql, g, search=search)
    if fast is not None:
        return fast
    _check_finite(ql.scales, "scales", ql.spec.name)
    if lossless_possible(ql, g):
        return _lossless(ql, g)
    fast = _kernels.requant(n, k, g, search=search, name=ql.spec.name, ql=ql)  # C++ twin, or None
    if fast is not None:
        q, scales, info = fast
    else:
        gi = ql.group_index()
        q, scales, info = _requant_rows(n, k, g, lambda r0, r1: _source_rows(ql, gi, r0, r1), search,
                                       ql.spec.name)
    info["exact_ints"] = False
    return W4A8Linear(ql.spec.name, q, scales, g, ql.bias, "requant", info)


# --------------------------------------------------------------------------- act-order fold


def _equal_groups(ql: QuantLinear) -> int | None:
    """The common group width if every source group holds the same number of columns."""
    k = ql.spec.k
    gi = ql.group_index()
    if gi.numel() != k or k == 0 or int(gi.min()) < 0:
        return None
    counts = torch.bincount(gi)
    width = int(counts[0])
    if width == 0 or not bool((counts == width).all()) or counts.numel() * width != k:
        return None
    return width


def _permute_rows(ql: QuantLinear, perm: torch.Tensor) -> QuantLinear:
    return replace(
        ql,
        codes=ql.codes[perm].contiguous(),
        scales=ql.scales[perm].contiguous(),
        zeros=None if ql.zeros is None else ql.zeros[perm].contiguous(),
        bias=None if ql.bias is None else ql.bias[perm].contiguous(),
    )


def fold_act_order(gate: QuantLinear, up: QuantLinear, down: QuantLinear,
                   group_size: int) -> tuple[W4A8Linear, W4A8Linear, W4A8Linear]:
    """Convert one MLP/expert, folding down's act-order permutation into gate/up rows.

    ``down(silu(gate x) * up x)`` is unchanged by permuting the intermediate dim consistently,
    so down's columns are sorted by g_idx (contiguous groups, same ints) and gate/up rows follow.
    down's path is "fold" when its ints carry over (symmetric source), else "requant" of the
    permuted columns (still better than requantising across mixed groups); ``perm`` is set on
    all three either way.
    Falls back to plain ``to_w4a8`` for all three (no perm) when down's g_idx is trivial, its
    groups are unequal, or the target group does not sit inside the source groups.
    """
    i_dim = down.spec.k
    if gate.spec.n != i_dim or up.spec.n != i_dim:
        raise InputError(
            f"cannot fold act-order: gate/up out_features ({gate.spec.n}, {up.spec.n}) != "
            f"down in_features {i_dim} ({down.spec.name})", tensor=down.spec.name)
    g = _normalize_group(group_size, i_dim)
    width = None if down.has_trivial_g_idx() else _equal_groups(down)
    tgt = i_dim if g == -1 else g
    if width is None or width % tgt:
        return to_w4a8(gate, group_size), to_w4a8(up, group_size), to_w4a8(down, group_size)
    perm = torch.argsort(down.g_idx.long(), stable=True)
    down_p = replace(
        down,
        spec=replace(down.spec, act_order=False, group_size=width),
        codes=down.codes[:, perm].contiguous(),
        g_idx=None,  # sorted with equal widths == k // width
    )
    d = to_w4a8(down_p, group_size)
    # "fold" promises bit-identical ints; an asym down still gains from the sorted (aligned)
    # groups, but its ints are requantised, so it keeps the "requant" label
    if d.path == "lossless":
        d.path = "fold"
    d.perm = perm
    d.error["folded"] = True
    outs = []
    for ql in (gate, up):
        o = to_w4a8(_permute_rows(ql, perm), group_size)
        o.perm = perm
        outs.append(o)
    return outs[0], outs[1], d
