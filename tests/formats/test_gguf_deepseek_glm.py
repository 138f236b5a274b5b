"""The GGUF reader on deepseek2 (DeepSeek-V2/V3) and glm4moe (GLM-4.5) files as llama.cpp's converter
writes them: files written here from known float weights with the converter's keys, names and kv_b_proj
split (tests/_gguf_files.py: gguf's own writer and quantiser), and the converter's own output
(tests/fixtures/gguf_dsv3_q4_0, gguf_glm4moe_q8_0). Values are checked against the floats drawn and
against gguf.quants.dequantize; configs key by key against the config.json the converter read."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gguf  # noqa: E402
from gguf import quants  # noqa: E402

import int4pack  # noqa: E402
from _gguf_files import (deepseek_v3_config, glm4_moe_config, hf_weights, kv_b_split,  # noqa: E402
                         write_converted)
from _reference import FIXTURES  # noqa: E402
from int4pack.errors import InputError  # noqa: E402
from int4pack.families import family  # noqa: E402
from int4pack.formats import open_reader  # noqa: E402
from int4pack.sources.containers import open_checkpoint  # noqa: E402
from int4pack.verify import verify  # noqa: E402

# config.json keys the converter carries into the GGUF (conversion/base.py, deepseek.py, glm.py)
MOE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "first_k_dense_replace", "num_attention_heads", "num_key_value_heads", "n_shared_experts",
            "n_routed_experts", "n_group", "topk_group", "num_experts_per_tok", "norm_topk_prob",
            "routed_scaling_factor", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
            "model_type", "architectures")
DSV3_KEYS = MOE_KEYS + ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                        "scoring_func", "topk_method")
GLM_KEYS = MOE_KEYS + ("head_dim", "partial_rotary_factor", "attention_bias", "use_qk_norm",
                       "num_nextn_predict_layers")
YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
VARIANTS = {
    "deepseek-v3": deepseek_v3_config(),
    "deepseek-v3-yarn": deepseek_v3_config(rope_scaling=YARN),
    # DeepSeek-V2: softmax, no score bias, group-limited, mscale = mscale_all_dim = 0.707
    "deepseek-v2": deepseek_v3_config(
        architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", scoring_func="softmax",
        topk_method="group_limited_greedy", norm_topk_prob=False, routed_scaling_factor=16.0,
        rope_scaling={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707}),
    # DeepSeek-V2-Lite: no q_lora_rank (q_proj), one group
    "deepseek-v2-lite": deepseek_v3_config(
        architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", q_lora_rank=None, scoring_func="softmax",
        topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0),
}


def _producer(path: Path) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32, through gguf's own reader and dequantize."""
    return {t.name: np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)
            for t in gguf.GGUFReader(path).tensors}


def _file(tmp_path: Path, arch: str, hf: dict, seed: int = 0, **kw) -> tuple[Path, dict, dict]:
    """(path, HF weights drawn, GGUF name -> array written) of a file the converter's way (write_converted)."""
    w = hf_weights(hf, seed=seed)
    p = tmp_path / "m.gguf"
    return p, w, write_converted(p, arch, hf, w, **kw)


def _same_floats(ck, r, w: dict[str, np.ndarray]) -> None:
    """Every tensor of ``w`` (HF name -> float32 written: F32, experts F16) read back as written."""
    specs = r.linears()
    for name, x in w.items():
        mod = name[: -len(".weight")]
        if mod in specs:
            got = r.read(specs[mod]).dequantize().numpy()
            want = x.astype(np.float16).astype(np.float32) if ".experts." in name else x
        else:
            got, want = ck.get(name).float().numpy(), x
        assert np.array_equal(got, want), name


def _gguf_value(ref: dict[str, np.ndarray], ck, mod: str) -> np.ndarray:
    """gguf's dequantisation of the GGUF tensor a linear comes from (its expert's slice of fused experts)."""
    want = ref[ck.gguf_linears[mod].source]
    return want[int(mod.split(".experts.")[1].split(".")[0])] if ".experts." in mod else want


