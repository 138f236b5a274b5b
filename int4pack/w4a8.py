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
  ``||w - s * clamp(round(w / s), -8, 7)||^2`` with ``s`` already rounded to the shipped dtype
  (``scale_search``).

Each path runs in the C++ kernels when they are built, else in torch; both give the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from . import kernels as _kernels
from .errors import InputError, UsageError
from .groups import check_group_size, normalize_group
from .records import QuantLinear
from .scale_search import ErrorStats, check_finite, out_scale_dtype, requant_info, search_chunk, workspace_width

__all__ = [
    "W4A8Linear",
    "lossless_possible",
    "lossless_fast",
    "requant_fast",
    "to_w4a8",
    "requantize",
    "fold_act_order",
    "dequantize_w4a8",
    "error_stats",
]

# elements of w per chunk of the torch search: bounds its temporaries to a few MB
CHUNK_ELEMS = 1 << 18
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


# --------------------------------------------------------------------------- helpers


def _rows_per_chunk(k: int) -> int:
    return max(1, CHUNK_ELEMS // max(k, 1))


def dequantize_w4a8(q: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """float32 [N, K] = q * scales[:, k // g] (channel: q * scales[:, 0])."""
    n, k = q.shape
    s = scales.float()
    if group_size == -1 or group_size == k:
        return q.float() * s.reshape(n, 1)
    return (q.float().view(n, k // group_size, group_size) * s.view(n, -1, 1)).view(n, k)


def error_stats(w: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group_size: int) -> dict:
    """rel_l2, max_abs, cosine of dequantize_w4a8(q, scales) against float ``w`` (row chunks)."""
    n, k = w.shape
    st = ErrorStats()
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


# --------------------------------------------------------------------------- scale search


def _requant_rows(n: int, k: int, g: int, rows, search: bool, name: str | None):
    """Drive the search over row chunks supplied by ``rows(r0, r1)`` (float32 [r, K])."""
    gcount = 1 if g == -1 else k // g
    q = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, gcount, dtype=out_scale_dtype(g))
    st = ErrorStats()
    base_sse = 0.0
    zero_groups = 0
    step = _rows_per_chunk(k)
    ws = torch.empty(min(n, step) * k * workspace_width(search), dtype=torch.float64)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        w = rows(r0, r1).float().contiguous()
        qc, sc, _, be, zg = search_chunk(w, g, search, ws)
        # a NaN/Inf weight makes every candidate scale of its group non-finite: cheap to spot here
        check_finite(sc, "weights", name)
        q[r0:r1] = qc
        scales[r0:r1] = sc.to(scales.dtype)
        st.add(w, dequantize_w4a8(qc, sc, g))
        base_sse += be
        zero_groups += zg
    return q, scales, requant_info(search, st, base_sse, zero_groups)


def requantize(w: torch.Tensor, group_size: int, *, search: bool = True):
    """float [N, K] -> (q int8 [N, K], scales bf16 [N, K/g] | fp32 [N, 1], info).

    ``info`` holds rel_l2 / max_abs / cosine against ``w`` and ``baseline_rel_l2`` (plain absmax
    RTN with bf16-rounded scales on the same tensor), plus search details.
    """
    if w.dim() != 2:
        raise UsageError(f"requantize expects a 2-D weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    g = normalize_group(group_size, k)
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
    scales = ql.scales[:, src_groups].to(out_scale_dtype(g)).contiguous()
    check_finite(scales, "scales (after the cast to the W4A8 dtype)", ql.spec.name)
    fast = _kernels.lossless(ql, scales, src_groups, g)  # C++ twin of the code below, or None
    if fast is not None:
        q, err = fast
    else:
        q = (ql.codes.to(torch.int8) - 8).contiguous()
        gi = ql.group_index()
        st = ErrorStats()
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
    g = normalize_group(group_size, k)
    zeros = _NO_ZEROS if ql.zeros is None else ql.zeros
    if zeros.dtype != torch.uint8:
        return None
    src_group = ql.spec.group_size if ql.spec.group_size > 0 else k
    status, q, s, tot = m.lossless_job(layout, data, n, k, ql.scales, zeros.contiguous(), src_group,
                                       k if g == -1 else g, g != -1, _kernels.kernel_threads())
    if int(status) != 0:
        return None
    st = ErrorStats()
    st.dd, st.ww, st.vv, st.wv, st.max_abs = tot.tolist()
    return _lossless_result(ql, q, s.to(out_scale_dtype(g)), g, st.result())


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
    g = normalize_group(group_size, k)
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
    g = normalize_group(group_size, k)
    fast = lossless_fast(ql, g)
    if fast is None:
        fast = requant_fast(ql, g, search=search)
    if fast is not None:
        return fast
    check_finite(ql.scales, "scales", ql.spec.name)
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
    g = normalize_group(group_size, i_dim)
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
