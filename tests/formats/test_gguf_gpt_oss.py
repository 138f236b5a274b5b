"""The GGUF reader on gpt-oss as llama.cpp's converter writes it (tests/fixtures/gguf_gptoss_mxfp4:
convert_hf_to_gguf.py on the MXFP4 safetensors fixture gptoss_mxfp4, README "Other source formats").

References: gguf's own reader and ``gguf.quants.dequantize`` (the producer's), the safetensors release
the converter read (its MXFP4 decoded from the bit fields, _reference.mxfp4_decode; its config.json),
and int4pack's conversion of that release: a gpt-oss GGUF converts to the same output, its experts
bit for bit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gguf  # noqa: E402
from gguf import quants  # noqa: E402

import int4pack  # noqa: E402
from _gguf_files import retype  # noqa: E402
from _reference import FIXTURES, load_all, mxfp4_decode  # noqa: E402
from int4pack.errors import RefusedError  # noqa: E402
from int4pack.formats import open_reader  # noqa: E402
from int4pack.sources import gguf_config  # noqa: E402
from int4pack.sources.containers import open_checkpoint  # noqa: E402
from int4pack.verify import verify  # noqa: E402

GG = FIXTURES / "gguf_gptoss_mxfp4"
FILE = GG / "model.gguf"
SRC = FIXTURES / "gptoss_mxfp4"  # the safetensors release the converter read
LAYERS, E, I, H = 2, 4, 64, 128


def _producer(path: Path) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32, through gguf's own reader and dequantize."""
    return {t.name: np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)
            for t in gguf.GGUFReader(path).tensors}


def _expert(mod: str) -> int:
    return int(mod.split(".experts.")[1].split(".")[0])


