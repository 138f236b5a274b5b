"""The C++ kernels' library (``_kernels-<machine>.so``, built by ``pip install``) through ctypes.

The library has a C ABI: pointers and sizes in, a status out (``csrc/api.cpp``). This module
checks the tensors (dtype, shape, contiguity), allocates the outputs with torch and passes
``data_ptr()``s, so the library depends on no torch or Python ABI. ctypes drops the GIL during
each call. ``ConvertKernels`` and ``KleidiaiPack`` keep the method names and answers of the
torch extensions they replace.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from . import _build
from .errors import SourceBytesVanished
from .groups import is_channelwise
from ._lazy import torch, torch_loaded  # the batches pass numpy arrays and addresses: no torch

ABI_VERSION = 2
VANISHED = -2  # a call's status when its input bytes vanished under it (csrc/api.cpp, kVanished)

_p = ctypes.c_void_p
_i = ctypes.c_int64


class _JobArgs(ctypes.Structure):  # i4p::JobArgs (convert_kernels.h)
    _fields_ = [("layout", _i), ("data", _p), ("d0", _i), ("d1", _i), ("n", _i), ("k", _i),
                ("sscale", _p), ("src_groups", _i), ("zeros", _p), ("gidx", _p), ("src_group", _i), ("g", _i),
                ("bf16", ctypes.c_int32), ("search", ctypes.c_int32),
                ("coarse", _p), ("n_coarse", _i), ("fine", _p), ("n_fine", _i)]


_SIGNATURES = {
    "i4p_abi_version": ([], _i),
    "i4p_last_error": ([], ctypes.c_char_p),
    "i4p_last_fault": ([], ctypes.c_uint64),
    "i4p_source_hash": ([], ctypes.c_char_p),
    "i4p_tables": ([], ctypes.c_char_p),
    "i4p_unpack_gptq": ([_p, _i, _i, _p, _i], _i),
    "i4p_unpack_ct": ([_p, _i, _i, _i, _p, _i], _i),
    "i4p_unpack_awq": ([_p, _i, _i, _p, _i], _i),
    "i4p_lossless_job": ([ctypes.POINTER(_JobArgs), _p, _p, _p, _p, _i], _i),
    "i4p_requant_job": ([ctypes.POINTER(_JobArgs), _p, _p, _p, _p, _p, _p, _i], _i),
    "i4p_requant_supported": ([], _i),
    "i4p_search_batches": ([_p], None),
    "i4p_element_groups": ([_p], None),
    "i4p_element_candidates": ([_p], None),
    "i4p_force_search64": ([_i], _i),
    "i4p_use_awq_avx2": ([_i], _i),
    "i4p_crc32c": ([_p, _i, ctypes.c_uint32], ctypes.c_uint32),
    "i4p_crc32c_copy": ([_p, _p, _i, ctypes.c_uint32], ctypes.c_uint32),
    "i4p_kleidiai_pack": ([_p, _i, _i, _i, _p, _i, _p, _i, _p, _i, _i], _i),
    "i4p_kleidiai_unpack": ([_p, _i, _i, _i, _i, _i, _i, _p, _p, _p, _i], _i),
    "i4p_int8_range": ([_p, _i, _i, _p], _i),
    "i4p_dequant_w4a8": ([_p, _i, _i, _i, _p, _i, _p, _i], _i),
    "i4p_ref_pack": ([_p, _i, _i, _p, _i, _i, _p, _i], _i),
    "i4p_lossless_batch": ([_p, _i, _p, _i, _p, _i, _p, _p, _i], _i),
    "i4p_requant_batch": ([_p, _i, _p, _i, _p, _i, _p, _i, _p, _i, _p, _p, _p, _i], _i),
    "i4p_float_rows": ([_p, _i, _p, _p], _i),
    "i4p_crc32": ([_p, _i, ctypes.c_uint32], ctypes.c_uint32),
    "i4p_use_crc32_clmul": ([_i], _i),
    "i4p_scales_to_float": ([_p, _i, _i, _i, _i, _p], _i),
    "i4p_kleidiai_verify_blob": ([_p, _i, _i, _i, _i, _i, _p, _p, _p, _p, _p, _i], _i),
    "i4p_dequant_sq": ([_p, _i, _i, _i, _p, _i, _p, _p, _p], _i),
    "i4p_w4a8_matmul": ([_p, _i, _i, _p, _i, _i, _p, _i, _p, _i, _i], _i),
    "i4p_w4a8_matmul_avx2": ([], _i),
    "i4p_w4a8_reference": ([_p, _i, _i, _p, _i, _i, _p, _i, _p, _p, _p, _p], _i),
    "i4p_act_noise": ([_p, _i, _i, _p, _p, _i, _p, _p, _i, _p], _i),
}


def library_path() -> Path:
    return _build.HERE / _build.library_name()


def open_library(path: Path | None = None) -> ctypes.CDLL:
    """Load and check the library; raises OSError (missing, unloadable) or RuntimeError (stale)."""
    path = path or library_path()
    lib = ctypes.CDLL(str(path))
    for name, (args, res) in _SIGNATURES.items():
        fn = getattr(lib, name, None)
        if fn is None:
            raise RuntimeError(f"{path} has no {name}: it was built from other sources")
        fn.argtypes, fn.restype = args, res
    if lib.i4p_abi_version() != ABI_VERSION:
        raise RuntimeError(f"{path} has interface version {lib.i4p_abi_version()}, this int4pack needs "
                           f"{ABI_VERSION}")
    built = lib.i4p_source_hash().decode()
    if _build.CSRC.is_dir() and any(_build.CSRC.rglob("*.cpp")):
        want = _build.source_hash()
        if built != want:
            raise RuntimeError(f"{path} was built from other sources (hash {built}, the sources beside it are "
                               f"{want})")
    return lib


class _Lib:
    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib

    def tables(self) -> dict[str, dict[str, int]]:
        """The library's own tables (csrc/convert_kernels/convert_kernels.h, named once there): the tensor
        jobs' statuses, the batch descriptor's fields, its result columns and its scale types, as
        {"job_status": {"done": 0, ...}, "batch_field": {...}, "batch_result": {...}, "scale_type": {...}}."""
        out = {}
        for part in self._lib.i4p_tables().decode().split(";"):
            if part:
                table, items = part.split(":", 1)
                out[table] = {k: int(v) for k, v in (i.split("=") for i in items.split(",") if i)}
        return out

    def _call(self, name: str, *args) -> int:
        st = getattr(self._lib, name)(*args)
        if st == VANISHED:
            raise SourceBytesVanished(int(self._lib.i4p_last_fault()))
        if st < 0:
            raise RuntimeError(self._lib.i4p_last_error().decode(errors="replace"))
        return st

    def crc32(self, data, crc: int = 0) -> int:
        """zlib's CRC-32 of a contiguous buffer (bytes, numpy array, CPU tensor), continuing from ``crc``."""
        if torch_loaded() and isinstance(data, torch.Tensor):  # no tensor exists before torch does
            if data.device.type != "cpu" or not data.is_contiguous():
                raise ValueError("crc32: expected a contiguous CPU tensor")
            return int(self._lib.i4p_crc32(_ptr(data), data.nbytes, crc & 0xFFFFFFFF))
        a = _bytes(data)
        return int(self._lib.i4p_crc32(a.ctypes.data, a.nbytes, crc & 0xFFFFFFFF))


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None or t.numel() == 0 else t.data_ptr()


