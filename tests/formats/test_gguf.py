"""The GGUF reader against the gguf package's own files and dequantisation (tests/_gguf_files.py)."""

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
from _gguf_files import E, H, I, LAYERS, blocks, llama_permute, write_moe, write_qwen3moe  # noqa: E402
from _reference import FIXTURES  # noqa: E402
from int4pack.sources.containers import open_checkpoint  # noqa: E402
from int4pack import kernels  # noqa: E402
from int4pack.errors import InputError, RefusedError  # noqa: E402
from int4pack.formats import open_reader  # noqa: E402
from int4pack.formats.gguf import q4_0_codes  # noqa: E402
from int4pack.verify import verify  # noqa: E402

REQUANT_TYPES = ["Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4", "F16"]


def _producer(path: Path) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 array in HF order, through gguf's own reader and dequantize."""
    r = gguf.GGUFReader(path)
    return {t.name: np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32) for t in r.tensors}


def test_q4_0_record_is_the_producers_values():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 128)).astype(np.float32)
    b = quants.quantize(x, gguf.GGMLQuantizationType.Q4_0)
    codes, d, zeros = q4_0_codes(b, 128)
    ref = quants.dequantize(b, gguf.GGMLQuantizationType.Q4_0)
    assert zeros is not None and (d >= 0).all()  # gguf's quantiser writes negative d (max / -8)
    z = np.repeat(zeros, 32, axis=1).astype(np.float32)
    got = (codes.astype(np.float32) - z) * np.repeat(d.astype(np.float32), 32, axis=1)
    assert np.array_equal(got, ref)


def _batch_decode(raw: np.ndarray, qtype: str, n: int, k: int) -> np.ndarray:
    """The values convert's C++ requant batch decodes from GGUF block bytes ``raw`` [N, bytes per row]."""
    from int4pack import batch, kernels

    d = np.zeros(batch.FIELDS, np.int64)
    d[[batch._LAYOUT, batch._WORDS, batch._D0, batch._D1, batch._N, batch._K, batch._STYPE]] = \
        batch._GGUF, 0, n, raw.shape[1], n, k, batch._GGUF_TYPES[qtype]
    return kernels.ext().float_rows(np.ascontiguousarray(raw), d)


def _same_values(got: np.ndarray, want: np.ndarray, signed_zeros: bool = True) -> bool:
    """Bit for bit (or as values: 0.0 == -0.0), a NaN anywhere one is (its payload aside)."""
    nan = np.isnan(want)
    if not np.array_equal(np.isnan(got), nan):
        return False
    return np.array_equal(got[~nan].view(np.int32), want[~nan].view(np.int32)) if signed_zeros else \
        np.array_equal(got[~nan], want[~nan])


