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

Each path is one C++ call (``lossless_job``, ``requant_job``: checks, unpacking, the work and its
error sums), or its torch twin where the C++ library is unavailable; both give the same bytes and
refuse the same inputs with the same errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from . import _ext
from . import kernels as _kernels
from .errors import InputError, UsageError
from .groups import (CHANNEL, block, check_group_size, group_scale, is_channelwise, nests, normalize_group,
                     scales_per_row)
from .records import Packing, QuantLinear
from .scale_search import (ErrorStats, check_finite, not_finite, out_scale_dtype, requant_info, search_chunk,
                           workspace_width)

__all__ = [
    "W4A8Linear",
    "lossless_possible",
    "check_scales",
    "to_w4a8",
    "requantize",
    "fold_act_order",
    "dequantize_w4a8",
    "error_stats",
]

# elements of w per chunk of the torch search: bounds its temporaries to a few MB
CHUNK_ELEMS = 1 << 18


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
    vk = _ext.load("verify_kernels")
    if vk is not None and q.dtype == torch.int8 and q.is_contiguous() and scales.dtype in (torch.float32,
                                                                                          torch.bfloat16):
        ng = scales_per_row(k, group_size)
        if scales.numel() == n * ng:  # the same products, in C++
            return vk.dequant(q, scales.contiguous().reshape(n, ng), _kernels.kernel_threads())
    s = scales.float()
    if is_channelwise(k, group_size):
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
    gcount = k // block(k, g)
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
    m = _kernels.ext()
    if m is not None and m.requant_ok:
        wf = w.float().contiguous()
        return _requant_cpp(m, None, (m.FLOAT_VALUES, wf), n, k, g, search,
                            lambda r, j: wf.view(n, -1, block(k, g))[r, j])
    return _requant_rows(n, k, g, lambda r0, r1: w[r0:r1], search, None)


# --------------------------------------------------------------------------- the one dispatch


