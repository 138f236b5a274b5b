"""The compressed-tensors ``quantization_config`` of a W4A8 output, as vLLM's CPU backend reads it.

vLLM (CompressedTensorsConfig._is_dynamic_token_w4a8_int) takes weights int, 4 bits,
symmetric, static, strategy group or channel, and input activations int, 8 bits, dynamic,
strategy token; the format is ``int-quantized`` (int4 values stored as int8).
"""

from __future__ import annotations

__all__ = ["w4a8_quant_config", "CT_VERSION"]

# the compressed-tensors version whose schema we write (the fields have been stable since 0.11)
CT_VERSION = "0.20.0"


def w4a8_quant_config(group_size: int, ignore: list[str]) -> dict:
    channel = group_size == -1
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": True,
        "strategy": "channel" if channel else "group",
        "group_size": None if channel else group_size,
        "dynamic": False,
        "actorder": None,
        "block_structure": None,
        "observer": None,
        "observer_kwargs": {},
    }
    acts = {
        "num_bits": 8,
        "type": "int",
        "symmetric": True,
        "strategy": "token",
        "group_size": None,
        "dynamic": True,
        "observer": None,
        "observer_kwargs": {},
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "format": "int-quantized",
                "weights": weights,
                "input_activations": acts,
                "output_activations": None,
            }
        },
        "ignore": sorted(set(ignore)),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
        "version": CT_VERSION,
    }