def _need(t: torch.Tensor, what: str, dtype: torch.dtype, dim: int | None = 2) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or (dim is not None and t.dim() != dim) \
            or not t.is_contiguous() or t.device.type != "cpu":
        want = f"contiguous {dtype}" + ("" if dim is None else f" {dim}-D")
        got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise RuntimeError(f"{what}: expected a {want} CPU tensor, got {got}")


def _channel_block(k: int, block: int) -> bool:
    """Whether a pack/unpack block (groups.block: K for channel) is channelwise; -1 is no block here."""
    if block <= 0:
        raise RuntimeError(f"group_size {block}: give the block (K for channelwise)")
    return is_channelwise(k, block)


def _bytes(buf, writable: bool = False):
    """A contiguous buffer as a uint8 numpy array over the same memory (its .ctypes.data is the address)."""
    import numpy as np  # here: loading the library (a resume's report) needs no numpy
    mv = memoryview(buf)
    if not mv.contiguous:
        raise ValueError("expected a contiguous buffer")
    if writable and mv.readonly:
        raise ValueError("expected a writable buffer")
    return np.frombuffer(mv if mv.ndim == 1 and mv.format == "B" else mv.cast("B"), dtype=np.uint8)


class ConvertKernels(_Lib):
    """The convert hot loops (csrc/convert_kernels)."""

    FLOAT_VALUES = 4  # a job's source given as float32 values [N, K] (w4a8.requantize), not a records.Packing

    def __init__(self, lib: ctypes.CDLL):
        super().__init__(lib)
        # False on x86-64 CPUs without AVX2/FMA: the requant kernels are built for x86-64-v3 only
        self.requant_ok = bool(lib.i4p_requant_supported())

    def unpack_gptq(self, qweight: torch.Tensor, threads: int) -> torch.Tensor:
        _need(qweight, "qweight", torch.int32)
        kw, n = qweight.shape
        out = torch.empty(n, kw * 8, dtype=torch.uint8)
        self._call("i4p_unpack_gptq", _ptr(qweight), kw, n, _ptr(out), threads)
        return out

    def unpack_ct(self, packed: torch.Tensor, k: int, threads: int) -> torch.Tensor:
        _need(packed, "weight_packed", torch.int32)
        n, kw = packed.shape
        if not 0 <= k <= kw * 8:
            raise RuntimeError(f"weight_packed: K={k} does not fit {kw} words")
        out = torch.empty(n, k, dtype=torch.uint8)
        self._call("i4p_unpack_ct", _ptr(packed), n, kw, k, _ptr(out), threads)
        return out

    def unpack_awq(self, qweight: torch.Tensor, threads: int) -> torch.Tensor:
        _need(qweight, "qweight", torch.int32)
        k, nw = qweight.shape
        out = torch.empty(nw * 8, k, dtype=torch.uint8)
        self._call("i4p_unpack_awq", _ptr(qweight), k, nw, _ptr(out), threads)
        return out

    @staticmethod
    def _job_args(layout: int, data: torch.Tensor, n: int, k: int, sscale: torch.Tensor | None,
                  zeros: torch.Tensor | None, gidx: torch.Tensor | None, src_group: int, g: int, bf16: bool,
                  search: bool = False, coarse: torch.Tensor | None = None,
                  fine: torch.Tensor | None = None) -> tuple[_JobArgs, list]:
        """The job's arguments, and the tensors that must live while it runs."""
        what = {0: ("codes", torch.uint8), ConvertKernels.FLOAT_VALUES: ("w", torch.float32)}.get(layout,
                                                                                   ("packed words", torch.int32))
        _need(data, *what)
        keep = [data]
        a = _JobArgs(layout=layout, data=_ptr(data), d0=data.shape[0], d1=data.shape[1], n=n, k=k, g=g,
                     src_group=src_group, bf16=int(bool(bf16)), search=int(bool(search)))
        if sscale is not None:
            sf = sscale.float().contiguous()
            if sf.dim() != 2 or sf.shape[0] != n:
                raise RuntimeError("scales: expected [N, G]")
            a.sscale, a.src_groups = _ptr(sf), sf.shape[1]
            keep.append(sf)
            if zeros is not None:
                if zeros.dtype != torch.uint8 or not zeros.is_contiguous() or tuple(zeros.shape) != tuple(sf.shape):
                    raise RuntimeError("zeros: expected contiguous uint8 [N, G]")
                a.zeros = _ptr(zeros)
                keep.append(zeros)
        if gidx is not None:
            _need(gidx, "g_idx", torch.int64, 1)
            if gidx.numel() != k:
                raise RuntimeError("g_idx: expected contiguous int64 [K]")
            a.gidx = _ptr(gidx)
            keep.append(gidx)
        for name, t in (("coarse", coarse), ("fine", fine)):
            if t is not None and t.numel():
                _need(t, name, torch.float32, 1)
                setattr(a, name, _ptr(t))
                setattr(a, "n_" + name, t.numel())
                keep.append(t)
        return a, keep

    def lossless_job(self, layout: int, data: torch.Tensor, n: int, k: int, sscale: torch.Tensor,
                     zeros: torch.Tensor | None, gidx: torch.Tensor | None, src_group: int, g: int, bf16: bool,
                     threads: int):
        """(status, report [row, group, more], q int8 [N, K], scales float32 [N, K/g] (the shipped values),
        sums [dd, ww, vv, wv, max_abs]); q, scales and sums None unless status is 0."""
        a, keep = self._job_args(layout, data, n, k, sscale, zeros, gidx, src_group, g, bf16)
        if g <= 0 or k % g:
            raise RuntimeError(f"lossless_job: group {g} does not divide K={k}")
        q = torch.empty(n, k, dtype=torch.int8)
        s = torch.empty(n, k // g, dtype=torch.float32)
        tot = (ctypes.c_double * 5)()
        report = (ctypes.c_int64 * 3)()
        st = self._call("i4p_lossless_job", ctypes.byref(a), _ptr(q), _ptr(s), ctypes.addressof(tot),
                        ctypes.addressof(report), threads)
        del keep
        if st != 0:
            return st, list(report), None, None, None
        return st, list(report), q, s, list(tot)

    def requant_job(self, layout: int, data: torch.Tensor, n: int, k: int, sscale: torch.Tensor | None,
                    zeros: torch.Tensor | None, gidx: torch.Tensor | None, src_group: int, g: int, bf16: bool,
                    search: bool, coarse: torch.Tensor, fine: torch.Tensor, threads: int):
        """(status, report [row, group, more], q int8 [N, K], scales [N, K/g] bf16 or float32, flags uint8
        [N, K/g], sums [dd, ww, vv, wv, baseline sse, max_abs], zero groups, close calls); all but status
        and report None unless status is 0. Close calls are left out of the sums: flag bit 0 marks them."""
        if not self.requant_ok:
            raise RuntimeError("requant_job: this CPU lacks AVX2/FMA (x86-64-v3)")
        a, keep = self._job_args(layout, data, n, k, sscale, zeros, gidx, src_group, g, bf16, search, coarse, fine)
        if g <= 0 or k % g:
            raise RuntimeError(f"requant_job: group {g} does not divide K={k}")
        q = torch.empty(n, k, dtype=torch.int8)
        s = torch.empty(n, k // g, dtype=torch.float32)
        flags = torch.empty(n, k // g, dtype=torch.uint8)
        tot = (ctypes.c_double * 6)()
        counts = (ctypes.c_int64 * 2)()
        report = (ctypes.c_int64 * 3)()
        st = self._call("i4p_requant_job", ctypes.byref(a), _ptr(q), _ptr(s), _ptr(flags), ctypes.addressof(tot),
                        ctypes.addressof(counts), ctypes.addressof(report), threads)
        del keep
        if st != 0:
            return st, list(report), None, None, None, None, None, None
        # the shipped scales: torch's own float32 -> bfloat16 rounding, as the twin casts
        return (st, list(report), q, s.to(torch.bfloat16) if bf16 else s, flags, list(tot), counts[0], counts[1])

    def search_batches(self) -> tuple[int, int]:
        out = (ctypes.c_int64 * 2)()
        self._lib.i4p_search_batches(ctypes.addressof(out))
        return int(out[0]), int(out[1])

    def element_groups(self) -> tuple[int, int]:
        """Element-path groups (float sources) decided in the float32 batches, and one by one in float64."""
        out = (ctypes.c_int64 * 2)()
        self._lib.i4p_element_groups(ctypes.addressof(out))
        return int(out[0]), int(out[1])

    def element_candidates(self) -> tuple[int, int]:
        """Candidate scales of those float32 batches evaluated, and skipped: their clipped extremes alone
        cost more than the batch's best so far (eight groups a candidate)."""
        out = (ctypes.c_int64 * 2)()
        self._lib.i4p_element_candidates(ctypes.addressof(out))
        return int(out[0]), int(out[1])

    def force_search64(self, on: bool) -> bool:
        return bool(self._lib.i4p_force_search64(int(bool(on))))

    def use_awq_avx2(self, on: bool) -> bool:
        return bool(self._lib.i4p_use_awq_avx2(int(bool(on))))

    def crc32c(self, data, crc: int = 0) -> int:
        a = _bytes(data)
        return int(self._lib.i4p_crc32c(a.ctypes.data, a.nbytes, crc & 0xFFFFFFFF))

    def crc32c_copy(self, src, dst, crc: int = 0) -> int:
        a, b = _bytes(src), _bytes(dst, writable=True)
        if b.nbytes < a.nbytes:
            raise ValueError(f"crc32c_copy: {a.nbytes} bytes into a buffer of {b.nbytes}")
        return int(self._lib.i4p_crc32c_copy(a.ctypes.data, b.ctypes.data, a.nbytes, crc & 0xFFFFFFFF))


    # the lossless batch (csrc/convert_kernels/batch.cpp; int4pack/batch.py lays out its rows)
    BATCH_FIELDS = 24
    BATCH_RESULTS = 10

    def lossless_batch(self, src: int, src_len: int, desc: np.ndarray, out, threads: int = 1):
        """Run the lossless path of ``desc``'s modules (int64 [count, BATCH_FIELDS]) on the source
        mapped at address ``src`` (``src_len`` bytes), writing their outputs into the writable buffer
        ``out``: (results int64 [count, BATCH_RESULTS], sums float64 [count, 5])."""
        import numpy as np
        if desc.dtype != np.int64 or desc.ndim != 2 or desc.shape[1] != self.BATCH_FIELDS or \
                not desc.flags.c_contiguous:
            raise RuntimeError(f"lossless_batch: expected contiguous int64 [count, {self.BATCH_FIELDS}]")
        o = _bytes(out, writable=True)
        res = np.zeros((desc.shape[0], self.BATCH_RESULTS), dtype=np.int64)
        tot = np.zeros((desc.shape[0], 5), dtype=np.float64)
        self._call("i4p_lossless_batch", src, src_len, desc.ctypes.data, desc.shape[0], o.ctypes.data, o.nbytes,
                   res.ctypes.data, tot.ctypes.data, threads)
        return res, tot

    def requant_batch(self, src: int, src_len: int, desc: np.ndarray, out, coarse: np.ndarray, fine: np.ndarray,
                      threads: int = 1):
        """Run the requant path of ``desc``'s modules (GPTQ or AWQ words with zero points; the
        descriptor of ``lossless_batch``) with the search's points ``coarse`` and ``fine`` (float32;
        empty coarse: round to nearest): (results int64 [count, BATCH_RESULTS], sums float64
        [count, 6] as requant_job's, zero groups int64 [count])."""
        import numpy as np
        if not self.requant_ok:
            raise RuntimeError("requant_batch: this CPU lacks AVX2/FMA (x86-64-v3)")
        if desc.dtype != np.int64 or desc.ndim != 2 or desc.shape[1] != self.BATCH_FIELDS or \
                not desc.flags.c_contiguous:
            raise RuntimeError(f"requant_batch: expected contiguous int64 [count, {self.BATCH_FIELDS}]")
        coarse = np.ascontiguousarray(coarse, dtype=np.float32)
        fine = np.ascontiguousarray(fine, dtype=np.float32)
        o = _bytes(out, writable=True)
        res = np.zeros((desc.shape[0], self.BATCH_RESULTS), dtype=np.int64)
        tot = np.zeros((desc.shape[0], 6), dtype=np.float64)
        zg = np.zeros(desc.shape[0], dtype=np.int64)
        self._call("i4p_requant_batch", src, src_len, desc.ctypes.data, desc.shape[0], o.ctypes.data, o.nbytes,
                   coarse.ctypes.data, coarse.size, fine.ctypes.data, fine.size, res.ctypes.data, tot.ctypes.data,
                   zg.ctypes.data, threads)
        return res, tot, zg

    def float_rows(self, src, desc: np.ndarray) -> np.ndarray | None:
        """Tests: the values [N, K] requant_batch decodes from the source bytes ``src`` for its descriptor
        row ``desc`` (int64 [BATCH_FIELDS]: bf16/f16/f32, e4m3, E2M1, MLX or GGUF), or None where the
        batch hands the module back."""
        import numpy as np
        a = _bytes(src)
        d = np.ascontiguousarray(desc, dtype=np.int64)
        if d.shape != (self.BATCH_FIELDS,):
            raise RuntimeError(f"float_rows: expected int64 [{self.BATCH_FIELDS}]")
        out = np.empty((int(d[4]), int(d[5])), dtype=np.float32)
        st = self._call("i4p_float_rows", a.ctypes.data, a.nbytes, d.ctypes.data, out.ctypes.data)
        return None if st else out

    def use_crc32_clmul(self, on: bool) -> bool:
        """Tests: zlib's CRC-32 by carry-less multiplies (x86-64 with PCLMULQDQ) or by tables; the previous setting."""
        return bool(self._lib.i4p_use_crc32_clmul(int(bool(on))))

    def scales_to_float(self, src, n: int, groups: int, dtype: int, kn: bool) -> np.ndarray:
        """Source scales (0 float32, 1 float16, 2 bfloat16; ``kn``: stored [G, N]) as float32 [N, G]."""
        import numpy as np
        a = _bytes(src)
        if a.nbytes != n * groups * (4 if dtype == 0 else 2):
            raise RuntimeError("scales_to_float: size does not match")
        out = np.empty((n, groups), dtype=np.float32)
        self._call("i4p_scales_to_float", a.ctypes.data, n, groups, dtype, int(bool(kn)), out.ctypes.data)
        return out


class KleidiaiPack(_Lib):
    """The KleidiAI RHS packer (csrc/kleidiai_pack)."""

    def pack(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, group_size: int,
             out: torch.Tensor, threads: int = 0) -> None:
        _need(q, "q", torch.int8, 3)
        _need(out, "out", torch.uint8, 2)
        e, n, k = q.shape
        if out.shape[0] != e:
            raise RuntimeError("out: one row per expert")
        if scales.dtype not in (torch.float32, torch.bfloat16) or not scales.is_contiguous():
            raise RuntimeError("scales: contiguous fp32 [E, N] or bf16 [E, N, K/g]")
        per = e * n * (k // group_size if group_size > 0 else 0)  # the block: K for channel
        if scales.numel() != per:
            raise RuntimeError("scales: fp32 [E, N] or bf16 [E, N, K/g]")
        if bias is not None:
            _need(bias, "bias", torch.float32, None)
            if bias.numel() != e * n:
                raise RuntimeError("bias: contiguous fp32 [E, N]")
        if threads <= 0:
            threads = torch.get_num_threads()
        self._call("i4p_kleidiai_pack", _ptr(q), e, n, k, _ptr(scales), int(scales.dtype == torch.bfloat16),
                   _ptr(bias), group_size, _ptr(out), out.shape[1], threads)

    def unpack(self, blob: torch.Tensor, n: int, k: int, group_size: int, has_bias: bool, check: bool,
               threads: int = 1, out: tuple | None = None):
        """(failed checks (bits, 0: consistent), q int8 [N, K], scales bf16 [N, K/g] | fp32 [N, 1], bias fp32 [N]
        | None) of one blob; ``group_size`` == K for channelwise. ``out``: (q, scales) to fill instead of
        fresh tensors (reused buffers: fresh memory costs page faults comparable to the decode)."""
        _need(blob, "blob", torch.uint8, 1)
        q, scales = out if out is not None else self._decoded(n, k, group_size)
        self._check_decoded(q, scales, n, k, group_size)
        bias = torch.empty(n, dtype=torch.float32) if has_bias else None
        bad = self._call("i4p_kleidiai_unpack", _ptr(blob), blob.numel(), n, k, group_size, int(bool(check)),
                         int(bool(has_bias)), _ptr(q), _ptr(scales), _ptr(bias), threads)
        return bad, q, scales, bias

    @staticmethod
    def _decoded(n: int, k: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh (q int8 [N, K], scales fp32 [N, 1] (channel, g == K) | bf16 [N, K/g]) for a decode."""
        channel = _channel_block(k, group_size)
        return torch.empty(n, k, dtype=torch.int8), (torch.empty(n, 1, dtype=torch.float32) if channel else
                                                     torch.empty(n, k // group_size, dtype=torch.bfloat16))

    @staticmethod
    def _check_decoded(q: torch.Tensor, scales: torch.Tensor, n: int, k: int, group_size: int) -> None:
        _need(q, "q", torch.int8)
        channel = _channel_block(k, group_size)
        want = (torch.float32, n) if channel else (torch.bfloat16, n * (k // max(group_size, 1)))
        if tuple(q.shape) != (n, k) or scales.dtype != want[0] or scales.numel() != want[1] \
                or not scales.is_contiguous():
            raise RuntimeError(f"decode buffers: expected int8 [{n}, {k}] and {want[0]} scales of {want[1]} values")

    def verify_blob(self, blob: torch.Tensor, n: int, k: int, group_size: int, has_bias: bool,
                    scratch: dict, threads: int = 1, into: tuple | None = None):
        """One stored blob checked in one call: (failed decode checks (kleidiai_unpack's bits; 64: the
        repacked bytes differ), CRC-32s (8 hex digits, zlib's) of [the blob, q, scales, bias], q, scales,
        bias | None). The blob is decoded with every check, and only when they pass are the decoded
        values checksummed (bias: None without one), packed again and compared. ``scratch``: a dict of
        this thread's buffers, filled here on first use and reused (q, scales and bias are views of
        it, valid until the next call for the same shape). ``into``: (q, scales) buffers of the
        caller's to decode into instead."""
        _need(blob, "blob", torch.uint8, 1)
        key = (n, k, group_size, blob.numel())
        bufs = scratch.get(key)
        if bufs is None:
            if len(scratch) >= 8:  # a model has a few shapes (an MoE layer's experts: two)
                scratch.clear()
            bufs = scratch[key] = (*self._decoded(n, k, group_size), torch.empty(n, dtype=torch.float32),
                                   torch.empty(blob.numel(), dtype=torch.uint8), (ctypes.c_uint32 * 4)())
        q, scales, bias, repack, crcs = bufs
        if into is not None:
            q, scales = into
            self._check_decoded(q, scales, n, k, group_size)
        bad = self._call("i4p_kleidiai_verify_blob", _ptr(blob), blob.numel(), n, k, group_size, int(bool(has_bias)),
                         _ptr(q), _ptr(scales), _ptr(bias), _ptr(repack), ctypes.addressof(crcs), threads)
        hexes = [f"{crcs[0]:08x}"] + ([None] * 3 if bad & 63 else
                                      [f"{crcs[1]:08x}", f"{crcs[2]:08x}", f"{crcs[3]:08x}" if has_bias else None])
        return bad, hexes, q, scales, (bias if has_bias else None)
