"""The W4A8 matmul verify's numerical pass runs: torch's ``_dyn_quant_matmul_4bit`` where torch runs
it with KleidiAI (Arm: the checkpoint's own blobs go through the kernel vLLM serves with, the real
check), and elsewhere int4pack's C++ twin of torch's reference kernel.

Without KleidiAI (x86-64), torch's op is a scalar reference kernel (per-row dynamic int8
activations, int4 weights with group scales; 2-3 ns per weight and row on a 2-core x86-64 host)
that takes a float32 buffer of the weights made on the fly from the same int4 values the
references use. The twin (``csrc/verify_kernels/w4a8_matmul.cpp``, AVX2 where the CPU has it) does
that kernel's arithmetic on the int4 values and scales themselves, with no buffer: the same bits
out (tests/test_verify_matmul.py compares it with torch's op), 10-37x faster on 1-8 rows of a
Qwen3-30B-A3B expert. ``INT4PACK_VERIFY_MATMUL=torch`` runs torch's op instead.
"""

from __future__ import annotations

import os
from functools import partial

import torch

from .. import _ext, kleidiai
from ..errors import UsageError
from ..kernels import kernel_threads

__all__ = ["ENV", "TWIN", "TORCH", "setting", "twin", "fits", "matmul", "run_expert", "info"]

ENV = "INT4PACK_VERIFY_MATMUL"
TWIN, TORCH = "int4pack", "torch"


def setting() -> str:
    """auto or torch, from INT4PACK_VERIFY_MATMUL; another value is a UsageError."""
    v = os.environ.get(ENV, "").strip().lower()
    if v not in ("", "auto", TORCH):
        raise UsageError(f"{ENV}={os.environ[ENV]!r}: expected auto (the default) or torch",
                         hint="unset it, or set it to torch to run torch's _dyn_quant_matmul_4bit")
    return v or "auto"


def twin():
    """The C++ kernels whose ``w4a8_matmul`` verify runs here, or None: torch's op runs (KleidiAI
    here, the C++ library missing, or ``INT4PACK_VERIFY_MATMUL=torch``)."""
    if setting() == TORCH or kleidiai.native_kleidiai_available():
        return None
    return _ext.load("verify_kernels")


def fits(q: torch.Tensor, scales: torch.Tensor, block: int) -> bool:
    """The twin takes these weights as they are: int8 [N, K] values, fp32/bf16 scales one per block
    (its input rows must be float32, as torch's groupwise kernel's)."""
    if q.dtype != torch.int8 or q.dim() != 2:
        return False
    n, k = q.shape
    return (scales.dtype in (torch.float32, torch.bfloat16) and block > 0 and k % block == 0
            and scales.numel() == n * (k // block))


def matmul(vk, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """``_dyn_quant_matmul_4bit(x, pack(q, scales), block, K, N)`` as torch's reference kernel computes
    it, on the twin ``vk`` (``fits`` must hold), with the calling thread's kernel threads."""
    n = q.shape[0]
    return vk.w4a8_matmul(x.contiguous(), q.contiguous(), scales.contiguous().reshape(n, -1), block,
                          threads=kernel_threads())


def run_expert(run, i: int, twin, w13: tuple, w2: tuple, packed, clock) -> str:
    """Expert i's rows of ``run`` (moe.MoeRun) through the W4A8 matmul: the twin ``twin`` on w13 and w2
    as (int4 values, scales) where it runs and ``fits`` them, else torch's op on ``packed()`` (w13 and
    w2 as it takes them). Returns which ran: TWIN or TORCH."""
    if twin is not None and fits(*w13, run.g13) and fits(*w2, run.g2):
        with clock("kernel"):
            run.expert_with(i, partial(matmul, twin), w13, w2)
        return TWIN
    w13p, w2p = packed()
    with clock("kernel"):
        run.expert(i, w13p, w2p)
    return TORCH


def info() -> dict:
    """The report's ``kernel``: which matmul verify runs here (each layer's ``matmul`` says which ran)."""
    if kleidiai.native_kleidiai_available():
        out = {"matmul": "kleidiai", "op": "torch.ops.aten._dyn_quant_matmul_4bit"}
    else:
        vk = twin()
        if vk is None:
            out = {"matmul": "torch reference (x86 fallback)", "op": "torch.ops.aten._dyn_quant_matmul_4bit"}
        else:
            simd = "avx2" if vk.w4a8_matmul_avx2() else "portable"
            out = {"matmul": f"torch reference algorithm, int4pack C++ ({simd})",
                   "op": "int4pack verify_kernels w4a8_matmul"}
    out["moe_op"] = "python"  # vLLM's algorithm in Python (moe.MoeRun) over the matmul
    if os.environ.get(ENV):
        out["setting"] = f"{ENV}={os.environ[ENV]}"
    return out
