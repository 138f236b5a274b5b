"""The registry entry for ``int4pack-kleidiai``: a light QuantizationConfig whose ``from_config``
builds the real one (``_methods.packed_config``, which imports vLLM's compressed-tensors code)."""

from __future__ import annotations

import torch
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from ..serve_spec import QUANT_METHOD

__all__ = ["KleidiAIPackedConfig", "register_config"]


class KleidiAIPackedConfig(QuantizationConfig):
    """Stands for the method in vLLM's registry; never instantiated (``from_config`` returns the
    compressed-tensors subclass that serves the blobs)."""

    def get_name(self) -> str:
        return QUANT_METHOD

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # a CPU method: vLLM checks capability only on GPUs

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict):
        from ._methods import packed_config

        return packed_config(config)

    def get_quant_method(self, layer, prefix: str):
        raise NotImplementedError("int4pack-kleidiai: use the config from_config returns")


def register_config() -> None:
    if QUANT_METHOD not in QUANTIZATION_METHODS:  # plugins may be loaded more than once per process
        register_quantization_config(QUANT_METHOD)(KleidiAIPackedConfig)
