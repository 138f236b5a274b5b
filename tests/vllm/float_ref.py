"""The vLLM lane's float references (scripts/vllm_arm_e2e.py): the float32 folder of a source's
dequantised weights, the W4A8 weights a converted folder holds, the mirror folder (those weights as
the kernel computes them), and the float64 forward that scores vLLM's logprobs: ``FloatRef``, the
hand-written forward of Qwen3-MoE and Mixtral, or transformers' own class (hf_reference.py).
"""

from __future__ import annotations

import glob
import json
import math
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hf_reference import fake_quant_int8_rows  # the kernel's int8 activations


def dequantised_source(src: Path) -> tuple[dict, dict[str, torch.Tensor], set[str]]:
    """(config, float32 tensors with every quantised linear dequantised, quantised module names)."""
    from int4pack.sources.containers import open_checkpoint
    from int4pack.formats import open_reader

    # the container its files need (a .gguf file, an MLX folder, safetensors), as convert opens it
    with open_checkpoint(src) as ckpt:
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


# model types whose transformers class holds the experts fused and loads no per-expert names:
# gate/up columns interleaved (gpt-oss: GptOssExperts.gate_up_proj [E, H, 2I], gate = [..., ::2]) or
# concatenated (Llama 4: Llama4TextExperts.gate_up_proj [E, H, 2I], ``chunk(2, -1)``: gate = the first I)
INTERLEAVED = {"gpt_oss"}
CONCATENATED = {"llama4", "llama4_text"}
# ... or as ``nn.functional.linear`` takes them, with no conversion mapping to fuse per-expert names
# (Gemma 4 in transformers 5.23: Gemma4TextExperts.gate_up_proj [E, 2I, H], gate = the first I rows)
STACKED = {"gemma4", "gemma4_text", "step3p5"}  # Step3p7Experts (hf_reference.OWN_CLASS) likewise
_PER_EXPERT = re.compile(r"^(?P<p>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.(?P<x>weight|bias)$")


def hf_layout(cfg: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert [N, K] weights and biases -> the fused tensors of a class in ``INTERLEAVED`` or
    ``CONCATENATED`` (``<p>.gate_up_proj`` [E, H, 2I]: gate at even columns, or gate in the first I
    columns and up in the last I; ``gate_up_proj_bias`` [E, 2I], ``down_proj`` [E, I, H],
    ``down_proj_bias`` [E, H]) or ``STACKED`` (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]);
    other model types as they are."""
    mt = (cfg.get("text_config") or cfg).get("model_type", cfg.get("model_type"))
    if mt not in INTERLEAVED | CONCATENATED | STACKED:
        return tensors
    out, per = {}, {}
    for k, v in tensors.items():
        m = _PER_EXPERT.match(k)
        if m:
            per.setdefault(m["p"], {})[(int(m["e"]), m["proj"], m["x"])] = v
        else:
            out[k] = v
    for p, d in per.items():
        n_e = 1 + max(e for e, _, _ in d)
        for x, suffix in (("weight", ""), ("bias", "_bias")):
            if (0, "gate_proj", x) not in d:
                continue
            gate = torch.stack([d[(e, "gate_proj", x)] for e in range(n_e)])
            up = torch.stack([d[(e, "up_proj", x)] for e in range(n_e)])
            if mt in INTERLEAVED:  # rows g0 u0 g1 u1 ..
                gu = torch.stack([gate, up], dim=2).reshape(n_e, 2 * gate.shape[1], *gate.shape[2:])
            else:  # rows g0 g1 .. u0 u1 ..
                gu = torch.cat([gate, up], dim=1)
            down = torch.stack([d[(e, "down_proj", x)] for e in range(n_e)])
            turn = x == "weight" and mt not in STACKED
            out[f"{p}.gate_up_proj{suffix}"] = gu.transpose(1, 2).contiguous() if turn else gu
            out[f"{p}.down_proj{suffix}"] = down.transpose(1, 2).contiguous() if turn else down
    return out


def write_float_folder(src: Path, dst: Path) -> set[str]:
    cfg, tensors, qmods = dequantised_source(src)
    tensors = hf_layout(cfg, tensors)
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


_STORED = re.compile(r"^(?P<b>.+\.experts\.\d+)\.(?P<leaf>gate_up_proj|down_proj)\.(?P<x>weight|weight_scale|bias)$")


def _per_expert_names(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A W4A8 folder in gpt-oss's per-expert layout (docs/families.md: ``experts.E.gate_up_proj.weight``
    [H, 2I] = [gate; up] transposed, ``weight_scale`` [H/g, 2I], ``bias`` [2I]; ``down_proj`` [I, H])
    under the per-expert names [N, K] the other W4A8 folders use; any other folder as it is."""
    if not any(_STORED.match(k) and k.endswith(".gate_up_proj.weight") for k in t):
        return t
    out = {}
    for k, v in t.items():
        m = _STORED.match(k)
        if not m:
            out[k] = v
        elif m["leaf"] == "down_proj":
            out[f"{m['b']}.down_proj.{m['x']}"] = v if m["x"] == "bias" else v.T.contiguous()
        else:
            i = v.shape[-1] // 2
            for proj, part in (("gate_proj", slice(0, i)), ("up_proj", slice(i, 2 * i))):
                out[f"{m['b']}.{proj}.{m['x']}"] = v[part] if m["x"] == "bias" else v[:, part].T.contiguous()
    return out


def dequantised_w4a8(folder: Path) -> tuple[dict[str, torch.Tensor], set[str]]:
    """float tensors of a W4A8 int-quantized folder (int8 weight * scale per group), quantised names."""
    t = _per_expert_names(load_tensors(folder))
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
        tw = self.r(tw)  # vLLM's CPU softmax top-k computes the weights in the logits' dtype (hf_reference.SOFTMAX_TOPK_BF16)
        out = torch.zeros_like(h)
        for t in range(h.shape[0]):
            for j in range(topk):
                out[t] += tw[t, j] * self.expert(pre, int(ti[t, j]), h[t:t + 1])[0]
        return self.r(out)


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
    from hf_reference import model_class, text_model

    cfg, prefix, _ = text_model(json.loads((folder / "config.json").read_text()))
    cls = model_class(cfg).__name__
    of = f" on the {prefix.rstrip('.')} of the wrapper" if prefix else ""
    return f"transformers {transformers.__version__} {cls}{of} (tests/vllm/hf_reference.py), float64"


def write_mirror_folder(w4a8: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A float folder of a W4A8 folder's dequantised weights (``dequantised_w4a8``: float64, the rest
    as stored) with its config less the quantisation: what the transformers mirror loads."""
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((w4a8 / "config.json").read_text())
    tensors = hf_layout(cfg, tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg.pop("quantization_config", None)
    cfg.pop("compression_config", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def greedy(ref: FloatRef, prompt, n) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(ref.logprobs(ids)[-1].argmax()))
    return ids[len(prompt):]
