"""The read-only view verify has of a converted W4A8 output: its scheme from the config, its
quantised modules (int8 weights and scales, KleidiAI blobs, or a model class's own per-expert
layout), each module's group, the MoE layers and routers, and each module's weights as stored.

The view reads; it judges nothing. What it could not make sense of it keeps as facts for the
checks (``moe_unusable``, ``targeted_by``: checkpoint_checks.py), and it shows each module's
weights, as it reads them, to its ``watch`` (module_checks.ModuleChecks): the structural checks
then run on the bytes the numerical pass computes on, without reading them again.
"""

from __future__ import annotations

import torch

from .. import blobs, kleidiai
from ..architectures import classify, moe_config, routers
from ..errors import InputError
from ..formats.compressed_tensors import CompressedTensorsReader
from ..groups import channel_group, scale_dtype, scales_per_row
from ..serve_spec import QUANT_METHOD, ROTARY, SUFFIX, read_record, tensor_parallel_size
from ..serving import expert_layout
from ..sources.checkpoint import Checkpoint
from ..w4a8 import dequantize_w4a8

__all__ = ["ReadWatch", "W4A8Output"]

_TORCH_SCALES = {"BF16": torch.bfloat16, "F32": torch.float32}


class ReadWatch:
    """What sees a ``W4A8Output``'s reads of module weights. This one sees nothing: a packed
    module is then decoded unchecked."""

    def values(self, m: str, q: torch.Tensor, s: torch.Tensor) -> None:
        """A plain module's int4 values and scales, as read."""

    def decode(self, m: str, into: tuple | None = None) -> tuple | None:
        """A packed module's blob read, checked and decoded (into ``into``, (q, scales) buffers, where
        it can), or None: the view then decodes it unchecked."""
        return None


