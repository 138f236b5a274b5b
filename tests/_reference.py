"""Independent reference decoders for the tests, written from docs/formats.md.

They share no code with int4pack: tensors come from the safetensors library, nibbles are
taken apart with numpy, and each format's dequantisation is the producer's formula as the
spec states it. End-to-end tests compare int4pack's output against these.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from safetensors import safe_open

FIXTURES = Path(__file__).resolve().parent / "fixtures"  # real producer checkpoints, see its README
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
# Fixtures of the 2025-26 MoE families (DeepSeek-V3 and relatives, GLM, MiniMax-M2, Kimi,
# Qwen3.5/Qwen3-Next, Llama 4, gpt-oss MXFP4) and of the late-2026 families (Gemma-4,
# DeepSeek-V4, GLM-5.2, MiniMax-M3, Laguna, EXAONE-MoE, GLM-5.3-Flash, Step-3.5 twice, Kimi-K3,
# each with its bf16 float twin `dense_<family>`). Their shapes differ from the 2-layer 4-expert
# Qwen3-MoE/Mixtral set the generic fixture tests assume, so those tests leave them out and each
# family's own tests use them by name.
LATE_2026_FAMILIES = ("gemma4", "deepseekv4", "glmmoedsa", "minimaxm3", "laguna", "exaonemoe",
                      "glm5next", "step3p5", "step3p5flash", "kimik3")
FAMILY_FIXTURES_2026 = frozenset({
    "ct_deepseekv3_w4a16", "ct_glm4moe_w4a16", "ct_minimaxm2_w4a16", "ct_kimik2_w4a16",
    "ct_qwen35moe_w4a16", "ct_qwen35moe_vl_w4a16", "ct_qwen3next_w4a16", "ct_glm4moelite_w4a16",
    "ct_deepseekv32_w4a16", "ct_kimik25_w4a16", "ct_llama4_w4a16", "gptoss_mxfp4",
    *(f"ct_{f}_w4a16" for f in LATE_2026_FAMILIES), *(f"dense_{f}" for f in LATE_2026_FAMILIES),
})
# Fixtures of the other source formats (tests/fixtures/README.md, "Other source formats"): AutoRound,
# MLX, GGUF, FP8, FP4, mixed precision and float sources, read by their own format's tests
FORMAT_FIXTURES = frozenset({
    "autoround_q3_sym_g32", "autoround_q3_sym_g128", "autoround_q3_asym_g32", "autoround_q3_gptq_asym_g32",
    "autoround_q3_awq_g32", "autoround_q3_mixed_g32", "ct_qwen3moe_mixed_w4w8", "ct_qwen3moe_mixed_experts",
    "mlx_q3_4bit_g64", "mlx_q3_mixed_4_8", "gguf_q3_q8_0", "gguf_q3_q4_0", "gguf_q3_q4_k_m", "gguf_dsv3_q4_0",
    "gguf_glm4moe_q8_0", "gguf_gptoss_mxfp4",
    "fp8_qwen3moe_block32", "ct_qwen3moe_fp8_block", "ct_qwen3moe_nvfp4a16", "ct_qwen3moe_mxfp4a16",
    "dense_glm4moe",
})


def checkpoint_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names, else every one in the folder (a
    producer's reference values may lie beside the shards of an indexed checkpoint)."""
    idx = Path(folder) / "model.safetensors.index.json"
    if idx.is_file():
        return sorted(Path(folder) / f for f in set(json.loads(idx.read_text())["weight_map"].values()))
    return sorted(Path(folder).glob("*.safetensors"))


def load_all(folder: Path) -> dict[str, "np.ndarray"]:
    """Every tensor of a folder as numpy (bf16 widened to float32), via the safetensors library."""
    import torch

    out = {}
    for f in checkpoint_files(folder):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                t = fh.get_tensor(k)
                out[k] = t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
    return out


