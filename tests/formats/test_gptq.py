"""GPTQ reader: real GPTQModel fixtures against an independent numpy decoder, and tiny synthetic files."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _reference import gptq_decode
from int4pack.sources.checkpoint import Checkpoint
from int4pack.errors import InputError, RefusedError
from int4pack.formats import open_reader
from int4pack.formats.gptq import GPTQReader, _group_code_sums
from int4pack.formats.gptq import _zeros as gptq_zeros
from int4pack.records import LinearSpec

GPTQ_FIXTURES = ["gptq_q3_sym", "gptq_q3_asym", "gptq_q3_descact", "gptq_mixtral_sym"]


@pytest.mark.parametrize("name", GPTQ_FIXTURES)
def test_real_fixture_matches_reference(name, fixture_dir, raw):
    folder = fixture_dir(name)
    tensors = raw(folder)
    ck = Checkpoint(folder)
    reader = open_reader(ck)
    assert isinstance(reader, GPTQReader)
    v = reader.verdict()
    assert v.format == "gptq"
    assert v.extra["zero_convention"] == "v1"  # GPTQModel 7.7 writes v1 even for "gptq" label
    assert not v.warnings
    specs = reader.linears()
    assert set(specs) == {k[: -len(".qweight")] for k in tensors if k.endswith(".qweight")}
    for m, spec in specs.items():
        assert set(spec.keys) == {k for k in tensors if k.rsplit(".", 1)[0] == m}
        ref = gptq_decode(tensors, m, v1=True)
        q = reader.read(spec)
        assert q.codes.dtype == torch.uint8 and q.codes.shape == (spec.n, spec.k)
        np.testing.assert_array_equal(q.codes.numpy(), ref["u"])
        zeros = np.full(ref["z"].shape, 8) if q.zeros is None else q.zeros.numpy()
        np.testing.assert_array_equal(zeros, ref["z"])
        np.testing.assert_array_equal(q.scales.double().numpy(), ref["s"])
        np.testing.assert_array_equal(q.group_index().numpy(), ref["g_idx"])
        np.testing.assert_allclose(q.dequantize().numpy(), ref["w"], rtol=1e-6, atol=0)


def test_real_sym_words_are_v1(fixture_dir, raw):
    tensors = raw(fixture_dir("gptq_q3_sym"))
    words = {int(w) & 0xFFFFFFFF for k, t in tensors.items() if k.endswith(".qzeros") for w in t.ravel()}
    assert words == {0x77777777}
    reader = open_reader(Checkpoint(fixture_dir("gptq_q3_sym")))
    assert any("0x77777777" in e for e in reader.verdict().evidence)
    assert all(reader.read(s).zeros is None for s in reader.linears().values())


def test_real_asym_reports_mean_evidence(fixture_dir):
    v = open_reader(Checkpoint(fixture_dir("gptq_q3_asym"))).verdict()
    fig = [e for e in v.evidence if e.startswith("mean(code - stored zero)")]
    assert fig and 0.7 < float(fig[0].split("=")[1].split()[0]) < 1.3


def test_real_descact_g_idx(fixture_dir):
    reader = open_reader(Checkpoint(fixture_dir("gptq_q3_descact")))
    specs = reader.linears()
    assert all(s.act_order for s in specs.values())
    q = reader.read(next(iter(specs.values())))
    assert q.g_idx is not None and not q.has_trivial_g_idx()
    assert torch.bincount(q.g_idx).tolist() == [32] * (q.spec.k // 32)  # each group still 32 columns


# -- synthetic checkpoints ------------------------------------------------------------------------
def pack_along_k(u: np.ndarray) -> np.ndarray:
    """[K, N] codes -> int32 [K/8, N]; one python int per word."""
    k, n = u.shape
    out = np.zeros((k // 8, n), dtype=np.int64)
    for r in range(k // 8):
        for c in range(n):
            word = 0
            for i in range(8):
                word += int(u[8 * r + i, c]) * 16**i
            out[r, c] = word
    return out.astype(np.uint32).view(np.int32)


def pack_along_n(z: np.ndarray) -> np.ndarray:
    """[G, N] nibbles -> int32 [G, N/8]."""
    return pack_along_k(z.T).T.copy()


def gptq_tensors(rng, m, k=64, n=16, group=16, zeros=None, store="v2", g_idx=None, bias=False):
    """Tensors of one module, plus the truth (codes, zeros, scales) it encodes."""
    groups = k // group
    z = np.full((groups, n), 8) if zeros is None else zeros
    gi = np.arange(k) // group if g_idx is None else g_idx
    u = np.clip(z[gi] + np.round(rng.normal(0, 3, (k, n))), 0, 15).astype(np.int64)
    s = rng.uniform(0.01, 0.02, (groups, n)).astype(np.float16)
    stored = z if store == "v2" else z - 1  # v1 stores zero - 1 per nibble
    out = {f"{m}.qweight": pack_along_k(u), f"{m}.qzeros": pack_along_n(stored),
           f"{m}.scales": s, f"{m}.g_idx": gi.astype(np.int32)}
    if bias:
        out[f"{m}.bias"] = rng.normal(0, 1, n).astype(np.float16)
    truth = (u.astype(np.float64) - z[gi]) * s.astype(np.float64)[gi]
    return out, truth.T


M0 = "model.layers.0.mlp.experts.0.down_proj"
M1 = "model.layers.0.mlp.experts.1.down_proj"


def cfg(**kw):
    base = {"quant_method": "gptq", "bits": 4, "group_size": 16, "sym": True, "desc_act": False,
            "checkpoint_format": "gptq"}
    base.update(kw)
    return base


def test_hand_checked_word():
    # codes 0..7 down K in one word: nibble i holds k = i
    assert int(pack_along_k(np.arange(8).reshape(8, 1))[0, 0]) == 0x76543210


@pytest.mark.parametrize("store,label,expect", [("v2", "gptq_v2", "v2"), ("v1", "gptq", "v1")])
def test_sym_word_decides(make_ckpt, store, label, expect):
    rng = np.random.default_rng(0)
    t, truth = gptq_tensors(rng, M0, store=store)
    word = int(t[f"{M0}.qzeros"][0, 0]) & 0xFFFFFFFF
    assert word == (0x88888888 if store == "v2" else 0x77777777)
    reader = open_reader(Checkpoint(make_ckpt(t, cfg(checkpoint_format=label))))
    v = reader.verdict()
    assert v.extra == {"zero_convention": expect, "label": label}
    assert v.detail == f"gptq {expect} zero points" and not v.warnings
    q = reader.read(reader.linears()[M0])
    assert q.zeros is None
    np.testing.assert_allclose(q.dequantize().numpy(), truth, rtol=1e-6)


def test_label_disagrees_with_data(make_ckpt):
    t, truth = gptq_tensors(np.random.default_rng(1), M0, store="v2")
    reader = open_reader(Checkpoint(make_ckpt(t, cfg(checkpoint_format="gptq"))))
    v = reader.verdict()
    assert v.extra["zero_convention"] == "v2"
    assert any("following the data" in w for w in v.warnings)
    np.testing.assert_allclose(reader.read(reader.linears()[M0]).dequantize().numpy(), truth, rtol=1e-6)


@pytest.mark.parametrize("store", ["v1", "v2"])
def test_asym_convention_from_data(make_ckpt, store):
    rng = np.random.default_rng(2)
    z = rng.integers(3, 13, (4, 16))
    t0, truth0 = gptq_tensors(rng, M0, zeros=z, store=store)
    t1, truth1 = gptq_tensors(rng, M1, zeros=rng.integers(3, 13, (4, 16)), store=store)
    # the label always says v1: the data must decide
    reader = open_reader(Checkpoint(make_ckpt({**t0, **t1}, cfg(sym=False))))
    v = reader.verdict()
    assert v.extra["zero_convention"] == store
    assert any(e.startswith("mean(code - stored zero)") for e in v.evidence)
    assert bool(v.warnings) == (store == "v2")
    q = reader.read(reader.linears()[M0])
    np.testing.assert_array_equal(q.zeros.numpy(), z.T)
    np.testing.assert_allclose(q.dequantize().numpy(), truth0, rtol=1e-6)
    np.testing.assert_allclose(reader.read(reader.linears()[M1]).dequantize().numpy(), truth1, rtol=1e-6)


def test_ambiguous_zero_convention_refused(make_ckpt):
    rng = np.random.default_rng(3)
    k, n, group = 64, 16, 16
    stored = rng.integers(3, 13, (k // group, n))
    u = stored[np.arange(k) // group] + (np.arange(k)[:, None] % 2)  # code - stored zero: half 0, half 1
    t = {f"{M0}.qweight": pack_along_k(u), f"{M0}.qzeros": pack_along_n(stored),
         f"{M0}.scales": np.ones((k // group, n), np.float16)}
    reader = open_reader(Checkpoint(make_ckpt(t, cfg(sym=False))))
    with pytest.raises(RefusedError, match=r"v1 from v2.*0\.500"):
        reader.verdict()


def test_v1_zero_point_zero_borrows(make_ckpt):
    """GPTQModel's v1 conversion subtracts 0x11111111 from whole words, so zero 0 becomes 0xF + borrow."""
    rng = np.random.default_rng(4)
    z = rng.integers(4, 12, (4, 16))
    z[1, 3] = 0
    z[2, 8] = 0
    z[3, 7] = 0  # a word's top nibble: the subtraction wraps the word mod 2^32, the decode wraps back
    z[0, 15] = 0
    t, truth = gptq_tensors(rng, M0, zeros=z, store="v2")
    t[f"{M0}.qzeros"] = ((t[f"{M0}.qzeros"].view(np.uint32).astype(np.int64) - 0x11111111) % 2**32
                         ).astype(np.uint32).view(np.int32)
    assert (int(t[f"{M0}.qzeros"][1, 0]) >> 12) & 0xF == 0xF
    reader = open_reader(Checkpoint(make_ckpt(t, cfg(sym=False))))
    v = reader.verdict()
    assert v.extra["zero_convention"] == "v1"
    assert any("0xF" in w for w in v.warnings)
    q = reader.read(reader.linears()[M0])
    np.testing.assert_array_equal(q.zeros.numpy(), z.T)
    np.testing.assert_allclose(q.dequantize().numpy(), truth, rtol=1e-6)
    assert any("0xF" in n for n in reader.linears()[M0].notes)  # the module's own note, from its read


