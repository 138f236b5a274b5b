"""An MLX affine checkpoint (mlx-lm, mlx-community) presented as a Checkpoint.

mlx-lm saves safetensors with ``config.json["quantization"]`` = ``{"group_size", "bits", "mode":
"affine"}`` plus one entry per module quantised otherwise (``{"group_size", "bits"}``) or not at
all (``false``). A quantised module P holds

    P.weight  U32 [..., N, K * bits / 32]   values packed from the low bits of each word up
    P.scales, P.biases  [..., N, K / group]   value = q * scale + bias   (mlx.core.dequantize)

and a MoE layer's experts are stacked along a leading E: ``<layer>.mlp.switch_mlp.<proj>``. Here:

* stacked experts are listed per expert as ``<layer>.mlp.experts.E.<proj>.{weight,scales,biases}``
  (expert e's rows are one contiguous run of each stacked tensor);
* quantised modules vLLM loads in float (embeddings, lm_head, routers) become derived BF16
  ``P.weight`` tensors, dequantised when read;
* the quantisation entries leave the config (they describe the source, not the output).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .checkpoint import Checkpoint
from .derived_tensors import DerivedTensors, bf16_bits
from ..errors import InputError, RefusedError
from .safetensors_header import TensorInfo
from .source_folder import load_json

__all__ = ["MLXCheckpoint", "is_mlx_folder", "unpack", "dequantize", "MLX_BITS", "MLXLinear"]

MLX_BITS = (4, 8)
_LINEAR_LEAF = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_SWITCH = ".switch_mlp."


def is_mlx_folder(path: Path) -> bool:
    """A folder whose config.json has mlx-lm's ``quantization`` entry (and no quant_method)."""
    cfg = path / "config.json"
    if not (path.is_dir() and cfg.is_file()):
        return False
    try:
        c = load_json(cfg)
    except InputError:
        return False
    q = c.get("quantization")
    return isinstance(q, dict) and "group_size" in q and "bits" in q and "quant_method" not in q


def unpack(words: np.ndarray, bits: int) -> np.ndarray:
    """MLX packed uint32 [..., W] -> uint8 codes [..., W * 32 / bits], low bits of each word first."""
    b = np.ascontiguousarray(words).view("<u4").view(np.uint8)  # little-endian: low byte first
    if bits == 8:
        return b
    return np.stack([b & 0x0F, b >> 4], axis=-1).reshape(*b.shape[:-1], b.shape[-1] * 2)