def _same_config(got: dict, want: dict, keys) -> None:
    for k in keys:
        assert got[k] == want[k], (k, got.get(k), want[k])
    theta = want["rope_parameters"]["rope_theta"] if "rope_parameters" in want else want["rope_theta"]
    assert got["rope_theta"] == theta
    # the routing vLLM's model class builds from each config (families/): the same
    assert family(got["model_type"]).facts(got) == family(want["model_type"]).facts(want)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_deepseek2_config_is_the_converters_source(tmp_path, variant):
    hf = VARIANTS[variant]
    p, _, _ = _file(tmp_path, "deepseek2", hf)
    with open_checkpoint(p) as ck:
        c = ck.config
    _same_config(c, hf, DSV3_KEYS)
    assert c.get("rope_scaling", {}) == {**hf.get("rope_scaling", {}), **({"rope_type": "yarn"} if "rope_scaling" in hf else {})}
    assert c["moe_layer_freq"] == 1 and c["num_nextn_predict_layers"] == 0  # the converter drops MTP (skip_mtp)


def test_deepseek2_tensors_are_the_floats_written(tmp_path):
    """F32 matrices and F16 experts: every tensor comes back as drawn; kv_b_proj from the split parts."""
    p, w, _ = _file(tmp_path, "deepseek2", deepseek_v3_config(), 5, expert_type="F16", linear_type="F32")
    with open_checkpoint(p) as ck:
        r = open_reader(ck)
        specs = r.linears()
        assert not any(".k_b_proj" in n or ".v_b_proj" in n for n in ck.tensors)
        _same_floats(ck, r, w)
        assert specs["model.layers.0.self_attn.kv_b_proj"].bits == 16  # float: kept in bf16 (precision.py)


def test_kv_b_rebuilt_is_what_the_converter_split(tmp_path):
    """Q8_0 parts: the converter's split (kv_b_split, its torch code) of the rebuilt kv_b_proj gives
    gguf's dequantisation of attn_k_b and attn_v_b exactly."""
    hf = deepseek_v3_config()
    p, _, _ = _file(tmp_path, "deepseek2", hf, 6, linear_type="Q8_0")
    ref = _producer(p)
    with open_checkpoint(p) as ck:
        r = open_reader(ck)
        specs = r.linears()
        for layer in range(hf["num_hidden_layers"]):
            kv = r.read(specs[f"model.layers.{layer}.self_attn.kv_b_proj"]).dequantize().numpy()
            k_b, v_b = kv_b_split(kv, hf["num_attention_heads"], hf["qk_nope_head_dim"], hf["v_head_dim"])
            assert np.array_equal(k_b, ref[f"blk.{layer}.attn_k_b.weight"])
            assert np.array_equal(v_b, ref[f"blk.{layer}.attn_v_b.weight"])
        for mod, lin in ck.gguf_linears.items():  # every other linear: gguf's values
            if lin.source in ref:
                assert np.array_equal(r.read(specs[mod]).dequantize().numpy(), _gguf_value(ref, ck, mod)), mod


@pytest.mark.parametrize("kv_b", ["fused", "both"])
def test_kv_b_of_older_files_is_read_as_it_is(tmp_path, kv_b):
    p, _, _ = _file(tmp_path, "deepseek2", deepseek_v3_config(), 7, linear_type="Q8_0", kv_b=kv_b)
    ref = _producer(p)
    with open_checkpoint(p) as ck:
        r = open_reader(ck)
        lin = ck.gguf_linears["model.layers.1.self_attn.kv_b_proj"]
        assert lin.source == "blk.1.attn_kv_b.weight"
        got = r.read(r.linears()["model.layers.1.self_attn.kv_b_proj"]).dequantize().numpy()
        assert np.array_equal(got, ref["blk.1.attn_kv_b.weight"])
        assert not any(".k_b_proj" in n or ".v_b_proj" in n for n in ck.tensors)


def test_kv_b_half_missing_is_refused(tmp_path):
    """A file with attn_k_b but not attn_v_b (the converter writes both): refused, naming the tensor."""
    p, _, _ = _file(tmp_path, "deepseek2", deepseek_v3_config(), linear_type="Q8_0")
    rd = gguf.GGUFReader(p)
    q = tmp_path / "k_only.gguf"
    wr = gguf.GGUFWriter(q, "deepseek2")
    for field in rd.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        wr.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    for t in rd.tensors:
        if t.name != "blk.2.attn_v_b.weight":
            wr.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    with pytest.raises(InputError, match="blk.2.attn_k_b.weight without its attn_v_b") as e:
        open_checkpoint(q)
    assert e.value.path == str(q)