@pytest.mark.skipif(kernels.ext() is None, reason="the C++ library decodes GGUF blocks in convert's batches")
@pytest.mark.parametrize("qtype", ["Q4_0", *[t for t in REQUANT_TYPES if t != "F16"]])
def test_the_batches_decode_blocks_as_gguf_dequantises_them(qtype):
    """The blocks of every type convert's C++ batches read, decoded as gguf.quants.dequantize does, bit for bit:
    blocks from gguf's quantiser (or with sane scales), every byte random (any fp16 scale: subnormal, Inf,
    NaN), and blocks whose fp16 scales are negative."""
    rng = np.random.default_rng(7)
    t = gguf.GGMLQuantizationType[qtype]
    per, size = gguf.GGML_QUANT_SIZES[t]
    n, k = 6, 2 * 256
    sane = blocks(rng, rng.standard_normal((n, k)).astype(np.float32), qtype)
    wild = rng.integers(0, 256, (n, k // per * size), dtype=np.uint8)
    for raw in (sane, wild):
        with np.errstate(over="ignore", invalid="ignore"):  # random bytes: Inf/NaN fp16 scales, E8M0 255
            want = quants.dequantize(raw, t)
        got = _batch_decode(raw, qtype, n, k)
        if qtype == "Q4_0" and not (raw.reshape(n, -1, size)[:, :, 1] & 0x80).any():
            continue  # every d >= 0: the module keeps its ints (the per-module path)
        # Q4_0: the codes record (c - z) * |d| makes a zero of d < 0 +0.0 where gguf's (q - 8) * d gives -0.0
        assert got is not None and _same_values(got, want, qtype != "Q4_0"), qtype


@pytest.mark.parametrize("qtype", ["Q4_0", *REQUANT_TYPES])
def test_experts_split_as_gguf_reads_them(tmp_path, qtype):
    p = write_qwen3moe(tmp_path / "m.gguf", expert_type=qtype, attn_type="Q8_0")
    ref = _producer(p)
    with open_checkpoint(p) as ck:
        r = open_reader(ck)
        specs = r.linears()
        assert len([s for s in specs if ".experts." in s]) == LAYERS * E * 3
        for layer in range(LAYERS):
            for proj, gname in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"),
                                ("down_proj", "ffn_down_exps")):
                fused = ref[f"blk.{layer}.{gname}.weight"]
                assert fused.shape[0] == E
                for e in (0, E - 1):
                    got = r.read(specs[f"model.layers.{layer}.mlp.experts.{e}.{proj}"]).dequantize().numpy()
                    assert np.array_equal(got, fused[e]), (qtype, layer, proj, e)
        got = r.read(specs["model.layers.1.self_attn.o_proj"]).dequantize().numpy()
        assert np.array_equal(got, ref["blk.1.attn_output.weight"])


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "llama"])
def test_float_tensors_against_the_written_floats(tmp_path, arch):
    """Independent of gguf's reader: F16 experts and attention come back as the HF-order floats drawn
    (llama: q/k rows permuted by llama.cpp's rule when written, put back when read)."""
    written: dict = {}
    p = write_moe(tmp_path / "m.gguf", arch, expert_type="F16", attn_type="F16", seed=3, written=written)
    experts = "block_sparse_moe.experts" if arch == "llama" else "mlp.experts"
    names = ("w1", "w3", "w2") if arch == "llama" else ("gate_proj", "up_proj", "down_proj")
    with open_checkpoint(p) as ck:
        r = open_reader(ck)
        specs = r.linears()
        for e in range(E):
            for proj, gname in zip(names, ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")):
                got = r.read(specs[f"model.layers.1.{experts}.{e}.{proj}"]).dequantize().numpy()
                want = written[f"blk.1.{gname}.weight"][e].astype(np.float16).astype(np.float32)
                assert np.array_equal(got, want), (e, proj)
        for proj, gname in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v")):
            got = ck.get(f"model.layers.0.self_attn.{proj}.weight").float().numpy()
            assert np.array_equal(got, written[f"blk.0.{gname}.weight"].astype(np.float16).astype(np.float32)), proj
        if arch == "qwen2moe":
            assert ck.tensors["model.layers.0.mlp.shared_expert_gate.weight"].shape == (1, H)
            got = ck.get("model.layers.0.self_attn.q_proj.bias").numpy()
            assert np.array_equal(got, written["blk.0.attn_q.bias"])


@pytest.mark.parametrize("arch", ["qwen2moe", "llama"])
def test_other_architectures_convert_and_verify(tmp_path, arch):
    p = write_moe(tmp_path / "m.gguf", arch, expert_type="Q4_K", attn_type="Q4_0")
    ref = _producer(p)
    with open_checkpoint(p) as ck:
        r = open_reader(ck)
        if arch == "llama":  # a quantised q projection: its rows put back in HF order, block bytes intact
            got = r.read(r.linears()["model.layers.0.self_attn.q_proj"]).dequantize().numpy()
            gguf_rows = ref["blk.0.attn_q.weight"]
            assert np.array_equal(llama_permute(got, 2), gguf_rows)
        assert ck.config["model_type"] == {"qwen2moe": "qwen2_moe", "llama": "mixtral"}[arch]
    out = tmp_path / "out"
    int4pack.convert(p, out)
    assert verify(out, against=p)["ok"]


def test_config_and_tokenizer_from_the_metadata(tmp_path):
    p = write_qwen3moe(tmp_path / "m.gguf")
    with open_checkpoint(p) as ck:
        c = ck.config
        assert (c["model_type"], c["num_hidden_layers"], c["hidden_size"], c["num_experts"], c["num_experts_per_tok"],
                c["moe_intermediate_size"], c["head_dim"], c["num_key_value_heads"], c["rms_norm_eps"]) == \
            ("qwen3_moe", LAYERS, H, E, 2, I, 128, 1, 1e-6)
        assert c["tie_word_embeddings"] is False and c["norm_topk_prob"] is True
        files = ck.generated_files()
    tok = json.loads(files["tokenizer.json"])
    tokens = gguf.GGUFReader(p).fields["tokenizer.ggml.tokens"].contents()
    assert tok["model"]["vocab"] == {t: i for i, t in enumerate(tokens)}
    assert tok["model"]["merges"] == ["t 0", "t 1"]
    assert [a["content"] for a in tok["added_tokens"]] == ["<|endoftext|>", "<|im_end|>"]
    tcfg = json.loads(files["tokenizer_config.json"])
    assert (tcfg["eos_token"], tcfg["bos_token"], tcfg["chat_template"]) == ("<|im_end|>", "<|endoftext|>",
                                                                            "{{ messages }}")


def test_tied_embeddings_and_a_quantised_embedding(tmp_path):
    p = write_qwen3moe(tmp_path / "m.gguf", embed_type="Q8_0", output=False)
    ref = _producer(p)["token_embd.weight"]
    with open_checkpoint(p) as ck:
        assert ck.config["tie_word_embeddings"] is True
        t = ck.get("model.embed_tokens.weight")
        assert t.dtype == torch.bfloat16
        assert torch.equal(t, torch.from_numpy(ref).to(torch.bfloat16))


@pytest.mark.parametrize("serve_format", ["compressed-tensors", "kleidiai"])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "MXFP4"])  # MXFP4: llama-quantize MXFP4_MOE
def test_convert_and_verify_against_the_gguf(tmp_path, qtype, serve_format):
    # the K-quant file also has a Q8_0 embedding and a Q6_K lm_head: BF16 in the output, compared by verify
    p = write_qwen3moe(tmp_path / "m.gguf", expert_type=qtype, attn_type="Q6_K" if qtype == "Q4_K" else qtype,
                       embed_type="Q8_0" if qtype == "Q4_K" else "F16")
    out = tmp_path / "out"
    rep = int4pack.convert(p, out, serve_format=serve_format)
    mods = rep["modules"]
    assert len(mods) == LAYERS * (E * 3 + 4)
    for m, st in mods.items():  # the search never loses to plain RTN
        # Q6_K attention is 6-bit: kept in bf16, exactly (precision.py); the int4 and Q4 ones requantised
        want = "dequant" if qtype == "Q4_K" and ".self_attn." in m else "requant"
        assert st["path"] == want, m
        if want == "requant":
            assert float(st["rel_l2"]) <= float(st["baseline_rel_l2"]), m
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= {f.name for f in out.iterdir()}
    res = verify(out, against=p)
    assert res["ok"], res


