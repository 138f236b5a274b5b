"""The lane's driver parts on x86 alone (no emulated vLLM; tests/vllm/lane_inputs.py, which
scripts/vllm_arm_e2e.py runs): what it prepares for a family the packed format refuses, and the
engine options it records for pipeline ranks; and that the lane's code depends on scripts/ one way."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def driver():
    sys.path.insert(0, str(REPO / "tests" / "vllm"))
    import lane_inputs

    return lane_inputs


def test_a_family_the_packed_format_refuses_is_served_in_the_default_format_with_the_reason(driver, tmp_path):
    """gpt-oss with --serve-format kleidiai: convert refuses the packed format (the plugin loads no
    expert biases); the run serves the plain W4A8 folder and records why, instead of stopping."""
    item = driver.resolve_inputs(["gptoss_mxfp4"])[0]
    rec = driver.prepare(item, tmp_path, serve="kleidiai")
    assert rec["serve_format"] == "compressed-tensors"
    assert rec["serve_format_refused"]["serve_format"] == "kleidiai"
    assert "plugin" in rec["serve_format_refused"]["reason"]
    assert "plain_dir" not in rec and Path(rec["model_dir"]).name == "w4a8_group"
    assert (Path(rec["model_dir"]) / "config.json").exists() and not (tmp_path / item["key"] / "packed_group").exists()
    # the probe output it reads is the plain folder's, and no packed-vs-plain comparison is asked for
    assert not driver.probe_path(tmp_path, rec, "t").name.endswith("_kleidiai.json")
    saved = json.loads((tmp_path / item["key"] / "prepare_group_kleidiai.json").read_text())
    assert saved["serve_format_refused"] == rec["serve_format_refused"]


def test_pipeline_ranks_get_a_compilation_mode_that_makes_the_receive_buffers(driver):
    """vLLM's CPU runner makes the receive buffer of a pipeline rank > 0 only in its warm-up, which
    compilation mode NONE skips (enforce_eager selects it): with ranks the probe asks for another mode,
    one that compiles nothing on CPU, and the results say so."""
    assert driver.engine_record(1) == {"enforce_eager": True}
    rec = driver.engine_record(2)
    assert rec["enforce_eager"] is False
    assert rec["compilation_config"]["mode"] not in ("NONE", "VLLM_COMPILE", "DYNAMO_TRACE_ONCE")
    assert rec["compilation_config"]["cudagraph_mode"] == "NONE" and rec["compilation_config"]["backend"] == "eager"
    assert "receive buffer" in rec["why"]


def test_no_test_imports_the_lane_script():
    """scripts/vllm_arm_e2e.py imports the lane's modules (tests/vllm), never the other way round: no
    file under tests/vllm puts scripts/ on its path or imports the script (running it is fine)."""
    bad = []
    for f in sorted(p for p in (REPO / "tests" / "vllm").glob("*.py") if p.name != Path(__file__).name):
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if ("sys.path" in line and "scripts" in line) or re.match(r"\s*(from|import)\s+vllm_arm_e2e\b", line) \
                    or ("spec_from_file_location" in line and "vllm_arm_e2e" in line):
                bad.append(f"{f.name}:{n}")
    assert bad == []


def test_the_emulated_install_is_kept_per_package_content(tmp_path):
    """lane_plugin keeps one emulated site per sdist content: the same package files give the same
    key whatever the archive's timestamps or its tests, a changed package file another."""
    import io
    import tarfile

    from lane_plugin import content_hash

    def sdist(name, files, mtime):
        p = tmp_path / name
        with tarfile.open(p, "w:gz") as tf:
            for path, text in files.items():
                data = text.encode()
                info = tarfile.TarInfo(f"int4pack-0.1.0/{path}")
                info.size, info.mtime = len(data), mtime
                tf.addfile(info, io.BytesIO(data))
        return p

    files = {"int4pack/__init__.py": "x = 1\n", "setup.py": "setup()\n", "tests/test_a.py": "a\n"}
    a = content_hash(sdist("a.tar.gz", files, 1))
    assert content_hash(sdist("b.tar.gz", {**files, "tests/test_a.py": "b\n"}, 2)) == a
    assert content_hash(sdist("c.tar.gz", {**files, "int4pack/__init__.py": "x = 2\n"}, 1)) != a
    assert content_hash(sdist("d.tar.gz", {**files, "int4pack/vllm_plugin/_new.py": ""}, 1)) != a


