"""Llama-4 Scout / Maverick (llama4 wrapper, llama4_text).

transformers stores the experts fused 3-D (feed_forward.experts.gate_up_proj [E, H, 2I], transposed);
llm-compressor splits them into per-expert linears before quantising (feed_forward.experts.E.
{gate,up,down}_proj), which vLLM V032's llama4.py loads through its per-expert mapping
(ckpt_gate_proj_name="gate_proj"). The router feed_forward.router is a GateLinear (float) and the
shared expert feed_forward.shared_expert.* a LlamaMLP with the model's quant_config.
Routing: Llama4MoE.custom_routing_function (top-1, sigmoid), apply_router_weight_on_input=True.
"""

from ._family import LLAMA4, Family
from ..serving.vllm_releases import V019, V032

FAMILY = Family(
    name="Llama-4 Scout / Maverick",
    model_types=("llama4", "llama4_text"),
    experts="feed_forward.experts.E.{gate,up,down}_proj + feed_forward.shared_expert.* "
            "(router feed_forward.router; dense feed_forward.* layers between MoE layers)",
    routing=LLAMA4,
    shared_experts=1,
    qk_rotary=True,  # Llama4ForCausalLM.load_weights -> permute_qk_weight_for_rotary (V019 and V032)
    routing_label="Llama4 (top-1 sigmoid)",
    text_config="text_config",
    prefixes=("language_model.model.", "model.language_model.", "model."),
    kept=((r"^(?:vision_model|multi_modal_projector|model\.vision_model|model\.multi_modal_projector)\.",
           "vision encoder and projector: not experts"),),
    # measured under QEMU (docs/serving.md): stock weights the expert input by the softmax probability
    # (the lane's router-weight check fails it; its other gates pass on the fixture)
    serve={V019: "not run",
           V032: "packed format only (stock: softmax, not sigmoid, weight on the expert input, no error)"},
)
