"""The vLLM lane's inputs (scripts/vllm_arm_e2e.py): the fixtures it covers, a checkpoint folder or
fixture name resolved to a work folder, and each input prepared on x86: converted with
``int4pack.convert`` (plain W4A8 and, for ``--serve-format kleidiai``, the packed format), edited
for a negative control, with the float folder the references read; where each probe output goes;
the engine options recorded for pipeline ranks.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # the fixtures folder is named once, by the tests' references

from _reference import FIXTURES  # noqa: E402
from controls import CONTROL_TAG, CONTROLS, write_control_copy, write_swapped_copy  # noqa: E402
from float_ref import write_float_folder  # noqa: E402
from lane_checks import group_label  # noqa: E402
from probe import PP_COMPILATION  # noqa: E402


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



def resolve_inputs(args: list[str]) -> list[dict]:
    """PATH_OR_FIXTURE -> {"input", "src", "key" (unique folder name under --work)}."""
    out, keys = [], set()
    for a in args or list(CASES):
        p = Path(a)
        if p.exists() and is_checkpoint(p):
            src = p.resolve()
        elif is_checkpoint(FIXTURES / a):
            src = FIXTURES / a
        else:
            raise SystemExit(f"{a}: not a checkpoint (no config.json, no .gguf file) and not a fixture in {FIXTURES} "
                             f"({', '.join(COVERS)})")
        key = re.sub(r"[^A-Za-z0-9_.-]", "_", src.name)
        n = 1
        while key in keys:
            n += 1
            key = f"{src.name}_{n}"
        keys.add(key)
        out.append({"input": a, "src": src, "key": key})
    return out


def is_checkpoint(p: Path) -> bool:
    """A folder with a config.json, a GGUF file, or a folder holding one (GGUF carries its config)."""
    return (p / "config.json").exists() or p.suffix == ".gguf" and p.is_file() or \
        p.is_dir() and any(p.glob("*.gguf"))


def is_w4a8_int(src: Path) -> bool:
    """Already the target format: compressed-tensors int-quantized, int4 weights, int8 activations."""
    if not (src / "config.json").exists():
        return False  # a GGUF source: always converted
    cfg = json.loads((src / "config.json").read_text())
    qc = cfg.get("quantization_config") or cfg.get("compression_config") or {}
    if qc.get("format") != "int-quantized":
        return False
    for grp in (qc.get("config_groups") or {}).values():
        w, a = grp.get("weights") or {}, grp.get("input_activations") or {}
        if w.get("num_bits") != 4 or a.get("num_bits") != 8:
            return False
    return bool(qc.get("config_groups"))


def prepare(item: dict, work: Path, group_size="auto", reuse: bool = False, swap: bool = False,
            serve: str = "compressed-tensors", tp: int = 1, control: str | None = None) -> dict:
    """Convert (or take as is) one input; write its float folder. Returns the record. ``serve``
    kleidiai: model_dir is the packed serving format (``tp`` > 1: converted with --tensor-parallel
    tp), plain_dir the W4A8 folder it equals."""
    import int4pack
    from int4pack.errors import RefusedError

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
        try:
            int4pack.convert(src, d / f"packed_{glabel}{ptp}", overwrite=True, group_size=group_size,
                             serve_format=serve, tensor_parallel=tp)
        except RefusedError as e:  # a family the plugin does not serve: the default format only, and why
            rec["serve_format"] = "compressed-tensors"
            rec["serve_format_refused"] = {"serve_format": serve, "reason": str(e)}
        else:
            rec["plain_dir"], rec["model_dir"] = rec["model_dir"], str(d / f"packed_{glabel}{ptp}")
    patch = {k: v for key in ("model_dir", "plain_dir") if rec.get(key) and Path(rec[key]).is_relative_to(d)
             for k, v in release_form(Path(rec[key])).items()}
    if patch:
        rec["config_release_form"] = patch
    if control:  # vLLM serves edited copies (packed and plain alike); the references stay the model's
        for key in ("model_dir", "plain_dir"):
            if rec.get(key):
                rec[key] = str(write_control_copy(Path(rec[key]), d / f"{Path(rec[key]).name}_{control}", control))
        rec["negative_control"] = CONTROLS[control]
    rec["convert_s"] = round(time.perf_counter() - t, 2)
    write_float_folder(src, d / "float")
    saved.write_text(json.dumps(rec) + "\n")
    return rec


def _minimax_m3(cfg: dict) -> dict:
    """MiniMax-M3: vLLM's vision tower reads ``vision_config.img_token_compression_config``
    (models/minimax_m3/common/vision_tower.py:45, as MiniMax's release config has it); transformers
    5.23's config keeps its two fields at the top of ``vision_config``. Its text model (vLLM's
    transformers_utils/configs/minimax_m3.py, defaults "mirror the MiniMax-M3-preview checkpoint")
    reads the release's ``hidden_act: swigluoai`` (nvidia/model.py:177 refuses any other; transformers
    5.23 rewrites it to ``silu`` and computes SwiGLU-OAI whatever it says), ``moe_layer_freq`` and
    ``sparse_attention_config`` (transformers 5.23 folds them into ``mlp_layer_types``, ``layer_types``
    and ``index_*``; without them vLLM takes its 60-layer defaults: 3 dense layers, no sparse one)."""
    added = {}
    vc = cfg.get("vision_config")
    if isinstance(vc, dict) and "img_token_compression_config" not in vc:
        vc["img_token_compression_config"] = {k: vc[k] for k in ("temporal_patch_size", "spatial_merge_size")
                                              if k in vc}
        added["vision_config.img_token_compression_config"] = vc["img_token_compression_config"]
    tc = cfg.get("text_config")
    if not isinstance(tc, dict):
        return added
    if tc.get("hidden_act") != "swigluoai":
        tc["hidden_act"] = added["text_config.hidden_act"] = "swigluoai"
    if "moe_layer_freq" not in tc and isinstance(tc.get("mlp_layer_types"), list):
        tc["moe_layer_freq"] = [0 if t == "dense" else 1 for t in tc["mlp_layer_types"]]
        added["text_config.moe_layer_freq"] = tc["moe_layer_freq"]
    if "sparse_attention_config" not in tc and isinstance(tc.get("layer_types"), list):
        sparse = [1 if t == "minimax_m3_sparse" else 0 for t in tc["layer_types"]]
        tc["sparse_attention_config"] = {
            "use_sparse_attention": any(sparse), "sparse_index_dim": tc.get("index_head_dim"),
            "sparse_num_index_heads": tc.get("index_n_heads"), "sparse_topk_blocks": tc.get("index_topk_blocks"),
            "sparse_block_size": tc.get("index_block_size"), "sparse_disable_index_value": sparse,
            "sparse_score_type": "max", "sparse_init_block": 0, "sparse_local_block": tc.get("index_local_blocks"),
            "sparse_attention_freq": sparse}
        added["text_config.sparse_attention_config"] = tc["sparse_attention_config"]
    return added


def _step3p5(cfg: dict) -> dict:
    """Step-3.5-Flash: vLLM's step3p5.py and its config (transformers_utils/configs/step3p5.py,
    0.32.0) read the release's names: ``num_attention_groups``, ``attention_other_setting`` (the
    sliding layers' heads), ``moe_num_experts`` / ``moe_top_k`` (defaults 16 / 4),
    ``moe_router_activation`` (default softmax), ``moe_layers_enum`` (default: every layer but the
    first) and ``rope_theta`` (per layer); transformers 5.23's config holds the same facts as
    ``num_key_value_heads``, ``per_layer_config``, ``n_routed_experts``, ``num_experts_per_tok``,
    ``mlp_layer_types`` and a per-layer-type ``rope_parameters`` (which transformers hands vLLM as
    ``rope_scaling``: unhashable in get_rope, rotary_embedding/__init__.py:84), and its per-layer form
    makes a global ``num_attention_heads`` an error (AmbiguousGlobalPerLayerAttributeError,
    step3p5.py:432). The router is sigmoid (Step3p7TopKRouter in transformers 5.23)."""
    per = cfg.get("per_layer_config")
    if not isinstance(per, dict) or "attention_other_setting" in cfg:
        return {}
    sliding = {int(i): v.get("num_attention_heads") for i, v in per.items()}
    heads = next(iter(sliding.values()))
    rope = cfg["rope_parameters"]
    added = {"num_attention_groups": cfg["num_key_value_heads"],
             "attention_other_setting": {"attention_type": "sliding_attention", "num_attention_heads": heads,
                                         "num_attention_groups": cfg["num_key_value_heads"],
                                         "head_dim": cfg["head_dim"]},
             "rope_theta": [rope[t]["rope_theta"] for t in cfg["layer_types"]],
             "moe_num_experts": cfg["n_routed_experts"], "moe_top_k": cfg["num_experts_per_tok"],
             "moe_router_activation": "sigmoid",
             "moe_layers_enum": ",".join(str(i) for i, t in enumerate(cfg["mlp_layer_types"]) if t != "dense")}
    cfg.update(added)
    for k in ("per_layer_config", "num_sliding_attention_heads", "rope_parameters"):
        added[f"{k} (removed)"] = cfg.pop(k, None)
    return added


def _deepseek_v4(cfg: dict) -> dict:
    """DeepSeek-V4: vLLM's config (transformers_utils/configs/deepseek_v4.py, 0.32.0) keeps the
    release's V3-flavoured names, which its CPU model reads (models/deepseek_v4/cpu/model.py:148,163;
    attention.py:233): ``num_hash_layers``, ``compress_ratios`` (per layer: 0 sliding, else the
    compression) and ``topk_method: noaux_tc`` (else no score-correction bias is built).
    transformers 5.23 folds them into ``mlp_layer_types`` (hash_moe / moe) and ``layer_types`` +
    ``compress_rates``, which the transformers under vLLM validates against its generic sparse/dense
    (configuration_utils.py validate_layer_type: a ValueError at load)."""
    mlp, att, rates = cfg.get("mlp_layer_types"), cfg.get("layer_types"), cfg.get("compress_rates") or {}
    if not isinstance(mlp, list) or "num_hash_layers" in cfg:
        return {}
    added = {"num_hash_layers": sum(1 for t in mlp if t == "hash_moe"),
             "compress_ratios": [0 if t == "sliding_attention" else rates[t] for t in att],
             "topk_method": "noaux_tc"}
    cfg.update(added)
    for k in ("mlp_layer_types", "layer_types", "compress_rates"):
        added[f"{k} (removed)"] = cfg.pop(k, None)
    return added


def _glm5_next(cfg: dict) -> dict:
    """GLM-5.3-Flash: vLLM's glm5next class (models/glm5next/common/model.py, 0.32.0) reads release
    keys that transformers 5.23's Glm5NextTextConfig neither keeps nor derives: ``mhc`` (line 369;
    transformers always runs the hyper-connection streams, ``hc_mult`` of them), ``mla_use_nope``
    (line 400: attention without RoPE, the fixture's ``qk_rope_head_dim`` 0), ``topk_method`` /
    ``scoring_func`` (lines 245, 301: transformers' Glm5NextTopKRouter scores with a sigmoid plus
    ``e_score_correction_bias``), ``indexer_rope_interleave`` (attention.py:514; no RoPE dimension
    here, so either value computes the same) and ``num_nextn_predict_layers`` (no MTP layer)."""
    tc = cfg.get("text_config")
    if not isinstance(tc, dict) or "mhc" in tc:
        return {}
    added = {"mhc": int(tc.get("hc_mult") or 1) > 1, "mla_use_nope": not tc.get("qk_rope_head_dim"),
             "topk_method": "noaux_tc", "scoring_func": "sigmoid", "indexer_rope_interleave": False,
             "num_nextn_predict_layers": 0}
    tc.update(added)
    return {f"text_config.{k}": v for k, v in added.items()}


def _kimi_k3(cfg: dict) -> dict:
    """Kimi-K3: vLLM's class (models/kimi_k3/nvidia/model.py, 0.32.0) is a hybrid model whatever the
    layers are, and sizes its KDA state from ``text_config.linear_attn_config`` when the KV cache is
    planned (``get_mamba_state_shape_from_config``, model.py:1668: a TypeError on None). The
    release's config lists its KDA and full-attention layers there; the fixture has no KDA layer (its
    producer class cannot build one without the fla-core kernels), which the same key says as the
    release spells it: ``kda_layers`` empty, every layer (1-based) in ``full_attn_layers``, the KDA
    head count and size those of the attention, and the release's short-conv width 4."""
    tc = cfg.get("text_config")
    if not isinstance(tc, dict) or tc.get("linear_attn_config") is not None:
        return {}
    tc["linear_attn_config"] = {"kda_layers": [], "full_attn_layers": list(range(1, tc["num_hidden_layers"] + 1)),
                                "num_heads": tc["num_attention_heads"], "head_dim": tc["qk_nope_head_dim"],
                                "short_conv_kernel_size": 4}
    return {"text_config.linear_attn_config": tc["linear_attn_config"]}


