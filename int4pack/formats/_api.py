"""What a format reader is, and the row that lists it in the reader table (formats/__init__.py).

A row says which sources its reader claims, from their quantization config and tensor headers
only (nothing of the data is read), and in words what the reader keeps losslessly and what it
requantises (the refusal of an unknown source and the README list the rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Protocol

from ..records import FormatVerdict, LinearSpec, QuantLinear
from ..sources.safetensors_header import TensorInfo

__all__ = ["Header", "Format", "Reader", "quant_method"]


@dataclass(frozen=True)
class Header:
    """What ``claims`` may look at."""

    container: str  # "safetensors"; a source in another container names its own (e.g. "gguf")
    tensors: Mapping[str, TensorInfo]  # name -> dtype, shape, file (headers only)
    model_type: str  # the family's model_type (a known wrapper's own, else the text model's)
    files: tuple[str, ...]  # the files the tensors lie in


class Reader(Protocol):
    """A source's quantised linears in the canonical convention (records.py).

    Optional: ``in_place(spec)`` (where a module's packed words lie, for convert's batches, see
    GPTQReader.in_place) and ``units()`` (modules written together in a layout of their own)."""

    name: str

    def verdict(self) -> FormatVerdict: ...

    def linears(self) -> dict[str, LinearSpec]: ...

    def read(self, spec: LinearSpec, *, unpack: bool = True) -> QuantLinear:
        """The module's data. unpack=False may leave the codes packed (QuantLinear.packed)."""
        ...


@dataclass(frozen=True)
class Format:
    """One row of the reader table."""

    name: str  # the verdict's format name
    claims: Callable[[dict | None, Header], bool]  # (quantization config or None, header) -> is it mine
    reader: Callable[..., Reader]  # reader(ckpt, config, config_path) -> Reader
    reads: str  # what it reads, as the refusal of an unknown source lists it
    lossless: str  # what keeps its int4 values (the lossless path)
    requant: str  # what is requantised with the error-minimising search
    config_files: tuple[str, ...] = ()  # side files its quantization config may be in (besides config.json)
    # its checkpoints may hold float experts beside quantised ones: open_reader adds them (float_experts.py)
    float_siblings: bool = False


def quant_method(config: dict | None) -> str:
    """The config's quant_method, lower case ("" when none)."""
    return str((config or {}).get("quant_method") or "").lower()