def target_source_groups(ql: QuantLinear, g: int, gi: torch.Tensor | None = None) -> torch.Tensor | None:
    """Source group of each contiguous target group, or None if some target group spans two.
    ``gi``: the source's group of each input column (an act-order fold permutes it), else its own."""
    k = ql.spec.k
    gi = ql.group_index() if gi is None else gi
    if gi.numel() != k:
        return None
    gs = block(k, g)
    blocks = gi.view(k // gs, gs)
    if not bool((blocks == blocks[:, :1]).all()):
        return None
    return blocks[:, 0].contiguous()


def lossless_possible(ql: QuantLinear, g: int) -> bool:
    """True when q = codes - 8 with the source scales reproduces the source exactly.

    Needs: zero points all 8 in the data, a valid W4A8 group, and every contiguous target group
    inside one source group (equal groups and trivial g_idx is the usual case; a finer target
    group, or channel -> group, also qualifies). Reads no codes: a packed record can be asked.
    """
    k = ql.spec.k
    if is_channelwise(k, g):
        g = CHANNEL
    if check_group_size(g, k) is not None:
        return False
    if ql.spec.signed_scales or not ql.is_symmetric():  # W4A8 scales are positive
        return False
    if ql.g_idx is None:  # source group i holds columns [i*src, (i+1)*src): no tensor to look at
        return nests(ql.spec.group_size, k, g)
    return target_source_groups(ql, g) is not None


def check_scales(ql: QuantLinear) -> None:
    """Refuse source scales no producer writes, naming the tensor; cheap (scales are ~1/32 of the codes).

    NaN/Inf: never valid. Negative: GPTQ, AWQ and compressed-tensors all derive scales from a range
    (max - min, clamped positive), so a sign bit means corruption or a misread layout. Zero: valid
    only on a group whose codes all sit at its zero point (a pruned group dequantises to 0 either
    way); a zero scale over other codes erases weights the codes still hold, e.g. a zero-filled
    region of a damaged file. The C++ jobs check the same, in the same order, and report the
    place: ``_refusal`` words both.
    """
    s = ql.scales

    def first(mask: torch.Tensor) -> list[int]:
        n, g = (int(i) for i in mask.nonzero()[0])
        return [n, g, int(mask.sum()) - 1]

    bad = ~torch.isfinite(s)
    if bool(bad.any()):
        raise _refusal(ql, "scale_not_finite", first(bad))
    if not ql.spec.signed_scales and bool((s < 0).any()):
        raise _refusal(ql, "scale_negative", first(s < 0))
    zero = s == 0
    if bool(zero.any()):
        ql = ql.unpacked()
        gi = ql.group_index()
        z = 8 if ql.zeros is None else ql.zeros[:, gi]
        erased = zero[:, gi] & (ql.codes != z)  # [N, K]: a code a zero scale would wipe out
        if bool(erased.any()):
            n, k = (int(i) for i in erased.nonzero()[0])
            raise _refusal(ql, "scale_erases", [n, int(gi[k]), 0])


def _status_name(status: int) -> str:
    """A tensor job's refusal as the library names it (its JobStatus table, read from it)."""
    return next(name for name, v in _kernels.ext().tables()["job_status"].items() if v == status)


def _refusal(ql: QuantLinear | None, status: int | str, where: list[int]) -> InputError:
    """The error of a refused source, naming the tensor (``ql`` None: a bare float weight). ``status``:
    a tensor job's (the library's number) or the torch checks' (its name there, e.g. "scale_negative"),
    with the place [row, group, how many more] where its message names one."""
    status = _status_name(status) if isinstance(status, int) else status
    if status == "cast_not_finite":
        return not_finite("scales (after the cast to the W4A8 dtype)", ql.spec.name)
    if status == "weight_not_finite":
        return not_finite("weights", None if ql is None else ql.spec.name)
    name = next((k for k in ql.spec.keys if k.endswith((".scales", ".weight_scale"))), f"{ql.spec.name}.scales")
    fix = "re-download or re-export the checkpoint"
    n, g, more = where
    at = f"row {n}, group {g}" + (f" (and {more} more)" if more else "")
    if status == "scale_not_finite":
        return InputError(f"{name}: NaN or Inf scale at {at}", tensor=name,
                          hint=f"The scales are corrupt (or overflowed their dtype when saved); {fix}.")
    if status == "scale_negative":
        return InputError(f"{name}: negative scale at {at}", tensor=name,
                          hint=f"No int4 producer writes negative scales: the tensor is corrupt or not the "
                               f"layout the config claims; {fix}.")
    return InputError(f"{name}: zero scale at row {n}, group {g} over codes that are not at the zero point (the "
                      "weights they hold would be erased)", tensor=name,
                      hint=f"A zero-filled or damaged region of the file; {fix}.")


def to_w4a8(ql: QuantLinear, group_size: int, *, search: bool = True) -> W4A8Linear:
    """The linear in W4A8: its path decided once from its data (lossless when ``lossless_possible``,
    else requant), then that path's one C++ call, or its torch twin where the C++ library is
    unavailable (the same bytes). ``ql`` may still hold its codes packed."""
    n, k = ql.spec.n, ql.spec.k
    if ql.spec.signed_scales and ql.dense is None:  # W4A8 scales stay positive: the signed grid is requantised
        ql = replace(ql, dense=_checked(ql).dequantize())
    if ql.dense is not None:  # a float source (MXFP4): no ints to keep, requantised
        if tuple(ql.dense.shape) != (n, k):
            raise InputError(f"{ql.spec.name}: weights shape {tuple(ql.dense.shape)} != spec [{n}, {k}]",
                             tensor=ql.spec.name)
        q, scales, info = requantize(ql.dense, group_size, search=search)
        info["exact_ints"] = False
        return W4A8Linear(ql.spec.name, q, scales, normalize_group(group_size, k), ql.bias, "requant", info)
    if ql.codes is not None and tuple(ql.codes.shape) != (n, k):
        raise InputError(f"{ql.spec.name}: codes shape {tuple(ql.codes.shape)} != spec [{n}, {k}]",
                         tensor=ql.spec.name)
    g = normalize_group(group_size, k)
    m = _kernels.ext()
    if lossless_possible(ql, g):
        return lossless_job(ql, g) if m is not None else _lossless_torch(_checked(ql), g)
    if m is not None and m.requant_ok:
        return requant_job(ql, g, search=search)
    return _requant_torch(_checked(ql), g, search)


def _checked(ql: QuantLinear) -> QuantLinear:
    """The record unpacked, its scales checked: what the torch twins start from."""
    ql = ql.unpacked()
    check_scales(ql)
    return ql


def _job_source(ql: QuantLinear):
    """(layout, data) of a record for the C++ jobs: its packed words, or its codes."""
    return ql.packed if ql.codes is None else (Packing.CODES, ql.codes.to(torch.uint8).contiguous())


def _job_groups(ql: QuantLinear):
    """(zeros, g_idx, source group width) of a record for the C++ jobs."""
    zeros = None if ql.zeros is None else ql.zeros.to(torch.uint8).contiguous()
    gidx = None if ql.g_idx is None else ql.g_idx.long().contiguous()
    return zeros, gidx, block(ql.spec.k, ql.spec.group_size)


# --------------------------------------------------------------------------- lossless


def lossless_job(ql: QuantLinear, g: int) -> W4A8Linear:
    """The lossless path in one C++ call on a record ``lossless_possible`` accepts (codes possibly
    packed): the scale checks of ``check_scales``, q, the cast scales and their error. Raises the
    twin's InputError for a refused scale."""
    n, k = ql.spec.n, ql.spec.k
    layout, data = _job_source(ql)
    zeros, gidx, src_group = _job_groups(ql)
    status, where, q, s, tot = _kernels.ext().lossless_job(layout, data, n, k, ql.scales, zeros, gidx, src_group,
                                                           block(k, g), group_scale(g), _kernels.kernel_threads())
    if status:
        raise _refusal(ql, status, where)
    st = ErrorStats()
    st.dd, st.ww, st.vv, st.wv, st.max_abs = tot
    return _lossless_result(ql, q, s.to(out_scale_dtype(g)), g, st.result())


def _lossless_torch(ql: QuantLinear, g: int) -> W4A8Linear:
    """The lossless path in torch (the twin of ``lossless_job``), on checked codes."""
    n, k = ql.codes.shape
    src_groups = target_source_groups(ql, g)
    scales = ql.scales[:, src_groups].to(out_scale_dtype(g)).contiguous()
    check_finite(scales, "scales (after the cast to the W4A8 dtype)", ql.spec.name)
    q = (ql.codes.to(torch.int8) - 8).contiguous()
    gi = ql.group_index()
    st = ErrorStats()
    step = _rows_per_chunk(k)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        st.add(_source_rows(ql, gi, r0, r1), dequantize_w4a8(q[r0:r1], scales[r0:r1], g))
    return _lossless_result(ql, q, scales, g, st.result())


def _lossless_result(ql: QuantLinear, q: torch.Tensor, scales: torch.Tensor, g: int, err: dict) -> W4A8Linear:
    err["baseline_rel_l2"] = None
    err["exact_ints"] = True
    return W4A8Linear(ql.spec.name, q, scales, g, ql.bias, ql.spec.kept_path, err)


# --------------------------------------------------------------------------- requant


def requant_job(ql: QuantLinear, g: int, *, search: bool = True) -> W4A8Linear:
    """The requant path in one C++ call on any record (codes possibly packed; to_w4a8 hands it
    those that are not lossless): the scale checks of ``check_scales``, the search, the error
    sums. Raises the twin's InputError for a refused scale or a NaN/Inf weight."""
    n, k = ql.spec.n, ql.spec.k

    def groups(r: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        # _source_rows at rows r, target groups j [A, gs]: the same arithmetic, element for element
        src = ql.unpacked()
        gs = block(k, g)
        rr, cols = r[:, None], j[:, None] * gs + torch.arange(gs)
        gi = src.group_index()[cols]
        z = 8.0 if src.zeros is None else src.zeros[rr, gi].float()
        return (src.codes[rr, cols].float() - z) * src.scales[rr, gi].float()

    q, scales, info = _requant_cpp(_kernels.ext(), ql, _job_source(ql), n, k, g, search, groups)
    info["exact_ints"] = False
    return W4A8Linear(ql.spec.name, q, scales, g, ql.bias, "requant", info)


def _requant_cpp(m, ql: QuantLinear | None, source, n: int, k: int, g: int, search: bool, groups):
    """(q, scales, info) of the C++ requant job on a record ``ql`` or (None) float values; its close
    calls decided by ``kernels.redo_close_calls`` on ``groups(rows, target groups)``, the source
    values there."""
    coarse, fine = _kernels.search_points(search)
    layout, data = source
    zeros, gidx, src_group = (None, None, 1) if ql is None else _job_groups(ql)
    sscale = None if ql is None else ql.scales
    status, where, q, s, flags, tot, zero_groups, close = m.requant_job(
        layout, data, n, k, sscale, zeros, gidx, src_group, block(k, g), group_scale(g), search, coarse, fine,
        _kernels.kernel_threads())
    if status:
        raise _refusal(ql, status, where)
    if close:
        _kernels.redo_close_calls((flags & 1).nonzero(), groups, q, s, tot, g, block(k, g), search,
                                  None if ql is None else ql.spec.name)
    return q, s, _kernels.requant_info(search, tot, zero_groups)


def _requant_torch(ql: QuantLinear, g: int, search: bool) -> W4A8Linear:
    """The requant path in torch (the twin of ``requant_job``), on checked codes."""
    gi = ql.group_index()
    q, scales, info = _requant_rows(ql.spec.n, ql.spec.k, g, lambda r0, r1: _source_rows(ql, gi, r0, r1), search,
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
    tgt = block(i_dim, g)
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
