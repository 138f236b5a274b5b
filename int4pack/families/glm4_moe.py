"""GLM-4.5/4.6/4.7 (glm4_moe) and GLM-4.7-Flash (glm4_moe_lite: MLA attention, DeepSeek-V2 layers).

Both route as DeepSeek-V3 (sigmoid + e_score_correction_bias, n_group/topk_group, routed scaling):
vLLM's glm4_moe.py builds its FusedMoE with scoring_func="sigmoid"; glm4_moe_lite.py reuses
DeepseekV2MoE. Model types checked against vLLM V032's registry (Glm4MoeForCausalLM,
Glm4MoeLiteForCausalLM) and transformers 5.23's CONFIG_MAPPING.
"""

from ._family import DEEPSEEK_V3, Family
from ..serving.vllm_releases import V019, V032

_KEPT = ((r"\.gate\.e_score_correction_bias$", "router score bias: copied bit-exactly"),)

GLM4_MOE = Family(
    name="GLM-4.5 / 4.6 / 4.7",
    model_types=("glm4_moe",),
    experts="mlp.experts.E.{gate,up,down}_proj + mlp.shared_experts.* (first_k_dense_replace dense layers)",
    routing=DEEPSEEK_V3,
    renormalize_default=True,
    kept=_KEPT,
    serve={V019: "packed format only", V032: "packed format only"},
)

GLM4_MOE_LITE = Family(
    name="GLM-4.7-Flash",
    model_types=("glm4_moe_lite",),
    mla=True,
    experts="mlp.experts.E.{gate,up,down}_proj + mlp.shared_experts.* (MLA attention)",
    routing=DEEPSEEK_V3,
    renormalize_default=True,
    kept=_KEPT,
    serve={V019: "no: MLA refused on CPU", V032: "packed format only"},
)

FAMILIES = (GLM4_MOE, GLM4_MOE_LITE)
