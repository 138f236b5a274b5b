"""The vLLM side: a compressed-tensors config whose W4A8 methods take KleidiAI blobs as they are.

``packed_config`` builds ``KleidiAIPackedCTConfig``, vLLM's ``CompressedTensorsConfig`` parsing the
same quantization_config as the plain checkpoint, so every layer gets exactly the method and
kernel the plain checkpoint gets (routers and ignored layers unquantised, the same MoE method, the
same dense kernel) except where the weights come from:

* MoE layers: vLLM's own ``CompressedTensorsW4A8Int8MoEMethod``, subclassed so that
  ``create_weights`` makes ``w13_weight_packed`` / ``w2_weight_packed`` directly as the uint8
  ``[E, bytes]`` blobs and ``process_weights_after_loading`` packs nothing. Its
  ``apply_monolithic`` routes as the model does (``_routing.moe_plan``, decided at load: softmax
  top-k, DeepSeek-V3's grouped sigmoid with bias, MiniMax-M2's, DeepSeek-V4's sqrtsoftplus and hash
  layers, Gemma-4's per-expert scale) and calls vLLM's op ``torch.ops._C.dynamic_4bit_int_moe`` on
  those two tensors, in the form this vLLM takes, or, for an activation the op cannot apply, runs
  the experts in steps on the same tensors (``_experts.py``).
  vLLM's own forward routes with softmax only (V019) or refuses the sigmoid types (V032's
  ``CPUExpertsInt4``), so the packed format does not use it. On V032 vLLM's kernel is still built
  (``make_w4a8_int8_moe_kernel``, as its own method does after packing): its runner reads it.
  (Releases are named by their constants in serving/vllm_releases.py.)
* Dense W4A8 linears: ``weight_packed`` uint8 ``[bytes]`` fed to ``_dyn_quant_matmul_4bit`` with the
  dtype handling of vLLM's ``Dynamic4bitLinearKernel``; those the record lists in ``plain_modules``
  (KleidiAI could not pack them) keep vLLM's own method and its int8 weights.

Same bytes, same ops: tokens and logprobs equal the plain checkpoint's.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

from ._layout import (DenseBlobs, ExpertBlobs, blob_check, check_runtime, check_tensor_parallel, column_shards,
                      plain_reason)
from ._experts import experts_in_steps, work_dtype
from ._find import MOE_KERNEL, first, served, vllm_version
from ._score_bias import take_score_bias
from ._routing import (backend_accepts, moe_op_args, moe_plan, route_layer, takes_input_ids, vllm_select,
                       with_hash_table)
from ..groups import block
from ..serve_spec import QUANT_METHOD, read_record

__all__ = ["packed_config", "KleidiAIPackedCTConfig", "KleidiAIPackedLinearMethod"]

_VLLM_MOE = "CompressedTensorsW4A8Int8MoEMethod"
_VLLM_LINEAR = "CompressedTensorsW4A8Int"
# MLA's kv_b_proj: the attention reads its whole weight after loading (split_kv_b_proj). On CPU vLLM's
# unquantised linear method packs a weight for its GEMM and empties it (layers/utils.py,
# dispatch_cpu_unquantized_gemm) unless the layer says _cpu_skip_gemm_dispatch, which V032's generic
# MLAAttention sets (mla_attention.py:606) and Kimi-K3's own MLA (models/kimi_k3/nvidia/mla.py) does not
_MLA_READS_WEIGHT = ".kv_b_proj"


def packed_config(config: dict) -> "KleidiAIPackedCTConfig":
    record = read_record(config)
    check_runtime(record)  # before any weight is read: refuse clearly on a host that cannot run the blobs
    plain = {k: v for k, v in config.items() if k != "kleidiai"}
    plain["quant_method"] = "compressed-tensors"
    cfg = KleidiAIPackedCTConfig.from_config(plain)
    cfg.kleidiai = record
    return cfg


class KleidiAIPackedCTConfig(CompressedTensorsConfig):
    kleidiai: dict = {}

    def get_name(self) -> str:
        return QUANT_METHOD

    def get_quant_method(self, layer, prefix: str):
        try:
            method = super().get_quant_method(layer, prefix)
        except Exception:
            if getattr(layer, "moe_config", None) is None:
                raise
            # vLLM's W4A8 backend refused the layer's routing or activation: int4pack's refusal, if
            # any, comes first; else the method is built with a type that backend takes
            moe_plan(layer, prefix, self.kleidiai)
            with backend_accepts(layer):
                method = super().get_quant_method(layer, prefix)
        if type(method).__name__ == _VLLM_MOE:
            # refuses a routing or activation int4pack does not compute, or what this vLLM cannot hand it
            plan = moe_plan(layer, prefix, self.kleidiai, takes_input_ids(type(method)))
            with backend_accepts(layer):
                packed = _packed_moe_class(type(method))(method.weight_quant, method.input_quant, method.moe)
            packed.int4pack_plan = plan
            packed.int4pack_check = (self.kleidiai, prefix)  # the recorded group and CRCs (_layout.blob_check)
            return packed
        if method is not None and hasattr(layer, "moe_config") and "Unquantized" not in type(method).__name__:
            # a packed MoE layer needs the method above; vLLM's own would expect int8 weights
            raise RuntimeError(f"{QUANT_METHOD}: {prefix}: this vLLM gives the MoE layer {type(method).__name__}, "
                               f"not {_VLLM_MOE}; serve the packed format with {served()}")
        if isinstance(layer, LinearBase) and prefix.endswith(_MLA_READS_WEIGHT) and type(method).__name__ == \
                "UnquantizedLinearMethod":
            layer._cpu_skip_gemm_dispatch = True  # the weight stays for the MLA that absorbs it
        if isinstance(layer, LinearBase) and type(getattr(layer, "scheme", None)).__name__ == _VLLM_LINEAR:
            if plain_reason(self.kleidiai, prefix) is not None:
                return method  # stored as int8 weights and scales: vLLM's own method packs it at load
            return KleidiAIPackedLinearMethod(layer.scheme.group_size, (self.kleidiai, prefix))
        return method


def _moe_op_arg_names() -> list[str]:
    try:
        op = torch.ops._C.dynamic_4bit_int_moe
    except (AttributeError, RuntimeError) as e:
        raise RuntimeError(f"{QUANT_METHOD}: this vLLM has no torch.ops._C.dynamic_4bit_int_moe (the Arm "
                           f"W4A8 MoE op); serve the packed format with {served()} on aarch64") from e
    return [a.name for a in op.default._schema.arguments]


class _PackedExperts:
    """Mixed into vLLM's W4A8 MoE method: weights created and loaded as blobs, nothing packed,
    and the forward routes as the layer does before calling the op."""

    int4pack_plan = None  # the layer's MoEPlan (_routing.moe_plan), set by KleidiAIPackedCTConfig.get_quant_method

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        ep = getattr(self.moe, "ep_size", 1)
        if ep != 1 or getattr(self.moe, "use_ep", False):
            raise ValueError(f"{QUANT_METHOD}: expert parallelism ({ep}) is not supported: vLLM's CPU int4 MoE op "
                             "(dynamic_4bit_int_moe) has no expert map. Serve without enable_expert_parallel.")
        tp, rank = getattr(self.moe, "tp_size", 1), getattr(self.moe, "tp_rank", 0)
        record, prefix = getattr(self, "int4pack_check", ({}, ""))
        check_tensor_parallel(record, tp, getattr(layer, "layer_name", None) or prefix or "a MoE layer")
        blobs = ExpertBlobs(num_experts, hidden_size, intermediate_size_per_partition, self.group_size, tp, rank,
                            blob_check(record, prefix, experts=num_experts))
        for name in ("w13", "w2"):
            p = torch.nn.Parameter(blobs.empty(name), requires_grad=False)
            p.weight_loader = blobs.load
            layer.register_parameter(f"{name}_weight_packed", p)
        layer.int4pack_blobs = blobs
        if self.int4pack_plan.routing.bias:  # V032's Laguna: its layer's loader drops the bias
            take_score_bias(layer)
        # what vLLM's method sets on the layer (its own forward reads them)
        layer.w13_in_features = hidden_size
        layer.w13_out_features = 2 * intermediate_size_per_partition
        layer.w2_in_features = intermediate_size_per_partition
        layer.w2_out_features = hidden_size
        layer.group_size = self.group_size
        # resolved here, not in the forward that vLLM V032 compiles
        if self.int4pack_plan.op_kind is not None:
            self.int4pack_op_args = moe_op_args(_moe_op_arg_names(), hidden_size, intermediate_size_per_partition,
                                                self.group_size)
        self.int4pack_select = vllm_select()

    def process_weights_after_loading(self, layer) -> None:
        missing = layer.int4pack_blobs.missing()
        if missing:
            raise ValueError(f"{QUANT_METHOD}: {len(missing)} expert blob(s) missing from the checkpoint "
                             f"({', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''})")
        layer.int4pack_blobs.check_bytes()
        del layer.int4pack_blobs
        # DeepSeek-V4's hash table: vLLM V032 attaches it to the layer after this method was built
        self.int4pack_plan = with_hash_table(self.int4pack_plan, layer, getattr(self, "int4pack_check", ({}, ""))[1])
        if getattr(self, "experts_cls", None) is None:
            return  # vLLM V019 builds no kernel object
        make_w4a8_int8_moe_kernel, tried = first(MOE_KERNEL)
        if make_w4a8_int8_moe_kernel is None:
            raise RuntimeError(f"{QUANT_METHOD}: {vllm_version()} chose a W4A8 MoE backend but has no W4A8 MoE "
                               f"kernel factory (tried {', '.join(tried)}); serve the packed format with "
                               f"{served()}")

        with backend_accepts(layer):  # its kernel is built for a routing and activation it takes
            self.moe_kernel = make_w4a8_int8_moe_kernel(
                moe_quant_config=self.get_fused_moe_quant_config(layer), moe_config=self.moe,
                experts_cls=self.experts_cls, routing_tables=layer._expert_routing_tables())

    def apply_monolithic(self, layer, x: torch.Tensor, router_logits: torch.Tensor, input_ids=None, **_unused):
        if getattr(layer, "routing_sink", None) is not None:
            raise ValueError(f"{QUANT_METHOD}: routed-experts capture is not supported")
        plan = self.int4pack_plan
        weights, ids = route_layer(plan, layer, x, router_logits, input_ids, self.int4pack_select)
        on_input = bool(layer.apply_router_weight_on_input)
        if plan.op_kind is None:  # an activation the op cannot apply: W13, the activation, W2 in steps
            return experts_in_steps(x, ids, weights, layer.w13_weight_packed, layer.w2_weight_packed,
                                    layer.w13_in_features, layer.w2_in_features, self.group_size, plan.activation,
                                    on_input)
        return torch.ops._C.dynamic_4bit_int_moe(
            x, ids.to(torch.long), weights, layer.w13_weight_packed, layer.w2_weight_packed, *self.int4pack_op_args,
            on_input, plan.op_kind)


@lru_cache(maxsize=None)
def _packed_moe_class(base: type) -> type:
    return type("KleidiAIPackedMoEMethod", (_PackedExperts, base), {"__doc__": _PackedExperts.__doc__})


class KleidiAIPackedLinearMethod(LinearMethodBase):
    """A dense W4A8 linear whose ``weight_packed`` is its KleidiAI blob."""

    def __init__(self, group_size: int, check: tuple[dict, str] = ({}, "")):
        self.group_size = group_size  # -1: channelwise
        self.check = check  # (layout record, vLLM prefix): _layout.blob_check
        self.kleidiai = check[0] or {}

    def create_weights(self, layer, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        name = getattr(layer, "prefix", "") or self.check[1] or "a dense layer"
        tp, rank = getattr(layer, "tp_size", 1), getattr(layer, "tp_rank", 0)
        shards = k_split = None
        if any(c.__name__ == "RowParallelLinear" for c in type(layer).__mro__):  # split along K (or tp 1)
            check_tensor_parallel(self.kleidiai, tp, name)
            k_split = (tp, rank) if tp > 1 else None
        elif sum(output_partition_sizes) != output_size:  # column parallel: each rank a byte range per part
            reps = getattr(layer, "num_kv_head_replicas", 1) if len(output_partition_sizes) == 3 else 1  # q/k/v
            shards = column_shards(list(output_partition_sizes), tp, rank, reps, name)
        blobs = DenseBlobs(list(output_partition_sizes), input_size_per_partition, self.group_size, shards, k_split,
                           name, blob_check(*self.check, parts=len(output_partition_sizes)))
        p = torch.nn.Parameter(blobs.empty(), requires_grad=False)
        p.weight_loader = blobs.load
        layer.register_parameter("weight_packed", p)
        layer.int4pack_blobs = blobs
        layer.int4pack_shape = (sum(output_partition_sizes), input_size_per_partition)

    def process_weights_after_loading(self, layer) -> None:
        missing = layer.int4pack_blobs.missing()
        if missing:
            raise ValueError(f"{QUANT_METHOD}: blob(s) of fused part(s) {missing} missing from the checkpoint")
        layer.int4pack_blobs.check_bytes()
        del layer.int4pack_blobs

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # as vLLM's Dynamic4bitLinearKernel: the bias is inside the blob; groupwise bf16 and any
        # fp16 activations go through float32 (the kernels' native inputs)
        n, k = layer.int4pack_shape
        dtype = x.dtype
        work = work_dtype(dtype, self.group_size)
        x2 = x.reshape(-1, k)
        if work != dtype:
            x2 = x2.to(work)
        out = torch.ops.aten._dyn_quant_matmul_4bit(x2, layer.weight_packed, block(k, self.group_size), k, n)
        out = out.reshape(*x.shape[:-1], n)
        return out.to(dtype) if work != dtype else out