def load_raw(folder: Path) -> dict:
    """Every tensor as a torch tensor in its stored dtype (for bit-exact comparisons)."""
    out = {}
    for f in checkpoint_files(folder):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


def qconfig(folder: Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())["quantization_config"]


def _nibbles_along_rows(words: np.ndarray) -> np.ndarray:
    """int32 [R, C] -> uint8 [8R, C]: row 8r+i holds nibble i of words[r]."""
    u = words.astype(np.int64) & 0xFFFFFFFF
    parts = [(u >> (4 * i)) & 0xF for i in range(8)]
    return np.stack(parts, axis=1).reshape(-1, words.shape[1]).astype(np.int64)


def _nibbles_along_cols(words: np.ndarray) -> np.ndarray:
    """int32 [R, C] -> [R, 8C]: column 8c+i holds nibble i of words[:, c]."""
    u = words.astype(np.int64) & 0xFFFFFFFF
    parts = [(u >> (4 * i)) & 0xF for i in range(8)]
    return np.stack(parts, axis=2).reshape(words.shape[0], -1).astype(np.int64)


def gptq_modules(t: dict) -> list[str]:
    return sorted(k[: -len(".qweight")] for k in t if k.endswith(".qweight"))


def gptq_decode(t: dict, m: str, *, v1: bool = True) -> dict:
    """GPTQ (formats.md §1): W[n,k] = (u[k,n] - z[g_idx[k], n]) * s[g_idx[k], n]; v1 z = stored + 1
    (vLLM's per-nibble reading: only the v1 decode when no stored nibble is 0xF)."""
    u = _nibbles_along_rows(t[f"{m}.qweight"]).T  # [N, K]
    n, k = u.shape
    zs = _nibbles_along_cols(t[f"{m}.qzeros"])[:, :n]  # [G, N]
    if v1:
        assert not (zs == 15).any(), "per-nibble +1 is only the v1 decode when no nibble is 0xF"
    z = (zs + 1) if v1 else zs
    s = t[f"{m}.scales"].astype(np.float64)  # [G, N]
    gi = t[f"{m}.g_idx"].astype(np.int64) if f"{m}.g_idx" in t else np.arange(k) // (k // s.shape[0])
    w = (u - z[gi, :].T) * s[gi, :].T
    return {"u": u, "z": z.T, "s": s.T, "g_idx": gi, "w": w}


def awq_decode(t: dict, m: str, group: int | None = None) -> dict:
    """AWQ GEMM (formats.md §2): nibble i of word j holds column 8j + AWQ_ORDER[i]; no +1.
    ``group`` None: K over the scales' rows."""
    def unpack(words):
        raw = _nibbles_along_cols(words)  # column 8j+i = nibble i
        out = np.empty_like(raw)
        for i, col in enumerate(AWQ_ORDER):
            out[:, col::8] = raw[:, i::8]
        return out

    u = unpack(t[f"{m}.qweight"]).T  # [N, K]
    z = unpack(t[f"{m}.qzeros"])  # [G, N]
    s = t[f"{m}.scales"].astype(np.float64)
    gi = np.arange(u.shape[1]) // (group or u.shape[1] // s.shape[0])
    w = (u - z[gi, :].T) * s[gi, :].T
    return {"u": u, "z": z.T, "s": s.T, "w": w}


def ct_modules(t: dict) -> list[str]:
    mods = [k[: -len(".weight_packed")] for k in t if k.endswith(".weight_packed")]
    mods += [k[: -len(".weight")] for k in t if k.endswith(".weight") and f"{k}_scale" in t]
    return sorted(mods)


