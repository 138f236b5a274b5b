"""Laguna (laguna: poolside Laguna-XS.2).

Read in transformers 5.23.0 models/laguna/ (modeling_laguna.py, configuration_laguna.py) and
conversion_mapping.py ("laguna"):
- LagunaTopKRouter: logits soft-capped, cap * tanh(logit / cap), when ``moe_router_logit_softcapping``
  > 0; sigmoid scores; the choice by scores + ``e_score_correction_bias``; top-k; renormalised;
  LagunaSparseMoeBlock multiplies the routed output by ``moe_routed_scaling_factor`` and adds the
  shared expert (``shared_expert_intermediate_size``);
- experts silu(gate) * up; dense layers by ``mlp_layer_types`` (``mlp_only_layers`` [0]);
- on disk the score bias is ``mlp.experts.e_score_correction_bias`` and the shared expert
  ``mlp.shared_expert.*`` (transformers: ``mlp.gate.e_score_correction_bias``, ``mlp.shared_experts.*``).
"""

from ..activation import SILU, from_hidden_act
from ..routing import Routing
from ._family import MINIMAX2, Family, LayerMoE, mlp_type, num
from ..serving.vllm_releases import V019, V032


def _moe(tc: dict, layer: int) -> LayerMoE | None:
    if mlp_type(tc, layer, dense_first=1) == "dense":
        return None
    cap = float(num(tc, "moe_router_logit_softcapping", default=0.0))
    r = Routing("sigmoid", int(num(tc, "num_experts_per_tok", default=8)), True, bias=True,
                scale=float(num(tc, "moe_routed_scaling_factor", default=1.0)), softcap=cap if cap > 0 else None)
    return LayerMoE(r, from_hidden_act(tc.get("hidden_act")) or SILU, shared_experts=1)


FAMILY = Family(
    name="Laguna",
    model_types=("laguna",),
    experts="mlp.experts.E.{gate,up,down}_proj + mlp.shared_expert(s).* (first layer dense)",
    routing=MINIMAX2,
    routing_label="sigmoid, score bias, renormalised, routed scaling; logits soft-capped where set",
    kept=((r"\.(?:gate|experts)\.e_score_correction_bias$", "router score bias: copied bit-exactly"),),
    moe=_moe,
    # vLLM's laguna.py LagunaMLP (the release V032 names): gate_proj and up_proj stay two ColumnParallelLinear modules
    vllm_apart=("gate_up_proj",),
    serve={V019: "not run", V032: "packed format only (under QEMU, bfloat16; the plugin loads the score bias vLLM drops); stock: refused at load"},
)
