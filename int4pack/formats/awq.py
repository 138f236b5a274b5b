"""AWQ GEMM reader (formats.md §2): qweight [K, N/8] packed along N in the AWQ nibble order.

Zero points are stored as they are (no +1, no g_idx). Other AWQ layouts (gemv, gemv_fast,
marlin, exllama) are refused by name.
"""

from __future__ import annotations

import numpy as np

from .._lazy import torch
from ..sources.checkpoint import Checkpoint
from ..errors import InputError, RefusedError
from ..records import FormatVerdict, LinearSpec, Packing, QuantLinear
from ._api import Format, Header, quant_method
from ._common import all_bytes, cfg_bool, check_dtype, check_shape, need, prefixes_with, quant_params, read_transposed, \
    require_bits4

__all__ = ["AWQReader", "FORMAT", "claims"]

_REFUSED_VERSIONS = {
    "gemv": "qweight [N, K/8] packed along K with transposed, padded scales/qzeros",
    "gemv_fast": "int16 qweight interleaved by 4 with pre-scaled fp16 zeros",
    "marlin": "a Marlin tile permutation of qweight and scales",
    "exllama": "an exllama repack of GEMM done at load time",
    "exllamav2": "an exllamav2 repack of GEMM done at load time",
    "ipex": "an Intel IPEX repack",
}
_SCALE_DTYPES = ("F16", "BF16", "F32")


def claims(q: dict | None, header: Header) -> bool:
    return quant_method(q) == "awq"


class AWQReader:
    name = "awq"

    def __init__(self, ckpt: Checkpoint, qcfg: dict, path: str | None = None):
        self.ckpt = ckpt
        self.cfg = qcfg
        self.path = path or str(ckpt.folder / "config.json")
        self.params = quant_params(qcfg)
        self.bits, self.group = self.params.bits, self.params.group_size
        self.version = str(qcfg.get("version") or qcfg.get("format") or "gemm").lower()
        self.zero_point = cfg_bool(qcfg, "zero_point", True)
        self.not_convert = [str(m) for m in (qcfg.get("modules_to_not_convert") or [])]
        self.modules = sorted(set(prefixes_with(ckpt, ".qweight")) | set(prefixes_with(ckpt, ".qzeros")))
        self._specs: dict[str, LinearSpec] | None = None

    def _check_config(self) -> None:
        if self.version != "gemm":
            what = _REFUSED_VERSIONS.get(self.version, "an unknown AWQ layout")
            raise RefusedError(f"AWQ version {self.version!r} is {what}", path=self.path,
                               hint="int4pack reads AWQ GEMM (version: gemm); re-export with version GEMM.")
        if not self.zero_point:
            raise RefusedError(
                "AWQ with zero_point: false has no GEMM layout that AutoAWQ writes (its GEMM packer needs "
                "zero points), so int4pack cannot be sure how the codes are stored", path=self.path,
                hint="Re-export with zero_point: true, or convert to compressed-tensors first.")
        require_bits4(self.bits, self.modules[0] if self.modules else "(none)", self.path)

    def _spec(self, name: str) -> LinearSpec:
        ck = self.ckpt
        qweight = need(ck, name, "qweight", "AWQ tensors")
        qzeros = need(ck, name, "qzeros", "a qweight")
        scales = need(ck, name, "scales", "a qweight")
        check_dtype(ck, qweight, ("I32",), "AWQ GEMM qweight")
        check_dtype(ck, qzeros, ("I32",), "AWQ GEMM qzeros")
        check_dtype(ck, scales, _SCALE_DTYPES, "scales")
        qshape = ck.tensors[qweight].shape
        sshape = ck.tensors[scales].shape
        if len(qshape) != 2 or len(sshape) != 2:
            raise InputError(f"{qweight}: expected 2-D qweight [K, N/8] and scales [G, N], got "
                             f"{list(qshape)} and {list(sshape)}", tensor=qweight,
                             hint="3-D or fused AWQ tensors are not a layout int4pack reads.")
        k, n = qshape[0], qshape[1] * 8
        group = self.params.group_along(k)
        groups = -(-k // group)
        check_shape(ck, scales, (groups, n), f"[ceil(K/group_size), N] for K={k}, N={n}, group_size={group}")
        check_shape(ck, qzeros, (groups, n // 8), f"[G, N/8] for G={groups}, N={n}")
        keys = [qweight, qzeros, scales]
        notes = []
        if any(m in name for m in self.not_convert):
            notes.append("matches modules_to_not_convert, but its qweight is present")
        b_name = f"{name}.bias"
        has_bias = b_name in ck.tensors
        if has_bias:
            check_shape(ck, b_name, (n,), f"out_features N={n}")
            keys.append(b_name)
        return LinearSpec(name=name, fmt="awq", n=n, k=k, bits=4, group_size=group, sym=False, act_order=False,
                          keys=tuple(keys), scale_dtype=ck.tensors[scales].dtype, has_bias=has_bias, notes=notes)

    def linears(self) -> dict[str, LinearSpec]:
        self._check_config()
        if self._specs is None:
            self._specs = {m: self._spec(m) for m in self.modules}
        return self._specs

    def verdict(self) -> FormatVerdict:
        self._check_config()
        evidence = [f"quant_method awq, version {self.version!r}, bits {self.bits}, group_size {self.group}, "
                    f"zero_point {self.zero_point}",
                    f"{len(self.modules)} module(s) with qweight"]
        if self.not_convert:
            evidence.append(f"modules_to_not_convert: {self.not_convert} (informational; tensors decide)")
        return FormatVerdict(format=self.name, detail="awq gemm", evidence=evidence,
                             extra={"version": self.version})

    def in_place(self, spec: LinearSpec) -> tuple | None:
        """Where a module's data lies, for convert's batches (batch.py), which read it in place (see
        GPTQReader.in_place); None where ``read`` is the only way."""
        if spec.refused or spec.has_bias or spec.signed_scales:
            return None
        t = self.ckpt.tensors
        return (Packing.AWQ, t[f"{spec.name}.qweight"], t[f"{spec.name}.scales"], True, t[f"{spec.name}.qzeros"],
                0x88, None)

    def read(self, spec: LinearSpec, *, unpack: bool = True) -> QuantLinear:
        from .. import kernels  # torch's: imported when the work starts, not by the plan

        ck = self.ckpt
        qweight = ck.view(f"{spec.name}.qweight")  # mapped; convert releases it after the job
        packed = None
        if unpack:
            codes = kernels.unpack_awq(qweight)  # [N, K]
            ck.release(f"{spec.name}.qweight")  # (no copy of the packed words was made)
        else:
            codes, packed = None, (Packing.AWQ, kernels.words(qweight))
        words = ck.read_bytes(f"{spec.name}.qzeros")
        zeros = None
        if not all_bytes(words, 0x88):  # not every zero 8 (N is a multiple of 8: no padding nibbles)
            zw = torch.from_numpy(np.frombuffer(words, np.int32).reshape(spec.groups, spec.n // 8))
            zeros = kernels.unpack_awq(zw)  # same layout as qweight: [N, G]
        scales = read_transposed(ck, f"{spec.name}.scales")
        bias = ck.get(f"{spec.name}.bias") if spec.has_bias else None
        return QuantLinear(spec, codes, scales, zeros, None, bias, packed=packed)


FORMAT = Format(
    "awq", claims, AWQReader,
    reads="quant_method awq (GEMM)",
    lossless="none (AWQ is asymmetric: its zero points are not the symmetric int4 grid)",
    requant="every module",
    float_siblings=True)
