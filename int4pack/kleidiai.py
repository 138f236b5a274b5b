"""KleidiAI W4A8 RHS blobs: the bytes torch's ``_dyn_quant_pack_4bit_weight`` writes on Arm.

Two layouts, both with ``nr=8, kr=16, sr=2`` (docs/kleidiai.md §1.5):

- groupwise ``qsi4c32p`` (bf16 scales, ``group_size`` a multiple of 32 dividing K): per 8-row
  block, per quant block: data bytes then 8 bf16 scales; after the blocks 8 fp32 row sums
  (Σ q·scale, rounded once per 16-value segment in storage order) and 8 fp32 biases;
- channelwise ``qsi4cxp`` (fp32 scales, ``group_size == K`` or -1): per 8-row block the data
  bytes (K padded to 32 with zeros), 8 int32 row sums of q·16, 8 fp32 scales/16, 8 fp32 biases.

Data bytes, per 32-value chunk of K, per half-chunk segment s, per row: 8 bytes, byte i holding
the signed nibbles of k = 32c + 8s + i (low) and k + 16 (high). Rows past N repeat row N-1
(data, scales, bias); verified byte-for-byte against torch's packer under QEMU
(``tests/arm64/pack_check.py``).

The byte size alone does not identify the layout: with K/g == 2 a groupwise blob has exactly
the channelwise size (K=64, g=32), so callers must record the group size next to the blob.

Three code paths produce or read the format: ``pack_reference`` (numpy, the test oracle),
``pack_portable`` (C++ in ``csrc/kleidiai_pack/kleidiai_pack.cpp``), and ``unpack``.
"""

from __future__ import annotations

import platform
from functools import lru_cache

from ._lazy import torch
from .errors import InputError
from .groups import block, check_group_size, is_channelwise, scales_per_row

__all__ = [
    "LAYOUT_NAME",
    "LAYOUT_VERSION",
    "NR",
    "KR",
    "SR",
    "packed_size",
    "nibble_pack",
    "torch_pack",
    "probe_matrix",
    "pack_reference",
    "pack_portable",
    "pack_experts",
    "native_kleidiai_available",
    "pack",
    "unpack",
    "check_blob",
    "load_for_matmul",
    "is_channelwise",
]

LAYOUT_NAME = "kleidiai-qsi4c32p/qsi4cxp"
LAYOUT_VERSION = 1
NR, KR, SR = 8, 16, 2


def _roundup(a: int, b: int) -> int:
    return (a + b - 1) // b * b


def _check_shape(n: int, k: int, group_size: int) -> None:
    if n < 1 or k < 2 or k % 2:
        raise InputError(f"KleidiAI packing needs N >= 1 and an even K >= 2, got N={n}, K={k}")
    if is_channelwise(k, group_size):
        return
    why = check_group_size(group_size, k)
    if why:
        raise InputError(
            f"group size {group_size} is not valid for K={k}: {why}",
            hint="use a multiple of 32 that divides K, or -1 / K for channelwise",
        )