class W4A8Output:
    """A converted checkpoint as verify reads it. Raises InputError where the config is not a
    W4A8 one at all (nothing to check); everything else is read as it is and checked elsewhere."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt
        q = ckpt.quant_config or {}
        self.config_groups = _config_groups(ckpt, q)
        self.quant_config = q
        self.ignore = list(q.get("ignore") or [])
        self.record = read_record(q)  # the packed format's layout record, or None
        self.packed = blobs.PackedWeights(ckpt, self.record) if self.record else None  # None: int8 weights and scales
        # a packed checkpoint keeps as int8 weights and scales the modules KleidiAI cannot pack
        # (the layout record's plain_modules): each module is read as it is stored
        self.blobs = set(self.packed.modules) if self.packed else set()
        self.modules = sorted(self.blobs | {n[: -len(".weight_scale")] for n in ckpt.tensors
                                            if n.endswith(".weight_scale")})
        # a model class's own per-expert layout (gpt-oss: expert_layout.py): read as int4pack's modules
        self.views = {} if self.packed else expert_layout.views(
            self.modules, {n: tuple(i.shape) for n, i in ckpt.tensors.items() if n.endswith(".weight")})
        self.stored = {v.stored for v in self.views.values()}
        if self.views:
            self.modules = sorted((set(self.modules) - self.stored) | set(self.views))
        self.targeted_by, self.groups = _module_groups(ckpt, q, self.modules)
        moe, self.moe_unusable = moe_config(ckpt.model_type, ckpt.family_type, ckpt.text_config)
        self.num_experts, self.top_k, self.routing = moe.num_experts, moe.top_k, moe.routing
        self.norm_offset, self.norm_topk, self.activation = moe.norm_offset, moe.renormalize, moe.activation
        self.layers: dict[str, dict[int, dict[str, str]]] = {}  # MoE layer -> expert -> role -> module
        self.roles: dict[str, str] = {}
        for m in self.modules:
            role, d = classify(m)
            self.roles[m] = role
            if role == "expert":
                self.layers.setdefault(d["moe"], {}).setdefault(d["e"], {})[d["proj"]] = m
        self.routers = routers(ckpt.tensors)
        self.watch = ReadWatch()

    # ----------------------------------------------------------------------- what a module is

    def is_blob(self, m: str) -> bool:
        """Whether module m is stored as a KleidiAI blob (else int8 weight and scales)."""
        return m in self.blobs

    def group_for(self, m: str) -> int:
        """Module m's group from its config group; a group equal to K is channelwise."""
        return channel_group(self.shape(m)[1], self.groups.get(m, -1))

    def moe_group(self, slot: dict[str, str]) -> int:
        """The one group vLLM's MoE kernel runs for an expert's w13 and w2 (channel only if both are)."""
        a, b = self.group_for(slot["gate"]), self.group_for(slot["down"])
        return a if a == b else self.groups.get(slot["gate"], -1)

    def shape(self, m: str) -> tuple[int, int]:
        if m in self.views:
            v = self.views[m]
            return v.hi - v.lo, self.ckpt.tensors[f"{v.stored}.weight"].shape[0]
        if self.is_blob(m):
            return self.packed.shape(m)
        info = self.ckpt.tensors.get(f"{m}.weight")
        if info is None:
            raise InputError(f"{m}.weight: missing (its weight_scale is there)", tensor=f"{m}.weight",
                             hint="The checkpoint lost a tensor; convert again.")
        return tuple(info.shape)

    def rotary_heads(self, m: str) -> int | None:
        """The heads whose rows module m's blob holds in vLLM's Llama-4 rotary order (its provenance's
        ``ROTARY``), or None: the source's rows compare to it in that order."""
        if not self.is_blob(m):
            return None
        return self.packed.prov.get(f"{m}.{SUFFIX}", {}).get(ROTARY)

    def stored_names(self, m: str) -> set[str]:
        """The output tensors module m's weight, scales and bias live in."""
        return self.views[m].names() if m in self.views else {f"{m}.{x}" for x in ("weight", "weight_scale", "bias")}

    def read_names(self, m: str) -> set[str]:
        """The output tensors the numerical pass reads for module m (its blob, or weight and scales)."""
        if self.is_blob(m):
            return {f"{m}.{SUFFIX}"}
        return self.views[m].names() if m in self.views else {f"{m}.weight", f"{m}.weight_scale"}

    def place(self, m: str) -> tuple[str, int]:
        """(shard, offset) of the first byte of module m the numerical pass reads."""
        tensors = self.ckpt.tensors
        return min(((tensors[n].file, tensors[n].begin) for n in self.read_names(m) if n in tensors),
                   default=("", 0))

    def weight_spec(self, m: str) -> tuple[int, int, torch.dtype, int] | None:
        """(N, K, scale dtype, scale columns) of module m's ``weight`` as ``weight_into`` writes it; None
        where it does not (a model's own per-expert layout, a blob split for tensor parallelism)."""
        if self.is_blob(m):
            if self.packed.split(m) != 1:
                return None
            n, k = self.packed.shape(m)
            g = self.packed.group(m)
            return n, k, getattr(torch, scale_dtype(g)), scales_per_row(k, g)
        if m in self.views:
            return None
        wi, si = self.ckpt.tensors.get(f"{m}.weight"), self.ckpt.tensors.get(f"{m}.weight_scale")
        if wi is None or si is None or wi.dtype != "I8" or len(wi.shape) != 2 or len(si.shape) != 2 \
                or si.dtype not in _TORCH_SCALES or si.shape[0] != wi.shape[0]:
            return None
        return wi.shape[0], wi.shape[1], _TORCH_SCALES[si.dtype], si.shape[1]

    # ----------------------------------------------------------------------- reads

    def prefetch(self, mods) -> None:
        """Start reading what the numerical pass will read of these modules (a hint; a ``Tapped``
        checkpoint takes it)."""
        hint = getattr(self.ckpt, "prefetch", None)
        if hint is not None:
            hint([n for m in mods for n in self.read_names(m)])

    def weight(self, m: str) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Module m's (int4 values int8 [N, K], scales, group)."""
        if self.is_blob(m):
            dec = self._watched_decode(m)
            # (copies: the decode lives in the thread's scratch, which the next module reuses)
            q, s = (dec[0].clone(), dec[1].clone()) if dec is not None else self.packed.decode(m, check=False)[:2]
        elif m in self.views:
            v = self.views[m]
            q, s = (v.rows(self.ckpt.get(f"{v.stored}.{x}")) for x in ("weight", "weight_scale"))
        else:
            q = self.ckpt.get(f"{m}.weight")
            s = self.ckpt.get(f"{m}.weight_scale")
            self.watch.values(m, q, s)
        return q, s, self.group_for(m)

    def weight_into(self, m: str, q: torch.Tensor, s: torch.Tensor, scratch: dict | None = None) -> None:
        """``weight(m)``'s int4 values and scales written into q and s (shaped as ``weight_spec`` says):
        read or decoded straight into them, copied where that cannot be. ``scratch``: a dict whose
        uint8 buffers (by size) a packed module's blob is read into."""
        dec = self._watched_decode(m, (q, s)) if self.is_blob(m) and scratch is not None else None
        if dec is not None:
            qq, ss = dec[0], dec[1]
        elif self.is_blob(m):
            blob = None
            if scratch is not None:
                info = self.ckpt.tensors[f"{m}.{SUFFIX}"]
                blob = scratch[info.nbytes] = self.ckpt.get(f"{m}.{SUFFIX}", out=scratch.get(info.nbytes))
            qq, ss, _ = self.packed.decode(m, blob, check=False, out=(q, s))  # checked in the structural pass
        else:
            qq, ss = self.ckpt.get(f"{m}.weight", out=q), self.ckpt.get(f"{m}.weight_scale", out=s)
            self.watch.values(m, qq, ss)
        for dst, src in ((q, qq), (s, ss)):
            if src.data_ptr() != dst.data_ptr():
                dst.copy_(src.reshape(dst.shape))

    def _watched_decode(self, m: str, into: tuple | None = None) -> tuple | None:
        """A one-rank blob's decode as the watch checks it on the way (None: not checked here)."""
        return self.watch.decode(m, into) if self.packed.split(m) == 1 else None

    def dequant(self, m: str) -> torch.Tensor:
        q, s, g = self.weight(m)
        return dequantize_w4a8(q, s, g)

    def bias(self, m: str) -> torch.Tensor | None:
        """Module m's bias as stored (plain output), or None."""
        v = self.views.get(m)
        name = f"{v.stored}.bias" if v else f"{m}.bias"
        if name not in self.ckpt.tensors:
            return None
        return v.rows(self.ckpt.get(name)) if v else self.ckpt.get(name)

    def blob(self, m: str) -> torch.Tensor | None:
        """Module m's blob as stored, where torch's KleidiAI path can run it; else None (pack on the fly).
        Not one with a bias inside: the references here leave biases out; none of a checkpoint split
        for tensor parallelism: its row parallel blobs are per rank (the kernel runs whole matrices)."""
        if not (self.is_blob(m) and kleidiai.native_kleidiai_available()) or tensor_parallel_size(self.record) != 1:
            return None
        return None if self.packed.prov.get(f"{m}.{SUFFIX}", {}).get("bias") else self.packed.blob(m)


