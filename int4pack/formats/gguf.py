"""GGUF reader (llama.cpp; container in gguf_checkpoint.py): the quantised linears of a GGUF file.

* ``Q4_0`` is symmetric int4 per 32 inputs: a block is an fp16 scale ``d`` and 16 bytes holding
  32 codes, element j < 16 in the low nibble of byte j and element 16 + j in its high nibble, value
  ``(q - 8) * d`` (ggml-quants.c ``dequantize_row_q4_0``; gguf.quants.Q4_0). llama.cpp's quantiser
  sets ``d = max / -8`` with ``max`` the block's signed value of largest magnitude, so about half
  the blocks have d < 0, and their code 0 holds +8|d|, which symmetric int4 [-8, 7] cannot hold.
  The record keeps every value exact: a block with d >= 0 as it is (codes q, zero 8, scale d), a
  block with d < 0 as codes 15 - q, zero 7, scale -d (the same (8 - q)|d|). A module whose scales
  are all >= 0 keeps its ints (KleidiAI's group 32; d cast to bf16, which rounds it: bf16 keeps 8
  of fp16's 11 mantissa bits); any other is requantised from those exact values.
* every other type of GGUF_TYPES (Q4_1, Q5_0/Q5_1, Q8_0, Q4_K/Q5_K/Q6_K, IQ4_NL/IQ4_XS, MXFP4) and
  float experts: dequantised to float32 by gguf's own ``gguf.quants.dequantize`` and requantised by
  convert's error-minimising search (the ``dense`` record, as for MXFP4 safetensors). MXFP4 (gpt-oss)
  is a block of an E8M0 byte ``e`` and 16 bytes of E2M1 codes (Q4_0's nibble order), value
  ``E2M1[q] * 2^(e - 127)``: the values of the safetensors release the converter repacked.
* gpt-oss's experts carry biases (``ffn_*_exps.bias``, listed per expert by the checkpoint): each
  expert's gate, up and down are one unit (``units``), written in the per-expert layout vLLM's
  gpt-oss class loads, as formats/mxfp4.py's experts are (serving/expert_layout.py).

convert's C++ requant batches read the same modules in place (``gguf_in_place``, ``float_in_place``):
csrc/convert_kernels/float_rows.cpp decodes each block type a row at a time with gguf's float32
operations in gguf's order (the same bits: tests/formats/test_gguf.py), and Q4_0 into this record.
"""

from __future__ import annotations

import numpy as np

from .._lazy import torch
from ..architectures import classify
from ..errors import RefusedError
from ..sources.gguf_checkpoint import FLOAT_TYPES, GGUF_TYPES, GGUFCheckpoint
from ..records import FormatVerdict, LinearSpec, QuantLinear
from ._api import Format, Header
from ._common import SpecsOnce

__all__ = ["GGUFReader", "q4_0_codes", "NOT_INT4"]

_BITS = {"Q4_0": 4, "Q4_1": 4, "IQ4_NL": 4, "IQ4_XS": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6,
         "Q8_0": 8, "MXFP4": 4}  # the source's bits, reported
# 4-bit GGUF types whose values are not integers on a uniform grid (inspect names them)
NOT_INT4 = {"gguf-mxfp4": "MXFP4", "gguf-iq4_nl": "IQ4_NL", "gguf-iq4_xs": "IQ4_XS"}
_Q4_0_BLOCK = 18  # 2 bytes fp16 d + 16 bytes of nibbles, per 32 inputs


