"""compressed-tensors reader (formats.md §3): pack-quantized and int-quantized int4 weights.

The config is parsed as plain JSON (the ct library rejects some real configs). A module is
quantised iff its tensors exist; the config only supplies bits, symmetry, strategy and group.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from .._lazy import torch
from ..sources.checkpoint import Checkpoint
from ..errors import InputError, RefusedError
from ..records import FormatVerdict, LinearSpec, Packing, QuantLinear
from ..nibbles import unpack_rows
from ._api import Format, Header, quant_method
from ._common import WIDE_BITS, byte_cols, byte_rows, check_dtype, check_shape, dequantize_rows, \
    g_idx_unless_trivial, nontrivial_g_idx, owned, prefixes_with, quant_params

__all__ = ["CompressedTensorsReader", "Scheme", "FORMAT", "claims"]

_PACK = "pack-quantized"
_INT = ("int-quantized", "naive-quantized")
_REFUSED_FORMATS = {
    "marlin-24": "the legacy 2:4-sparse Marlin layout (removed in compressed-tensors 0.15)",
    "float-quantized": "float (fp8) weights",
    "nvfp4-pack-quantized": "NVFP4 weights",
    "mxfp4-pack-quantized": "MXFP4 weights",
    "sparse-24-bitmask": "2:4 sparse bitmask weights",
    "sparse-bitmask": "sparse bitmask weights",
}
_STRATEGIES = ("group", "channel", "tensor")
_SCALE_DTYPES = ("F16", "BF16", "F32")
_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape")
_ACT_PARAMS = ("input_scale", "input_zero_point", "input_g_idx", "output_scale", "output_zero_point")


@dataclass
class Scheme:
    """One config group, reduced to what a reader needs."""

    name: str
    targets: list[str]
    format: str
    bits: int | None
    type: str
    symmetric: bool
    strategy: str
    group_size: int | None
    problem: str | None  # why modules of this group cannot be converted

    def match_rank(self, module: str) -> int | None:
        """Best precedence among this group's targets: 0 exact name, 1 regex, 2 class; None if none match."""
        ranks = [r for r in (_target_rank(t, module) for t in self.targets) if r is not None]
        return min(ranks) if ranks else None


def _target_rank(target: str, module: str) -> int | None:
    if target.startswith("re:"):
        return 1 if re.match(target[3:], module) is not None else None
    if "." not in target and target[:1].isupper():  # a class name; only Linear is knowable here
        return 2 if target == "Linear" else None
    return 0 if target == module else None


def _target_matches(target: str, module: str) -> bool:
    return _target_rank(target, module) is not None


def _scheme(name: str, group: dict, top_format: str | None) -> Scheme:
    w = group.get("weights") or {}
    if not isinstance(w, dict):
        raise InputError(f"quantization_config config group {name!r}: weights is a {type(w).__name__}, "
                         "not an object", hint="Fix the config: weights holds num_bits, strategy, group_size.")
    fmt = str(group.get("format") or top_format or "")
    try:
        p = quant_params(w, bits=None, group_size=None)
    except InputError as e:
        raise InputError(f"quantization_config config group {name!r}: {str(e).removeprefix('quantization_config ')}",
                         hint=e.hint) from None
    strategy = str(w.get("strategy") or ("group" if p.group_size and p.group_size > 0 else "channel"))
    s = Scheme(name=name, targets=[str(t) for t in (group.get("targets") or [])], format=fmt,
               bits=p.bits, type=str(w.get("type", "int")), symmetric=p.sym,
               strategy=strategy, group_size=p.group_size, problem=None)
    s.problem = _scheme_problem(s, w)
    return s


def _scheme_problem(s: Scheme, w: dict) -> str | None:
    if not w:
        return f"config group {s.name!r} has no weight quantisation"
    if s.format in _REFUSED_FORMATS:
        return f"format {s.format!r} is {_REFUSED_FORMATS[s.format]}"
    if s.format != _PACK and s.format not in _INT:
        return f"format {s.format!r} is not an int4 layout int4pack reads"
    if s.type != "int":
        return f"weights type {s.type!r} (int4pack converts int weights only)"
    if s.bits not in WIDE_BITS:
        return f"num_bits={s.bits}; int4pack reads 4-bit modules (and 8-bit ones beside them)"
    if s.strategy not in _STRATEGIES:
        return f"strategy {s.strategy!r} is not supported (group, channel or tensor only)"
    if w.get("dynamic"):
        return "dynamic weight quantisation has no stored scales"
    if s.strategy == "group" and not (s.group_size and s.group_size > 0):
        return f"strategy group without a positive group_size ({s.group_size!r})"
    return None


