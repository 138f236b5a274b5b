"""Qwen2-MoE, Qwen3-MoE (and Qwen3-VL-MoE's per-expert requantised repos) and OLMoE: softmax routing,
experts as mlp.experts.E.{gate,up,down}_proj."""

from ._family import SOFTMAX, Family
from ..serving.vllm_releases import V019, V032

QWEN2 = Family(
    name="Qwen1.5/Qwen2-MoE",
    model_types=("qwen2_moe",),
    experts="mlp.experts.E.{gate,up,down}_proj + mlp.shared_expert.* + mlp.shared_expert_gate",
    routing=SOFTMAX,
    shared_experts=1,
    shared_gate=True,  # sigmoid(shared_expert_gate(x)) scales the shared expert's output
    serve={V019: "not run (softmax, as Qwen3-MoE)", V032: "not run (softmax, as Qwen3-MoE)"},
)

QWEN3 = Family(
    name="Qwen3-MoE",
    model_types=("qwen3_moe",),
    experts="mlp.experts.E.{gate,up,down}_proj (dense mlp_only_layers)",
    routing=SOFTMAX,
    serve={V019: "yes (float32)", V032: "yes"},
)

OLMOE = Family(
    name="OLMoE",
    model_types=("olmoe",),
    experts="mlp.experts.E.{gate,up,down}_proj",
    routing=SOFTMAX,
    serve={V019: "not run (softmax, as Qwen3-MoE)", V032: "not run (softmax, as Qwen3-MoE)"},
)

FAMILIES = (QWEN2, QWEN3, OLMOE)
