"""Fast paths of the convert hot loops (``csrc/convert_kernels/``), each beside its torch twin.

Every function takes the same inputs as the pure-torch code it replaces and returns the same
bytes; when the C++ library is unavailable (``INT4PACK_NO_EXT=1``, not built: see ``_ext``) it
*is* the torch twin. ``tests/test_kernels.py`` compares the two byte for byte. The tensor jobs
themselves are called from ``w4a8``; here are their search points, their sums as an info dict and
the torch decision of their close calls.

Threads: a kernel splits its rows over ``kernel_threads()``: torch's intra-op thread count, or
the count the calling thread set with ``threads_here`` (convert's workers take one each, so
nothing nests, without changing torch's process-wide setting).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

from . import _ext
from ._lazy import torch

__all__ = ["ext", "words", "unpack_gptq", "unpack_awq", "unpack_ct", "requant_info", "redo_close_calls",
           "search_points", "search_arrays", "kernel_threads", "threads_here", "crc32c"]


def ext():
    """The C++ ``convert_kernels`` (``_native.ConvertKernels``), or None (then the torch twins run)."""
    return _ext.load("convert_kernels")


_here = threading.local()  # .threads: this thread's kernel thread count, when set


def kernel_threads() -> int:
    """Threads a kernel called from this thread may use."""
    return getattr(_here, "threads", None) or max(1, torch.get_num_threads())


@contextmanager
def threads_here(n: int):
    """Kernel calls made by the current thread use ``n`` threads inside the block."""
    old = getattr(_here, "threads", None)
    _here.threads = max(1, int(n))
    try:
        yield
    finally:
        _here.threads = old


def words(t: torch.Tensor) -> torch.Tensor:
    """Packed int4 words as contiguous int32 (what every kernel here takes)."""
    return t.contiguous() if t.dtype == torch.int32 else t.to(torch.int32).contiguous()


def unpack_gptq(qweight: torch.Tensor) -> torch.Tensor:
    """GPTQ qweight [K/8, N] (packed along K) -> codes uint8 [N, K]."""
    m = ext()
    if m is not None and qweight.dim() == 2:
        return m.unpack_gptq(words(qweight), kernel_threads())
    from .nibbles import unpack_rows  # numpy's: the torch twins only

    return unpack_rows(qweight).t().contiguous()


def unpack_awq(qweight: torch.Tensor) -> torch.Tensor:
    """AWQ GEMM qweight [K, N/8] (packed along N, AWQ nibble order) -> codes uint8 [N, K]."""
    m = ext()
    if m is not None and qweight.dim() == 2:
        return m.unpack_awq(words(qweight), kernel_threads())
    from .nibbles import AWQ_SHIFTS, unpack_cols

    return unpack_cols(qweight, AWQ_SHIFTS).t().contiguous()


def unpack_ct(packed: torch.Tensor, k: int) -> torch.Tensor:
    """compressed-tensors weight_packed [N, ceil(K/8)] (packed along K) -> codes uint8 [N, K]."""
    m = ext()
    if m is not None and packed.dim() == 2 and 0 <= k <= packed.shape[1] * 8:
        return m.unpack_ct(words(packed), k, kernel_threads())
    from .nibbles import unpack_cols

    return unpack_cols(packed)[:, :k].contiguous()


def crc32c(data, crc: int = 0) -> int:
    """CRC-32C (Castagnoli) of a contiguous buffer, continuing from ``crc`` (0 to start), like zlib.crc32:
    crc.crc32c (the extension at memory speed, else its numpy engine)."""
    from . import crc as crc_mod  # numpy's tables: loading the kernels needs none

    return crc_mod.crc32c(data, crc)


def crc32c_copy(src, dst, crc: int = 0) -> int:
    """Copy ``src`` into the start of ``dst`` and return the CRC-32C of those bytes (continuing from
    ``crc``): the writer's direct path, one pass over the source, without the GIL (C++ library)."""
    src = _bytes_view(src)
    m = ext()
    if m is not None:
        return int(m.crc32c_copy(src, dst, crc))
    dst = _bytes_view(dst)
    dst[: len(src)] = src
    return crc32c(dst[: len(src)], crc)


def _bytes_view(data) -> memoryview:
    mv = memoryview(data)
    return mv if mv.ndim == 1 and mv.format == "B" else mv.cast("B")


_points = None  # the last setting and its answer: (ratios tensor, its version, fine points, answer)


def search_points(search: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' candidate ratios: (coarse, fine offsets around the coarse winner), as float32.
    Made once per setting, not per requant job (a linspace and its copies for every job)."""
    from . import scale_search as S  # torch's: a batched (lossless) convert never gets here

    global _points
    empty = torch.empty(0, dtype=torch.float32)
    if not search:
        return empty, empty
    ratios, fine_points, last = S.COARSE_RATIOS, S.FINE_POINTS, _points
    if last is not None and last[0] is ratios and last[1] == ratios._version and last[2] == fine_points:
        return last[3]
    from .search_grid import fine_offsets

    coarse = ratios.float().contiguous().clone()
    fine = torch.from_numpy(fine_offsets(coarse.numpy(), fine_points))
    _points = (ratios, ratios._version, fine_points, (coarse, fine))
    return coarse, fine


def search_arrays(search: bool):
    """search_points as float32 numpy arrays, for the requant batches: without torch where
    scale_search was never imported (its default points, search_grid.py)."""
    import numpy as np

    from . import search_grid

    if not search:
        return np.empty(0, dtype=np.float32), np.empty(0, dtype=np.float32)
    if not search_grid.settings_loaded():
        return search_grid.default_points()
    c, f = search_points(search)
    return c.numpy(), f.numpy()


def requant_info(search: bool, sums, zero_groups: int) -> dict:
    """The requant path's info from the kernels' sums (dd, ww, vv, wv, baseline sse, max_abs);
    torch-free (search_grid), for the batches."""
    from . import search_grid
    from .error_stats import ErrorStats

    st = ErrorStats()
    st.dd, st.ww, st.vv, st.wv, base_sse, st.max_abs = (float(v) for v in sums)
    return search_grid.requant_info(search, st, base_sse, zero_groups)


def redo_close_calls(amb: torch.Tensor, groups, q, s, tot: list, g: int, gs: int, search: bool, name) -> None:
    """Groups whose candidate errors were too close to call in C++: decided by scale_search.search_chunk.

    ``amb`` holds (row, group) pairs; ``groups(r, j)`` the source values there (float32 [A, gs]).
    The C++ left these groups out of the sums dd, vv, wv and max_abs of ``tot`` (ww and the
    baseline sum do not depend on the choice): they are added here, from the torch decision.
    """
    from . import scale_search as S

    r, j = amb[:, 0], amb[:, 1]
    wg = groups(r, j).contiguous()  # float32 [A, gs]
    ws = torch.empty(wg.numel() * S.workspace_width(search), dtype=torch.float64)
    qg, sg, _, _, _ = S.search_chunk(wg, g, search, ws)  # gs is block(K, g)
    S.check_finite(sg, "weights", name)
    q.view(q.shape[0], -1, gs)[r, j] = qg
    s[r, j] = sg[:, 0].to(s.dtype)
    # dequantize_w4a8 of each group (q * s in float32), its error against the source in float64
    v = (qg.float() * sg).double()
    x = wg.double()
    d = v - x
    tot[0] += float((d * d).sum())
    tot[2] += float((v * v).sum())
    tot[3] += float((x * v).sum())
    tot[5] = max(tot[5], float(d.abs().max()))