def _float(arr: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return (arr.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32)


def dequantize(codes: np.ndarray, scales: np.ndarray, biases: np.ndarray, group: int) -> np.ndarray:
    """q * scale + bias per group: float32 [N, K] (what mlx.core.dequantize computes)."""
    s = np.repeat(scales, group, axis=-1)
    b = np.repeat(biases, group, axis=-1)
    return codes.astype(np.float32) * s + b


class MLXLinear:
    """One quantised linear: its three keys, [N, K], bits and group."""

    __slots__ = ("weight", "scales", "biases", "n", "k", "bits", "group")

    def __init__(self, prefix: str, n: int, k: int, bits: int, group: int):
        self.weight, self.scales, self.biases = f"{prefix}.weight", f"{prefix}.scales", f"{prefix}.biases"
        self.n, self.k, self.bits, self.group = n, k, bits, group


class MLXCheckpoint(DerivedTensors, Checkpoint):
    """See the module docstring."""

    container = "mlx"  # what the reader table's rows see (formats/_api.Header)
    expert_layout = "MLX's stacked switch_mlp.{gate,up,down}_proj, one [E, N, K] tensor each, read per expert"

    def __init__(self, folder: str | os.PathLike):
        super().__init__(folder)
        self._init_derived()
        q = self.config.get("quantization")
        self.base_bits, self.base_group = int(q["bits"]), int(q["group_size"])
        self.mode = str(q.get("mode", "affine"))
        self.overrides = {k: v for k, v in q.items() if isinstance(v, (dict, bool))}
        self.config = {k: v for k, v in self.config.items() if k not in ("quantization", "quantization_config")}
        path = str(self.folder / "config.json")
        if self.mode != "affine":
            raise RefusedError(f"MLX quantization mode {self.mode!r}: int4pack reads MLX affine only", path=path,
                               hint="Use an affine (default) mlx-lm quantisation of the model.")
        self.quant_config = {"quant_method": "mlx", "bits": self.base_bits, "group_size": self.base_group,
                             "mode": self.mode, "overrides": len(self.overrides)}
        self.quant_config_path = self.folder / "config.json"
        self.mlx_linears: dict[str, MLXLinear] = {}
        for p in sorted(n[: -len(".scales")] for n in list(self.tensors) if n.endswith(".scales")):
            self._module(p, path)

    def _bits_group(self, prefix: str, path: str) -> tuple[int, int]:
        o = self.overrides.get(prefix)
        bits, group = (int(o.get("bits", self.base_bits)), int(o.get("group_size", self.base_group))) \
            if isinstance(o, dict) else (self.base_bits, self.base_group)
        if bits not in MLX_BITS or group not in (32, 64, 128):
            raise RefusedError(f"{prefix}: MLX {bits}-bit, group {group}; int4pack reads 4- and 8-bit MLX with "
                               "groups 32, 64 or 128", path=path, tensor=f"{prefix}.weight",
                               hint="Use a 4- or 8-bit mlx-lm quantisation of the model.")
        return bits, group

    def _module(self, p: str, path: str) -> None:
        t = self.tensors
        for key in (f"{p}.weight", f"{p}.biases"):
            if key not in t:
                raise InputError(f"{p}: has scales but no {key}", tensor=key,
                                 hint="The checkpoint is incomplete or not MLX affine; re-download it.")
        bits, group = self._bits_group(p, path)
        w, s = t[f"{p}.weight"], t[f"{p}.scales"]
        if w.dtype != "U32" or tuple(s.shape) != tuple(t[f"{p}.biases"].shape) or w.shape[:-1] != s.shape[:-1] \
                or w.shape[-1] * 32 // bits != s.shape[-1] * group:
            raise InputError(f"{p}.weight: {w.dtype}{list(w.shape)} with scales {list(s.shape)} is not MLX "
                             f"{bits}-bit group {group} (uint32 [N, K*{bits}/32], scales [N, K/{group}])",
                             tensor=f"{p}.weight", hint="The config's quantization entry and the tensors disagree.")
        n, k = w.shape[-2], w.shape[-1] * 32 // bits
        if _SWITCH in p:  # stacked experts: one contiguous run per expert
            moe, proj = p.split(_SWITCH)
            for e in range(w.shape[0]):
                mod = f"{moe}.experts.{e}.{proj}"
                for part in ("weight", "scales", "biases"):
                    src = t[f"{p}.{part}"]
                    per = src.nbytes // src.shape[0]
                    t[f"{mod}.{part}"] = TensorInfo(f"{mod}.{part}", src.file, src.dtype, tuple(src.shape[1:]),
                                                    src.begin + e * per, src.begin + (e + 1) * per)
                self.mlx_linears[mod] = MLXLinear(mod, n, k, bits, group)
            for part in ("weight", "scales", "biases"):
                del t[f"{p}.{part}"]
        elif p.rsplit(".", 1)[-1] in _LINEAR_LEAF and len(w.shape) == 2:
            self.mlx_linears[p] = MLXLinear(p, n, k, bits, group)
        else:  # an embedding, lm_head or router: vLLM loads it in float
            parts = [t.pop(f"{p}.{part}") for part in ("weight", "scales", "biases")]
            self.add_derived(TensorInfo(f"{p}.weight", parts[0].file, "BF16", (n, k), 0, 2 * n * k),
                             self._rows(parts, bits, group))

    def _rows(self, parts: list[TensorInfo], bits: int, group: int):
        """rows(r0, r1) of a quantised module dequantised, as bf16 bit patterns."""

        def rows(r0: int, r1: int) -> np.ndarray:
            got = []
            for info in parts:
                per = info.nbytes // info.shape[0]
                buf = np.empty((r1 - r0, per), np.uint8)
                Checkpoint._read(self, info, buf, r0 * per, buf.nbytes)
                got.append(buf)
            w, s, b = got
            return bf16_bits(dequantize(unpack(w.view(np.uint32), bits), self._floats(s, parts[1].dtype),
                                        self._floats(b, parts[2].dtype), group))

        return rows

    @staticmethod
    def _floats(raw: np.ndarray, dtype: str) -> np.ndarray:
        """Scales or biases bytes [rows, bytes] -> float32 [rows, groups]."""
        return _float(raw.view({"BF16": np.uint16, "F16": np.float16, "F32": np.float32}[dtype]), dtype)

    def linear_data(self, lin: MLXLinear) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(codes uint8 [N, K], scales float32 [N, G], biases float32 [N, G]) of one linear."""
        t = self.tensors
        words = np.frombuffer(self.read_bytes(lin.weight), np.uint32).reshape(lin.n, -1)
        s = np.frombuffer(self.read_bytes(lin.scales), np.uint8).reshape(lin.n, -1)
        b = np.frombuffer(self.read_bytes(lin.biases), np.uint8).reshape(lin.n, -1)
        return (unpack(words, lin.bits), self._floats(s, t[lin.scales].dtype), self._floats(b, t[lin.biases].dtype))