# facts a transformers-saved config spells otherwise than the release's config that vLLM's class
# reads: written in the release's form too in the served folders (their weights untouched, the
# references unchanged), and recorded in the result (config_release_form)
RELEASE_FORM = {"minimax_m3_vl": _minimax_m3, "step3p5": _step3p5, "deepseek_v4": _deepseek_v4,
                "glm5_next": _glm5_next, "kimi_k3": _kimi_k3}


def release_form(folder: Path) -> dict:
    """Add to a served folder's config.json what RELEASE_FORM names for its model type; the keys added."""
    p = folder / "config.json"
    cfg = json.loads(p.read_text())
    fix = RELEASE_FORM.get(cfg.get("model_type"))
    added = fix(cfg) if fix else {}
    if added:
        p.write_text(json.dumps(cfg, indent=2) + "\n")
    return added


def probe_path(work: Path, rec: dict, tag: str, plain: bool = False) -> Path:
    """The probe output of rec's model_dir (``plain``: of the plain W4A8 folder it is compared with)."""
    packed = rec.get("serve_format") == "kleidiai" and not plain
    return work / rec["key"] / f"probe_{tag}{CONTROL_TAG.get(rec.get('negative_control'), '')}" \
                               f"{'_kleidiai' if packed else ''}.json"


def engine_record(pp: int) -> dict:
    """The compilation options the probe passes to LLM(...): enforce_eager, except with pipeline ranks
    (a compilation mode that compiles nothing on CPU, so that vLLM makes the ranks' receive buffers:
    tests/vllm/probe.py PP_COMPILATION says why)."""
    if pp <= 1:
        return {"enforce_eager": True}
    return {"enforce_eager": False, "compilation_config": {k: v for k, v in PP_COMPILATION.items() if k != "enforce_eager"},
            "why": "pipeline_parallel_size > 1: vLLM's CPU runner makes the receive buffer of rank > 0 only in its "
                   "warm-up, which compilation mode NONE (enforce_eager) skips; STOCK_TORCH_COMPILE compiles "
                   "nothing on CPU, TorchDynamo stays disabled"}