def test_q4_0_keeps_its_ints_where_every_scale_is_positive(tmp_path, monkeypatch, counted):
    """The report says lossless and the ints are gguf's; convert's C++ requant batches (which keep the
    ints of a Q4_0 module they find symmetric) write the per-module path's files and report."""
    import filecmp

    from int4pack import batch

    p = write_qwen3moe(tmp_path / "m.gguf")
    raw = bytearray(p.read_bytes())
    r = gguf.GGUFReader(p)
    for t in r.tensors:  # clear the sign bit of every Q4_0 block scale: d = |d|
        if t.tensor_type == gguf.GGMLQuantizationType.Q4_0:
            for off in range(t.data_offset, t.data_offset + t.n_bytes, 18):
                raw[off + 1] &= 0x7F
    del r
    p.write_bytes(bytes(raw))
    ref = _producer(p)
    out = tmp_path / "out"
    rep = int4pack.convert(p, out)
    monkeypatch.setattr(batch, "ENABLED", False)
    rep_b = int4pack.convert(p, tmp_path / "per_module")
    varies = ("seconds", "seconds_plan", "workers")
    assert json.dumps({k: v for k, v in rep.items() if k not in varies}).replace(str(out), "OUT") == \
        json.dumps({k: v for k, v in rep_b.items() if k not in varies}).replace(str(tmp_path / "per_module"), "OUT")
    for f in sorted(x.name for x in out.iterdir()):
        assert filecmp.cmp(out / f, tmp_path / "per_module" / f, shallow=False), f
    experts = sum(1 for m in rep["modules"] if ".experts." in m)
    assert counted["batched"] >= experts and counted["handed_back"] == 0
    st = rep["modules"]["model.layers.0.mlp.experts.2.down_proj"]
    assert st["path"] == "lossless" and st["exact_ints"] is True
    with safe_open(out / "model.safetensors", "pt") as f:
        q = f.get_tensor("model.layers.0.mlp.experts.2.down_proj.weight").float()
        s = f.get_tensor("model.layers.0.mlp.experts.2.down_proj.weight_scale").float()
    w = ref["blk.0.ffn_down_exps.weight"][2]  # (q - 8) * d with d >= 0
    # w / bf16(d) = (q - 8)(1 + e) with |e| <= 2^-9: rounds back to the ints
    assert torch.equal(q, torch.round(torch.from_numpy(w) / s.repeat_interleave(32, 1)))
    assert verify(out, against=p)["ok"]


