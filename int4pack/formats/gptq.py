"""GPTQ reader (formats.md §1): qweight packed along K, qzeros along N, v1 or v2 zero points.

The v1/v2 zero convention is read from the data, not only from the label: symmetric files
store one exact word (0x77777777 in v1, 0x88888888 in v2); asymmetric files are judged by
mean(u - stored_zero) over a sample of modules, which is ~1 for v1 and ~0 for v2.
"""

from __future__ import annotations

import re

import numpy as np

from .._lazy import torch
from ..sources.checkpoint import Checkpoint
from ..errors import InputError, RefusedError
from ..records import FormatVerdict, LinearSpec, Packing, QuantLinear
from ..nibbles import nibble_cols, nibble_rows
from ._api import Format, Header, quant_method
from ._common import (
    QuantParams, WIDE_BITS, all_bytes, byte_cols, byte_rows, cfg_bool, check_dtype, check_shape, dequantize_rows,
    g_idx_unless_trivial, need, nontrivial_g_idx, prefixes_with, quant_params, read_transposed, require_bits4)

__all__ = ["GPTQReader", "FORMAT", "claims", "V1_SYM_WORD", "V2_SYM_WORD", "V1_OFFSET"]

V1_SYM_WORD = 0x77777777
V2_SYM_WORD = 0x88888888
V1_OFFSET = 0x11111111  # v1 stores zero-1 per nibble; GPTQModel converts whole words
V1_OFFSET_8 = 0x01010101  # the same for 8-bit zero points, four a word
_LABELS = {"gptq": "v1", "gptq_v2": "v2"}
_REFUSED_LABELS = {
    "marlin": "a Marlin-repacked layout (tile-permuted qweight and scales)",
    "gptq_p": "GPTQModel's planar gptq_p layout (5/6/7-bit)",
    "bitblas": "a BitBLAS-repacked layout",
    "qqq": "the QQQ layout",
    "awq": "AWQ tensors under a GPTQ config",
}
_SAMPLE = 8
_V2_BELOW, _V1_ABOVE = 0.3, 0.7  # mean(u - stored zero) thresholds
_SANE = (-0.5, 1.5)  # outside this neither convention explains the data
_SCALE_DTYPES = ("F16", "BF16", "F32")
# byte -> 1 where either nibble is 0xF (a v1 zero point of 0): one table pass over the qzeros bytes
_HAS_F_NIBBLE = bytes(int(b & 0xF == 0xF or b >> 4 == 0xF) for b in range(256))
_V1_F_NOTE = "v1 zero nibble 0xF (zero point 0) decoded with whole-word carry"


def _flatten(x) -> list[str]:
    if x is None:
        return []
    if isinstance(x, str):
        return [x]
    return [s for item in x for s in _flatten(item)]