def _load(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            out.update({k: s.get_tensor(k) for k in s.keys()})
    return out


def _reads_as_gguf(path: Path) -> None:
    """Every linear (and an expert's bias) as gguf dequantises its GGUF tensor, bit for bit."""
    ref = _producer(path)
    with open_checkpoint(path) as ck:
        r = open_reader(ck)
        specs = r.linears()
        assert len(specs) == LAYERS * (E * 3 + 4)
        for mod, spec in specs.items():
            lin = ck.gguf_linears[mod]
            q = r.read(spec)
            want = ref[lin.source]
            if ".experts." in mod:
                want = want[_expert(mod)]
                bias = ref[lin.source.replace(".weight", ".bias")][_expert(mod)]
                assert spec.has_bias and np.array_equal(q.bias.numpy(), bias), mod
            assert np.array_equal(q.dequantize().numpy(), want), mod


def test_the_converters_file_reads_as_gguf_dequantises_it():
    _reads_as_gguf(FILE)


def test_experts_are_the_safetensors_releases_values():
    """Independent of gguf: the experts and biases are the MXFP4 release's, gate its even rows and up
    its odd rows (the converter's split), decoded from E2M1/E8M0 bit fields in float64."""
    src = load_all(SRC)
    raw = {}
    for f in sorted(SRC.glob("*.safetensors")):
        with safe_open(str(f), "np") as s:
            raw.update({k: s.get_tensor(k) for k in s.keys() if k.endswith(("_blocks", "_scales"))})
    with open_checkpoint(FILE) as ck:
        r = open_reader(ck)
        specs = r.linears()
        for layer in range(LAYERS):
            p = f"model.layers.{layer}.mlp.experts"
            gu = mxfp4_decode(raw[f"{p}.gate_up_proj_blocks"], raw[f"{p}.gate_up_proj_scales"])
            dn = mxfp4_decode(raw[f"{p}.down_proj_blocks"], raw[f"{p}.down_proj_scales"])
            for e in range(E):
                for proj, w, b in (("gate_proj", gu[e][0::2], src[f"{p}.gate_up_proj_bias"][e][0::2]),
                                   ("up_proj", gu[e][1::2], src[f"{p}.gate_up_proj_bias"][e][1::2]),
                                   ("down_proj", dn[e], src[f"{p}.down_proj_bias"][e])):
                    q = r.read(specs[f"{p}.{e}.{proj}"])
                    assert np.array_equal(q.dequantize().double().numpy(), w), (layer, e, proj)
                    assert np.array_equal(q.bias.numpy(), b), (layer, e, proj)
        for name in ("model.layers.1.self_attn.sinks", "model.layers.0.mlp.router.weight",
                     "model.layers.0.mlp.router.bias", "model.layers.1.post_attention_layernorm.weight"):
            assert np.array_equal(ck.get(name).float().numpy(), src[name]), name


def test_config_is_the_one_the_converter_read():
    want = json.loads((SRC / "config.json").read_text())
    with open_checkpoint(FILE) as ck:
        got = ck.config
    for k in ("architectures", "model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "head_dim",
              "num_attention_heads", "num_key_value_heads", "num_local_experts", "num_experts_per_tok",
              "sliding_window", "layer_types", "rms_norm_eps", "vocab_size", "max_position_embeddings",
              "attention_bias", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert got[k] == want[k], (k, got.get(k), want[k])
    # ggml's YaRN floors and ceils the correction dims (ggml_rope_yarn_corr_dims): truncate, as llama.cpp
    # runs the file; the release says false, which the GGUF does not carry
    assert got["rope_parameters"] == {**want["rope_parameters"], "truncate": True}
    assert "rope_theta" not in got and "rope_scaling" not in got


@pytest.mark.parametrize("pattern,want", [(None, "SFSF"), (3, "SSFS"), (1, "FFFF"), (0, "SSSS"),
                                          ([True, False, False, True], "SFFS")])
def test_sliding_layers_follow_llama_cpps_pattern(pattern, want):
    """gpt-oss.attention.sliding_window_pattern as llama.cpp's set_swa_pattern reads it: layer il slides
    where il % n < n - 1 (n absent: 2, openai-moe.cpp), n 0: all; an array: one flag a layer."""
    meta = {"gpt-oss.block_count": 4, "gpt-oss.embedding_length": 8, "gpt-oss.attention.head_count": 2,
            "gpt-oss.expert_count": 2}
    if pattern is not None:
        meta["gpt-oss.attention.sliding_window_pattern"] = pattern
    cfg, _ = gguf_config.build_config(meta, "gpt-oss", set(), "m.gguf")
    assert cfg["layer_types"] == [{"S": "sliding_attention", "F": "full_attention"}[c] for c in want]


def test_converts_to_what_the_safetensors_release_converts_to(converted):
    """Same tensors as int4pack's output of gptoss_mxfp4 (vLLM's per-expert gpt-oss layout): the experts
    bit for bit (the same values, the same search), biases, sinks, router and norms the same values (F32
    as the GGUF holds them), attention and embeddings within the converter's Q8_0; verify passes."""
    out, rep = converted("gguf_gptoss_mxfp4")
    ref_out, _ = converted("gptoss_mxfp4")
    got, want = _load(out), _load(ref_out)
    assert set(got) == set(want)
    for name, t in want.items():
        if ".mlp.experts." in name and not name.endswith(".bias"):
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
        elif name.endswith(("_proj.weight", "embed_tokens.weight", "lm_head.weight")) and "router" not in name:
            d = (got[name].float() - t.float()).norm() / t.float().norm()
            assert got[name].dtype == torch.bfloat16 and float(d) < 0.01, name  # Q8_0: 0.006 at most
        else:
            assert torch.equal(got[name].float(), t.float()), name
    for m, st in rep["modules"].items():  # every expert requantised, none worse than plain RTN
        assert st["path"] == ("requant" if ".experts." in m else "dequant"), m
        if st["path"] == "requant":
            assert float(st["rel_l2"]) <= float(st["baseline_rel_l2"]), m
    cfg, ref_cfg = (json.loads((o / "config.json").read_text()) for o in (out, ref_out))
    assert cfg["quantization_config"] == ref_cfg["quantization_config"]
    assert "0.19.1 cannot load" in rep["next"] and "tensor_parallel_size 1" in rep["next"]
    assert verify(out, against=FILE)["ok"]


def test_the_packed_format_is_refused_as_for_the_safetensors_release(tmp_path):
    """--serve-format kleidiai: gpt-oss's experts are written in its model class's own layout, which
    int4pack's vLLM plugin does not load, whichever the source (tests/formats/test_mxfp4.py)."""
    for src in (FILE, SRC):
        with pytest.raises(RefusedError, match="plugin does not load"):
            int4pack.convert(src, tmp_path / "out", serve_format="kleidiai")


@pytest.mark.parametrize("qtype", ["Q8_0", "F16", "Q4_0"])
def test_experts_of_other_types_convert_with_their_biases(tmp_path, qtype):
    """Experts as the converter writes them from a bf16 gpt-oss (Q8_0, F16: conversion/gpt_oss.py) or a
    requantised file (Q4_0), requantised by gguf from the fixture's values: read as gguf dequantises
    them, biases carried, converted and verified."""
    p = tmp_path / "m.gguf"
    retype(FILE, p, lambda n: qtype if "_exps.weight" in n else None)
    _reads_as_gguf(p)
    out = tmp_path / "out"
    rep = int4pack.convert(p, out)
    for m, st in rep["modules"].items():
        if ".experts." in m:
            assert st["path"] == "requant" and float(st["rel_l2"]) <= float(st["baseline_rel_l2"]), m
    o = _load(out)
    with open_checkpoint(p) as ck:
        want = torch.cat([ck.get(f"model.layers.1.mlp.experts.2.{x}_proj.bias") for x in ("gate", "up")])
    assert torch.equal(o["model.layers.1.mlp.experts.2.gate_up_proj.bias"], want)
    assert verify(out, against=p)["ok"]
