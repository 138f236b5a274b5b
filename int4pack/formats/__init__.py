"""Source format readers: one module per format behind one small interface.

A reader is built from a Checkpoint; it only parses headers and config until ``read``:

    reader = open_reader(ckpt)
    reader.verdict()            -> FormatVerdict (format, version, v1/v2 evidence, warnings)
    reader.linears()            -> {module prefix: LinearSpec} for every quantised linear
    reader.read(spec)           -> QuantLinear in the canonical convention (records.py)
"""

from __future__ import annotations

from typing import Protocol

from ..checkpoint import Checkpoint
from ..errors import RefusedError
from ..records import FormatVerdict, LinearSpec, QuantLinear

__all__ = ["Reader", "open_reader"]


class Reader(Protocol):
    name: str

    def verdict(self) -> FormatVerdict: ...

    def linears(self) -> dict[str, LinearSpec]: ...

    def read(self, spec: LinearSpec) -> QuantLinear: ...


def open_reader(ckpt: Checkpoint) -> Reader:
    """Pick the reader for the checkpoint's quant_method; refuse anything else clearly."""
    q = ckpt.quant_config
    if q is None:
        raise RefusedError(
            f"{ckpt.folder}: no quantization_config (config.json, quantize_config.json or quant_config.json)",
            path=str(ckpt.folder),
            hint="int4pack converts int4 GPTQ, AWQ or compressed-tensors checkpoints; quantise the model first.")
    method = str(q.get("quant_method", "")).lower()
    if method == "gptq" or (not method and "bits" in q and "desc_act" in q):
        from .gptq import GPTQReader
        return GPTQReader(ckpt, q)
    if method == "awq":
        from .awq import AWQReader
        return AWQReader(ckpt, q)
    if method in {"compressed-tensors", "compressed_tensors"} or "config_groups" in q:
        from .compressed_tensors import CompressedTensorsReader
        return CompressedTensorsReader(ckpt, q)
    raise RefusedError(
        f"quant_method {q.get('quant_method')!r} is not supported",
        path=str(ckpt.folder / "config.json"),
        hint="Supported: gptq, awq (gemm), compressed-tensors (pack-quantized, int-quantized).")