def _config_groups(ckpt: Checkpoint, q: dict) -> dict:
    """The quantization_config's config groups; InputError where there is no W4A8 scheme to read."""
    groups = q.get("config_groups") or {}
    if q.get("quant_method") not in ("compressed-tensors", QUANT_METHOD) or not groups:
        raise InputError(f"{ckpt.folder}: not a compressed-tensors W4A8 checkpoint "
                         f"(quant_method {q.get('quant_method')!r})",
                         hint="verify checks int4pack's output: convert this checkpoint first "
                              "(int4pack convert SRC OUT), then run int4pack verify OUT --against SRC.")
    if not isinstance(groups, dict):
        raise InputError(f"{ckpt.folder}: quantization_config.config_groups is a {type(groups).__name__}, "
                         "not an object", hint="verify checks int4pack's output; the config was edited.")
    for gname, grp in groups.items():
        if not isinstance(grp, dict) or not all(isinstance(grp.get(f) or {}, dict)
                                                for f in ("weights", "input_activations")):
            raise InputError(f"{ckpt.folder}: quantization_config.config_groups.{gname} is not an object of "
                             "objects (weights, input_activations)", hint="The config was edited; convert again.")
    return groups


def _module_groups(ckpt: Checkpoint, q: dict, modules: list[str]) -> tuple[dict[str, tuple[str, ...]], dict[str, int]]:
    """({module: the config groups whose targets name it best, in precedence order}, {module: its
    group}): vLLM resolves one config group per module, the first; a module no group names has none."""
    schemes = CompressedTensorsReader(ckpt, q).schemes
    targeted_by, groups = {}, {}
    for m in modules:
        ranked = sorted((r, i) for i, sc in enumerate(schemes) if (r := sc.match_rank(m)) is not None)
        targeted_by[m] = tuple(schemes[i].name for r, i in ranked if r == ranked[0][0])
        if ranked:
            sc = schemes[ranked[0][1]]
            groups[m] = -1 if sc.strategy == "channel" else int(sc.group_size or -1)
    return targeted_by, groups