def packed_size(n: int, k: int, group_size: int) -> int:
    """Bytes of one packed [N, K] matrix (the size torch's matmul checks to pick KleidiAI)."""
    _check_shape(n, k, group_size)
    if is_channelwise(k, group_size):
        return _roundup(n, NR) * (_roundup(k, 32) // 2 + 12)
    return _roundup(n, NR) * (k // 2 + 2 * (k // group_size) + 8)


def nibble_pack(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] in [-8, 7] -> uint8 [N, K/2]: +8, even k in the low nibble (the op's input)."""
    if q.dim() != 2 or q.shape[1] % 2:
        raise InputError(f"nibble_pack expects [N, K] with even K, got {tuple(q.shape)}")
    if q.is_floating_point():
        raise InputError(f"nibble_pack expects integer int4 values, got {q.dtype}")
    if q.numel():
        lo, hi = torch.aminmax(q)
        if int(lo) < -8 or int(hi) > 7:
            raise InputError("int4 values must lie in [-8, 7]")
    u = (q.to(torch.int8) + 8).view(torch.uint8)  # cannot overflow once in [-8, 7]
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()


# ---------------------------------------------------------------------------------------------
# input normalisation shared by every packer


def _prep(q, scales, bias, group_size):
    """Validate and normalise to (q int8 [N,K] contiguous, scales, bias fp32 [N] | None, g)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 2:
        raise InputError("q must be an int8 tensor [N, K]")
    if q.dtype != torch.int8:
        raise InputError(f"q must be int8 (int4 values in [-8, 7]), got {q.dtype}")
    n, k = q.shape
    _check_shape(n, k, group_size)
    q = q.contiguous()
    if is_channelwise(k, group_size):
        if scales.dtype != torch.float32:
            raise InputError(f"channelwise scales must be float32, got {scales.dtype}")
        if scales.numel() != n or scales.dim() not in (1, 2) or (scales.dim() == 2 and scales.shape[1] != 1):
            raise InputError(f"channelwise scales must be [N] or [N, 1] with N={n}, got {tuple(scales.shape)}")
        scales = scales.reshape(n).contiguous()
        g = k
    else:
        if scales.dtype != torch.bfloat16:
            raise InputError(f"groupwise scales must be bfloat16, got {scales.dtype}")
        if tuple(scales.shape) != (n, k // group_size):
            raise InputError(f"groupwise scales must be [N, K/g] = [{n}, {k // group_size}], got {tuple(scales.shape)}")
        scales = scales.contiguous()
        g = group_size
    if bias is not None:
        if bias.numel() != n:
            raise InputError(f"bias must have N={n} values, got {tuple(bias.shape)}")
        bias = bias.reshape(n).to(torch.float32).contiguous()
    return q, scales, bias, g


# ---------------------------------------------------------------------------------------------
# pure-numpy reference (the oracle): reshapes that mirror the layout description


def _data_bytes(qs: np.ndarray) -> np.ndarray:
    """Signed int4 [R8, Kp] (Kp % 32 == 0) -> bytes [R8/8, Kp/32, 2, 8, 8] (block, chunk, seg, row, byte)."""
    import numpy as np  # the reference's: a plan or a plugin load needs none
    r8, kp = qs.shape
    nib = (qs.astype(np.int16) & 0xF).astype(np.uint8)  # two's complement nibble == (q+8) ^ 8
    nib = nib.reshape(r8 // NR, NR, kp // 32, 2, 16)  # [blk, row, chunk, lo/hi half, 16]
    byte = nib[:, :, :, 0, :] | (nib[:, :, :, 1, :] << 4)  # [blk, row, chunk, 16]
    byte = byte.reshape(r8 // NR, NR, kp // 32, 2, 8)  # 16 bytes -> 2 segments of 8
    return byte.transpose(0, 2, 3, 1, 4)  # [blk, chunk, seg, row, byte]


def _pad_rows(a: np.ndarray, r8: int) -> np.ndarray:
    import numpy as np
    n = a.shape[0]
    if r8 == n:
        return a
    return np.concatenate([a, np.repeat(a[n - 1 : n], r8 - n, axis=0)], axis=0)


def _group_row_sums(q: np.ndarray, scf: np.ndarray, g: int) -> np.ndarray:
    """fp32 Σ q·scale the way KleidiAI rounds it: one float add per 16-value segment (the 8
    bytes of a row in one segment), in storage order. (Per block or per value rounds
    differently: 1-6 rows in 64 differ at K=4096, g=32, seen under emulation.)"""
    import numpy as np
    r8, k = q.shape
    qq = q.astype(np.int32).reshape(r8, k // 32, 2, 16)
    seg = (qq[:, :, 0, :] + qq[:, :, 1, :]).reshape(r8, k // 32, 2, 8).sum(axis=3).reshape(r8, k // 16)
    sums = np.zeros(r8, np.float32)
    for j in range(k // 16):
        # seg (|x| <= 128) times a bf16 scale is exact in fp32, so FMA or not cannot matter
        sums = (sums + seg[:, j].astype(np.float32) * scf[:, (16 * j) // g]).astype(np.float32)
    return sums


def pack_reference(q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, group_size: int) -> torch.Tensor:
    import numpy as np
    q, scales, bias, g = _prep(q, scales, bias, group_size)
    n, k = q.shape
    r8 = _roundup(n, NR)
    nb = r8 // NR
    qn = _pad_rows(q.numpy(), r8)
    bias_np = _pad_rows(bias.numpy(), r8) if bias is not None else np.zeros(r8, np.float32)
    if is_channelwise(k, g):
        kp = _roundup(k, 32)
        qp = np.zeros((r8, kp), np.int8)
        qp[:, :k] = qn
        data = _data_bytes(qp).reshape(nb, -1)
        sums = (qn.astype(np.int32).sum(axis=1) * 16).astype("<i4")
        sc = (_pad_rows(scales.numpy(), r8) * np.float32(0.0625)).astype("<f4")
        parts = [data, sums.view(np.uint8).reshape(nb, 32), sc.view(np.uint8).reshape(nb, 32),
                 bias_np.astype("<f4").view(np.uint8).reshape(nb, 32)]
        out = np.concatenate(parts, axis=1)
    else:
        nblk = k // g
        sc16 = _pad_rows(scales.view(torch.int16).numpy(), r8).astype("<i2")  # raw bf16 bits
        scf = _pad_rows(scales.float().numpy(), r8)  # [r8, nblk]
        data = _data_bytes(qn)  # [nb, K/32, 2, 8, 8]
        data = data.reshape(nb, nblk, (g // 32) * 2 * NR * 8)
        sc_bytes = sc16.reshape(nb, NR, nblk).transpose(0, 2, 1).copy().view(np.uint8)  # [nb, nblk, 16]
        blocks = np.concatenate([data, sc_bytes], axis=2).reshape(nb, -1)
        sums = _group_row_sums(qn, scf, g)
        out = np.concatenate([blocks, sums.astype("<f4").view(np.uint8).reshape(nb, 32),
                              bias_np.astype("<f4").view(np.uint8).reshape(nb, 32)], axis=1)
    return torch.from_numpy(np.ascontiguousarray(out).reshape(-1))


# ---------------------------------------------------------------------------------------------
# C++ packer (portable: runs on any host, writes the Arm bytes)


def _ext_mod():
    from . import _ext  # the C++ packer: only packing needs it, not the plugin reading blobs

    return _ext.load("kleidiai_pack")


def _prep_experts(q, scales, bias, group_size):
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.dtype != torch.int8:
        raise InputError("q must be an int8 tensor [E, N, K]")
    e, n, k = q.shape
    _check_shape(n, k, group_size)
    if is_channelwise(k, group_size):
        if scales.dtype != torch.float32 or scales.numel() != e * n or scales.shape[:2] != (e, n):
            raise InputError(f"channelwise scales must be float32 [E, N] or [E, N, 1], got {scales.dtype} {tuple(scales.shape)}")
        scales = scales.reshape(e, n).contiguous()
        g = k
    else:
        if scales.dtype != torch.bfloat16 or tuple(scales.shape) != (e, n, k // group_size):
            raise InputError(f"groupwise scales must be bfloat16 [E, N, K/g] = [{e}, {n}, {k // group_size}], "
                             f"got {scales.dtype} {tuple(scales.shape)}")
        scales = scales.contiguous()
        g = group_size
    if bias is not None:
        if bias.numel() != e * n:
            raise InputError(f"bias must be [E, N] = [{e}, {n}], got {tuple(bias.shape)}")
        bias = bias.reshape(e, n).to(torch.float32).contiguous()
    return q.contiguous(), scales, bias, g


def pack_experts(q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, group_size: int,
                 threads: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """int8 [E, N, K] (+ scales [E, N, K/g] bf16 or [E, N(,1)] fp32, bias [E, N]) -> uint8 [E, bytes].

    ``out`` (contiguous uint8 [E, bytes]) is filled in place when given: fresh memory costs page
    faults comparable to the packing itself.
    """
    q, scales, bias, g = _prep_experts(q, scales, bias, group_size)
    e, n, k = q.shape
    shape = (e, packed_size(n, k, g))
    if out is None:
        out = torch.empty(shape, dtype=torch.uint8)
    elif out.dtype != torch.uint8 or tuple(out.shape) != shape or not out.is_contiguous():
        raise InputError(f"out must be contiguous uint8 {list(shape)}, got {out.dtype} {list(out.shape)}")
    mod = _ext_mod()
    if mod is None:
        for i in range(e):
            out[i] = pack_reference(q[i], scales[i], None if bias is None else bias[i], g)
        return out
    mod.pack(q, scales, bias, g, out, int(threads or 0))
    return out


def pack_portable(q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, group_size: int,
                  threads: int | None = None) -> torch.Tensor:
    """The C++ packer (pure-numpy reference without the C++ library): uint8 1-D blob."""
    q, scales, bias, g = _prep(q, scales, bias, group_size)
    mod = _ext_mod()
    if mod is None:
        return pack_reference(q, scales, bias, g)
    # _prep checked and normalised everything pack_experts would: one expert's [1, ...] views, straight
    # to the library (the per-blob Python is convert's serial part)
    n, k = q.shape
    out = torch.empty(1, packed_size(n, k, g), dtype=torch.uint8)
    mod.pack(q.view(1, n, k), scales.view(1, *scales.shape), None if bias is None else bias.view(1, n), g, out,
             int(threads or 0))
    return out.view(-1)


# ---------------------------------------------------------------------------------------------
# torch's own packer (Arm + KleidiAI + dotprod only)


def torch_pack(q, scales, bias, g):
    """torch's packer on int8 [N, K] and its scales, for the block ``g`` (K for channelwise): a KleidiAI
    blob where torch's KleidiAI path is live, its float32 reference buffer elsewhere."""
    n, k = q.shape
    sc = scales.reshape(n, 1) if is_channelwise(k, g) else scales.contiguous()  # vLLM passes channelwise as [N, 1]
    return torch.ops.aten._dyn_quant_pack_4bit_weight(nibble_pack(q), sc, bias, g, k, n)


def probe_matrix(g: int, n: int = 13, k: int = 64, seed: int = 19):
    """(q int8 [N, K], scales, bias fp32 [N]): the small random matrix a packer probe packs, for the
    block ``g`` (K: channelwise fp32 scales [N, 1], else bf16 [N, K/g]). 13 rows: the padding of the
    last 8-row block is part of the layout too."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    s = torch.rand(n, scales_per_row(k, g), generator=gen) * 0.01 + 0.001
    return q, (s if is_channelwise(k, g) else s.to(torch.bfloat16)), torch.randn(n, generator=gen)


@lru_cache(maxsize=None)
def native_kleidiai_available(n: int = 13, k: int = 64) -> bool:
    """True when torch's packer really writes KleidiAI blobs here (probed, both layouts).

    torch falls back silently to its float32 format (no dotprod, wrong scale dtype, x86), and
    ``torch.backends.kleidiai.is_available()`` is only a build flag, so check dtype and size.
    """
    if platform.machine().lower() not in {"aarch64", "arm64"}:
        return False
    if not hasattr(torch.ops.aten, "_dyn_quant_pack_4bit_weight"):
        return False
    try:
        for g in (32, k):
            q, sc, _ = probe_matrix(g, n, k)
            out = torch_pack(q, sc, None, g)
            if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != packed_size(n, k, g):
                return False
    except Exception:  # an op that refuses the probe is not usable either
        return False
    return True


def pack(q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, group_size: int,
         packer: str = "auto") -> tuple[torch.Tensor, str]:
    """(uint8 blob, packer used): "native" (torch on Arm), "portable" (C++) or "reference" (numpy)."""
    if packer not in {"auto", "native", "portable"}:
        raise InputError(f"unknown packer {packer!r}", hint="use auto, native or portable")
    q, scales, bias, g = _prep(q, scales, bias, group_size)
    n, k = q.shape
    if packer in {"auto", "native"} and native_kleidiai_available():
        out = torch_pack(q, scales, bias, g)
        if out.dtype == torch.uint8 and out.numel() == packed_size(n, k, g):
            return out.contiguous(), "native"
        if packer == "native":
            raise InputError(f"torch's packer did not write a KleidiAI blob for N={n} K={k} g={group_size}")
    elif packer == "native":
        raise InputError("native KleidiAI packing is not available on this host",
                         hint="needs aarch64 with dotprod and a KleidiAI torch build; use packer='portable'")
    used = "portable" if _ext_mod() is not None else "reference"
    return pack_portable(q, scales, bias, g), used


# ---------------------------------------------------------------------------------------------
# decoding and loading


def check_blob(blob: torch.Tensor, n: int, k: int, group_size: int) -> None:
    """Refuse anything that is not a contiguous uint8 1-D blob of the KleidiAI size."""
    want = packed_size(n, k, group_size)
    if not isinstance(blob, torch.Tensor):
        raise InputError(f"KleidiAI blob must be a tensor, got {type(blob).__name__}")
    if blob.dtype != torch.uint8:
        raise InputError(f"KleidiAI blob must be uint8, got {blob.dtype}",
                         hint="a float32 blob is torch's reference format, not KleidiAI")
    if blob.dim() != 1 or blob.numel() != want:
        raise InputError(f"KleidiAI blob for N={n} K={k} g={group_size} must be 1-D with {want} bytes, "
                         f"got shape {tuple(blob.shape)}")
    if not blob.is_contiguous():
        raise InputError("KleidiAI blob must be contiguous")


def unpack(blob: torch.Tensor, n: int, k: int, group_size: int, has_bias: bool, check: bool = True,
           out: tuple | None = None):
    """Decode a blob -> (q int8 [N, K], scales bf16 [N, K/g] | fp32 [N, 1], bias fp32 [N] | None).

    With ``check`` the redundant fields must agree: padding rows repeat row N-1, the row sums
    match the data, the K padding is zero, and a blob without bias stores zeros there.
    ``out``: (q, scales) buffers the C++ decoder fills instead of fresh tensors (without the
    library they are left alone: use what is returned).
    """
    check_blob(blob, n, k, group_size)
    mod = _ext_mod()
    if mod is not None:
        g = k if is_channelwise(k, group_size) else group_size
        bad, q, scales, bias = mod.unpack(blob, n, k, g, has_bias, check, out=out)
        if bad:
            raise InputError(unpack_problem(bad, n, k, g))
        return q, scales, bias
    return unpack_torch(blob, n, k, group_size, has_bias, check)


def unpack_problem(bad: int, n: int, k: int, group_size: int) -> str:
    """What the C++ decoder's failed-check bits ``bad`` (non-zero) mean: the first in the order
    unpack_torch checks them (``group_size`` K for channelwise)."""
    what = next(what for bit, what in _UNPACK_CHECKS if bad & bit)
    return f"KleidiAI blob is inconsistent: {what if bad & 3 != 2 or is_channelwise(k, group_size) else what + ' and scales'}"


# the C++ decoder's failed-check bits (kleidiai_unpack.cpp), in the order unpack_torch checks them
_UNPACK_CHECKS = ((1, "K padding is not zero"), (2, "row sums disagree with the data"),
                  (4, "padding rows do not repeat row N-1 (data)"), (8, "padding rows do not repeat row N-1 (scales)"),
                  (16, "padding rows do not repeat row N-1 (bias)"), (32, "blob holds a bias but has_bias=False"))


def unpack_torch(blob: torch.Tensor, n: int, k: int, group_size: int, has_bias: bool, check: bool = True):
    """``unpack`` in torch (the C++ decoder's twin, and the path without the library)."""
    check_blob(blob, n, k, group_size)
    r8 = _roundup(n, NR)
    nb = r8 // NR
    raw = blob.reshape(nb, -1)

    def nibbles(data, kp):  # [nb, kp/32, 2, 8 rows, 8 bytes] -> int8 [r8, kp]
        d = data.reshape(nb, kp // 32, 2, NR, 8).permute(0, 3, 1, 2, 4).reshape(r8, kp // 2)
        lo = (d & 0xF).to(torch.int8)
        hi = (d >> 4).to(torch.int8)
        lo = lo - ((lo & 8) << 1)  # sign-extend the 4-bit two's complement
        hi = hi - ((hi & 8) << 1)
        lo = lo.reshape(r8, kp // 32, 2, 8)
        hi = hi.reshape(r8, kp // 32, 2, 8)
        return torch.cat([lo.reshape(r8, kp // 32, 16), hi.reshape(r8, kp // 32, 16)], dim=2).reshape(r8, kp)

    def f32(x):  # [nb, 32] bytes -> [r8] float
        return x.contiguous().view(torch.float32).reshape(r8)

    if is_channelwise(k, group_size):
        kp = _roundup(k, 32)
        dlen = kp // 2 * NR
        qall = nibbles(raw[:, :dlen], kp)
        sums = raw[:, dlen:dlen + 32].contiguous().view(torch.int32).reshape(r8)
        sc = f32(raw[:, dlen + 32:dlen + 64]) * 16.0
        bias = f32(raw[:, dlen + 64:dlen + 96])
        if check:
            _agree(qall[:, k:].eq(0).all(), "K padding is not zero")
            _agree(sums.eq(qall.to(torch.int32).sum(1) * 16).all(), "row sums disagree with the data")
        q = qall[:, :k]
        scales = sc.reshape(r8, 1)
    else:
        nblk = k // group_size
        dlen = group_size // 2 * NR
        per = raw[:, :nblk * (dlen + 2 * NR)].reshape(nb, nblk, dlen + 2 * NR)
        q = nibbles(per[:, :, :dlen].reshape(nb, -1), k)
        scales = per[:, :, dlen:].contiguous().view(torch.bfloat16).reshape(nb, nblk, NR).permute(0, 2, 1).reshape(r8, nblk)
        tail = raw[:, nblk * (dlen + 2 * NR):]
        sums = f32(tail[:, :32])
        bias = f32(tail[:, 32:64])
        if check:
            acc = torch.from_numpy(_group_row_sums(q.numpy(), scales.float().numpy(), group_size))
            _agree(torch.equal(acc, sums), "row sums disagree with the data and scales")
    if check and r8 > n:
        for name, t in (("data", q), ("scales", scales), ("bias", bias)):
            _agree(torch.equal(t[n:], t[n - 1:n].expand_as(t[n:])), f"padding rows do not repeat row N-1 ({name})")
    if check and not has_bias:
        _agree(bias.eq(0).all(), "blob holds a bias but has_bias=False")
    return q[:n].contiguous(), scales[:n].contiguous(), (bias[:n].contiguous() if has_bias else None)


def _agree(ok, what: str) -> None:
    if not bool(ok):
        raise InputError(f"KleidiAI blob is inconsistent: {what}")


def load_for_matmul(blob: torch.Tensor, n: int, k: int, group_size: int, has_bias: bool) -> torch.Tensor:
    """A tensor for ``torch.ops.aten._dyn_quant_matmul_4bit(x, w, block, k, n)`` on this host.

    Where torch's KleidiAI path is live (Arm, dotprod) that is the blob itself. Elsewhere (x86,
    Arm without dotprod) torch's matmul expects its float32 reference format, so the blob is
    decoded to the canonical tensors and repacked with ``_dyn_quant_pack_4bit_weight``: the same
    call works everywhere, at the fallback's speed. ``block`` is K for channelwise.
    """
    check_blob(blob, n, k, group_size)
    if native_kleidiai_available():
        return blob.contiguous()
    q, scales, bias = unpack(blob, n, k, group_size, has_bias)
    return torch_pack(q, scales, bias, block(k, group_size))
