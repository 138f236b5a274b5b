"""MLX affine reader (container in mlx_checkpoint.py): 4- and 8-bit, groups 32/64/128.

MLX's affine value ``q * scale + bias`` has no integer zero point (mlx-lm's bias is the group's
minimum, not a multiple of its scale), so no MLX module keeps its ints: each linear is dequantised
exactly as mlx.core.dequantize does and requantised to symmetric int4 by convert's
error-minimising search (the ``dense`` record, as for MXFP4). A group of 32/64/128 is kept as the
target group where vLLM runs it. convert's C++ requant batches read the words, scales and biases
in place (``mlx_in_place``) and decode them a row at a time as ``dequantize`` does (float_rows.cpp).
"""

from __future__ import annotations

from .._lazy import torch
from ..errors import RefusedError
from ..sources.mlx_checkpoint import MLXCheckpoint, dequantize
from ..records import FormatVerdict, LinearSpec, QuantLinear
from ._api import Format, Header
from ._common import SpecsOnce

__all__ = ["MLXReader"]


class MLXReader(SpecsOnce):
    name = "mlx"
    ckpt: MLXCheckpoint

    def _find_linears(self) -> dict[str, LinearSpec]:
        t = self.ckpt.tensors
        return {m: LinearSpec(name=m, fmt=f"mlx-{lin.bits}bit", n=lin.n, k=lin.k, bits=lin.bits, group_size=lin.group,
                              sym=False, act_order=False, keys=(lin.weight, lin.scales, lin.biases),
                              scale_dtype=t[lin.scales].dtype, has_bias=False)
                for m, lin in sorted(self.ckpt.mlx_linears.items())}

    def verdict(self) -> FormatVerdict:
        kinds: dict[str, int] = {}
        for lin in self.ckpt.mlx_linears.values():
            key = f"{lin.bits}-bit group {lin.group}"
            kinds[key] = kinds.get(key, 0) + 1
        ck = self.ckpt
        ev = [f"config.json quantization: bits {ck.base_bits}, group_size {ck.base_group}, mode {ck.mode}, "
              f"{len(ck.overrides)} per-module entr{'y' if len(ck.overrides) == 1 else 'ies'}",
              "linears: " + ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items()))]
        warnings = ["MLX affine (q * scale + bias) is asymmetric with a float bias: every linear is dequantised "
                    "and requantised to symmetric int4 (lossy; the report gives each module's error)"]
        derived = sorted(n for n in ck.tensors if ck.is_derived(n))
        if derived:
            warnings.append(f"{len(derived)} quantised tensor(s) vLLM loads in float (e.g. {derived[0]}) are "
                            "dequantised to bf16")
        return FormatVerdict("mlx", "mlx affine", evidence=ev, warnings=warnings, extra={"mlx_linears": kinds})

    def mlx_in_place(self, spec: LinearSpec):
        """For convert's requant batches (batch.py): (words, scales, biases TensorInfo, bits, group) of a
        linear ``read`` dequantises, which the C++ decodes in place as ``dequantize`` does."""
        lin = self.ckpt.mlx_linears.get(spec.name)
        if lin is None:
            return None
        t = self.ckpt.tensors
        return t[lin.weight], t[lin.scales], t[lin.biases], lin.bits, lin.group

    def read(self, spec: LinearSpec, *, unpack: bool = True) -> QuantLinear:
        lin = self.ckpt.mlx_linears.get(spec.name)
        if lin is None:
            raise RefusedError(f"{spec.name}: not an MLX linear of this checkpoint", tensor=spec.name)
        codes, s, b = self.ckpt.linear_data(lin)
        w = torch.from_numpy(dequantize(codes, s, b, lin.group))
        # the dense record's scales only need to be positive (MLX's may be negative or zero): the weights are in w
        return QuantLinear(spec, None, torch.ones(spec.n, 1), None, dense=w)


def claims(config: dict | None, header: Header) -> bool:
    return header.container == "mlx"


FORMAT = Format(
    "mlx", claims, lambda ckpt, config, path: MLXReader(ckpt, config),
    reads="MLX affine (mlx-lm): 4- and 8-bit, groups 32/64/128, switch_mlp experts, per-module bits",
    lossless="none (q * scale + bias has a float bias)",
    requant="every linear")
