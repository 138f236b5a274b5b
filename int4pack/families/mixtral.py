"""Mixtral (and the Mixtral-style checkpoints GPTQModel writes with transformers 5 names)."""

from ._family import SOFTMAX, Family
from ..serving.vllm_releases import V019, V032

# vLLM V019 and V032 MixtralForCausalLM load experts as block_sparse_moe.experts.E.w1/w3/w2
# (FusedMoE.make_expert_params_mapping) and the router as block_sparse_moe.gate; GPTQModel writes
# mlp.experts.E.gate_proj and mlp.gate, which vLLM's loader cannot place (KeyError)
_W = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}

FAMILY = Family(
    name="Mixtral",
    model_types=("mixtral",),
    experts="block_sparse_moe.experts.E.{w1,w3,w2} or (block_sparse_moe|mlp).experts.E.{gate,up,down}_proj",
    routing=SOFTMAX,
    renormalize_default=True,
    # vLLM's mixtral.py builds FusedMoE(renormalize=True) and transformers' MixtralTopKRouter always
    # divides by the top-k sum: a norm_topk_prob in the config changes nothing
    renormalize=True,
    renames=(
        (r"\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.gate_proj(?=\.|$)", r".block_sparse_moe.experts.\1.w1"),
        (r"\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.up_proj(?=\.|$)", r".block_sparse_moe.experts.\1.w3"),
        (r"\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.down_proj(?=\.|$)", r".block_sparse_moe.experts.\1.w2"),
        (r"\.mlp\.experts\.(\d+)\.(w[123])(?=\.|$)", r".block_sparse_moe.experts.\1.\2"),
        (r"\.mlp\.gate(?=\.|$)", ".block_sparse_moe.gate"),
    ),
    serve={V019: "yes (float32)", V032: "yes"},
)
