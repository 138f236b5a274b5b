"""Gemma-4 MoE (gemma4 wrapper, gemma4_text): Gemma-4-26B-A4B.

Read in transformers 5.23.0 models/gemma4/modeling_gemma4.py and configuration_gemma4.py:
- each decoder layer with ``enable_moe_block`` has a dense ``mlp.{gate,up,down}_proj`` AND a MoE
  beside it, directly under the layer: ``layers.N.router`` (Gemma4TextRouter) and
  ``layers.N.experts`` (Gemma4TextExperts, fused 3-D ``gate_up_proj`` [E, 2I, H], ``down_proj``);
  llm-compressor splits them per expert, ``layers.N.experts.E.{gate,up,down}_proj``;
- Gemma4TextRouter: logits ``router.proj(rms_norm(x) * router.scale * H**-0.5)``, softmax over all
  experts, top ``top_k_experts``, renormalised, then times ``router.per_expert_scale[ids]``;
- the experts' activation is ``hidden_activation`` (gelu_pytorch_tanh) of gate, times up;
- text model under ``model.language_model.``, vision/audio towers beside it.
vLLM (families-2026h2.md §1.2): gemma4.py passes ``custom_routing_function=self.router.routing_function``,
routing type Custom, which CPUExpertsInt4 refuses (V032); V019 takes the plain softmax top-k
branch (no per-expert scale: wrong, no error). The CPU W4A8 MoE op has no GELU activation either.
"""

from ..activation import GELU_TANH, from_hidden_act
from ..routing import Routing
from ._family import SOFTMAX, Family, LayerMoE, num
from ..serving.vllm_releases import V019, V032


def _moe(tc: dict, layer: int) -> LayerMoE | None:
    if not tc.get("enable_moe_block", True):
        return None
    k = int(num(tc, "top_k_experts", "num_experts_per_tok", default=0))
    act = from_hidden_act(tc.get("hidden_activation") or "gelu_pytorch_tanh") or GELU_TANH
    return LayerMoE(Routing("softmax", k, True, per_expert_scale=True), act)


FAMILY = Family(
    name="Gemma-4 MoE",
    model_types=("gemma4", "gemma4_text"),
    experts="[model.language_model.]layers.N.experts.E.{gate,up,down}_proj beside the dense layers.N.mlp.*; "
            "router layers.N.router.proj",
    routing=SOFTMAX,
    routing_label="Custom (softmax, renormalised, per-expert scale)",
    text_config="text_config",
    prefixes=("model.language_model.", "model."),
    kept=((r"\.router\.(?:scale|per_expert_scale)$", "router input scale and per-expert scale: copied"),
          (r"^model\.(?:vision_tower|audio_tower|embed_vision|embed_audio)\.", "vision and audio towers: not experts")),
    moe=_moe,
    serve={V019: "no: routed as plain softmax top-k (no per-expert scale), no error",
           V032: "packed format only (under QEMU, bfloat16; stock: refused at load)"},
)