_NUMPY_INTS = {"I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1"}


def _small_ints(ck: Checkpoint, name: str) -> list:
    """A small integer tensor (weight_shape) as nested lists, in its stored shape: its bytes through numpy
    (a torch tensor per module was a third of a compressed-tensors plan); other dtypes through ``get``."""
    t = ck.info(name)
    dt = _NUMPY_INTS.get(t.dtype)
    if dt is None:
        return ck.get(name).tolist()
    return np.frombuffer(ck.read_bytes(name), dtype=dt).reshape(t.shape).tolist()


def claims(q: dict | None, header: Header) -> bool:
    return q is not None and (quant_method(q) in ("compressed-tensors", "compressed_tensors") or "config_groups" in q)


class CompressedTensorsReader:
    name = "compressed-tensors"

    def __init__(self, ckpt: Checkpoint, qcfg: dict, path: str | None = None):
        self.ckpt = ckpt
        self.cfg = qcfg
        self.path = path or str(ckpt.folder / "config.json")
        self.top_format = qcfg.get("format")
        self.version = str(qcfg.get("version") or "unknown")
        groups = qcfg.get("config_groups") or {}
        if not isinstance(groups, dict):
            raise InputError("quantization_config config_groups is not an object", path=self.path,
                             hint="Fix the config: config_groups maps names to schemes.")
        top = None if self.top_format == "mixed-precision" else self.top_format
        self.schemes = [_scheme(str(n), g, top) for n, g in groups.items() if isinstance(g, dict)]
        self.ignore = [str(i) for i in (qcfg.get("ignore") or [])]
        self._specs: dict[str, LinearSpec] | None = None

    # -- checks ----------------------------------------------------------------------------
    def _check_config(self) -> None:
        if self.top_format in _REFUSED_FORMATS:
            raise RefusedError(f"compressed-tensors format {self.top_format!r} is {_REFUSED_FORMATS[self.top_format]}",
                               path=self.path, hint="int4pack reads pack-quantized or int-quantized int4 weights.")
        if not self.schemes:
            raise InputError("compressed-tensors config has no config_groups", path=self.path,
                             hint="The config is incomplete; re-export the checkpoint.")
        if all(s.problem for s in self.schemes):
            s = self.schemes[0]
            raise RefusedError(f"compressed-tensors config group {s.name!r}: {s.problem}", path=self.path,
                               hint="int4pack converts int4 (pack-quantized / int-quantized) weights only.")
        if not any(s.bits == 4 for s in self.schemes if not s.problem):
            s = next(s for s in self.schemes if not s.problem)
            raise RefusedError(f"compressed-tensors config group {s.name!r}: num_bits={s.bits} and no config group "
                               "is 4-bit; int4pack converts 4-bit checkpoints only", path=self.path,
                               hint="int4pack converts int4 (pack-quantized / int-quantized) weights only; 8-bit "
                                    "modules are read where they sit beside 4-bit ones.")
        sparsity = self.cfg.get("sparsity_config") or {}
        if isinstance(sparsity, dict) and sparsity.get("format") not in (None, "dense"):
            raise RefusedError(f"compressed-tensors sparsity_config format {sparsity.get('format')!r}",
                               path=self.path, hint="Sparse checkpoints are not supported; use a dense int4 one.")
        transform = self.cfg.get("transform_config") or {}
        if isinstance(transform, dict) and transform.get("config_groups"):
            raise RefusedError("compressed-tensors transform_config is set: the weights live in a rotated basis "
                               "that needs online transforms", path=self.path,
                               hint="Export the model without transforms (SpinQuant/QuIP) to convert it.")
        self._check_3d()

    def _check_3d(self) -> None:
        """Fused [E, N, K] expert tensors (llm-compressor repack_moe) are refused by name."""
        ts = self.ckpt.tensors
        bad = []
        for name, t in ts.items():
            stem = re.sub(r"(_packed|_scale|_zero_point|_g_idx|_shape)$", "", name)
            if stem == name:
                continue
            base = [ts.get(stem), ts.get(stem + "_packed"), t]
            if any(b is not None and len(b.shape) >= 3 for b in base):
                bad.append(name)
        if bad:
            raise RefusedError(f"3-D (fused MoE expert) compressed-tensors tensors are not supported: "
                               f"{', '.join(sorted(bad)[:4])}" + (f" (+{len(bad) - 4} more)" if len(bad) > 4 else ""),
                               tensor=sorted(bad)[0],
                               hint="Save the experts per module (one weight_packed per expert linear).")

    # -- matching ---------------------------------------------------------------------------
    def _modules(self) -> list[str]:
        ts = self.ckpt.tensors
        mods = set(prefixes_with(self.ckpt, ".weight_packed")) | set(prefixes_with(self.ckpt, ".weight_scale"))
        return sorted(m for m in mods if f"{m}.weight_packed" in ts or f"{m}.weight" in ts
                      or f"{m}.weight_scale" in ts)

    def _scheme_for(self, module: str) -> tuple[Scheme, list[str]]:
        notes = []
        if any(_target_matches(i, module) for i in self.ignore):
            notes.append("listed in ignore, but its quantised tensors are present")
        ranked = sorted((r, i) for i, s in enumerate(self.schemes) if (r := s.match_rank(module)) is not None)
        if ranked:
            # exact name beats regex beats class; among equals, a group whose format fits the tensors
            best = [self.schemes[i] for r, i in ranked if r == ranked[0][0]]
            fits = [s for s in best if (s.format == _PACK) == (f"{module}.weight_packed" in self.ckpt.tensors)]
            return (fits or best)[0], notes
        if len(self.schemes) == 1:
            notes.append(f"no target of config group {self.schemes[0].name!r} names it; using that only group")
            return self.schemes[0], notes
        raise InputError(f"{module}: has quantised tensors but matches no config group's targets",
                         tensor=module, path=self.path,
                         hint="The config's targets do not describe this module; fix config_groups.")

    # -- per module ------------------------------------------------------------------------------
    def _spec(self, module: str) -> LinearSpec:
        ck = self.ckpt
        scheme, notes = self._scheme_for(module)
        packed = f"{module}.weight_packed" in ck.tensors
        if scheme.problem:
            keys = tuple(f"{module}.{s}" for s in _SUFFIXES + ("weight", "bias") + _ACT_PARAMS
                         if f"{module}.{s}" in ck.tensors)
            n, k = self._nk_loose(module)
            return LinearSpec(name=module, fmt="ct-pack" if packed else "ct-int", n=n, k=k, bits=scheme.bits or 0,
                              group_size=max(k, 1), sym=scheme.symmetric, act_order=False, keys=keys,
                              scale_dtype=self._dtype(f"{module}.weight_scale"),
                              has_bias=f"{module}.bias" in ck.tensors,
                              refused=f"config group {scheme.name!r}: {scheme.problem}", notes=notes)
        if packed:
            n, k, keys = self._pack_tensors(module, notes, scheme.bits)
        else:
            n, k, keys = self._int_tensors(module)
        return self._finish(module, scheme, n, k, keys, notes, "ct-pack" if packed else "ct-int")

    def _dtype(self, name: str) -> str:
        t = self.ckpt.tensors.get(name)
        return t.dtype if t is not None else "BF16"

    def _nk_loose(self, module: str) -> tuple[int, int]:
        ts = self.ckpt.tensors
        if f"{module}.weight_shape" in ts:
            n, k = (int(x) for x in self.ckpt.get(f"{module}.weight_shape").tolist()[:2])
            return n, k
        for key in ("weight_packed", "weight"):
            t = ts.get(f"{module}.{key}")
            if t is not None and len(t.shape) == 2:
                return t.shape[0], t.shape[1] * (8 if key == "weight_packed" else 1)
        return 0, 0

    def _pack_tensors(self, module: str, notes: list[str], bits: int = 4) -> tuple[int, int, list[str]]:
        ck = self.ckpt
        wp = f"{module}.weight_packed"
        per_word = 32 // bits
        check_dtype(ck, wp, ("I32",), "weight_packed")
        pshape = ck.tensors[wp].shape
        if len(pshape) != 2:
            raise InputError(f"{wp}: expected 2 dims [N, ceil(K/{per_word})], got {list(pshape)}", tensor=wp)
        keys = [wp]
        ws = f"{module}.weight_shape"
        if ws in ck.tensors:
            shape = _small_ints(ck, ws)
            if len(shape) != 2:
                raise InputError(f"{ws}: expected [N, K], got {shape}", tensor=ws)
            n, k = int(shape[0]), int(shape[1])
            check_shape(ck, wp, (n, -(-k // per_word)), f"weight_shape {[n, k]} packed {per_word} per int32")
            keys.append(ws)
        else:
            n, k = pshape[0], pshape[1] * per_word
            notes.append(f"no weight_shape; K taken as {per_word} x packed columns")
        return n, k, keys

    def _int_tensors(self, module: str) -> tuple[int, int, list[str]]:
        ck = self.ckpt
        w = f"{module}.weight"
        if w not in ck.tensors:
            raise InputError(f"{module}: has weight_scale but neither weight_packed nor weight",
                             tensor=f"{module}.weight_scale",
                             hint="The checkpoint is incomplete; re-download or re-export it.")
        dt = ck.tensors[w].dtype
        if dt in _SCALE_DTYPES:
            raise RefusedError(f"{w}: float weight with a weight_scale: the checkpoint is not compressed "
                               f"(quantization_status {self.cfg.get('quantization_status')!r})", tensor=w,
                               hint="Save it compressed (save_compressed=True) first.")
        check_dtype(ck, w, ("I8",), "int-quantized weight")
        shape = ck.tensors[w].shape
        if len(shape) != 2:
            raise InputError(f"{w}: expected 2 dims [N, K], got {list(shape)}", tensor=w)
        return shape[0], shape[1], [w]

    def _finish(self, module: str, scheme: Scheme, n: int, k: int, keys: list[str], notes: list[str],
                fmt: str) -> LinearSpec:
        ck = self.ckpt
        sc = f"{module}.weight_scale"
        if sc not in ck.tensors:
            raise InputError(f"{module}: has {keys[0].rsplit('.', 1)[1]} but no weight_scale", tensor=sc,
                             hint="The checkpoint is incomplete; re-download or re-export it.")
        check_dtype(ck, sc, _SCALE_DTYPES, "weight_scale")
        group = scheme.group_size if scheme.strategy == "group" else k
        groups = -(-k // group) if k else 1
        if scheme.strategy == "tensor":
            if ck.tensors[sc].numel != 1:
                check_shape(ck, sc, (1,), "a tensor-strategy scale")
        else:
            check_shape(ck, sc, (n, groups), f"[N, ceil(K/group)] for N={n}, K={k}, group={group}")
        keys.append(sc)
        zp = f"{module}.weight_zero_point"
        if zp in ck.tensors:
            self._check_zp(zp, n, groups, scheme)
            keys.append(zp)
        elif not scheme.symmetric:
            raise InputError(f"{module}: config group {scheme.name!r} is asymmetric but there is no "
                             f"weight_zero_point", tensor=zp, hint="The checkpoint is incomplete; re-export it.")
        act_order = False
        gi = f"{module}.weight_g_idx"
        if gi in ck.tensors:
            act_order = nontrivial_g_idx(ck, gi, k, groups, group) is not None
            keys.append(gi)
        b = f"{module}.bias"
        has_bias = b in ck.tensors
        if has_bias:
            check_shape(ck, b, (n,), f"out_features N={n}")
            keys.append(b)
        acts = [f"{module}.{a}" for a in _ACT_PARAMS if f"{module}.{a}" in ck.tensors]
        if acts:
            keys.extend(acts)
            notes.append("static activation qparams dropped (the target quantises activations per token)")
        sym = scheme.symmetric and zp not in ck.tensors
        if scheme.bits != 4:
            notes.append(f"{scheme.bits}-bit (config group {scheme.name!r}): read as its float values")
        return LinearSpec(name=module, fmt=fmt, n=n, k=k, bits=scheme.bits, group_size=group, sym=sym,
                          act_order=act_order,
                          keys=tuple(keys), scale_dtype=ck.tensors[sc].dtype, has_bias=has_bias, notes=notes)

    def _check_zp(self, zp: str, n: int, groups: int, scheme: Scheme) -> None:
        t = self.ckpt.tensors[zp]
        if scheme.strategy == "tensor":
            if t.numel != 1:
                check_shape(self.ckpt, zp, (1,), "a tensor-strategy zero point")
            check_dtype(self.ckpt, zp, ("I8", "I32"), "weight_zero_point")
        elif t.dtype == "I32":  # >= 0.9.4: packed along N
            per_word = 32 // scheme.bits
            check_shape(self.ckpt, zp, (-(-n // per_word), groups),
                        f"packed [ceil(N/{per_word}), G] for N={n}, G={groups}")
        else:  # older: unpacked signed int8
            check_dtype(self.ckpt, zp, ("I8",), "weight_zero_point (packed int32 or unpacked int8)")
            check_shape(self.ckpt, zp, (n, groups), f"unpacked [N, G] for N={n}, G={groups}")

    # -- interface ---------------------------------------------------------------------------------
    def linears(self) -> dict[str, LinearSpec]:
        self._check_config()
        if self._specs is None:
            self._specs = {m: self._spec(m) for m in self._modules()}
        return self._specs

    def verdict(self) -> FormatVerdict:
        self._check_config()
        formats = sorted({s.format for s in self.schemes if not s.problem})
        detail = f"{'/'.join(formats)} (compressed-tensors {self.version})"
        evidence = [f"top-level format {self.top_format!r}, version {self.version}"]
        warnings = []
        for s in self.schemes:
            desc = (f"group {s.name!r}: {s.format}, {s.type}{s.bits}, "
                    f"{'sym' if s.symmetric else 'asym'}, {s.strategy}"
                    + (f" {s.group_size}" if s.strategy == "group" else "") + f", targets {', '.join(map(str, s.targets))}")
            evidence.append(desc)
            if s.problem:
                warnings.append(f"group {s.name!r} cannot be converted: {s.problem}")
        return FormatVerdict(format="compressed-tensors", detail=detail, evidence=evidence, warnings=warnings,
                             extra={"ct_version": self.version, "ct_format": "/".join(formats)})

    def in_place(self, spec: LinearSpec) -> tuple | None:
        """Where a pack-quantized module's data lies, for convert's lossless batch (batch.py), which
        reads it in place (see GPTQReader.in_place); None where ``read`` is the only way."""
        t = self.ckpt.tensors
        if spec.refused or spec.has_bias or spec.fmt != "ct-pack" or spec.bits != 4:
            return None
        sc, g = t[f"{spec.name}.weight_scale"], t.get(f"{spec.name}.weight_g_idx")
        z = t.get(f"{spec.name}.weight_zero_point")
        if tuple(sc.shape) != (spec.n, spec.groups) or (g is not None and g.dtype not in ("I32", "I64")) or \
                (z is not None and (z.dtype != "I32" or len(z.shape) != 2)):  # int8 zero points: read()
            return None
        return (Packing.CT, t[f"{spec.name}.weight_packed"], sc, False, z, 0x88, g)

    def read(self, spec: LinearSpec, *, unpack: bool = True) -> QuantLinear:
        if spec.refused:
            raise RefusedError(f"{spec.name}: {spec.refused}", tensor=spec.name,
                               hint="Only int4 weights can be converted.")
        if spec.bits != 4:
            return self._read_wide(spec)
        from .. import kernels  # torch's: imported when the work starts, not by the plan

        ck = self.ckpt
        packed = None
        if spec.fmt == "ct-pack" and not unpack:
            codes, packed = None, (Packing.CT, kernels.words(ck.view(f"{spec.name}.weight_packed")))  # mapped
        elif spec.fmt == "ct-pack":
            codes = kernels.unpack_ct(ck.view(f"{spec.name}.weight_packed"), spec.k)
            ck.release(f"{spec.name}.weight_packed")
        else:
            codes = self._int_codes(f"{spec.name}.weight")
        scales = ck.get(f"{spec.name}.weight_scale")  # [N, G], already in memory of its own
        if scales.numel() == 1:  # tensor strategy: one scale, broadcast as a channel scale
            scales = owned(scales.reshape(1, 1).expand(spec.n, 1))
        zeros = self._zeros(spec, scales.shape[1])
        g_idx = None
        if f"{spec.name}.weight_g_idx" in ck.tensors:
            g_idx = g_idx_unless_trivial(ck, f"{spec.name}.weight_g_idx", spec.k, spec.groups, spec.group_size)
        bias = ck.get(f"{spec.name}.bias") if spec.has_bias else None
        return QuantLinear(spec, codes, scales, zeros, g_idx, bias, packed)

    def _read_wide(self, spec: LinearSpec) -> QuantLinear:
        """An 8-bit module: its float weights (QuantLinear.dense). Stored values are signed (pack-quantized
        keeps value + 128 in each byte, compressed-tensors' pack_to_int32), and so are its zero points."""
        ck = self.ckpt
        if spec.fmt == "ct-pack":
            q = byte_cols(ck.array(f"{spec.name}.weight_packed").view(np.uint32))[:, : spec.k].astype(np.int16) - 128
        else:
            q = ck.array(f"{spec.name}.weight").astype(np.int16)
        scales = ck.get(f"{spec.name}.weight_scale")
        if scales.numel() == 1:
            scales = owned(scales.reshape(1, 1).expand(spec.n, 1))
        zp: np.ndarray | int = 0
        name = f"{spec.name}.weight_zero_point"
        if name in ck.tensors:
            t = ck.array(name)
            if t.dtype == np.int32 and t.ndim == 2:  # packed along N, value + 128 a byte
                zp = byte_rows(t.view(np.uint32))[: spec.n].astype(np.int16) - 128
            else:
                zp = t.astype(np.int16).reshape(-1, t.shape[-1] if t.ndim == 2 else 1)
                if zp.shape[0] == 1:
                    zp = np.broadcast_to(zp, (spec.n, zp.shape[1]))
        g_idx = np.arange(spec.k) // spec.group_size
        if f"{spec.name}.weight_g_idx" in ck.tensors:
            g = nontrivial_g_idx(ck, f"{spec.name}.weight_g_idx", spec.k, spec.groups, spec.group_size)
            g_idx = g if g is not None else g_idx
        if scales.shape[1] == 1:
            g_idx = np.zeros(spec.k, dtype=np.int64)
        w = dequantize_rows(q, zp, scales, g_idx)
        bias = ck.get(f"{spec.name}.bias") if spec.has_bias else None
        return QuantLinear(spec, None, scales, None, None, bias, dense=w)

    def _int_codes(self, name: str) -> torch.Tensor:
        q = self.ckpt.get(name).to(torch.int16)
        if q.numel() and (int(q.min()) < -8 or int(q.max()) > 7):
            raise InputError(f"{name}: int-quantized values span [{int(q.min())}, {int(q.max())}], "
                             f"outside int4 [-8, 7]", tensor=name,
                             hint="The weights are not int4 although the config says num_bits 4.")
        return (q + 8).to(torch.uint8)

    def _zeros(self, spec: LinearSpec, groups: int) -> torch.Tensor | None:
        name = f"{spec.name}.weight_zero_point"
        if name not in self.ckpt.tensors:
            return None
        t = self.ckpt.get(name)
        if t.dtype == torch.int32 and t.dim() == 2:
            z = unpack_rows(t)[: spec.n]  # stored nibble = zp + 8, already the canonical zero
        else:
            zp = t.to(torch.int16).reshape(-1, t.shape[-1] if t.dim() == 2 else 1)
            if int(zp.min()) < -8 or int(zp.max()) > 7:
                raise InputError(f"{name}: zero points span [{int(zp.min())}, {int(zp.max())}], outside int4 "
                                 f"[-8, 7]", tensor=name, hint="The zero points are corrupt.")
            z = (zp + 8).to(torch.uint8)
            if z.shape[0] == 1:
                z = owned(z.expand(spec.n, groups))
        return None if bool((z == 8).all()) else z


FORMAT = Format(
    "compressed-tensors", claims, CompressedTensorsReader,
    reads="quant_method compressed-tensors (pack-quantized, int-quantized)",
    lossless="pack-quantized symmetric without g_idx at group 32/64/128 or channel; int-quantized W4A8 re-emitted",
    requant="asymmetric, g_idx, other groups; 8-bit modules beside 4-bit ones",
    float_siblings=True)