def q4_0_codes(blocks: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Q4_0 block bytes U8 [N, K/32 * 18] -> the canonical record's (codes uint8 [N, K] in 0..15,
    scales float16 [N, K/32] >= 0, zeros uint8 [N, K/32] or None when every d >= 0)."""
    n = blocks.shape[0]
    b = blocks.reshape(n, k // 32, _Q4_0_BLOCK)
    d = np.ascontiguousarray(b[:, :, :2]).view(np.float16).reshape(n, k // 32)
    qs = b[:, :, 2:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2)  # [N, K/32, 32]
    neg = d < 0
    if not neg.any():
        return codes.reshape(n, k), d, None
    codes = np.where(neg[:, :, None], 15 - codes, codes).astype(np.uint8)
    zeros = np.where(neg, 7, 8).astype(np.uint8)
    return codes.reshape(n, k), np.abs(d), zeros


class GGUFReader(SpecsOnce):
    name = "gguf"
    ckpt: GGUFCheckpoint

    def _find_linears(self) -> dict[str, LinearSpec]:
        specs = {}
        for mod, lin in sorted(self.ckpt.gguf_linears.items()):
            t = self.ckpt.tensors[lin.key]
            refused = None
            if lin.k % 32 and lin.qtype in GGUF_TYPES:
                refused = f"in_features {lin.k} is not a multiple of GGUF's 32-input blocks"
            group = GGUF_TYPES.get(lin.qtype, 32)  # float experts: requantised at the finest group vLLM runs
            specs[mod] = LinearSpec(
                name=mod, fmt=f"gguf-{lin.qtype.lower()}", n=lin.n, k=lin.k, bits=_BITS.get(lin.qtype, 16),
                group_size=group, sym=False,  # Q4_0: its data decides (d >= 0)
                act_order=False, keys=(lin.key,) + ((lin.bias,) if lin.bias else ()),
                scale_dtype=("E8M0" if lin.qtype == "MXFP4" else "F16") if lin.qtype in GGUF_TYPES else t.dtype,
                refused=refused,
                notes=[f"GGUF {lin.source} ({lin.qtype})"], has_bias=lin.bias is not None)
        return specs

    def units(self) -> dict[str, list[str]]:
        """Expert module -> its [gate, up, down], written together in the model class's own per-expert
        layout (families' own_expert_layout: gpt-oss); empty for any other model."""
        from ..families import family

        fam = family(self.ckpt.config["model_type"])
        if fam is None or not fam.own_expert_layout:
            return {}
        out: dict[str, list[str]] = {}
        for mod in self.linears():
            role, m = classify(mod)
            if role == "expert":
                out[mod] = [f"{m['moe']}.experts.{m['e']}.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
        return out

    def verdict(self) -> FormatVerdict:
        types = self.ckpt.types
        lin = {}
        for s in self.ckpt.gguf_linears.values():
            lin[s.qtype] = lin.get(s.qtype, 0) + 1
        ev = [f"GGUF file(s) {', '.join(self.ckpt.files)}, architecture {self.ckpt.arch.gguf_name!r} "
              f"-> {self.ckpt.config['model_type']}",
              "tensor types: " + ", ".join(f"{t} x{n}" for t, n in sorted(types.items())),
              "linears: " + ", ".join(f"{t} x{n}" for t, n in sorted(lin.items()))]
        warnings = []
        if "Q4_0" in lin:
            warnings.append("Q4_0: a module whose block scales are all >= 0 keeps its ints (its fp16 scales rounded "
                            "to bf16, 8 of fp16's 11 mantissa bits: the module's error in the report); one with "
                            "negative scales (llama.cpp's quantiser writes d = max / -8: about half the blocks) holds "
                            "+8|d|, which symmetric int4 cannot, and is requantised from its exact values")
        requant = sorted(t for t in lin if t in GGUF_TYPES and t != "Q4_0")
        if requant:
            warnings.append(f"{', '.join(requant)} linears are dequantised by gguf and requantised to int4 "
                            "(lossy; the report gives each module's error)")
        floats = sorted({s.qtype for m, s in self.ckpt.gguf_linears.items() if s.qtype in FLOAT_TYPES
                         and ".experts." in m})
        if floats:
            warnings.append(f"{', '.join(floats)} experts are quantised to int4 from their float values (lossy; "
                            "the report gives each module's error)")
        rebuilt = self.ckpt.rebuilt_kv_b
        if rebuilt:
            warnings.append(f"{len(rebuilt)} kv_b_proj (e.g. {rebuilt[0]}) rebuilt in float32 from llama.cpp's "
                            "attn_k_b / attn_v_b split: a float dense linear, kept in bf16 unless --dense w4a8")
        derived = sorted(n for n in self.ckpt.tensors if self.ckpt.is_derived(n)
                         and n.removesuffix(".weight") not in rebuilt)
        if derived:
            warnings.append(f"{len(derived)} quantised tensor(s) vLLM loads in float (e.g. {derived[0]}) are "
                            "dequantised to bf16")
        if self.ckpt.tokenizer_note:
            warnings.append(f"no tokenizer written ({self.ckpt.tokenizer_note}); pass the original model's "
                            "tokenizer to vLLM (--tokenizer)")
        return FormatVerdict("gguf", f"gguf {self.ckpt.arch.gguf_name}", evidence=ev, warnings=warnings,
                             extra={"gguf_types": dict(sorted(lin.items()))})

    def gguf_in_place(self, spec: LinearSpec):
        """For convert's requant batches (batch.py): (block bytes TensorInfo U8 [N, bytes per row], ggml
        type) of a quantised linear ``read`` reads, which the C++ decodes in place as gguf's own
        ``dequantize`` does (Q4_0: into ``q4_0_codes``' record); None for a float one, or rows
        llama.cpp permuted."""
        lin = self.ckpt.gguf_linears.get(spec.name)
        if lin is None or lin.rows is not None or lin.qtype not in GGUF_TYPES:
            return None
        return self.ckpt.tensors[lin.key], lin.qtype

    def float_in_place(self, spec: LinearSpec):
        """For convert's requant batches: a float linear's weight, as float_source.float_in_place gives it."""
        from .float_source import float_in_place

        lin = self.ckpt.gguf_linears.get(spec.name)
        if lin is None or lin.rows is not None or lin.qtype not in FLOAT_TYPES:
            return None
        return float_in_place(self.ckpt, spec, lin.key)

    def read(self, spec: LinearSpec, *, unpack: bool = True) -> QuantLinear:
        lin = self.ckpt.gguf_linears.get(spec.name)
        if lin is None:
            raise RefusedError(f"{spec.name}: not a linear of this GGUF checkpoint", tensor=spec.name)
        bias = self.ckpt.get(lin.bias) if lin.bias else None
        if lin.qtype in FLOAT_TYPES:
            w = self.ckpt.get(lin.key).float()
            w = w if lin.rows is None else w[torch.from_numpy(lin.rows)]
            return QuantLinear(spec, None, torch.ones(spec.n, 1), None, bias=bias, dense=w)
        blocks = self.ckpt.block_bytes(lin)
        if lin.qtype == "Q4_0":
            codes, d, zeros = q4_0_codes(blocks, lin.k)
            return QuantLinear(spec, torch.from_numpy(codes), torch.from_numpy(d),
                               None if zeros is None else torch.from_numpy(zeros), bias=bias)
        from gguf import GGMLQuantizationType, quants

        w = quants.dequantize(blocks, GGMLQuantizationType[lin.qtype])
        return QuantLinear(spec, None, torch.ones(spec.n, 1), None, bias=bias,
                           dense=torch.from_numpy(np.ascontiguousarray(w)))


def claims(config: dict | None, header: Header) -> bool:
    return header.container == "gguf"


FORMAT = Format(
    "gguf", claims, lambda ckpt, config, path: GGUFReader(ckpt, config),
    reads="GGUF files (llama.cpp; a .gguf file, a folder holding one, or a split set) of qwen3moe, qwen2moe, llama with "
          "experts (Mixtral), deepseek2 (DeepSeek-V2/V3/R1, Kimi-K2; kv_b_proj rebuilt from attn_k_b/attn_v_b), "
          "glm4moe (GLM-4.5/4.6/4.7) and gpt-oss (MXFP4 experts with their biases, attention sinks): "
          "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4, F16/BF16/F32",
    lossless="Q4_0 modules whose block scales are all >= 0",
    requant="every other type, and Q4_0 modules with negative block scales (llama.cpp's usual)")
