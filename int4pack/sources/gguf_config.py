"""A GGUF file's metadata as the Hugging Face files vLLM reads beside the weights: config.json,
tokenizer.json and tokenizer_config.json, plus the HF parameter names of each architecture.

Sources, by architecture (an architecture not listed is refused by name):

* ``qwen3moe``, ``qwen2moe``, ``llama`` (Mixtral): transformers' own GGUF loader
  (``transformers/integrations/ggml.py`` ``GGUF_CONFIG_MAPPING`` and ``GGUF_CONFIG_DEFAULTS_MAPPING``,
  transformers 5.23.0), restated here because transformers is not a dependency. Where that mapping
  leaves a key out, the llama.cpp key is named beside it (``{arch}.expert_feed_forward_length`` is
  ``LLM_KV_EXPERT_FEED_FORWARD_LENGTH`` in llama.cpp's llama-arch.cpp and
  ``gguf.Keys.LLM.EXPERT_FEED_FORWARD_LENGTH``).
* ``deepseek2`` (DeepSeek-V2/V3/R1, Kimi-K2, GLM-4.7-Flash) and ``glm4moe`` (GLM-4.5/4.6/4.7):
  transformers 5.23 has no GGUF mapping for them, so the mapping is llama.cpp's converter read
  backwards, checked against its loader (the llama.cpp vendored in the llama-cpp-python 0.3.36 sdist):
  ``conversion/deepseek.py`` ``DeepseekV2Model.set_gguf_parameters`` / ``modify_tensors`` and
  ``conversion/glm.py`` ``Glm4MoeModel.set_gguf_parameters``, both over ``conversion/base.py``
  ``TextModel.set_gguf_parameters`` (the shared keys, rope scaling, expert groups, gating function);
  ``src/models/deepseek2.cpp`` and ``src/models/glm4-moe.cpp`` ``load_arch_hparams`` (which keys are
  optional, and llama.cpp's value when one is absent: the value written here, so the rebuilt config
  routes as llama.cpp runs the file) and ``src/llama-context.cpp`` (YaRN's mscale).
* ``gpt-oss``: likewise (transformers 5.23 has no GGUF mapping for it): ``conversion/gpt_oss.py``
  ``GptOssModel`` over ``TextModel.set_gguf_parameters``, checked against ``src/models/openai-moe.cpp``
  ``load_arch_hparams`` (sliding layers by ``load_swa_pattern(ml, 2)``) and ggml's YaRN
  (``ggml_rope_yarn_corr_dims`` floors and ceils the correction dims: ``truncate`` true); the
  config.json keys are those of transformers 5.23's ``GptOssConfig`` (``rope_parameters``,
  ``layer_types``, ``num_local_experts``), which vLLM's gpt_oss.py reads.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from ..errors import RefusedError
from ..families import deepseek, glm4_moe, gpt_oss, mixtral, qwen_moe

__all__ = ["ARCHS", "Arch", "build_config", "f32_value", "tokenizer_files"]

Get = Callable[[str], Any]  # an ``{arch}.``-prefixed metadata key -> its value, or None


def f32_value(x: float) -> float:
    """A float32 metadata value as its shortest decimal (1e-06, not 9.999999974752427e-07)."""
    import numpy as np

    return float(str(np.float32(x)))


class Arch:
    """One GGUF architecture: its HF model type and class, metadata -> config keys, HF parameter names.

    ``defaults``: config keys the file may leave out, at llama.cpp's (or transformers') value for a
    missing key. ``derive(get, cfg, names, path)``: what a key-for-key mapping cannot say (MLA head
    sizes, the gating function, keys read off the tensors present); it may set model_type and
    architectures."""

    def __init__(self, gguf_name: str, model_type: str, cls: str, keys: dict[str, str], modules: tuple[str, ...],
                 defaults: dict | None = None, rope_permuted: bool = False,
                 derive: Callable[[Get, dict, set, str], None] | None = None):
        self.gguf_name, self.model_type, self.cls = gguf_name, model_type, cls
        self.keys, self.modules, self.defaults = keys, modules, defaults or {}
        # llama.cpp's LlamaModel.permute reorders q_proj/k_proj rows for its RoPE (conversion/llama.py)
        self.rope_permuted = rope_permuted
        self.derive = derive


# GGUF_CONFIG_MAPPING's shared part (transformers' qwen2_moe / qwen3_moe rows)
_COMMON = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    # not in transformers' rows (they leave the class default): llama.cpp's keys
    "expert_feed_forward_length": "moe_intermediate_size",
}

# DeepSeek-V3-style MoE (deepseek2, glm4moe): TextModel.set_gguf_parameters writes expert_count from
# n_routed_experts, expert_group_count / expert_group_used_count from n_group / topk_group; the model
# classes add the rest (DeepseekV2Model, Glm4MoeModel)
_DEEPSEEK_MOE = {
    **{k: v for k, v in _COMMON.items() if k not in ("expert_count", "attention.head_count_kv")},
    "expert_count": "n_routed_experts",
    "expert_shared_count": "n_shared_experts",
    "leading_dense_block_count": "first_k_dense_replace",
    "expert_weights_scale": "routed_scaling_factor",
    "expert_weights_norm": "norm_topk_prob",  # written only when true (DeepseekV2Model)
    "expert_group_count": "n_group",
    "expert_group_used_count": "topk_group",
}
# llama.cpp's values when those keys are absent (llama-hparams.h: no dense lead, weights scale 0 =
# not scaled, not renormalised, no expert groups); no MTP block unless nextn_predict_layers says so
_DEEPSEEK_MOE_DEFAULTS = {"first_k_dense_replace": 0, "routed_scaling_factor": 1.0, "norm_topk_prob": False,
                          "n_group": 1, "topk_group": 1, "n_shared_experts": 0, "num_nextn_predict_layers": 0,
                          "attention_bias": False}

# the HF parameter names (without .weight/.bias) of each model class; gguf's TensorNameMap maps
# each to its GGUF name, as vLLM's and transformers' GGUF loaders map the names of the model they build.
# The experts are the merged names gguf maps to blk.N.ffn_{gate,up,down}_exps (split per expert here)
_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_LAYER = ("input_layernorm", "post_attention_layernorm", "mlp.gate",
          "mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")
_TOP = ("model.embed_tokens", "model.norm", "lm_head")
# DeepSeek-V3-style layers: shared experts, dense first layers, the router's score bias (GGUF
# blk.N.exp_probs_b.bias; the converter renames e_score_correction_bias to e_score_correction.bias,
# conversion/base.py), and the MTP block's own tensors (blk.N.nextn.*, N past the main layers)
_DEEPSEEK_FFN = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.gate.e_score_correction",
                 "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj")
NEXTN = ("eh_proj", "enorm", "hnorm", "shared_head.norm", "shared_head.head", "embed_tokens")
# the MLA projections; k_b_proj / v_b_proj are the converter's split of kv_b_proj (gguf_checkpoint.py)
_MLA = ("self_attn.q_proj", "self_attn.q_a_proj", "self_attn.q_a_layernorm", "self_attn.q_b_proj",
        "self_attn.kv_a_proj_with_mqa", "self_attn.kv_a_layernorm", "self_attn.kv_b_proj",
        "self_attn.k_b_proj", "self_attn.v_b_proj", "self_attn.o_proj")


def _layers(*names: str) -> tuple[str, ...]:
    return _TOP + tuple(f"model.layers.{{bid}}.{n}" for n in names)


# llama.cpp's llama_expert_gating_func_type (src/llama-hparams.h; gguf.ExpertGatingFuncType) -> scoring_func
_GATING = {1: "softmax", 2: "sigmoid", 4: "sqrtsoftplus"}


def _scoring(get: Get, arch: str, path: str, absent: str) -> str:
    v = get("expert_gating_func")
    if v is None:
        return absent
    if v not in _GATING:
        raise RefusedError(f"{path}: {arch}.expert_gating_func {v} is a gating function vLLM's model class has "
                           "no scoring_func for", path=path,
                           hint=f"int4pack reads {', '.join(f'{k} ({n})' for k, n in _GATING.items())}.")
    return _GATING[v]


def _deepseek2(get: Get, cfg: dict, names: set, path: str) -> None:
    """MLA head sizes, gating, routing bias and YaRN of a deepseek2 file (DeepseekV2Model)."""
    heads = int(cfg["num_attention_heads"])
    rope = get("rope.dimension_count")
    if rope is None or get("attention.kv_lora_rank") is None:
        raise RefusedError(f"{path}: a deepseek2 GGUF without deepseek2.rope.dimension_count or "
                           "deepseek2.attention.kv_lora_rank (MLA's sizes)", path=path,
                           hint="The file is incomplete; re-download it.")
    # the converter writes MLA as MQA: key_length = kv_lora_rank + rope and value_length = kv_lora_rank,
    # the per-head sizes in key_length_mla / value_length_mla; files from before the split hold the
    # per-head sizes in key_length / value_length (llama_hparams::n_embd_head_k_mla: _mla when both set).
    # Neither: n_embd / n_head, llama.cpp's default
    mla = get("attention.key_length_mla") is not None and get("attention.value_length_mla") is not None
    k_len = get("attention.key_length_mla" if mla else "attention.key_length")
    v_len = get("attention.value_length_mla" if mla else "attention.value_length")
    k_len = int(k_len if k_len is not None else cfg["hidden_size"] // heads)
    cfg.update(qk_rope_head_dim=int(rope), qk_nope_head_dim=k_len - int(rope),
               v_head_dim=int(v_len if v_len is not None else cfg["hidden_size"] // heads),
               num_key_value_heads=heads,  # MLA decompresses to one key/value head per query head
               head_dim=int(rope))  # DeepseekV3Config's head_dim: the rotary part
    # absent: softmax (DeepSeek-V2/V2.5 files), save llama.cpp's rule for GLM-4.7-Flash files (47 or 48
    # layers, 154880 tokens: sigmoid); deepseek2.cpp load_arch_hparams
    glm47_lite = cfg["num_hidden_layers"] in (47, 48) and cfg.get("vocab_size") == 154880
    cfg["scoring_func"] = _scoring(get, "deepseek2", path, "sigmoid" if glm47_lite else "softmax")
    # the score-correction bias exists only where the HF config's topk_method is noaux_tc (DeepSeek-V3's
    # router); vLLM's DeepseekV2MoE creates it iff topk_method == "noaux_tc"
    bias = any(n.endswith(".exp_probs_b.bias") for n in names)
    cfg["topk_method"] = "noaux_tc" if bias else ("group_limited_greedy" if cfg["n_group"] > 1 else "greedy")
    if bias:
        cfg.update(model_type=deepseek.DEEPSEEK_V3_FAMILY.model_types[0], architectures=["DeepseekV3ForCausalLM"])
    scaling = cfg.get("rope_scaling")
    log_mul = get("rope.scaling.yarn_log_multiplier")
    if scaling and scaling["rope_type"] == "yarn" and log_mul is not None:
        # the converter writes 0.1 * mscale_all_dim; llama.cpp takes mscale = 1, save for DeepSeek-V2's
        # mscale == mscale_all_dim != 1 (llama-context.cpp, TAG_DEEPSEEK2_YARN_LOG_MUL_FIX)
        all_dim = f32_value(log_mul / 0.1)
        scaling.update(mscale_all_dim=all_dim, mscale=all_dim if all_dim != 1.0 else 1.0)


def _glm4moe(get: Get, cfg: dict, names: set, path: str) -> None:
    """Partial rotary, attention bias and qk-norm of a glm4moe file (Glm4MoeModel)."""
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    rot = get("rope.dimension_count")  # int(head_dim * partial_rotary_factor); absent: all of the head
    cfg.update(head_dim=head_dim, partial_rotary_factor=(int(rot) / head_dim) if rot is not None else 1.0,
               # create_tensor_qkv loads the biases and glm4-moe.cpp the q/k norms where the file has them
               attention_bias="blk.0.attn_q.bias" in names, use_qk_norm="blk.0.attn_q_norm.weight" in names)
    if _scoring(get, "glm4moe", path, "sigmoid") != "sigmoid":  # vLLM's glm4_moe.py routes by sigmoid only
        raise RefusedError(f"{path}: a glm4moe GGUF whose experts are not gated by sigmoid", path=path,
                           hint="vLLM's Glm4MoeForCausalLM scores experts by sigmoid; this file says otherwise.")


def _gpt_oss(get: Get, cfg: dict, names: set, path: str) -> None:
    """Sliding layers, rope_parameters and attention bias of a gpt-oss file (GptOssModel), as
    transformers' GptOssConfig holds them."""
    layers = int(cfg["num_hidden_layers"])
    pattern = get("attention.sliding_window_pattern")  # llama.cpp: a bool per layer, or n (absent: 2)
    if isinstance(pattern, list):
        sliding = [bool(x) for x in pattern][:layers]
    else:
        n = int(pattern) if pattern is not None else 2
        sliding = [n == 0 or i % n < n - 1 for i in range(layers)]
    cfg["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    rope = {"rope_type": "default"}
    scaling = cfg.pop("rope_scaling", None)
    if scaling:
        rope = {k: v for k, v in scaling.items() if k != "type"}
        if rope["rope_type"] == "yarn":
            rope["truncate"] = True  # ggml_rope_yarn_corr_dims floors and ceils (the module docstring)
    if "rope_theta" in cfg:
        rope["rope_theta"] = cfg.pop("rope_theta")
    cfg["rope_parameters"] = rope
    cfg["attention_bias"] = "blk.0.attn_q.bias" in names  # create_tensor_qkv loads them where they are


def _rope_scaling(get: Get, path: str) -> dict | None:
    """The HF rope_scaling of TextModel.set_gguf_parameters' rope.scaling.* keys (linear, yarn)."""
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = get("rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "type": "linear", "factor": factor}
    if kind != "yarn":
        raise RefusedError(f"{path}: rope scaling {kind!r}, which int4pack does not rebuild", path=path,
                           hint="int4pack rebuilds linear and yarn rope scaling from GGUF metadata.")
    out = {"rope_type": "yarn", "type": "yarn", "factor": factor,
           "original_max_position_embeddings": get("rope.scaling.original_context_length")}
    for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                    ("yarn_ext_factor", "extrapolation_factor"), ("yarn_attn_factor", "attention_factor")):
        v = get(f"rope.scaling.{key}")
        if v is not None:
            out[hf] = v
    return out


ARCHS: dict[str, Arch] = {a.gguf_name: a for a in (
    Arch("qwen3moe", qwen_moe.QWEN3.model_types[0], "Qwen3MoeForCausalLM", {**_COMMON, "attention.key_length": "head_dim"},
         _layers(*_ATTN, "self_attn.q_norm", "self_attn.k_norm", *_LAYER),
         # GGUF_CONFIG_DEFAULTS_MAPPING: llama.cpp's qwen3moe always renormalises the top-k weights
         {"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "attention_bias": False}),
    Arch("qwen2moe", qwen_moe.QWEN2.model_types[0], "Qwen2MoeForCausalLM",
         {**_COMMON, "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
         _layers(*_ATTN, *_LAYER, "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj",
                 "mlp.shared_expert.down_proj", "mlp.shared_expert_gate"),
         # llama.cpp's qwen2moe does not renormalise the top-k weights (Qwen2MoeConfig's default too)
         {"norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []}),
    # llama.cpp writes Mixtral as "llama" with experts; transformers' llama row, plus the expert keys
    Arch("llama", mixtral.FAMILY.model_types[0], "MixtralForCausalLM",
         {k: v for k, v in _COMMON.items() if not k.startswith("expert_")} |
         {"rope.dimension_count": "head_dim", "expert_count": "num_local_experts",
          "expert_used_count": "num_experts_per_tok"},
         _layers(*_ATTN, "input_layernorm", "post_attention_layernorm", "block_sparse_moe.gate",
                 "block_sparse_moe.experts.w1", "block_sparse_moe.experts.w3", "block_sparse_moe.experts.w2"),
         {"sliding_window": None}, rope_permuted=True),
    # DeepSeek-V2 unless the file has the router's score bias (V3, R1, Kimi-K2, GLM-4.7-Flash: _deepseek2)
    Arch("deepseek2", deepseek.DEEPSEEK_V2.model_types[0], "DeepseekV2ForCausalLM",
         {**_DEEPSEEK_MOE, "attention.q_lora_rank": "q_lora_rank", "attention.kv_lora_rank": "kv_lora_rank"},
         _layers(*_MLA, *_LAYER, *_DEEPSEEK_FFN, *NEXTN),
         # q_lora_rank absent: DeepSeek-V2-Lite's q_proj; every layer past the dense lead is MoE
         {**_DEEPSEEK_MOE_DEFAULTS, "q_lora_rank": None, "moe_layer_freq": 1}, derive=_deepseek2),
    Arch("glm4moe", glm4_moe.GLM4_MOE.model_types[0], "Glm4MoeForCausalLM",
         {**_DEEPSEEK_MOE, "attention.head_count_kv": "num_key_value_heads", "attention.key_length": "head_dim"},
         _layers(*_ATTN, "self_attn.q_norm", "self_attn.k_norm", *_LAYER, *_DEEPSEEK_FFN, *NEXTN),
         dict(_DEEPSEEK_MOE_DEFAULTS), derive=_glm4moe),
    # the converter writes intermediate_size as both feed_forward_length and expert_feed_forward_length;
    # llama.cpp reads the latter
    Arch("gpt-oss", gpt_oss.FAMILY.model_types[0], "GptOssForCausalLM",
         {**{k: v for k, v in _COMMON.items() if not k.startswith(("expert_", "feed_forward"))},
          "attention.key_length": "head_dim", "attention.sliding_window": "sliding_window",
          "expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok",
          "expert_feed_forward_length": "intermediate_size"},
         _layers(*_ATTN, "self_attn.sinks", "input_layernorm", "post_attention_layernorm", "mlp.router",
                 "mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj"),
         derive=_gpt_oss),
)}


def build_config(meta: dict, arch_name: str, names: set[str], path: str) -> tuple[dict, Arch]:
    """config.json from the metadata and the tensor names; refuses an architecture int4pack has no rows for."""
    arch = ARCHS.get(arch_name)
    if arch is None:
        raise RefusedError(f"{path}: GGUF architecture {arch_name!r} is not one int4pack reads", path=path,
                           hint="Supported GGUF architectures: " + ", ".join(sorted(ARCHS)) +
                                "; convert the Hugging Face checkpoint of this model instead.")

    def get(key: str):
        return meta.get(f"{arch_name}.{key}")

    cfg: dict = {"architectures": [arch.cls], "model_type": arch.model_type, "torch_dtype": "bfloat16",
                 "hidden_act": "silu", "tie_word_embeddings": "output.weight" not in names}
    for key, hf in arch.keys.items():
        v = get(key)
        if v is not None:
            cfg[hf] = v
    if "vocab_size" not in cfg and isinstance(meta.get("tokenizer.ggml.tokens"), list):
        cfg["vocab_size"] = len(meta["tokenizer.ggml.tokens"])  # llama.cpp's own fallback
    for key, hf in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                    ("padding_token_id", "pad_token_id")):
        v = meta.get(f"tokenizer.ggml.{key}")
        if v is not None:
            cfg[hf] = v
    for k, v in arch.defaults.items():
        cfg.setdefault(k, v)
    if arch_name == "llama" and not get("expert_count"):
        raise RefusedError(f"{path}: a dense llama GGUF (no {arch_name}.expert_count): int4pack converts MoE models",
                           path=path, hint="Pass a Mixtral GGUF, or another MoE architecture: " +
                                           ", ".join(sorted(ARCHS)) + ".")
    experts = arch.keys["expert_count"]  # num_experts, or Mixtral's num_local_experts
    missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", experts) if k not in cfg]
    if missing:
        raise RefusedError(f"{path}: the GGUF metadata has no {', '.join(missing)} "
                           f"({', '.join(f'{arch_name}.' + k for k, v in arch.keys.items() if v in missing)})",
                           path=path, hint="The file is incomplete or not a MoE model; re-download it.")
    nextn = get("nextn_predict_layers")
    if nextn:  # the MTP blocks follow the main layers in block_count (Glm4MoeModel, Glm4MoeLiteModel)
        cfg["num_hidden_layers"] -= int(nextn)
        cfg["num_nextn_predict_layers"] = int(nextn)
    scaling = _rope_scaling(get, path)
    if scaling:
        cfg["rope_scaling"] = scaling
    if arch.derive:
        arch.derive(get, cfg, names, path)
    return cfg, arch


# the pre-tokenizer regexes of llama.cpp's BPE pre-tokenizer types (llama-vocab.cpp), as the HF
# tokenizer.json of those models spells them
_PRE = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
             r"\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+",
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types (gguf.TokenType)


def tokenizer_files(meta: dict, max_len: int | None) -> tuple[dict[str, bytes], str | None]:
    """({file name: bytes}, why not written) of a byte-level BPE tokenizer (``tokenizer.ggml.model``
    gpt2) with a known pre-tokenizer; other tokenizers give no files and the reason."""
    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    tokens, merges = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.merges", [])  # none: no merges
    if model != "gpt2" or pre not in _PRE or not isinstance(tokens, list) or not isinstance(merges, list):
        why = (f"tokenizer.ggml.model {model!r} with pre-tokenizer {pre!r}: int4pack rebuilds byte-level BPE "
               f"tokenizers ({', '.join(sorted(_PRE))}) only")
        return {}, why
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": types[i] == _CONTROL}
             for i, t in enumerate(tokens) if types[i] in (_CONTROL, _USER_DEFINED)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tok = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,  # llama.cpp normalises nothing (transformers' GGUF tokenizer neither)
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": _PRE[pre]}, "behavior": "Isolated", "invert": False},
            byte_level]},
        "post_processor": byte_level, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges},
    }

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
            "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            "bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
            "pad_token": token("padding_token_id"), "unk_token": token("unknown_token_id")}
    if max_len:
        tcfg["model_max_length"] = max_len
    if isinstance(meta.get("tokenizer.chat_template"), str):
        tcfg["chat_template"] = meta["tokenizer.chat_template"]
    return {"tokenizer.json": (json.dumps(tok, ensure_ascii=False) + "\n").encode(),
            "tokenizer_config.json": (json.dumps(tcfg, indent=2, ensure_ascii=False) + "\n").encode()}, None
