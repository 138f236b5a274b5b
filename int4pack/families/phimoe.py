"""Phi-3.5-MoE."""

from ._family import CUSTOM, Family
from ..serving.vllm_releases import V019, V032

FAMILY = Family(
    name="Phi-3.5-MoE",
    model_types=("phimoe",),
    experts="block_sparse_moe.experts.E.{w1,w3,w2}",
    routing=CUSTOM,  # sparsemixer: vLLM's PhiMoE passes its own custom_routing_function
    renormalize=False,  # phimoe.py: FusedMoE(renormalize=False); sparsemixer weights are its own
    serve={V019: "no: wrong routing (stock), refused (plugin)", V032: "no: wrong routing (stock), refused (plugin)"},
)
