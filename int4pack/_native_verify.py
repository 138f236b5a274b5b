"""verify's kernels in the C++ library (``csrc/kleidiai_pack/kleidiai_unpack.cpp``,
``csrc/verify_kernels/``) through ctypes, as ``_native`` wraps the others: the tensors checked
here, their addresses passed, the GIL let go during each call."""

from __future__ import annotations

from ._lazy import torch
from ._native import _Lib, _need, _ptr

__all__ = ["VerifyKernels"]


class VerifyKernels(_Lib):
    """Whole-matrix helpers of verify (csrc/kleidiai_pack/kleidiai_unpack.cpp)."""

    def int8_range(self, q: torch.Tensor, threads: int = 1) -> tuple[int, int]:
        _need(q, "q", torch.int8, None)
        out = torch.zeros(2, dtype=torch.int64)
        self._call("i4p_int8_range", _ptr(q), q.numel(), threads, out.data_ptr())
        return int(out[0]), int(out[1])

    @staticmethod
    def _scales(scales: torch.Tensor, n: int) -> None:
        if scales.dtype not in (torch.float32, torch.bfloat16) or not scales.is_contiguous() or \
                scales.dim() != 2 or scales.shape[0] != n:
            raise RuntimeError(f"scales: expected contiguous fp32 or bf16 [N={n}, G], got {scales.dtype} "
                               f"{list(scales.shape)}")

    def dequant(self, q: torch.Tensor, scales: torch.Tensor, threads: int = 1) -> torch.Tensor:
        """float32 [N, K] = q * the scale of each value's group (groups of K / scales.shape[1])."""
        n, k, ng = self._q_groups(q, scales, "dequant")
        out = torch.empty(n, k, dtype=torch.float32)
        self._call("i4p_dequant_w4a8", _ptr(q), n, k, k // ng, _ptr(scales), int(scales.dtype == torch.bfloat16),
                   _ptr(out), threads)
        return out

    def dequant_sq(self, q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, row_sq: torch.Tensor | None = None,
                   col_sq: torch.Tensor | None = None) -> torch.Tensor:
        """``dequant`` into ``out`` (float32 [N, K]), one thread, and where given row_sq [N] = sum over K of
        out^2 and col_sq [K] = sum over N of out^2 (in double, rounded once)."""
        n, k, ng = self._q_groups(q, scales, "dequant_sq")
        _need(out, "out", torch.float32)
        for name, t, size in (("row_sq", row_sq, n), ("col_sq", col_sq, k)):
            if t is not None:
                _need(t, name, torch.float32, 1)
                if t.numel() != size:
                    raise RuntimeError(f"dequant_sq: {name} must hold {size} floats")
        if tuple(out.shape) != (n, k):
            raise RuntimeError(f"dequant_sq: out must be [{n}, {k}]")
        self._call("i4p_dequant_sq", _ptr(q), n, k, k // ng, _ptr(scales), int(scales.dtype == torch.bfloat16),
                   _ptr(out), _ptr(row_sq), _ptr(col_sq))
        return out

    def ref_pack(self, q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None,
                 threads: int = 1) -> torch.Tensor:
        """torch's float32 reference layout of (q, scales) (moe._fallback_pack's)."""
        _need(q, "q", torch.int8)
        n, k = q.shape
        self._scales(scales, n)
        size = n * k // 2 + scales.numel()
        if out is None:
            out = torch.empty(size, dtype=torch.float32)
        _need(out, "out", torch.float32, 1)
        if out.numel() != size or k % 2:
            raise RuntimeError(f"ref_pack: out must hold {size} floats and K must be even")
        self._call("i4p_ref_pack", _ptr(q), n, k, _ptr(scales), int(scales.dtype == torch.bfloat16),
                   scales.numel(), _ptr(out), threads)
        return out

    def w4a8_matmul(self, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int,
                    out: torch.Tensor | None = None, threads: int = 1, simd: bool = True) -> torch.Tensor:
        """torch's reference ``_dyn_quant_matmul_4bit`` (its x86 kernel's arithmetic) of x float32 [M, K]
        with the weights q int8 [N, K] and scales [N, K/block] (bf16 or fp32; block == K: channelwise),
        without torch's float32 buffer: y float32 [M, N]. ``simd`` False: the portable loops (tests)."""
        m, k, n = self._x_q(x, q, scales, "w4a8_matmul")
        if block < 1 or k % block or scales.shape[1] != k // block:
            raise RuntimeError(f"w4a8_matmul: scales [{n}, {scales.shape[1]}] are not one per block of {block} "
                               f"of K={k}")
        if out is None:
            out = torch.empty(m, n, dtype=torch.float32)
        _need(out, "out", torch.float32)
        if tuple(out.shape) != (m, n):
            raise RuntimeError(f"w4a8_matmul: out must be [{m}, {n}]")
        self._call("i4p_w4a8_matmul", _ptr(x), m, k, _ptr(q), n, block, _ptr(scales),
                   int(scales.dtype == torch.bfloat16), _ptr(out), threads, int(bool(simd)))
        return out

    def _q_groups(self, q: torch.Tensor, scales: torch.Tensor, what: str) -> tuple[int, int, int]:
        """(N, K, groups) of weights q int8 [N, K] with scales [N, groups] whose groups divide K."""
        _need(q, "q", torch.int8)
        n, k = q.shape
        self._scales(scales, n)
        ng = scales.shape[1]
        if ng < 1 or k % ng:
            raise RuntimeError(f"{what}: {ng} groups do not divide K={k}")
        return n, k, ng

    def _x_q(self, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, what: str) -> tuple[int, int, int]:
        """(M, K, N) of activations x float32 [M, K] and weights q int8 [N, K] with their scales."""
        _need(x, "x", torch.float32)
        _need(q, "q", torch.int8)
        m, k = x.shape
        n = q.shape[0]
        if q.shape[1] != k:
            raise RuntimeError(f"{what}: x has K={k}, q has {q.shape[1]}")
        self._scales(scales, n)
        return m, k, n

    @staticmethod
    def _sums(a: torch.Tensor | None, b: torch.Tensor | None, na: int, nb: int) -> None:
        """Squared-weight sums: float32 [na] and [nb] (None: not asked for)."""
        for name, t, size in (("row sums", a, na), ("column sums", b, nb)):
            if t is not None:
                _need(t, name, torch.float32, 1)
                if t.numel() != size:
                    raise RuntimeError(f"{name} must hold {size} floats")

    def w4a8_matmul_avx2(self) -> bool:
        """True where ``w4a8_matmul`` runs its AVX2 loops (x86-64 with AVX2)."""
        return bool(self._lib.i4p_w4a8_matmul_avx2())

    def w4a8_reference(self, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None,
                       row_sq: torch.Tensor | None = None, col_sq: torch.Tensor | None = None,
                       group_sq: torch.Tensor | None = None) -> torch.Tensor:
        """float32 x [M, K] @ W^T for W = ``dequant(q, scales)`` (q int8 [N, K], scales [N, G]) without W:
        y [M, N] (sums over k in 16 lanes); where given, row_sq [N] and col_sq [K] as ``dequant_sq``'s,
        and group_sq (float32 [N, G]) each group's sum of q^2 (exact). One thread."""
        m, k, n = self._x_q(x, q, scales, "w4a8_reference")
        ng = self._q_groups(q, scales, "w4a8_reference")[2]
        self._sums(row_sq, col_sq, n, k)
        if group_sq is not None:
            _need(group_sq, "group_sq", torch.float32)
            if group_sq.numel() != n * ng:
                raise RuntimeError(f"w4a8_reference: group_sq must hold {n} x {ng} floats")
        if out is None:
            out = torch.empty(m, n, dtype=torch.float32)
        _need(out, "out", torch.float32)
        if tuple(out.shape) != (m, n):
            raise RuntimeError(f"w4a8_reference: out must be [{m}, {n}]")
        self._call("i4p_w4a8_reference", _ptr(x), m, k, _ptr(q), n, k // ng, _ptr(scales),
                   int(scales.dtype == torch.bfloat16), _ptr(out), _ptr(row_sq), _ptr(col_sq), _ptr(group_sq))
        return out

    def act_noise(self, x: torch.Tensor, y13: torch.Tensor, act: torch.Tensor, sq13: torch.Tensor,
                  sq2: torch.Tensor, kind: int) -> torch.Tensor:
        """``moe.propagated_noise(x, y13, act, sq13, sq2, H, kind)`` (activations on, no weight term) in
        one call: x [M, H], y13 [M, 2I], act [M, I], sq13 [2I], sq2 [I], all float32 -> [M] (sums in double)."""
        _need(x, "x", torch.float32)
        _need(y13, "y13", torch.float32)
        _need(act, "act", torch.float32)
        m, h = x.shape
        i = act.shape[1]
        if tuple(y13.shape) != (m, 2 * i) or act.shape[0] != m:
            raise RuntimeError(f"act_noise: y13 {list(y13.shape)} and act {list(act.shape)} for {m} rows")
        if sq13 is None or sq2 is None:
            raise RuntimeError("act_noise: both squared-weight sums are needed")
        self._sums(sq13, sq2, 2 * i, i)
        out = torch.empty(m, dtype=torch.float32)
        self._call("i4p_act_noise", _ptr(x), m, h, _ptr(y13), _ptr(act), i, _ptr(sq13), _ptr(sq2), kind, _ptr(out))
        return out
