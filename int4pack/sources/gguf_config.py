"""A GGUF file's metadata as the Hugging Face files vLLM reads beside the weights: config.json,
tokenizer.json and tokenizer_config.json, plus the HF parameter names of each architecture.

The metadata keys and the config keys they fill are transformers' own GGUF loader's
(``transformers/integrations/ggml.py`` ``GGUF_CONFIG_MAPPING`` and ``GGUF_CONFIG_DEFAULTS_MAPPING``,
transformers 5.23.0), restated here for the MoE architectures int4pack converts, because transformers
is not a dependency. Where that mapping leaves a key out, the llama.cpp key is named beside it
(``{arch}.expert_feed_forward_length`` is ``LLM_KV_EXPERT_FEED_FORWARD_LENGTH`` in llama.cpp's
llama-arch.cpp and ``gguf.Keys.LLM.EXPERT_FEED_FORWARD_LENGTH``). An architecture not listed is
refused by name.
"""

from __future__ import annotations

import json

from ..errors import RefusedError
from ..families import mixtral, qwen_moe

__all__ = ["ARCHS", "Arch", "build_config", "tokenizer_files"]


class Arch:
    """One GGUF architecture: its HF model type and class, metadata -> config keys, HF parameter names."""

    def __init__(self, gguf_name: str, model_type: str, cls: str, keys: dict[str, str], modules: tuple[str, ...],
                 defaults: dict | None = None, rope_permuted: bool = False):
        self.gguf_name, self.model_type, self.cls = gguf_name, model_type, cls
        self.keys, self.modules, self.defaults = keys, modules, defaults or {}
        # llama.cpp's LlamaModel.permute reorders q_proj/k_proj rows for its RoPE (conversion/llama.py)
        self.rope_permuted = rope_permuted


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

# the HF parameter names (without .weight/.bias) of each model class; gguf's TensorNameMap maps
# each to its GGUF name, as vLLM's and transformers' GGUF loaders map the names of the model they build.
# The experts are the merged names gguf maps to blk.N.ffn_{gate,up,down}_exps (split per expert here)
_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_LAYER = ("input_layernorm", "post_attention_layernorm", "mlp.gate",
          "mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")
_TOP = ("model.embed_tokens", "model.norm", "lm_head")


def _layers(*names: str) -> tuple[str, ...]:
    return _TOP + tuple(f"model.layers.{{bid}}.{n}" for n in names)


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
)}


def _meta(meta: dict, key: str, arch: str):
    return meta.get(f"{arch}.{key}")


def build_config(meta: dict, arch_name: str, has_output: bool, path: str) -> tuple[dict, Arch]:
    """config.json from the metadata; refuses an architecture int4pack has no rows for."""
    arch = ARCHS.get(arch_name)
    if arch is None:
        raise RefusedError(f"{path}: GGUF architecture {arch_name!r} is not one int4pack reads", path=path,
                           hint="Supported GGUF architectures: " + ", ".join(sorted(ARCHS)) +
                                "; convert the Hugging Face checkpoint of this model instead.")
    cfg: dict = {"architectures": [arch.cls], "model_type": arch.model_type, "torch_dtype": "bfloat16",
                 "hidden_act": "silu", "tie_word_embeddings": not has_output}
    for key, hf in arch.keys.items():
        v = _meta(meta, key, arch_name)
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
    if arch_name == "llama" and not _meta(meta, "expert_count", arch_name):
        raise RefusedError(f"{path}: a dense llama GGUF (no {arch_name}.expert_count): int4pack converts MoE models",
                           path=path, hint="Pass a Mixtral GGUF, or another MoE architecture: " +
                                           ", ".join(sorted(ARCHS)) + ".")
    experts = arch.keys["expert_count"]  # num_experts, or Mixtral's num_local_experts
    missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", experts) if k not in cfg]
    if missing:
        raise RefusedError(f"{path}: the GGUF metadata has no {', '.join(missing)} "
                           f"({', '.join(f'{arch_name}.' + k for k, v in arch.keys.items() if v in missing)})",
                           path=path, hint="The file is incomplete or not a MoE model; re-download it.")
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
