"""EXAONE-MoE / K-EXAONE-236B-A23B (exaone_moe).

Read in transformers 5.23.0 models/exaone_moe/modeling_exaone_moe.py and conversion_mapping.py:
ExaoneMoeTopkRouter routes as DeepSeek-V3 (sigmoid, ``e_score_correction_bias``, n_group/topk_group,
renormalised per ``norm_topk_prob``, times ``routed_scaling_factor``); experts silu(gate) * up;
``num_shared_experts`` shared; dense layers by ``mlp_layer_types`` (``first_k_dense_replace`` 1); the
score bias on disk is ``mlp.e_score_correction_bias`` (transformers: ``mlp.gate.e_score_correction_bias``).
"""

from ..activation import SILU, from_hidden_act
from ..routing import Routing
from ._family import DEEPSEEK_V3, Family, LayerMoE, mlp_type, num
from ..serving.vllm_releases import V019, V032


def _moe(tc: dict, layer: int) -> LayerMoE | None:
    if mlp_type(tc, layer, dense_first=1) == "dense":
        return None
    r = Routing("sigmoid", int(num(tc, "num_experts_per_tok", default=8)), bool(tc.get("norm_topk_prob", True)),
                bias=True, n_group=int(num(tc, "n_group", default=1)), topk_group=int(num(tc, "topk_group", default=1)),
                scale=float(num(tc, "routed_scaling_factor", default=2.5)))
    return LayerMoE(r, from_hidden_act(tc.get("hidden_act")) or SILU,
                    shared_experts=int(num(tc, "num_shared_experts", default=1)))


FAMILY = Family(
    name="EXAONE-MoE",
    model_types=("exaone_moe",),
    experts="mlp.experts.E.{gate,up,down}_proj + mlp.shared_experts.* (first layer dense)",
    routing=DEEPSEEK_V3,
    routing_label="DeepSeekV3",
    kept=((r"\.e_score_correction_bias$", "router score bias: copied bit-exactly"),),
    moe=_moe,
    serve={V019: "not run", V032: "packed format only (under QEMU, bfloat16; stock: refused at load)"},
)