def test_a_config_fact_vllm_reads_in_the_release_form_is_added_to_the_served_folders_only(driver, tmp_path):
    """MiniMax-M3: vLLM's vision tower reads vision_config.img_token_compression_config, which the
    transformers-saved fixture keeps as two top-level vision fields; its text model reads the release's
    hidden_act (swigluoai), moe_layer_freq and sparse_attention_config, which transformers 5.23 writes
    as silu, mlp_layer_types, layer_types and index_*. The served folders (packed and plain) get the
    release's form of the same facts, recorded; the fixture is not touched."""
    item = driver.resolve_inputs(["ct_minimaxm3_w4a16"])[0]
    rec = driver.prepare(item, tmp_path, serve="kleidiai")
    src = json.loads((item["src"] / "config.json").read_text())
    want = {"temporal_patch_size": 2, "spatial_merge_size": 2}
    assert rec["config_release_form"]["vision_config.img_token_compression_config"] == want
    tc0 = src["text_config"]
    sparse = [i for i, t in enumerate(tc0["layer_types"]) if t != "full_attention"]
    for key in ("model_dir", "plain_dir"):
        cfg = json.loads((Path(rec[key]) / "config.json").read_text())
        assert cfg["vision_config"]["img_token_compression_config"] == want
        tc = cfg["text_config"]
        assert tc["hidden_act"] == "swigluoai"
        assert [i for i, f in enumerate(tc["moe_layer_freq"]) if f] == \
            [i for i, t in enumerate(tc0["mlp_layer_types"]) if t == "sparse"] == [1, 2]
        sac = tc["sparse_attention_config"]
        assert [i for i, f in enumerate(sac["sparse_attention_freq"]) if f] == sparse == [1]
        assert (sac["sparse_num_index_heads"], sac["sparse_index_dim"], sac["sparse_block_size"],
                sac["sparse_topk_blocks"]) == (tc0["index_n_heads"], tc0["index_head_dim"], tc0["index_block_size"],
                                              tc0["index_topk_blocks"])
    assert "img_token_compression_config" not in src["vision_config"] and src["text_config"]["hidden_act"] == "silu"


@pytest.mark.parametrize("fx", ["ct_step3p5flash_w4a16", "ct_deepseekv4_w4a16", "ct_glm5next_w4a16",
                                "ct_kimik3_w4a16"])
def test_the_release_form_holds_the_facts_of_the_transformers_config(driver, tmp_path, fx):
    """Step-3.5-Flash, DeepSeek-V4, GLM-5.3-Flash, Kimi-K3: the names vLLM's classes read (the release's)
    carry the same per-layer facts as the fixture's transformers-saved config (or, where transformers
    keeps no key, what its class computes), and the transformers-only keys that vLLM's config cannot
    take (a per-layer-type rope_parameters, mlp_layer_types of hash_moe/moe) are gone."""
    item = driver.resolve_inputs([fx])[0]
    rec = driver.prepare(item, tmp_path, serve="kleidiai")
    src = json.loads((item["src"] / "config.json").read_text())
    moe = [i for i, t in enumerate((src.get("text_config") or src).get("mlp_layer_types") or []) if t != "dense"]
    for key in ("model_dir", "plain_dir"):
        cfg = json.loads((Path(rec[key]) / "config.json").read_text())
        if fx.startswith("ct_kimik3"):  # no linear_attn_config: transformers' Kimi-Linear runs MLA in every layer
            tc0, lac = src["text_config"], cfg["text_config"]["linear_attn_config"]
            assert tc0["linear_attn_config"] is None and lac["kda_layers"] == []
            assert lac["full_attn_layers"] == [i + 1 for i in range(tc0["num_hidden_layers"])]
        elif fx.startswith("ct_glm5next"):  # transformers' class: hyper-connections, no RoPE, sigmoid + bias
            tc, tc0 = cfg["text_config"], src["text_config"]
            assert tc["mhc"] is (tc0["hc_mult"] > 1) is True and tc["mla_use_nope"] is (tc0["qk_rope_head_dim"] == 0)
            assert (tc["scoring_func"], tc["topk_method"]) == ("sigmoid", "noaux_tc")
        elif fx.startswith("ct_step3p5"):
            assert [int(i) for i in cfg["moe_layers_enum"].split(",")] == moe
            assert (cfg["moe_num_experts"], cfg["moe_top_k"]) == (src["n_routed_experts"], src["num_experts_per_tok"])
            assert cfg["moe_router_activation"] == "sigmoid" and "rope_parameters" not in cfg
            assert cfg["rope_theta"] == [src["rope_parameters"][t]["rope_theta"] for t in src["layer_types"]]
        else:
            hashed = [i for i, t in enumerate(src["mlp_layer_types"]) if t == "hash_moe"]
            assert list(range(cfg["num_hash_layers"])) == hashed
            assert [r > 0 for r in cfg["compress_ratios"]] == [t != "sliding_attention" for t in src["layer_types"]]
            assert cfg["topk_method"] == "noaux_tc" and "mlp_layer_types" not in cfg


def test_hybrid_mla_families_ask_for_no_prefix_caching(driver):
    """GLM-5.3-Flash and Kimi-K3 (linear attention beside MLA) start on vLLM's CPU platform only with
    prefix caching off from the start; other configs get no extra option."""
    import probe

    for fx in ("ct_glm5next_w4a16", "ct_kimik3_w4a16"):
        cfg = json.loads((driver.FIXTURES / fx / "config.json").read_text())
        assert probe.model_engine_options(cfg) == {"enable_prefix_caching": False}
    assert probe.model_engine_options(json.loads((driver.FIXTURES / "ct_qwen3moe_w4a16" / "config.json").read_text())) == {}


def test_the_probes_call_counter_keeps_the_signature_the_plugin_reads():
    """The probe counts calls of vLLM's W4A8 MoE method by wrapping it; the plugin decides from that
    method's signature whether vLLM hands it the token ids (DeepSeek-V4's hash-routed layers)."""
    import probe
    from int4pack.vllm_plugin._routing import takes_input_ids

    class Method:
        def apply_monolithic(self, layer, x, router_logits, input_ids=None):
            return input_ids

    calls = {"w4a8_moe_apply": 0}
    Method.apply_monolithic = probe.counted(calls, "w4a8_moe_apply", Method.apply_monolithic)
    assert takes_input_ids(Method) and Method().apply_monolithic(None, None, None, input_ids=7) == 7
    assert calls["w4a8_moe_apply"] == 1