def test_glm4moe_config_and_mtp_block(tmp_path):
    hf = glm4_moe_config()
    p, w, _ = _file(tmp_path, "glm4moe", hf, 8, expert_type="F16", linear_type="F32")
    with open_checkpoint(p) as ck:
        _same_config(ck.config, hf, GLM_KEYS)
        # every tensor, the MTP block's (layer 2: eh_proj, enorm, hnorm, shared_head.norm) included
        _same_floats(ck, open_reader(ck), w)
        assert set(w) == set(ck.tensors)


@pytest.mark.parametrize("serve_format", ["compressed-tensors", "kleidiai"])
@pytest.mark.parametrize("arch", ["deepseek2", "glm4moe"])
def test_convert_and_verify_against_the_gguf(tmp_path, arch, serve_format):
    hf = deepseek_v3_config() if arch == "deepseek2" else glm4_moe_config()
    p, _, written = _file(tmp_path, arch, hf, 9, expert_type="Q4_K" if arch == "deepseek2" else "Q4_0",
                          linear_type="Q8_0")
    out = tmp_path / "out"
    rep = int4pack.convert(p, out, serve_format=serve_format)
    for m, st in rep["modules"].items():
        want = "requant" if ".experts." in m else "dequant"  # Q8_0 dense linears: bf16 (precision.py)
        assert st["path"] == want, m
        if want == "requant":
            assert float(st["rel_l2"]) <= float(st["baseline_rel_l2"]), m
    assert verify(out, against=p)["ok"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == hf["model_type"]
    names = set()
    for f in out.glob("*.safetensors"):
        with safe_open(f, "np") as sf:
            names |= set(sf.keys())
            if "model.layers.1.mlp.gate.e_score_correction_bias" in sf.keys():  # bit-exact, F32 as written
                got = sf.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
                assert np.array_equal(got, written["blk.1.exp_probs_b.bias"])
    assert not any(".k_b_proj" in n or ".v_b_proj" in n for n in names)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
    if arch == "glm4moe":
        assert "model.layers.2.eh_proj.weight" in names  # the MTP block, kept as the converter wrote it


# llama.cpp's converter (tests/fixtures/make_fixtures_formats.py, README "Other source formats")
DSV3 = FIXTURES / "gguf_dsv3_q4_0"
GLM = FIXTURES / "gguf_glm4moe_q8_0"


def test_llama_cpp_deepseek2_file():
    src = json.loads((DSV3 / "reference" / "source_config.json").read_text())
    ref = _producer(DSV3 / "model.gguf")
    with open_checkpoint(DSV3) as ck, safe_open(DSV3 / "reference" / "source_kv_b.safetensors", "pt") as kv:
        # the converter drops the MTP block (DeepseekV2Model.skip_mtp); everything else is carried
        _same_config(ck.config, src, DSV3_KEYS + ("moe_layer_freq",))
        r = open_reader(ck)
        said = r.verdict().warnings  # the rebuilt kv_b_proj is said as such, not as a float expert
        assert any("2 kv_b_proj" in w for w in said) and not any("experts are quantised" in w for w in said)
        specs = r.linears()
        for mod, spec in specs.items():
            got = r.read(spec).dequantize().numpy()
            if mod.endswith("kv_b_proj"):  # from F16 attn_k_b / attn_v_b: the source's values in F16, exactly
                want = kv.get_tensor(f"{mod}.weight").half().float().numpy()
            else:
                want = _gguf_value(ref, ck, mod)
            assert np.array_equal(got, want), mod


def test_llama_cpp_glm4moe_file():
    src = json.loads((FIXTURES / "dense_glm4moe" / "config.json").read_text())
    ref = _producer(GLM / "model.gguf")
    with open_checkpoint(GLM) as ck:
        _same_config(ck.config, src, GLM_KEYS)
        r = open_reader(ck)
        for mod, spec in r.linears().items():
            assert np.array_equal(r.read(spec).dequantize().numpy(), _gguf_value(ref, ck, mod)), mod


@pytest.mark.parametrize("serve_format", ["compressed-tensors", "kleidiai"])
@pytest.mark.parametrize("folder", [DSV3, GLM], ids=["deepseek2", "glm4moe"])
def test_llama_cpp_files_convert_and_verify(tmp_path, folder, serve_format):
    out = tmp_path / "out"
    rep = int4pack.convert(folder / "model.gguf", out, serve_format=serve_format)
    for m, st in rep["modules"].items():
        if st["path"] == "requant":
            assert float(st["rel_l2"]) <= float(st["baseline_rel_l2"]), m
    assert verify(out, against=folder / "model.gguf")["ok"]
