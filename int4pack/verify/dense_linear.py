"""verify's numerical check of one dense W4A8 linear: a few rows through
``_dyn_quant_matmul_4bit`` and through float32 references, the errors against their predictions."""

from __future__ import annotations

import math

import torch

from .. import _ext, kernels
from .. import moe as moe_mod
from ..errors import InputError
from ..groups import block
from ..serve_spec import rotary_rows
from ..w4a8 import dequantize_w4a8
from . import matmul
from .exact_ints import exact_module, ints_vs_source, lossless_values, rel_from, scale_error_sq
from .source import Source, bias_vs_source
from .tolerance import ABS_FLOOR, K_ACT, K_WEIGHT, budget, cos, not_finite, rel, sum_sq
from .w4a8_output import W4A8Output

__all__ = ["check_linear"]


def check_linear(output: W4A8Output, m: str, src: Source | None, report, x: torch.Tensor, clock) -> dict:
    """Module m on the rows ``x``: the kernel against the float reference on its int4 values (the
    activation error), and with a source that reference against the source's (the weight error)."""
    with kernels.threads_here(1):
        return _Linear(output, m, src, report, x, clock).run()


class _Linear:
    """One dense linear's check, its stages the methods; ``res`` the result they fill in."""

    def __init__(self, output: W4A8Output, m: str, src: Source | None, report, x: torch.Tensor, clock):
        self.output, self.m, self.src, self.report, self.x, self.clock = output, m, src, report, x, clock
        self.res: dict = {"module": m, "kind": "dense", "problems": []}
        self.vk = _ext.load("verify_kernels")

    def run(self) -> dict:
        output, m, src, x, clock, res, vk = self.output, self.m, self.src, self.x, self.clock, self.res, self.vk
        with clock("read"):
            self.q, self.s, self.g = q, s, g = output.weight(m)
            wp = output.blob(m)
            # the int4 values and scales as they are: the matmul twin and the int4 reference take them
            as_int4 = x.dtype == torch.float32 and q.dim() == 2 and matmul.fits(q, s, block(q.shape[1], g))
        exact = None  # a lossless linear equal to its source: the source's scales (exact_ints.py)
        if src is not None and vk is not None and as_int4 and output.rotary_heads(m) is None:
            with clock("compare"):
                exact = exact_module(output, src, m, q, s.reshape(q.shape[0], -1))
        # without a source, or with one whose ints these are, the float weights are only multiplied:
        # the references read the int4 values
        direct = (src is None or exact is not None) and vk is not None and as_int4
        with clock("read"):
            w_c = None if direct else dequantize_w4a8(q, s, g)
        n, k = q.shape
        if x.shape[1] != k:
            raise InputError(f"{m}: K={k} in its weights, {x.shape[1]} recorded", tensor=m)
        y_k = self._kernel(wp, as_int4)
        with clock("reference"):
            if direct:
                rows = torch.empty(n)
                y_c = vk.w4a8_reference(x.contiguous(), q.contiguous(), s.contiguous().reshape(n, -1), row_sq=rows)
                w_sq = math.fsum(rows.double().tolist())
            else:
                y_c = x @ w_c.t()
                w_sq = sum_sq(w_c)
        step2 = moe_mod.int8_step(x) ** 2 / 12
        act_pred = math.sqrt(float(step2.sum()) * w_sq) / max(float(y_c.double().norm()), 1e-30)
        act_rel = rel(y_k, y_c)
        res.update(act_rel=act_rel, act_pred=act_pred, act_ratio=act_rel / act_pred if act_pred else None)
        if not act_rel <= K_ACT * act_pred + ABS_FLOOR:
            res["problems"].append(
                f"activation-quantisation error {act_rel:.4g} exceeds {K_ACT} x predicted {act_pred:.4g}")
        tol, y_s = K_ACT * act_pred, y_c
        if exact is not None:
            y_s, tol = self._exact_vs_source(exact, y_c, act_pred)
        elif src is not None:
            y_s, tol = self._floats_vs_source(w_c, y_c, act_pred)
        res.update(rel_l2=rel(y_k, y_s), max_abs=float((y_k - y_s).abs().max()), cosine=cos(y_k, y_s), tolerance=tol)
        if not res["rel_l2"] <= tol + ABS_FLOOR:
            res["problems"].append(f"output error {res['rel_l2']:.4g} exceeds the tolerance {tol:.4g}")
        res["problems"] += not_finite(res)
        res["ok"] = not res["problems"]
        return res

    def _kernel(self, wp: torch.Tensor | None, as_int4: bool) -> torch.Tensor:
        """The rows through the W4A8 matmul: the checkpoint's blob ``wp`` through torch's op, else the
        twin on the int4 values where it runs and takes them, else torch's op on weights packed now."""
        q, s, g, clock = self.q, self.s, self.g, self.clock
        n, k = q.shape
        twin = matmul.twin() if wp is None and as_int4 else None
        if twin is not None:  # torch's reference kernel's twin
            with clock("kernel"):
                y_k = matmul.matmul(twin, self.x, q, s, block(k, g))
            self.res["matmul"] = matmul.TWIN
            return y_k
        if wp is None:
            with clock("pack"):
                wp = moe_mod.pack_for_matmul(q, s, g)
        with clock("kernel"):
            y_k = torch.ops.aten._dyn_quant_matmul_4bit(self.x, wp, block(k, g), k, n)
        self.res["matmul"] = matmul.TORCH
        return y_k

    def _exact_vs_source(self, exact: torch.Tensor, y_c: torch.Tensor, act_pred: float) -> tuple[torch.Tensor, float]:
        """A linear whose ints and scales are its lossless source's: the source's reference from the
        ints and the source's scales, the weight error from the scales alone. Returns the source's
        output and the layer tolerance."""
        m, src, x, q, clock, res = self.m, self.src, self.x, self.q, self.clock, self.res
        n, k = q.shape
        with clock("reference"):
            srows = torch.empty(n)
            y_s = self.vk.w4a8_reference(x.contiguous(), q.contiguous(), exact, row_sq=srows)
            s_sq = math.fsum(srows.double().tolist())
        with clock("compare"):
            meas = rel_from(scale_error_sq(self.vk, q.contiguous(), self.s, exact), s_sq)
        bud, why = budget(m, None, self.g, self.report, src)  # lossless: the bound needs no weights
        if not meas <= bud:
            res["problems"].append(f"weight rel_l2 {meas:.4g} vs the source exceeds its budget {bud:.4g} ({why})")
        res["exact_ints"] = True
        res["problems"] += bias_vs_source(self.output, src, m)
        src.forget([m])
        w_pred = bud * math.sqrt(s_sq / (n * k) * float(x.double().pow(2).sum()) * n) / max(float(y_s.double().norm()),
                                                                                              1e-30)
        return y_s, _weight_check(res, y_c, y_s, w_pred, meas, bud, act_pred)

    def _floats_vs_source(self, w_c: torch.Tensor, y_c: torch.Tensor, act_pred: float) -> tuple[torch.Tensor, float]:
        """The converted float weights ``w_c`` against the source's dequantised ones, and a lossless
        linear's ints and scales exactly (in the blob's row order). Returns the source's output and
        the layer tolerance."""
        m, src, x, g, clock, res = self.m, self.src, self.x, self.g, self.clock, self.res
        with clock("read"):
            w_s = src.dequant(m)
            heads = self.output.rotary_heads(m)
            if heads is not None:  # stored in vLLM's rotary order: the source's rows in that order
                w_s = rotary_rows(w_s, heads)
        meas = rel(w_c, w_s)
        bud, why = budget(m, w_s, g, self.report, src)
        if not meas <= bud:
            res["problems"].append(f"weight rel_l2 {meas:.4g} vs the source exceeds its budget {bud:.4g} ({why})")
        with clock("compare"):
            want = lossless_values(src.read(m), g)
            if want is not None and heads is not None:
                want = tuple(rotary_rows(v, heads) for v in want)
            res["exact_ints"] = want is not None
            res["problems"] += ints_vs_source(m, (self.q, self.s), want)
        res["problems"] += bias_vs_source(self.output, src, m)
        with clock("reference"):
            y_s = x @ w_s.t()
        src.forget([m])
        w_pred = bud * math.sqrt(sum_sq(w_s) / w_s.numel() * float(x.double().pow(2).sum()) * self.q.shape[0]) / max(
            float(y_s.double().norm()), 1e-30)
        return y_s, _weight_check(res, y_c, y_s, w_pred, meas, bud, act_pred)


def _weight_check(res: dict, y_c: torch.Tensor, y_s: torch.Tensor, w_pred: float, meas: float, bud: float,
                  act_pred: float) -> float:
    """The output's deviation from the source against its prediction from the weight budget
    (recorded in ``res``); returns the layer tolerance."""
    w_rel = rel(y_c, y_s)
    res.update(weight_rel=w_rel, weight_pred=w_pred, weight_l2=meas, budget=bud)
    if not w_rel <= K_WEIGHT * w_pred + ABS_FLOOR:
        res["problems"].append(f"output deviates from the source by {w_rel:.4g} (allowed {K_WEIGHT} x {w_pred:.4g})")
    return math.hypot(K_ACT * act_pred, K_WEIGHT * w_pred)