# words where the whole-word v1 add carries between nibbles and wraps past 2^32
EDGE_WORDS = [0xFFFFFFFF, 0xEFFFFFFF, 0xF0000000, 0x0FFFFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0x00000000,
              0xEEEEEEEE, 0x6F6F6F6F]


def _spec(n: int, groups: int = 2, sym: bool = False) -> LinearSpec:
    return LinearSpec(name=M0, fmt="gptq", n=n, k=16 * groups, bits=4, group_size=16, sym=sym, act_order=False,
                      keys=(), scale_dtype="F16")


def _zeros(words, n: int, conv: str, sym: bool = False):
    """The reader's zero points [N, G] of uint32 qzeros words [G, ceil(N/8)], and the spec it noted on."""
    w = np.asarray(words, dtype=np.uint32)
    spec = _spec(n, w.shape[0], sym)
    return gptq_zeros(spec, bytearray(w.tobytes()), conv), spec


def ref_zeros(words, n: int, conv: str) -> np.ndarray:
    """[N, G] with python ints: v1 adds 0x11111111 to the whole word mod 2^32, then nibble c % 8 of word c // 8."""
    out = np.zeros((n, len(words)), np.uint8)
    for g, row in enumerate(words):
        for c in range(n):
            w = (int(row[c // 8]) + (0x11111111 if conv == "v1" else 0)) % 2**32
            out[c, g] = (w >> (4 * (c % 8))) & 0xF
    return out


def test_v1_whole_word_add_wraps_like_python_ints():
    words = [EDGE_WORDS, EDGE_WORDS[::-1]]
    z, spec = _zeros(words, 80, "v1")
    np.testing.assert_array_equal(z.numpy(), ref_zeros(words, 80, "v1"))
    assert z.shape == (80, 2) and z.is_contiguous()
    assert any("0xF" in note for note in spec.notes)
    gptq_zeros(spec, bytearray(np.asarray(words, dtype=np.uint32).tobytes()), "v1")  # the module read again
    assert sum("0xF" in note for note in spec.notes) == 1  # noted once
    z2, spec2 = _zeros(words, 80, "v2")
    np.testing.assert_array_equal(z2.numpy(), ref_zeros(words, 80, "v2"))
    assert not spec2.notes  # the 0xF note is the v1 decode's


@pytest.mark.parametrize("word,f_nibble", [(0x6E6E6E6E, False), (0x0000000F, True), (0xF0000000, True),
                                           (0x000F0000, True), (0x12345678, False)])
def test_v1_note_only_for_a_0xf_nibble(word, f_nibble):
    z, spec = _zeros([[word, 0x66666666]], 16, "v1")
    np.testing.assert_array_equal(z.numpy(), ref_zeros([[word, 0x66666666]], 16, "v1"))
    assert any("0xF" in note for note in spec.notes) == f_nibble
    _, sym_spec = _zeros([[word, 0x66666666]], 16, "v1", sym=True)
    assert not sym_spec.notes  # a symmetric module is not noted


@pytest.mark.parametrize("conv,sym_word", [("v1", 0x77777777), ("v2", 0x88888888)])
def test_zeros_all_8_are_none_padding_aside(conv, sym_word):
    assert _zeros([[sym_word] * 2] * 2, 16, conv)[0] is None
    # N = 12: the last word's top four nibbles are padding; they do not count
    pad = (sym_word & 0xFFFF) | 0x12340000
    assert _zeros([[sym_word, pad]] * 2, 12, conv)[0] is None
    words = [[sym_word, pad], [sym_word, pad ^ 0x1]]  # one real zero point off 8
    z, _ = _zeros(words, 12, conv)
    np.testing.assert_array_equal(z.numpy(), ref_zeros(words, 12, conv))
    assert int(z[8, 1]) != 8 and int((z != 8).sum()) == 1


def test_split_across_shards_with_bias_and_descact(make_ckpt):
    rng = np.random.default_rng(5)
    gi = (rng.permutation(64) // 16).astype(np.int64)  # non-monotonic, 16 columns per group
    t, truth = gptq_tensors(rng, M0, store="v1", g_idx=gi, bias=True)
    shards = [{f"{M0}.qweight", f"{M0}.bias"}, {f"{M0}.qzeros", f"{M0}.scales", f"{M0}.g_idx"}]
    ck = Checkpoint(make_ckpt(t, cfg(desc_act=True), shards=shards))
    assert len(ck.shards) == 2
    reader = open_reader(ck)
    spec = reader.linears()[M0]
    assert spec.act_order and spec.has_bias and set(spec.keys) == set(t)
    q = reader.read(spec)
    np.testing.assert_array_equal(q.g_idx.numpy(), gi)
    np.testing.assert_array_equal(q.bias.numpy(), t[f"{M0}.bias"])
    np.testing.assert_allclose(q.dequantize().numpy(), truth, rtol=1e-6)


def test_group_minus_one_is_whole_k(make_ckpt):
    t, truth = gptq_tensors(np.random.default_rng(6), M0, group=64, store="v1")
    del t[f"{M0}.g_idx"]
    reader = open_reader(Checkpoint(make_ckpt(t, cfg(group_size=-1))))
    spec = reader.linears()[M0]
    assert spec.group_size == 64 and spec.groups == 1 and not spec.act_order
    np.testing.assert_allclose(reader.read(spec).dequantize().numpy(), truth, rtol=1e-6)


def pack_bytes(u: np.ndarray) -> np.ndarray:
    """[A, B] 8-bit codes -> int32 [A/4, B], packed down dim 0 (byte i of word r holds row 4r + i)."""
    a, b = u.shape
    out = np.zeros((a // 4, b), dtype=np.int64)
    for r in range(a // 4):
        for c in range(b):
            out[r, c] = sum(int(u[4 * r + i, c]) << (8 * i) for i in range(4))
    return out.astype(np.uint32).view(np.int32)


def gptq8_tensors(rng, m, k=64, n=16, group=16, store="v1", asym=False):
    """An 8-bit GPTQ module (qweight [K/4, N], qzeros [G, N/4]) and the float64 weights it encodes."""
    groups = k // group
    z = rng.integers(100, 156, (groups, n)) if asym else np.full((groups, n), 128)
    gi = np.arange(k) // group
    u = np.clip(z[gi] + np.round(rng.normal(0, 40, (k, n))), 0, 255).astype(np.int64)
    s = rng.uniform(0.001, 0.002, (groups, n)).astype(np.float16)
    stored = z - 1 if store == "v1" else z
    out = {f"{m}.qweight": pack_bytes(u), f"{m}.qzeros": pack_bytes(stored.T).T.copy(), f"{m}.scales": s,
           f"{m}.g_idx": gi.astype(np.int32)}
    return out, ((u - z[gi]) * s.astype(np.float64)[gi]).T


def test_hand_checked_8bit_word():
    assert int(pack_bytes(np.array([[0x10], [0x32], [0x54], [0x76]]))[0, 0]) == 0x76543210


@pytest.mark.parametrize("store,asym", [("v1", False), ("v1", True), ("v2", True)])
def test_dynamic_override_8bit_reads_its_float_values(make_ckpt, store, asym):
    rng = np.random.default_rng(7)
    t0, truth0 = gptq8_tensors(rng, M0, store=store, asym=asym)
    t1, truth1 = gptq_tensors(rng, M1, store=store)
    dyn = {r"+:.*experts\.0\..*": {"bits": 8}, r"-:.*experts\.1\..*": {}}
    reader = open_reader(Checkpoint(make_ckpt({**t0, **t1}, cfg(dynamic=dyn, sym=not asym,
                                                                checkpoint_format="gptq" if store == "v1" else "gptq_v2"))))
    assert reader.verdict().extra["zero_convention"] == store  # told by the 4-bit module
    specs = reader.linears()
    s0 = specs[M0]
    assert s0.refused is None and s0.bits == 8 and (s0.n, s0.k, s0.groups) == (16, 64, 4)
    assert set(s0.keys) == set(t0) and any("8-bit by the dynamic rule" in n for n in s0.notes)
    q0 = reader.read(s0)
    assert q0.codes is None and q0.dense.dtype == torch.float32
    np.testing.assert_allclose(q0.dense.numpy(), truth0, rtol=1e-6, atol=1e-9)
    assert reader.in_place(s0) is None  # never batched as int4 words
    # "-:" says float, but the tensors are there: tensors decide, with a note
    assert specs[M1].refused is None and any("not quantised" in n for n in specs[M1].notes)
    np.testing.assert_allclose(reader.read(specs[M1]).dequantize().numpy(), truth1, rtol=1e-6)


def test_dynamic_override_3bit_is_refused_per_module(make_ckpt):
    rng = np.random.default_rng(7)
    t0, _ = gptq_tensors(rng, M0)
    t1, _ = gptq_tensors(rng, M1)
    t0[f"{M0}.qweight"] = np.zeros((6, 16), np.int32)  # 3-bit: 32 codes in 3 words
    reader = open_reader(Checkpoint(make_ckpt({**t0, **t1}, cfg(dynamic={r".*experts\.0\..*": {"bits": 3}}))))
    specs = reader.linears()
    assert specs[M0].refused and "bits=3" in specs[M0].refused and "dynamic" in specs[M0].refused
    assert set(specs[M0].keys) == set(t0)
    with pytest.raises(RefusedError, match=M0):
        reader.read(specs[M0])


def test_modules_in_block_to_quantize_only_notes(make_ckpt):
    t, _ = gptq_tensors(np.random.default_rng(8), M0)
    reader = open_reader(Checkpoint(make_ckpt(t, cfg(modules_in_block_to_quantize=[["self_attn.q_proj"]]))))
    spec = reader.linears()[M0]
    assert spec.refused is None and spec.notes


@pytest.mark.parametrize("over,match", [
    ({"bits": 3}, r"4-bit checkpoints only.*bits=3.*" + M0.replace(".", r"\.")),
    ({"pack_dtype": "int16"}, "pack_dtype"),
    ({"checkpoint_format": "marlin"}, "Marlin"),
    ({"checkpoint_format": None, "format": "gptq_p"}, "gptq_p"),
    ({"checkpoint_format": "bogus"}, "unknown GPTQ"),
])
def test_refused_configs(make_ckpt, over, match):
    t, _ = gptq_tensors(np.random.default_rng(9), M0)
    reader = open_reader(Checkpoint(make_ckpt(t, cfg(**over))))
    with pytest.raises(RefusedError, match=match) as e:
        reader.verdict()
    assert e.value.hint
    with pytest.raises(RefusedError):
        reader.linears()


@pytest.mark.parametrize("key,bad", [("scales", np.ones((3, 16), np.float16)),
                                     ("qzeros", np.zeros((4, 3), np.int32)),
                                     ("g_idx", np.zeros(60, np.int32))])
def test_shape_mismatch_names_tensor(make_ckpt, key, bad):
    t, _ = gptq_tensors(np.random.default_rng(10), M0)
    t[f"{M0}.{key}"] = bad
    reader = open_reader(Checkpoint(make_ckpt(t, cfg())))
    with pytest.raises(InputError, match=f"{M0}.{key}") as e:
        reader.linears()
    assert e.value.tensor == f"{M0}.{key}" and e.value.hint


def test_g_idx_out_of_range(make_ckpt):
    t, _ = gptq_tensors(np.random.default_rng(11), M0)
    t[f"{M0}.g_idx"] = t[f"{M0}.g_idx"].copy()
    t[f"{M0}.g_idx"][5] = 4  # only groups 0..3 exist
    with pytest.raises(InputError, match=r"g_idx: group index out of range"):
        open_reader(Checkpoint(make_ckpt(t, cfg()))).linears()


@pytest.mark.parametrize("drop", ["qzeros", "scales", "qweight"])
def test_missing_partner_names_module(make_ckpt, drop):
    t, _ = gptq_tensors(np.random.default_rng(12), M0)
    del t[f"{M0}.{drop}"]
    with pytest.raises(InputError, match=f"{M0}: has .* but no {drop}"):
        open_reader(Checkpoint(make_ckpt(t, cfg()))).linears()


def test_string_booleans_in_config_are_read_as_written():
    from int4pack.formats._common import cfg_bool
    from int4pack.errors import InputError

    assert cfg_bool({"sym": "false"}, "sym", True) is False
    assert cfg_bool({"sym": "True"}, "sym", False) is True
    assert cfg_bool({}, "sym", True) is True
    with pytest.raises(InputError, match="not true or false"):
        cfg_bool({"sym": "maybe"}, "sym", True)


@pytest.mark.parametrize("k, n, group, permuted", [
    (64, 5, 16, False),   # whole words per group: the packed-word sums
    (64, 5, 16, True),    # act-order g_idx
    (48, 3, 12, False),   # a group that is not whole words
    (40, 4, 16, False),   # a short last group
    (32, 2, 32, False),   # one group
    (64, 5, 16, "empty"),  # act-order g_idx that leaves groups 0 and 2 without rows
])
def test_group_code_sums_against_python_ints(k, n, group, permuted):
    rng = np.random.default_rng(k + n + group)
    words = rng.integers(-2**31, 2**31, size=(k // 8, n), dtype=np.int64).astype(np.int32)  # negative words too
    groups = -(-k // group)
    g_idx = np.arange(k) // group
    if permuted:
        rng.shuffle(g_idx)
    if permuted == "empty":
        g_idx = np.where(g_idx % 2 == 0, 3, g_idx)
    want = np.zeros((groups, n), np.int64)
    for r in range(k):
        for c in range(n):
            want[g_idx[r], c] += (int(words[r // 8, c]) % 2**32 >> (4 * (r % 8))) & 0xF
    got = _group_code_sums(words.view(np.uint32), g_idx if permuted else None, groups, group)
    assert got.dtype == np.int64 and got.tolist() == want.tolist()