def ct_decode(t: dict, m: str, group: int | None) -> dict:
    """compressed-tensors (formats.md §3): q = u - 8 along K; asym zero points packed along N (also
    -8) or stored as int8; ``codes``/``zeros`` are q and zp as unsigned 0..15 (int4pack's records)."""
    if f"{m}.weight_packed" in t:
        n, k = (int(x) for x in t[f"{m}.weight_shape"])
        q = _nibbles_along_cols(t[f"{m}.weight_packed"])[:n, :k] - 8
    else:
        q = t[f"{m}.weight"].astype(np.int64)
        n, k = q.shape
    s = t[f"{m}.weight_scale"].astype(np.float64).reshape(n, -1)
    if f"{m}.weight_zero_point" in t:
        zw = t[f"{m}.weight_zero_point"]
        zp = _nibbles_along_rows(zw)[:n] - 8 if zw.dtype == np.int32 else zw.astype(np.int64)
    else:
        zp = np.zeros_like(s, dtype=np.int64)
    if f"{m}.weight_g_idx" in t:
        gi = t[f"{m}.weight_g_idx"].astype(np.int64)
    elif group is None or s.shape[1] == 1:
        gi = np.zeros(k, dtype=np.int64)
    else:
        gi = np.arange(k) // group
    w = (q - zp[:, gi]) * s[:, gi]
    return {"q": q, "zp": zp, "s": s, "g_idx": gi, "w": w, "codes": q + 8, "zeros": zp + 8}


def w4a8_decode(t: dict, m: str) -> dict:
    """The int4pack output (compressed-tensors int-quantized): W = q * s[:, k // g]."""
    q = t[f"{m}.weight"].astype(np.int64)
    s = t[f"{m}.weight_scale"].astype(np.float64)
    g = q.shape[1] // s.shape[1]
    w = q * np.repeat(s, g, axis=1)
    return {"q": q, "s": s, "w": w, "group": g}


def e2m1(code: int) -> float:
    """OCP MX E2M1 from its bits: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; exponent 0 is
    subnormal (m * 0.5)."""
    s, e, m = code >> 3, (code >> 1) & 3, code & 1
    mag = m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)
    return -mag if s else mag


def mxfp4_decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """gpt-oss MXFP4 (blocks U8 [..., G, 16], E8M0 scales U8 [..., G]) -> float64 [..., G*32]: byte j of a
    block holds value 2j (low nibble) and 2j + 1 (high nibble), times 2^(scale - 127)."""
    lo, hi = blocks & 0xF, blocks >> 4
    codes = np.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], 32)
    vals = np.vectorize(e2m1)(codes).astype(np.float64)
    vals = vals * np.ldexp(1.0, scales.astype(np.int64) - 127)[..., None]
    return vals.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def vllm_detects_w4a8(qcfg: dict) -> bool:
    """vLLM's CompressedTensorsConfig._is_dynamic_token_w4a8_int, as kleidiai.md §4 states it,
    applied to every config group (weights and input activations as vLLM parses them)."""
    if qcfg.get("quant_method") != "compressed-tensors":
        return False
    for grp in qcfg["config_groups"].values():
        w, a = grp.get("weights") or {}, grp.get("input_activations") or {}
        ok_w = (w.get("num_bits") == 4 and w.get("type") == "int" and w.get("symmetric") is True
                and w.get("strategy") in ("group", "channel") and not w.get("dynamic"))
        ok_a = (a.get("num_bits") == 8 and a.get("type") == "int" and a.get("strategy") == "token"
                and a.get("dynamic") is True)
        if not (ok_w and ok_a):
            return False
        if w["strategy"] == "group" and not (isinstance(w.get("group_size"), int) and w["group_size"] > 0):
            return False
    return True


def bitwise_crc32c(data: bytes) -> int:
    """CRC-32C by its definition, one bit at a time (reflected polynomial 0x82F63B78)."""
    c = 0xFFFFFFFF
    for b in data:
        c ^= b
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
    return c ^ 0xFFFFFFFF


