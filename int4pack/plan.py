"""The validation pass and the per-module decision, made before any long work starts.

``make_plan`` reads headers and config only (plus the small tensors a reader needs to tell
v1 from v2 zeros or act-order from trivial g_idx), refuses what cannot be converted with
every reason at once, and returns jobs whose output tensors (names, dtypes, shapes) are all
known up front, so the writer can lay out shards before computing anything.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from .serving import expert_layout
from ._lazy import gc_paused
from ._version import __version__
from .architectures import Layout, discover, fused_shards
from .sources.checkpoint import ITEMSIZE, Checkpoint, TensorInfo
from .errors import RefusedError, UsageError
from .group_choice import Unit, choose_groups, predict_path, tied_units
from .groups import parse_group_size, scale_dtype, scale_st_dtype, scales_per_row, scheme_label
from .precision import DENSE_MODES, decide, tie_fused
from .precision import summary as precision_summary
from .records import FormatVerdict, LinearSpec

__all__ = ["OutTensor", "Job", "Plan", "make_plan", "parse_size", "parse_group_size", "DENSE_MODES"]


@dataclass(frozen=True, slots=True)  # slots: the plan holds a few per module for the whole run
class OutTensor:
    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    nbytes: int = field(init=False, repr=False, compare=False)  # asked for per tensor many times

    def __post_init__(self) -> None:
        n = ITEMSIZE[self.dtype]
        for s in self.shape:
            n *= s
        object.__setattr__(self, "nbytes", n)
        if type(self.shape) is tuple:  # one tuple per distinct shape: they repeat per expert
            object.__setattr__(self, "shape", _SHAPES.setdefault(self.shape, self.shape))


_SHAPES: dict[tuple, tuple] = {}


@dataclass(slots=True)
class Job:
    """One unit of work: copy a tensor, convert a linear, or convert an MLP triple (fold)."""

    kind: str  # "copy" | "linear" | "fold" | "dequant"
    outputs: list[OutTensor]
    specs: list[LinearSpec] = field(default_factory=list)  # linear: [spec]; fold: [gate, up, down]
    source: str | None = None  # copy: the source tensor name
    paths: dict[str, str] = field(default_factory=dict)  # module -> predicted path
    in_bytes: int = 0
    group_size: int | None = None  # linear/fold: the W4A8 target group (-1 channel)

    @property
    def key(self) -> str:
        return self.source if self.kind == "copy" else self.specs[-1].name


@dataclass
class Plan:
    source: str
    verdict: FormatVerdict
    layout: Layout
    group_size: int | None  # the one target group (multiple of 32, or -1 channel); None when mixed
    dense: str  # "w4a8" | "bf16"
    jobs: list[Job]
    accounted: dict[str, str]  # every source tensor -> "converted:<module>" | "copied"
    options: dict
    reader: object = field(default=None, repr=False)  # the format reader that read the headers
    groups: dict[str, int] = field(default_factory=dict)  # W4A8 module -> its target group
    substituted: list[dict] = field(default_factory=list)  # where --group-size N could not be used
    mixed: list[dict] = field(default_factory=list)  # modules not in int4: what each became (precision.py)

    @property
    def outputs(self) -> list[OutTensor]:
        return [t for j in self.jobs for t in j.outputs]

    @property
    def out_bytes(self) -> int:
        return sum(t.nbytes for t in self.outputs)

    def path_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for j in self.jobs:
            for p in j.paths.values():
                out[p] = out.get(p, 0) + 1
        if any(j.kind == "copy" for j in self.jobs):
            out["copy"] = sum(1 for j in self.jobs if j.kind == "copy")
        return out

    def schemes(self) -> dict[int, int]:
        """{target group: number of W4A8 modules}, largest group of modules first."""
        counts: dict[int, int] = {}
        for g in self.groups.values():
            counts[g] = counts.get(g, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    def quantized_modules(self) -> list[str]:
        return [s.name for j in self.jobs if j.kind in ("linear", "fold", "experts") for s in j.specs]

    def fingerprint(self, ckpt: Checkpoint) -> str:
        """Changes whenever the output bytes could change: tool version, options, source tensors."""
        h = hashlib.sha256()
        h.update(json.dumps({"v": __version__, "opts": self.options}, sort_keys=True).encode())
        for name in sorted(ckpt.tensors):
            t = ckpt.tensors[name]
            h.update(f"{name}|{t.file}|{t.dtype}|{t.shape}|{t.begin}|{t.end}".encode())
        for shard in ckpt.shards:
            st = (ckpt.folder / shard).stat()
            h.update(f"{shard}|{st.st_size}|{st.st_mtime_ns}".encode())
        return h.hexdigest()

    def summary(self) -> dict:
        lay = self.layout
        return {
            "source": self.source,
            "format": self.verdict.to_dict(),
            "model_type": lay.model_type,
            "family": lay.family,
            "routing": lay.routing,
            "kept": lay.kept,
            "moe_layers": len(lay.moe_layers),
            "experts_per_layer": sorted({m.num_experts for m in lay.moe_layers}),
            "shared_experts": sum(1 for m in lay.moe_layers if m.shared),
            "routers": len(lay.routers),
            "roles": lay.counts(),
            "group_size": self.group_size,
            "scale_dtype": (None if self.group_size is None else
                            scale_dtype(self.group_size)),
            "schemes": [{"group_size": g, "scheme": scheme_label(g), "modules": n} for g, n in self.schemes().items()],
            "group_substitutions": self.substituted,
            "dense": self.dense,
            "mixed_precision": self.mixed,
            "paths": self.path_counts(),
            "tensors_in": len(self.accounted),
            "tensors_out": len(self.outputs),
            "out_bytes": self.out_bytes,
            "in_bytes": sum(j.in_bytes for j in self.jobs),
        }


def parse_size(s: str | int) -> int:
    """'5GB' / '500MB' / '200KB' / bytes -> bytes (decimal units, as transformers)."""
    if isinstance(s, int):
        return s
    t = str(s).strip().upper().replace(" ", "")
    units = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3, "TIB": 2**40, "GIB": 2**30, "MIB": 2**20,
             "KIB": 2**10, "B": 1}
    for u in sorted(units, key=len, reverse=True):
        if t.endswith(u):
            num = t[: -len(u)]
            break
    else:
        u, num = "B", t
    try:
        val = float(num)
    except ValueError:
        raise UsageError(f"--max-shard-size {s!r}: expected a size like 5GB, 500MB or 1048576",
                         hint="Use a number with an optional unit KB/MB/GB (or KiB/MiB/GiB).") from None
    if val <= 0:
        raise UsageError(f"--max-shard-size {s!r} must be positive")
    return int(val * units[u])


def _w4a8_outputs(spec: LinearSpec, g: int, bias_dtype: str | None) -> list[OutTensor]:
    out = [OutTensor(f"{spec.name}.weight", "I8", (spec.n, spec.k))]
    out.append(OutTensor(f"{spec.name}.weight_scale", scale_st_dtype(g), (spec.n, scales_per_row(spec.k, g))))
    if bias_dtype:
        out.append(OutTensor(f"{spec.name}.bias", bias_dtype, (spec.n,)))
    return out


@gc_paused()  # its records live as long as the run
def make_plan(ckpt: Checkpoint, *, group_size: int | str | None = None, dense: str | None = None,
              source_label: str | None = None, strict_group_size: bool = False) -> Plan:
    """Validate the whole checkpoint and decide every tensor's fate. Raises on any refusal.

    ``group_size`` is a model-wide request; a module that cannot run it takes the group it can
    (listed in ``Plan.substituted``), or, with ``strict_group_size``, the plan is refused.
    ``dense``: what dense linears become (precision.py); None is the default, int4 ones to W4A8."""
    if dense is not None and dense not in DENSE_MODES:
        raise UsageError(f"--dense {dense!r}: expected one of {', '.join(DENSE_MODES)}")
    requested = parse_group_size(group_size)
    from .formats import open_reader  # the readers' (numpy's): a resume that takes its plan from a record needs none

    reader = open_reader(ckpt)
    verdict = reader.verdict()
    specs = reader.linears()
    refused = [s for s in specs.values() if s.refused]
    if refused:
        lines = "; ".join(f"{s.name}: {s.refused}" for s in refused[:5])
        more = f" (+{len(refused) - 5} more)" if len(refused) > 5 else ""
        raise RefusedError(f"{len(refused)} module(s) cannot be converted: {lines}{more}",
                           tensor=refused[0].name, hint="See the reasons above; int4pack converts 4-bit int layouts only.")
    if not specs:
        raise RefusedError(f"{ckpt.folder}: no int4 linear found although quant_method is "
                           f"{(ckpt.quant_config or {}).get('quant_method')!r}",
                           hint="The checkpoint may not be quantised; nothing to convert.")
    # fused expert tensors the reader splits per expert itself (float sources) are not refused as fused
    split = reader.split_tensors() if hasattr(reader, "split_tensors") else set()
    layout = discover(ckpt.family_type, ckpt.text_config, sorted(specs), sorted(t for t in ckpt.tensors if t not in split))
    if not layout.moe_layers:
        raise RefusedError(f"{ckpt.folder}: no routed experts found in a {ckpt.model_type!r} checkpoint",
                           hint="int4pack targets MoE checkpoints; the tensor names did not match any expert layout.")

    # float_only: a linear vLLM builds without quantisation (families/): dequantised to bfloat16
    fates = {s.name: decide(s, layout.roles[s.name], dense, layout.roles[s.name] == "float_only")
             for s in specs.values()}
    tie_fused(fates, fused_shards(n for n in specs if layout.roles.get(n) != "expert"))
    w4a8_specs = [s for s in specs.values() if fates[s.name].w4a8]
    w4a8_names = {s.name for s in w4a8_specs}

    # MLP triples whose down projection carries act-order get folded together (int4 triples only)
    fold_of: dict[str, list[str]] = {}
    for t in layout.mlps:
        if {"gate", "up", "down"} <= t.keys() and specs[t["down"]].act_order \
                and all(specs[t[r]].bits == 4 for r in ("gate", "up", "down")):
            members = [t["gate"], t["up"], t["down"]]
            if all(m in w4a8_names for m in members):
                for m in members:
                    fold_of[m] = members
    folded = {m[2] for m in fold_of.values()}
    units = [Unit(u, folded) for u in tied_units(w4a8_specs, fold_of)]
    groups, substituted = choose_groups(requested, units, strict_group_size)

    jobs: list[Job] = []
    accounted: dict[str, str] = {}
    consumed: dict[str, str] = {}  # source tensor -> "converted:<module>", one string per module
    for s in specs.values():
        fate = f"converted:{s.name}"
        for key in s.keys:
            consumed[key] = fate

    def bias_dtype(s: LinearSpec) -> str | None:
        key = f"{s.name}.bias"
        return ckpt.tensors[key].dtype if s.has_bias and key in ckpt.tensors else None

    def in_bytes(s: LinearSpec) -> int:
        return sum(ckpt.tensors[k].nbytes for k in s.keys if k in ckpt.tensors)

    # modules a reader writes together in a layout of their own (gpt-oss experts: expert_layout.py)
    unit_of: dict[str, list[str]] = reader.units() if hasattr(reader, "units") else {}
    users: dict[str, int] = {}  # source tensor -> the units that read it (fused experts: every expert)
    for name, members in unit_of.items():
        if name == members[0]:
            for key in {k for m in members for k in specs[m].keys}:
                users[key] = users.get(key, 0) + 1

    done: set[str] = set()
    for name in sorted(specs):
        if name in done:
            continue
        s = specs[name]
        if name in unit_of:
            members = [specs[m] for m in unit_of[name]]
            g = groups[name]
            gate = members[0]
            bias = next((ckpt.tensors[k].dtype for k in gate.keys if k.endswith(("_bias", ".bias"))), None)
            outs = [OutTensor(*t) for t in expert_layout.outputs(gate.name.rsplit(".", 1)[0], gate.n, gate.k, g, bias)]
            paths = {m.name: predict_path(m, g, folded=False) for m in members}
            # fused source tensors are shared by all experts: each expert's share of them
            share = sum(ckpt.tensors[k].nbytes // users[k] for k in {k for m in members for k in m.keys})
            jobs.append(Job("experts", outs, members, paths=paths, in_bytes=share, group_size=g))
            done.update(m.name for m in members)
        elif name in fold_of:
            members = [specs[m] for m in fold_of[name]]
            g = groups[name]
            outs = [t for m in members for t in _w4a8_outputs(m, g, bias_dtype(m))]
            paths = {m.name: predict_path(m, g, folded=(m is members[2])) for m in members}
            jobs.append(Job("fold", outs, members, paths=paths, in_bytes=sum(map(in_bytes, members)),
                            group_size=g))
            done.update(m.name for m in members)
        elif name in w4a8_names:
            g = groups[name]
            jobs.append(Job("linear", _w4a8_outputs(s, g, bias_dtype(s)), [s],
                            paths={name: predict_path(s, g, folded=False)}, in_bytes=in_bytes(s), group_size=g))
            done.add(name)
        else:
            outs = [OutTensor(f"{name}.weight", "BF16", (s.n, s.k))]
            if bias_dtype(s):
                outs.append(OutTensor(f"{name}.bias", bias_dtype(s), (s.n,)))
            jobs.append(Job("dequant", outs, [s], paths={name: "dequant"}, in_bytes=in_bytes(s)))
            done.add(name)
    for key in sorted(ckpt.tensors):
        if key in consumed:
            accounted[key] = consumed[key]
            continue
        t: TensorInfo = ckpt.tensors[key]
        jobs.append(Job("copy", [OutTensor(key, t.dtype, t.shape)], source=key, in_bytes=t.nbytes))
        accounted[key] = "copied"

    seen: dict[str, str] = {}
    for j in jobs:
        for t in j.outputs:
            if t.name in seen:
                raise RefusedError(f"output tensor {t.name!r} would be written twice "
                                   f"(from {seen[t.name]} and {j.key})", tensor=t.name,
                                   hint="The source stores both a float and a quantised form of this module.")
            seen[t.name] = j.key
    jobs.sort(key=lambda j: j.outputs[0].name)
    distinct = set(groups.values())
    one = distinct.pop() if len(distinct) == 1 else None
    mixed = precision_summary(specs, layout.roles, fates)
    opts = {"group_size": one, "dense": dense or "w4a8"}
    if mixed:  # --dense given or not decides the 8-bit dense linears
        opts["mixed"] = [(m["first"], m["path"], m["modules"]) for m in mixed]
    if one is None:  # per module: the mapping decides the output bytes
        opts["groups"] = hashlib.sha256(json.dumps(groups, sort_keys=True).encode()).hexdigest()
    return Plan(source_label or str(ckpt.folder), verdict, layout, one, dense or "w4a8", jobs, accounted, opts,
                reader, groups=groups, substituted=substituted, mixed=mixed)
