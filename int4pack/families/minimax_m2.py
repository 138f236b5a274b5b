"""MiniMax-M2 / M2.5 / M2.7.

vLLM V019 and V032 minimax_m2.py load experts as block_sparse_moe.experts.E.{w1,w3,w2}
(V019: make_expert_params_mapping(ckpt_gate_proj_name="w1", ...); V032: FusedMoEFactory(ckpt_names=
("w1", "w2", "w3"))), the router block_sparse_moe.gate (a float32 GateLinear, never quantised) and
block_sparse_moe.e_score_correction_bias (loaded into a float32 parameter when use_routing_bias).
llm-compressor writes the experts as (mlp|block_sparse_moe).experts.E.{gate,up,down}_proj
(llm-compressor#3069): convert writes the names vLLM loads. Both releases build the block with
prefix ``<layer>.mlp`` although it loads as ``block_sparse_moe``: the plugin's per-blob checks are
recorded under ``<layer>.mlp.experts``, the name its MoE method is given.
"""

from ._family import MINIMAX2, Family
from ..serving.vllm_releases import V019, V032

_MOE = r"\.(?:mlp|block_sparse_moe)"

FAMILY = Family(
    name="MiniMax-M2 / M2.5 / M2.7",
    model_types=("minimax_m2",),
    experts="block_sparse_moe.experts.E.{w1,w3,w2} or (block_sparse_moe|mlp).experts.E.{gate,up,down}_proj",
    routing=MINIMAX2,
    renormalize_default=True,
    kept=((r"\.e_score_correction_bias$", "router score bias: copied bit-exactly"),),
    renames=(
        (_MOE + r"\.experts\.(\d+)\.(?:gate_proj|w1)(?=\.|$)", r".block_sparse_moe.experts.\1.w1"),
        (_MOE + r"\.experts\.(\d+)\.(?:up_proj|w3)(?=\.|$)", r".block_sparse_moe.experts.\1.w3"),
        (_MOE + r"\.experts\.(\d+)\.(?:down_proj|w2)(?=\.|$)", r".block_sparse_moe.experts.\1.w2"),
        (r"\.mlp\.gate(?=\.|$)", ".block_sparse_moe.gate"),
        (r"\.mlp\.e_score_correction_bias$", ".block_sparse_moe.e_score_correction_bias"),
    ),
    vllm_prefixes=((r"\.block_sparse_moe\.experts$", ".mlp.experts"),),
    serve={V019: "packed format only", V032: "packed format only"},
)