def _zeros(spec: LinearSpec, words: bytearray, conv: str) -> torch.Tensor | None:
    """qzeros bytes (words [G, ceil(N/8)], packed along N) -> zero points uint8 [N, G]; None when all are 8.
    Words in uint32: the v1 whole-word add wraps mod 2^32 by definition."""
    if all_bytes(words, 0x77 if conv == "v1" else 0x88):  # symmetric: every word 0x77777777 / 0x88888888
        return None
    w = np.frombuffer(words, np.uint32).reshape(spec.groups, -(-spec.n // 8))
    if conv == "v1":
        if not spec.sym and _V1_F_NOTE not in spec.notes and 1 in words.translate(_HAS_F_NIBBLE):
            spec.notes.append(_V1_F_NOTE)  # once, however often the module is read
        w = w + np.uint32(V1_OFFSET)
    z = nibble_rows(w.T)[: spec.n]
    # words not all uniform means some zero is not 8, unless it sits in the last word's padding
    return None if spec.n % 8 and bool((z == 8).all()) else torch.from_numpy(z)


def _group_code_sums(w: np.ndarray, g_idx: np.ndarray | None, groups: int, group_size: int) -> np.ndarray:
    """Sum of the codes of each (group, column) of a qweight [K/8, N] (uint32 words): int64 [groups, N].
    ``g_idx`` None means contiguous groups of ``group_size`` rows. Contiguous groups of whole words
    add each word's 8 nibbles with two masks and a multiply, without unpacking (the v1/v2 check
    unpacked 8 modules in float: a quarter of a second before any work). numpy only: the plan runs it."""
    k = w.shape[0] * 8
    if g_idx is None and group_size % 8 == 0 and k == groups * group_size:
        pairs = (w & np.uint32(0x0F0F0F0F)) + ((w >> np.uint32(4)) & np.uint32(0x0F0F0F0F))  # 4 bytes <= 30
        per_word = (pairs * np.uint32(0x01010101)) >> np.uint32(24)  # the top byte adds all four: <= 120
        return per_word.reshape(groups, group_size // 8, -1).sum(axis=1, dtype=np.int64)
    if g_idx is None:
        g_idx = np.arange(k) // group_size
    u = nibble_rows(w).astype(np.int64)  # [K, N]
    counts = np.bincount(g_idx, minlength=groups)
    out = np.zeros((groups, u.shape[1]), dtype=np.int64)
    full = counts > 0  # rows sorted by group: each non-empty group's rows are one run
    starts = (np.cumsum(counts) - counts)[full]
    out[full] = np.add.reduceat(u[np.argsort(g_idx, kind="stable")], starts, axis=0)
    return out


def claims(q: dict | None, header: Header) -> bool:
    """quant_method gptq, or an old GPTQ config without one (bits and desc_act)."""
    return q is not None and (quant_method(q) == "gptq" or (not quant_method(q) and "bits" in q and "desc_act" in q))


class GPTQReader:
    name = "gptq"
    fmt = "gptq"  # the LinearSpec.fmt of its modules (the layout of their tensors)

    def __init__(self, ckpt: Checkpoint, qcfg: dict, path: str | None = None):
        self.ckpt = ckpt
        self.cfg = qcfg
        self.path = path or str(ckpt.folder / "config.json")
        self.params = quant_params(qcfg)
        self.bits, self.group, self.sym = self.params.bits, self.params.group_size, self.params.sym
        self.desc_act = cfg_bool(qcfg, "desc_act", False)
        self.dynamic = qcfg.get("dynamic") or {}
        if not isinstance(self.dynamic, dict):
            raise InputError(f"quantization_config dynamic is a {type(self.dynamic).__name__}, not an object",
                             path=self.path, hint="Fix the config: dynamic maps module regexes to overrides.")
        self.in_block = _flatten(qcfg.get("modules_in_block_to_quantize"))
        self.modules = sorted(set(prefixes_with(ckpt, ".qweight")) | set(prefixes_with(ckpt, ".qzeros")))
        self._verdict: FormatVerdict | None = None
        self._specs: dict[str, LinearSpec] | None = None
        self._checked = False

    # -- config --------------------------------------------------------------------------
    def _label(self) -> str | None:
        if self.cfg.get("is_marlin_format"):
            return "marlin"
        label = self.cfg.get("checkpoint_format") or self.cfg.get("format")
        return str(label).lower() if label is not None else None

    def _check_config(self) -> None:
        if self._checked:
            return
        label = self._label()
        if label is not None and label not in _LABELS:
            what = _REFUSED_LABELS.get(label, "an unknown GPTQ checkpoint format")
            raise RefusedError(f"GPTQ checkpoint_format {label!r} is {what}", path=self.path,
                               hint="int4pack reads plain GPTQ (checkpoint_format gptq or gptq_v2); "
                                    "export the model in that format first.")
        pack = str(self.cfg.get("pack_dtype", "int32")).replace("torch.", "")
        if pack != "int32":
            raise RefusedError(f"GPTQ pack_dtype {pack!r} is not supported", path=self.path,
                               hint="int4pack reads GPTQ packed in int32 words; re-export with pack_dtype=int32.")
        first = self.modules[0] if self.modules else "(none)"
        require_bits4(self.bits, first, self.path)
        self._checked = True

    def _module_cfg(self, name: str) -> tuple[QuantParams, bool, str | None, list[str]]:
        """One module's parameters, its desc_act, the override that set its bits (None: the config's),
        and notes on how they were decided."""
        eff, desc_act, override = self.params, self.desc_act, None
        notes = []
        if self.in_block and not any(m in name for m in self.in_block):
            notes.append("not in modules_in_block_to_quantize, but its qweight is present")
        for key, rule in self.dynamic.items():
            negative = key.startswith("-:")
            pattern = key[2:] if key.startswith(("-:", "+:")) else key
            try:
                hit = re.match(pattern, name) is not None
            except re.error as e:
                raise InputError(f"quantization_config dynamic key {key!r} is not a valid regex ({e})",
                                 path=self.path, hint="Fix the regex in the dynamic section.") from None
            if not hit:
                continue
            if negative:
                notes.append(f"dynamic rule {key!r} says not quantised, but its qweight is present")
            elif isinstance(rule, dict):
                eff = eff.overridden(rule)
                desc_act = cfg_bool(rule, "desc_act", desc_act)
                if any(k in rule for k in ("bits", "w_bit")):
                    override = f"the dynamic rule {key!r}"
                notes.append(f"dynamic rule {key!r} applies")
            break  # first match wins
        return eff, desc_act, override, notes

    # -- per module ------------------------------------------------------------------------
    def _spec(self, name: str) -> LinearSpec:
        ck = self.ckpt
        qweight = need(ck, name, "qweight", f"{self.name} tensors")
        eff, desc_act, override, notes = self._module_cfg(name)
        if eff.bits not in WIDE_BITS:
            return self._refused_spec(name, qweight, eff, override, notes)
        qzeros = need(ck, name, "qzeros", "a qweight")
        scales = need(ck, name, "scales", "a qweight")
        check_dtype(ck, qweight, ("I32",), "qweight (pack_dtype int32)")
        check_dtype(ck, qzeros, ("I32",), "qzeros (pack_dtype int32)")
        check_dtype(ck, scales, _SCALE_DTYPES, "scales")
        qshape = ck.tensors[qweight].shape
        if len(qshape) != 2:
            raise InputError(f"{qweight}: expected 2 dims [K*bits/32, N], got {list(qshape)}", tensor=qweight,
                             hint="3-D or fused GPTQ tensors are not a layout int4pack reads.")
        per_word = 32 // eff.bits
        k, n = qshape[0] * per_word, qshape[1]
        group = eff.group_along(k)
        groups = -(-k // group)
        check_shape(ck, scales, (groups, n), f"[ceil(K/group_size), N] for K={k}, N={n}, group_size={group}"
                    + (f" ({eff.bits}-bit: K = {per_word} x qweight rows)" if eff.bits != 4 else ""))
        check_shape(ck, qzeros, (groups, -(-n // per_word)), f"[G, N*bits/32] for G={groups}, N={n}")
        keys = [qweight, qzeros, scales]
        act_order = False
        g_name = f"{name}.g_idx"
        if g_name in ck.tensors:
            act_order = nontrivial_g_idx(ck, g_name, k, groups, group) is not None
            keys.append(g_name)
        elif desc_act:
            notes.append("desc_act is set but there is no g_idx; groups taken as contiguous")
        b_name = f"{name}.bias"
        has_bias = b_name in ck.tensors
        if has_bias:
            check_shape(ck, b_name, (n,), f"out_features N={n}")
            keys.append(b_name)
        if eff.bits != 4:
            notes.append(f"{eff.bits}-bit" + (f" by {override}" if override else "") + ": read as its float values")
        return LinearSpec(name=name, fmt=self.fmt, n=n, k=k, bits=eff.bits, group_size=group, sym=eff.sym,
                          act_order=act_order, keys=tuple(keys), scale_dtype=ck.tensors[scales].dtype,
                          has_bias=has_bias, notes=notes)

    def _refused_spec(self, name: str, qweight: str, eff: QuantParams, override: str | None,
                      notes: list[str]) -> LinearSpec:
        """A module the config gives a width int4pack does not read: listed (so its tensors are
        accounted) but refused."""
        ck = self.ckpt
        keys = tuple(f"{name}.{s}" for s in ("qweight", "qzeros", "scales", "g_idx", "bias")
                     if f"{name}.{s}" in ck.tensors)
        rows, n = ck.tensors[qweight].shape[:2]
        k = rows * 32 // eff.bits if eff.bits else 0
        group = eff.group_along(max(k, 1))
        why = (f"bits={eff.bits}" + (f" by {override}" if override else "")
               + "; int4pack reads 4-bit modules (and 8-bit ones beside them)")
        scale_dtype = ck.tensors.get(f"{name}.scales", ck.tensors[qweight]).dtype
        return LinearSpec(name=name, fmt=self.fmt, n=n, k=k, bits=eff.bits or 0, group_size=group, sym=eff.sym,
                          act_order=False, keys=keys, scale_dtype=scale_dtype,
                          has_bias=f"{name}.bias" in ck.tensors, refused=why, notes=notes)

    # -- v1 / v2 ---------------------------------------------------------------------------
    def _sample(self, specs: dict[str, LinearSpec]) -> list[LinearSpec]:
        ok = [s for s in specs.values() if not s.refused and s.bits == 4]
        if len(ok) <= _SAMPLE:
            return ok
        step = (len(ok) - 1) / (_SAMPLE - 1)
        return [ok[round(i * step)] for i in range(_SAMPLE)]

    def _zero_words(self, spec: LinearSpec) -> np.ndarray:
        return self._words(f"{spec.name}.qzeros").ravel()

    def _words(self, name: str) -> np.ndarray:
        """An I32 tensor (checked by _spec) as numpy uint32 words."""
        return self.ckpt.array(name).view(np.uint32)

    def _mean_code_minus_stored_zero(self, sample: list[LinearSpec]) -> float:
        """mean(u - z) over the sample's weights, skipping those whose stored zero z is a v1 0xF
        (a borrowed zero point of 0: it would swamp the mean). Exact, in integers: per (group,
        column), the codes' sum minus the group's row count times z."""
        total, count = 0, 0
        for s in sample:
            words = self._words(f"{s.name}.qweight")  # [K/8, N]
            zs = nibble_cols(self._words(f"{s.name}.qzeros"))[:, : s.n].astype(np.int64)  # [G, N]
            g_idx = self._group_index(s)
            rows = np.bincount(g_idx, minlength=zs.shape[0])[:, None]  # [G, 1] weights per group
            sums = _group_code_sums(words, g_idx if s.act_order else None, zs.shape[0], s.group_size)  # [G, N]
            keep = zs != 0xF
            total += int((sums - rows * zs)[keep].sum())
            count += int((rows * keep).sum())
        return total / max(count, 1)

    def _group_index(self, spec: LinearSpec) -> np.ndarray:
        g_name = f"{spec.name}.g_idx"
        if g_name in self.ckpt.tensors:  # in range: _spec checked it (nontrivial_g_idx)
            return self.ckpt.array(g_name).astype(np.int64)
        return np.arange(spec.k) // spec.group_size

    def _detect(self, specs: dict[str, LinearSpec]) -> FormatVerdict:
        label = self._label()
        label_conv = _LABELS.get(label or "gptq", "v1")
        sample = self._sample(specs)
        evidence = [f"checkpoint_format label: {label!r} (means {label_conv})",
                    f"sampled {len(sample)} of {len(specs)} quantised module(s)"]
        warnings: list[str] = []
        if not sample:
            evidence.append("no 4-bit module to inspect; following the label")
            return self._make_verdict(label_conv, label, evidence, warnings)
        words = np.unique(np.concatenate([self._zero_words(s) for s in sample])).tolist()
        if words == [V1_SYM_WORD]:
            conv = "v1"
            evidence.append("every sampled qzeros word is 0x77777777: symmetric, v1 (stored zero 7 = 8 - 1)")
        elif words == [V2_SYM_WORD]:
            conv = "v2"
            evidence.append("every sampled qzeros word is 0x88888888: symmetric, v2 (stored zero 8)")
        else:
            conv = self._judge_asym(sample, evidence, warnings)
        if conv != label_conv:
            warnings.append(f"label {label!r} means {label_conv} zero points but the data says {conv}; "
                            f"following the data")
        return self._make_verdict(conv, label, evidence, warnings)

    def _judge_asym(self, sample: list[LinearSpec], evidence: list[str], warnings: list[str]) -> str:
        if self.sym:
            warnings.append("config says sym=true but the zero points vary; decoding them as stored")
        d = self._mean_code_minus_stored_zero(sample)
        evidence.append(f"mean(code - stored zero) = {d:.3f} over the sample, 0xF zeros skipped "
                        f"(~1 means v1, ~0 means v2)")
        if _SANE[0] <= d < _V2_BELOW:
            return "v2"
        if _V1_ABOVE < d <= _SANE[1]:
            conv = "v1"
            nib = np.concatenate([nibble_cols(self._words(f"{s.name}.qzeros")).ravel() for s in sample])
            if bool((nib == 0xF).any()):
                warnings.append("asymmetric v1 file stores a 0xF zero nibble (a zero point of 0 borrowed "
                                "from its neighbour); decoded by adding 0x11111111 to whole words")
            return conv
        raise RefusedError(
            f"cannot tell GPTQ v1 from v2 zero points: mean(code - stored zero) = {d:.3f} "
            f"(v1 gives ~1, v2 ~0)", path=self.path,
            hint="The zero points match neither convention; check the checkpoint was exported by "
                 "AutoGPTQ/GPTQModel/optimum and not modified.")

    def _make_verdict(self, conv: str, label: str | None, evidence: list[str],
                      warnings: list[str]) -> FormatVerdict:
        return FormatVerdict(format=self.name, detail=f"gptq {conv} zero points", evidence=evidence,
                             warnings=warnings, extra={"zero_convention": conv, "label": label})

    # -- interface -------------------------------------------------------------------------
    def linears(self) -> dict[str, LinearSpec]:
        self._check_config()
        if self._specs is None:
            self._specs = {m: self._spec(m) for m in self.modules}
        return self._specs

    def verdict(self) -> FormatVerdict:
        if self._verdict is None:
            self._verdict = self._detect(self.linears())
        return self._verdict

    def in_place(self, spec: LinearSpec) -> tuple | None:
        """Where a module's data lies, for convert's lossless batch (batch.py), which reads it in place:
        (layout, words, scales, scales stored [G, N], zeros, the byte of a zero point of 8, g_idx),
        TensorInfos (zeros and g_idx may be None); None where ``read`` is the only way."""
        if spec.refused or spec.has_bias or spec.bits != 4 or spec.signed_scales:
            return None
        t = self.ckpt.tensors
        g = t.get(f"{spec.name}.g_idx")
        if g is not None and g.dtype not in ("I32", "I64"):
            return None
        return (Packing.GPTQ, t[f"{spec.name}.qweight"], t[f"{spec.name}.scales"], True, t[f"{spec.name}.qzeros"],
                0x77 if self.verdict().extra["zero_convention"] == "v1" else 0x88, g)

    def read(self, spec: LinearSpec, *, unpack: bool = True) -> QuantLinear:
        if spec.refused:
            raise RefusedError(f"{spec.name}: {spec.refused}", tensor=spec.name,
                               hint="Only 4-bit modules can be converted.")
        ck = self.ckpt
        conv = self.verdict().extra["zero_convention"]
        if spec.bits != 4:
            return self._read_wide(spec, conv)
        from .. import kernels  # torch's: imported when the work starts, not by the plan

        qweight = ck.view(f"{spec.name}.qweight")  # mapped; convert releases it after the job
        packed = None
        if unpack:
            codes = kernels.unpack_gptq(qweight)  # [N, K]
            ck.release(f"{spec.name}.qweight")
        else:
            codes, packed = None, (Packing.GPTQ, kernels.words(qweight))
        zeros = _zeros(spec, ck.read_bytes(f"{spec.name}.qzeros"), conv)
        scales = read_transposed(ck, f"{spec.name}.scales")
        g_idx = None
        if f"{spec.name}.g_idx" in ck.tensors:
            g_idx = g_idx_unless_trivial(ck, f"{spec.name}.g_idx", spec.k, spec.groups, spec.group_size)
        bias = ck.get(f"{spec.name}.bias") if spec.has_bias else None
        return QuantLinear(spec, codes, scales, zeros, g_idx, bias, packed)

    def _read_wide(self, spec: LinearSpec, conv: str) -> QuantLinear:
        """An 8-bit module: its float weights (QuantLinear.dense), for convert to requantise or keep in bf16."""
        ck = self.ckpt
        u = byte_rows(self._words(f"{spec.name}.qweight"))  # [K, N]
        zw = self._words(f"{spec.name}.qzeros")
        if conv == "v1":  # zero - 1 per byte, converted back on whole words as for int4
            zw = zw + np.uint32(V1_OFFSET_8)
        z = byte_cols(zw)[:, : spec.n]  # [G, N]
        g_idx = self._group_index(spec) if f"{spec.name}.g_idx" in ck.tensors else np.arange(spec.k) // spec.group_size
        scales = read_transposed(ck, f"{spec.name}.scales")  # [N, G]
        w = dequantize_rows(u.T, z.T, scales, g_idx)
        bias = ck.get(f"{spec.name}.bias") if spec.has_bias else None
        return QuantLinear(spec, None, scales, None, None, bias, dense=w)


FORMAT = Format(
    "gptq", claims, GPTQReader,
    reads="quant_method gptq (v1 and v2 zero points, told apart by the data)",
    lossless="symmetric, no act-order, group 32/64/128 or channel",
    requant="asymmetric, act-order (g_idx), other groups; 8-bit modules beside 4-bit ones",
    float_siblings=True)