class VllmSchemes:
    """Which config group vLLM gives a layer, by the rules of vLLM 0.19.1 and 0.32.0
    (model_executor/layers/quantization/compressed_tensors/utils.py and compressed_tensors.py), written
    here from those rules without int4pack's code:

    * ``ignore`` first: an exact name or ``re:`` (re.match) on the layer name; a fused layer (its last
      name part a key of the model's packed_modules_mapping) is ignored by its shards, which must agree
      (0.32.0 looks at the fused name itself first);
    * then the first target, in config order, equal to the layer name or ``re:``-matching it; then
      (0.19.1) a target contained in the class name, case-insensitively, then the fused layer's shards
      (all must match; the first shard's target wins); 0.32.0 tries the shards before the class;
      0.19.1 raises when nothing matches, 0.32.0 leaves the layer unquantised;
    * an MoE layer asks for ``<prefix>.0.<gate>``, ``.0.<up>``, ``.0.<down>`` (gate_proj/up_proj/down_proj
      in 0.19.1, the model's checkpoint names in 0.32.0) with class FusedMoE, after adding a
      ``FusedMoE`` target that copies ``Linear``'s scheme; the three must agree.
    """

    def __init__(self, qcfg: dict, version: str, packed: dict[str, list[str]]):
        self.version, self.packed = version, packed
        self.ignore = list(qcfg.get("ignore") or [])
        self.targets: dict[str, str] = {}  # target -> config group name
        for name, grp in qcfg["config_groups"].items():
            for t in grp["targets"]:
                self.targets[t] = name

    @staticmethod
    def _hit(value: str, target: str, contains: bool = False) -> bool:
        if target.startswith("re:"):
            return re.match(target[3:], value) is not None
        return target.lower() in value.lower() if contains else target == value

    def _shards(self, name: str) -> list[str] | None:
        last = name.split(".")[-1]
        return [name[: -len(last)] + s for s in self.packed[last]] if last in self.packed else None

    def ignored(self, name: str) -> bool:
        direct = any(self._hit(name, t) for t in self.ignore)
        shards = self._shards(name)
        if shards is None or (self.version != "0.19.1" and direct) or (self.version == "0.19.1" and name in self.ignore):
            return direct
        flags = {any(self._hit(s, t) for t in self.ignore) for s in shards}
        if len(flags) > 1:
            raise ValueError(f"{name}: shards ignored and not ignored")
        return flags.pop()

    def _fused(self, name: str, targets: list[str]) -> str | None:
        key = next((k for k in self.packed if name.endswith(k)), None)
        if key is None:
            return None
        hits = [next((t for t in targets if self._hit(name.replace(key, s), t)), None) for s in self.packed[key]]
        return hits[0] if all(hits) else None

    def _target(self, name: str, cls: str, targets: list[str]) -> str | None:
        by_name = next((t for t in targets if self._hit(name, t)), None)
        by_class = next((t for t in targets if self._hit(cls, t, contains=True)), None)
        steps = (by_name, by_class, self._fused(name, targets)) if self.version == "0.19.1" else \
            (by_name, self._fused(name, targets), by_class)
        found = next((s for s in steps if s is not None), None)
        if found is None and self.version == "0.19.1":
            raise ValueError(f"Unable to find matching target for {name}")
        return found

    def linear(self, name: str, cls: str = "RowParallelLinear") -> str | None:
        """The config group of a linear layer, or None (ignored / unquantised)."""
        if self.ignored(name):
            return None
        t = self._target(name, cls, list(self.targets))
        return None if t is None else self.targets.get(t, self.targets.get("Linear"))

    def moe(self, prefix: str, ckpt_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> str | None:
        names = ("gate_proj", "up_proj", "down_proj") if self.version == "0.19.1" else ckpt_names
        targets = list(self.targets) + (["FusedMoE"] if "Linear" in self.targets and "FusedMoE" not in self.targets
                                        else [])
        got = []
        for n in names:
            name = f"{prefix}.0.{n}"
            if self.ignored(name):
                got.append(None)
                continue
            t = self._target(name, "FusedMoE", targets)
            got.append(None if t is None else self.targets.get(t, self.targets.get("Linear")))
        if len(set(got)) != 1:
            raise ValueError(f"{prefix}: MoE projections under different schemes {got}")
        return got[0]