def test_split_set_opens_whole_and_refuses_a_missing_part(tmp_path):
    p = write_qwen3moe(tmp_path / "m.gguf", split_max_tensors=10)
    parts = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(parts) > 2
    with open_checkpoint(parts[0]) as ck, open_checkpoint(tmp_path) as ck2:
        assert ck.files == [x.name for x in parts] and set(ck.tensors) == set(ck2.tensors)
        assert len(ck.shards) == len(parts)
    parts[1].unlink()
    with pytest.raises(InputError, match="missing"):
        open_checkpoint(parts[0])


def test_an_unread_type_is_refused_naming_tensor_and_type(tmp_path):
    p = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(p, "qwen3moe")
    w.add_block_count(1)
    w.add_tensor("blk.0.ffn_gate_exps.weight", blocks(np.random.default_rng(0), np.zeros((2, 4, 256), np.float32),
                                                     "Q4_K")[..., :84].copy(),
                 raw_dtype=gguf.GGMLQuantizationType.Q2_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(RefusedError) as e:
        open_checkpoint(p)
    assert "blk.0.ffn_gate_exps.weight" in str(e.value) and "Q2_K" in str(e.value)


def test_an_unknown_architecture_is_refused_by_name(tmp_path):
    p = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(p, "dbrx")
    w.add_block_count(1)
    w.add_tensor("output_norm.weight", np.ones(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(RefusedError, match="'dbrx'"):
        open_checkpoint(p)


def test_a_folder_with_two_models_asks_for_the_file(tmp_path):
    write_qwen3moe(tmp_path / "a-Q4_0.gguf")
    write_qwen3moe(tmp_path / "a-Q8_0.gguf", expert_type="Q8_0")
    with pytest.raises(InputError, match="2 GGUF models"):
        open_checkpoint(tmp_path)
    with open_checkpoint(tmp_path / "a-Q8_0.gguf") as ck:
        assert ck.files == ["a-Q8_0.gguf"]


# llama.cpp's own converter and quantiser (tests/fixtures/make_fixtures_gguf.py)
# and tests/fixtures/make_fixtures_formats.py's: the converter's Q8_0, its F16 quantised by gguf to Q4_0, and
# auto-round 0.16.1's GGUF export (Q4_K, Q5_0, Q6_K, Q8_0)
LAYERS_REAL = 2
REAL = {"gguf_qwen3moe_q4_0": "tiny-qwen3moe-Q4_0.gguf", "gguf_qwen3moe_q4_k_m": "tiny-qwen3moe-Q4_K_M.gguf",
        "gguf_q3_q8_0": "model.gguf", "gguf_q3_q4_0": "model.gguf", "gguf_q3_q4_k_m": "model.gguf"}


@pytest.mark.parametrize("name", sorted(REAL))
def test_llama_cpp_files_read_as_gguf_dequantises_them(name):
    path = FIXTURES / name / REAL[name]
    ref = _producer(path)
    with open_checkpoint(FIXTURES / name) as ck:
        r = open_reader(ck)
        specs = r.linears()
        assert len(specs) == LAYERS_REAL * (4 * 3 + 4)
        for mod, spec in specs.items():
            lin = ck.gguf_linears[mod]
            fused = ref[lin.source]
            want = fused[int(mod.split(".experts.")[1].split(".")[0])] if ".experts." in mod else fused
            assert np.array_equal(r.read(spec).dequantize().numpy(), want), mod


def test_llama_cpp_q4_0_keeps_ints_exactly_where_its_scales_allow(tmp_path):
    """A module is lossless iff every block scale d >= 0 (read here from gguf's reader's block bytes)."""
    name = "gguf_qwen3moe_q4_0"
    rd = gguf.GGUFReader(FIXTURES / name / REAL[name])
    nonneg = {}
    for t in rd.tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.Q4_0:
            b = np.asarray(t.data)
            d = np.ascontiguousarray(b.reshape(*b.shape[:-1], -1, 18)[..., :2]).view(np.float16)[..., 0]
            nonneg[t.name] = (d >= 0).reshape(d.shape[0], -1).all(axis=1) if d.ndim == 3 else bool((d >= 0).all())
    out = tmp_path / "out"
    rep = int4pack.convert(FIXTURES / name, out)
    with open_checkpoint(FIXTURES / name) as ck:
        for mod, st in rep["modules"].items():
            lin = ck.gguf_linears[mod]
            ok = nonneg[lin.source]
            if ".experts." in mod:
                ok = bool(ok[int(mod.split(".experts.")[1].split(".")[0])])
            assert (st["path"] == "lossless") == ok, mod
            if st["path"] == "requant":
                assert float(st["rel_l2"]) <= float(st["baseline_rel_l2"]), mod
    assert verify(out, against=FIXTURES / name)["ok"]


@pytest.mark.parametrize("serve_format", ["compressed-tensors", "kleidiai"])
@pytest.mark.parametrize("name", sorted(REAL))
def test_llama_cpp_files_convert_and_verify(tmp_path, name, serve_format):
    out = tmp_path / "out"
    int4pack.convert(FIXTURES / name / REAL[name], out, serve_format=serve_format)
    assert verify(out, against=FIXTURES / name / REAL[name])["ok"]


@pytest.mark.parametrize("name", sorted(REAL))
def test_the_rebuilt_tokenizer_has_the_files_tokens(name):
    r = gguf.GGUFReader(FIXTURES / name / REAL[name])
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    merges = r.fields["tokenizer.ggml.merges"].contents() if "tokenizer.ggml.merges" in r.fields else []
    with open_checkpoint(FIXTURES / name) as ck:
        tok = json.loads(ck.generated_files()["tokenizer.json"])
    assert tok["model"]["vocab"] == {t: i for i, t in enumerate(tokens)} and tok["model"]["merges"] == merges


def test_the_rebuilt_tokenizer_is_transformers_own():
    """tokenizer.json from the metadata against transformers' GGUF tokenizer of the same file."""
    name = "gguf_qwen3moe_q4_0"
    ref = json.loads((FIXTURES / name / "transformers_tokenizer.json").read_text())
    with open_checkpoint(FIXTURES / name) as ck:
        ours = json.loads(ck.generated_files()["tokenizer.json"])
    assert ours["model"]["vocab"] == ref["model"]["vocab"]
    assert [m.split(" ") if isinstance(m, str) else m for m in ours["model"]["merges"]] == ref["model"]["merges"]
    assert [(a["id"], a["content"], a["special"]) for a in ours["added_tokens"]] == \
        [(a["id"], a["content"], a["special"]) for a in ref["added_tokens"]]
    assert ours["pre_tokenizer"]["pretokenizers"][0] == ref["pre_tokenizer"]["pretokenizers"][0]  # the split regex
    assert ours["normalizer"] == ref["normalizer"]


@pytest.mark.parametrize("keep", [100, 5000, -1000])
def test_a_truncated_file_is_refused_naming_it(tmp_path, keep):
    data = (FIXTURES / "gguf_qwen3moe_q4_0" / REAL["gguf_qwen3moe_q4_0"]).read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[:keep])
    with pytest.raises(InputError, match="cut.gguf"):
        open_checkpoint(p)
