"""compressed-tensors reader: real ct fixtures against a numpy decoder and the dense source, plus synthetic files."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _reference import ct_decode
from int4pack.sources.checkpoint import Checkpoint
from int4pack.errors import InputError, RefusedError
from int4pack.formats import open_reader
from int4pack.formats.compressed_tensors import CompressedTensorsReader

CT_FIXTURES = ["ct_qwen3moe_w4a16", "ct_qwen3moe_w4a16_asym_g32", "ct_qwen3moe_w4a16_channel",
               "ct_qwen3moe_w4a8_int_g32", "ct018_q3_actorder", "mf_mixtral"]
FROM_DENSE = {"ct_qwen3moe_w4a16", "ct_qwen3moe_w4a16_asym_g32", "ct_qwen3moe_w4a16_channel",
              "ct_qwen3moe_w4a8_int_g32", "ct018_q3_actorder"}
QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape")


def group_of(reader) -> int | None:
    w = reader.cfg["config_groups"][next(iter(reader.cfg["config_groups"]))]["weights"]
    return w["group_size"] if w.get("strategy") == "group" else None


@pytest.mark.parametrize("name", CT_FIXTURES)
def test_real_fixture_matches_reference(name, fixture_dir, raw):
    folder = fixture_dir(name)
    tensors = raw(folder)
    reader = open_reader(Checkpoint(folder))
    assert isinstance(reader, CompressedTensorsReader)
    v = reader.verdict()
    assert v.format == "compressed-tensors" and reader.cfg["version"] in v.detail
    assert reader.cfg["format"] in v.detail and not v.warnings
    specs = reader.linears()
    quant = {k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_scale")}
    assert set(specs) == quant and quant
    dense = raw(fixture_dir("dense_qwen3moe")) if name in FROM_DENSE else {}
    for m, spec in specs.items():
        own = {k for k in tensors if k.rsplit(".", 1)[0] == m}
        assert set(spec.keys) == own
        ref = ct_decode(tensors, m, group_of(reader))
        q = reader.read(spec)
        assert q.codes.shape == (spec.n, spec.k) and q.codes.dtype == torch.uint8
        np.testing.assert_array_equal(q.codes.numpy(), ref["codes"])
        zeros = np.full(ref["zeros"].shape, 8) if q.zeros is None else q.zeros.numpy()
        np.testing.assert_array_equal(zeros, ref["zeros"])
        np.testing.assert_array_equal(q.group_index().numpy(), ref["g_idx"])
        np.testing.assert_allclose(q.dequantize().numpy(), ref["w"], rtol=1e-6, atol=0)
        if dense:  # the producer rounded the dense weight: within about half a step
            err = np.abs(ref["w"] - dense[f"{m}.weight"]) / ref["s"][:, ref["g_idx"]]
            assert err.max() <= 0.6, (m, err.max())


def test_real_asym_has_zero_points(fixture_dir):
    reader = open_reader(Checkpoint(fixture_dir("ct_qwen3moe_w4a16_asym_g32")))
    spec = next(iter(reader.linears().values()))
    assert not spec.sym and reader.read(spec).zeros is not None


def test_real_actorder_and_w4a8(fixture_dir):
    r = open_reader(Checkpoint(fixture_dir("ct018_q3_actorder")))
    assert all(s.act_order for s in r.linears().values())
    r = open_reader(Checkpoint(fixture_dir("ct_qwen3moe_w4a8_int_g32")))
    specs = r.linears()
    assert {s.fmt for s in specs.values()} == {"ct-int"}
    assert all(r.read(s).zeros is None and s.sym for s in specs.values())


# -- synthetic -------------------------------------------------------------------------------------
def pack_k(u: np.ndarray) -> np.ndarray:
    """[N, K] codes -> int32 [N, ceil(K/8)], tail zero-padded; python loops."""
    n, k = u.shape
    out = np.zeros((n, -(-k // 8)), dtype=np.int64)
    for r in range(n):
        for c in range(k):
            out[r, c // 8] |= int(u[r, c]) << (4 * (c % 8))
    return out.astype(np.uint32).view(np.int32)


M = "model.layers.0.mlp.experts.0.gate_proj"
A = "model.layers.0.self_attn.q_proj"


def cfg(weights=None, fmt="pack-quantized", targets=("Linear",), **top):
    w = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 8}
    w.update(weights or {})
    base = {"quant_method": "compressed-tensors", "format": fmt, "version": "0.20.0",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": list(targets), "weights": w, "format": fmt}},
            "ignore": ["lm_head"]}
    base.update(top)
    return base


def ct_tensors(rng, m=M, n=16, k=24, group=8, asym=None):
    g = -(-k // group)
    q = rng.integers(-8, 8, (n, k))
    s = torch.from_numpy(rng.uniform(0.01, 0.05, (n, g))).to(torch.bfloat16)
    t = {f"{m}.weight_packed": pack_k(q + 8), f"{m}.weight_shape": np.array([n, k], np.int64),
         f"{m}.weight_scale": s}
    zp = np.zeros((n, g), np.int64)
    if asym == "packed":
        zp = rng.integers(-8, 8, (n, g))
        t[f"{m}.weight_zero_point"] = pack_k((zp + 8).T).T.copy()
    elif asym == "int8":
        zp = rng.integers(-8, 8, (n, g))
        t[f"{m}.weight_zero_point"] = zp.astype(np.int8)
    gi = np.arange(k) // group
    return t, (q - zp[:, gi]) * s.double().numpy()[:, gi]


def read_one(folder, m=M):
    r = open_reader(Checkpoint(folder))
    return r, r.read(r.linears()[m])


def test_hand_checked_word_and_padding(make_ckpt):
    assert int(pack_k(np.arange(8)[None])[0, 0]) == 0x76543210
    t = {f"{M}.weight_packed": pack_k(np.tile(np.arange(12), (8, 1))),  # K=12: 4 nibbles of padding
         f"{M}.weight_shape": np.array([8, 12], np.int64),
         f"{M}.weight_scale": torch.ones(8, 1, dtype=torch.bfloat16)}
    r, q = read_one(make_ckpt(t, cfg({"strategy": "channel", "group_size": None})))
    assert q.codes.shape == (8, 12) and q.codes[0].tolist() == list(range(12))
    assert q.dequantize()[0].tolist() == [c - 8.0 for c in range(12)]
    assert r.linears()[M].group_size == 12


@pytest.mark.parametrize("asym", ["packed", "int8"])
def test_asym_zero_points_both_layouts(make_ckpt, asym):
    t, truth = ct_tensors(np.random.default_rng(0), asym=asym)
    r, q = read_one(make_ckpt(t, cfg({"symmetric": False})))
    assert not r.linears()[M].sym and q.zeros is not None
    np.testing.assert_allclose(q.dequantize().numpy(), truth, rtol=1e-6)


def test_packed_and_int8_zero_points_agree(make_ckpt):
    rng = np.random.default_rng(1)
    zp = rng.integers(-8, 8, (16, 3))
    t, _ = ct_tensors(rng, asym="int8")
    t[f"{M}.weight_zero_point"] = zp.astype(np.int8)
    _, q_old = read_one(make_ckpt(dict(t), cfg({"symmetric": False}), name="old"))
    t[f"{M}.weight_zero_point"] = pack_k((zp + 8).T).T.copy()  # [ceil(N/8), G] int32
    assert t[f"{M}.weight_zero_point"].shape == (2, 3)
    _, q_new = read_one(make_ckpt(t, cfg({"symmetric": False}), name="new"))
    np.testing.assert_array_equal(q_old.zeros.numpy(), zp + 8)
    np.testing.assert_array_equal(q_new.zeros.numpy(), zp + 8)


def test_sharded_module_with_g_idx_and_bias(make_ckpt):
    rng = np.random.default_rng(2)
    t, _ = ct_tensors(rng)
    gi = rng.permutation(24) // 8
    t[f"{M}.weight_g_idx"] = gi.astype(np.int32)
    t[f"{M}.bias"] = torch.randn(16, dtype=torch.bfloat16)
    q8 = (np.array([[(int(w) >> (4 * i)) & 15 for w in row for i in range(8)] for row in
                    t[f"{M}.weight_packed"].view(np.uint32)]) - 8)[:, :24]
    truth = q8 * t[f"{M}.weight_scale"].double().numpy()[:, gi]
    shards = [{f"{M}.weight_packed", f"{M}.bias"}, {f"{M}.weight_shape", f"{M}.weight_scale", f"{M}.weight_g_idx"}]
    r, q = read_one(make_ckpt(t, cfg({"actorder": "group"}), shards=shards))
    spec = r.linears()[M]
    assert spec.act_order and spec.has_bias and set(spec.keys) == set(t)
    np.testing.assert_array_equal(q.g_idx.numpy(), gi)
    np.testing.assert_allclose(q.dequantize().numpy(), truth, rtol=1e-6)


def test_tensor_strategy_broadcasts_one_scale(make_ckpt):
    rng = np.random.default_rng(3)
    t, _ = ct_tensors(rng)
    t[f"{M}.weight_scale"] = torch.tensor([0.5], dtype=torch.bfloat16)
    r, q = read_one(make_ckpt(t, cfg({"strategy": "tensor", "group_size": None})))
    assert q.scales.shape == (16, 1) and bool((q.scales == 0.5).all())
    assert r.linears()[M].groups == 1


def test_int_quantized_codes_and_range(make_ckpt):
    rng = np.random.default_rng(4)
    q = rng.integers(-8, 8, (16, 32)).astype(np.int8)
    s = torch.from_numpy(rng.uniform(0.01, 0.05, (16, 4))).to(torch.bfloat16)
    t = {f"{M}.weight": q, f"{M}.weight_scale": s}
    acts = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}
    c = cfg(fmt="int-quantized")
    c["config_groups"]["group_0"]["input_activations"] = acts
    _, out = read_one(make_ckpt(t, c, name="ok"))
    np.testing.assert_array_equal(out.codes.numpy(), q.astype(np.int64) + 8)
    q[3, 5] = 9
    t[f"{M}.weight"] = q
    with pytest.raises(InputError, match=rf"{M}.weight: int-quantized values span \[-8, 9\]"):
        read_one(make_ckpt(t, c, name="bad"))


def pack_bytes_k(u: np.ndarray) -> np.ndarray:
    """uint8 values [N, K] -> int32 [N, ceil(K/4)]: byte i of word j holds k = 4j + i (python ints)."""
    n, k = u.shape
    out = np.zeros((n, -(-k // 4)), dtype=np.int64)
    for r in range(n):
        for c in range(k):
            out[r, c // 4] += int(u[r, c]) << (8 * (c % 4))
    return out.astype(np.uint32).view(np.int32)


def test_mixed_precision_8bit_int_quantized_group_reads_floats(make_ckpt):
    rng = np.random.default_rng(5)
    t, truth = ct_tensors(rng, M)
    qa = rng.integers(-128, 128, (16, 24)).astype(np.int8)
    sa = torch.from_numpy(rng.uniform(0.001, 0.002, (16, 1))).to(torch.bfloat16)
    t[f"{A}.weight"], t[f"{A}.weight_scale"] = qa, sa
    c = cfg(fmt="mixed-precision", targets=[r"re:.*experts.*"])
    c["config_groups"]["group_0"]["format"] = "pack-quantized"
    c["config_groups"]["group_1"] = {"targets": [r"re:.*self_attn.*"], "format": "int-quantized",
                                     "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                 "strategy": "channel"}}
    r = open_reader(Checkpoint(make_ckpt(t, c)))
    specs = r.linears()
    assert specs[A].refused is None and specs[A].bits == 8 and specs[A].fmt == "ct-int"
    assert set(specs[A].keys) == {f"{A}.weight", f"{A}.weight_scale"}
    np.testing.assert_allclose(r.read(specs[A]).dense.numpy(), qa * sa.double().numpy(), rtol=1e-6)
    assert r.in_place(specs[A]) is None
    assert specs[M].refused is None and specs[M].fmt == "ct-pack" and specs[M].bits == 4
    np.testing.assert_allclose(r.read(specs[M]).dequantize().numpy(), truth, rtol=1e-6)


@pytest.mark.parametrize("zp_kind", [None, "packed", "int8"])
def test_8bit_pack_quantized_group_reads_floats(make_ckpt, zp_kind):
    """compressed-tensors' pack_to_int32 stores value + 128 a byte along K, zero points the same along N."""
    rng = np.random.default_rng(6)
    t, _ = ct_tensors(rng, M)
    n, k, g = 16, 40, 8
    q = rng.integers(-128, 128, (n, k))
    s = torch.from_numpy(rng.uniform(0.001, 0.002, (n, k // g))).to(torch.bfloat16)
    zp = np.zeros((n, k // g), np.int64)
    t.update({f"{A}.weight_packed": pack_bytes_k(q + 128), f"{A}.weight_shape": np.array([n, k], np.int64),
              f"{A}.weight_scale": s})
    if zp_kind:
        zp = rng.integers(-20, 20, (n, k // g))
        t[f"{A}.weight_zero_point"] = (pack_bytes_k((zp + 128).T).T.copy() if zp_kind == "packed"
                                      else zp.astype(np.int8))
    c = cfg(fmt="mixed-precision", targets=[r"re:.*experts.*"])
    c["config_groups"]["group_0"]["format"] = "pack-quantized"
    c["config_groups"]["group_1"] = {"targets": [r"re:.*self_attn.*"], "format": "pack-quantized",
                                     "weights": {"num_bits": 8, "type": "int", "symmetric": zp_kind is None,
                                                 "strategy": "group", "group_size": g}}
    r = open_reader(Checkpoint(make_ckpt(t, c)))
    spec = r.linears()[A]
    assert (spec.bits, spec.n, spec.k, spec.groups) == (8, n, k, k // g)
    gi = np.arange(k) // g
    truth = (q - zp[:, gi]) * s.double().numpy()[:, gi]
    np.testing.assert_allclose(r.read(spec).dense.numpy(), truth, rtol=1e-6, atol=1e-9)


def test_8bit_only_is_refused(make_ckpt):
    t = {f"{A}.weight": np.zeros((16, 24), np.int8), f"{A}.weight_scale": torch.ones(16, 1, dtype=torch.bfloat16)}
    c = cfg({"num_bits": 8, "strategy": "channel", "group_size": None}, fmt="int-quantized")
    with pytest.raises(RefusedError, match="no config group is 4-bit"):
        open_reader(Checkpoint(make_ckpt(t, c))).linears()


@pytest.mark.parametrize("c,match", [
    (cfg(fmt="marlin-24"), "marlin-24"),
    (cfg({"type": "float", "num_bits": 8}, fmt="float-quantized"), "float"),
    (cfg({"num_bits": 8}), "num_bits=8"),
    (cfg({"strategy": "block", "block_structure": [128, 128]}), "block"),
    (cfg({"type": "float"}), "type 'float'"),
    (cfg(transform_config={"config_groups": {"u": {}}}), "transform_config"),
])
def test_refused_configs(make_ckpt, c, match):
    t, _ = ct_tensors(np.random.default_rng(6))
    reader = open_reader(Checkpoint(make_ckpt(t, c)))
    with pytest.raises(RefusedError, match=match) as e:
        reader.linears()
    assert e.value.hint
    with pytest.raises(RefusedError):
        reader.verdict()


def test_fused_3d_experts_refused(make_ckpt):
    t, _ = ct_tensors(np.random.default_rng(7))
    e = "model.layers.0.mlp.experts"
    t[f"{e}.gate_up_proj"] = np.zeros((4, 32, 16), np.int8)
    t[f"{e}.gate_up_proj_scale"] = torch.ones(4, 32, 1, dtype=torch.bfloat16)
    with pytest.raises(RefusedError, match=r"3-D.*gate_up_proj_scale"):
        open_reader(Checkpoint(make_ckpt(t, cfg()))).verdict()


@pytest.mark.parametrize("key,bad", [("weight_scale", torch.ones(16, 2, dtype=torch.bfloat16)),
                                     ("weight_packed", np.zeros((16, 2), np.int32)),
                                     ("weight_zero_point", np.zeros((16, 3), np.int32))])
def test_shape_mismatch_names_tensor(make_ckpt, key, bad):
    t, _ = ct_tensors(np.random.default_rng(8), asym="packed")
    t[f"{M}.{key}"] = bad
    with pytest.raises(InputError, match=f"{M}.{key}: shape") as e:
        open_reader(Checkpoint(make_ckpt(t, cfg({"symmetric": False})))).linears()
    assert e.value.tensor == f"{M}.{key}"


def test_g_idx_out_of_range(make_ckpt):
    t, _ = ct_tensors(np.random.default_rng(9))
    t[f"{M}.weight_g_idx"] = np.full(24, 3, np.int32)
    with pytest.raises(InputError, match="weight_g_idx: group index out of range"):
        open_reader(Checkpoint(make_ckpt(t, cfg()))).linears()


def test_asym_without_zero_point_is_malformed(make_ckpt):
    t, _ = ct_tensors(np.random.default_rng(10))
    with pytest.raises(InputError, match=f"{M}: .*asymmetric but there is no weight_zero_point"):
        open_reader(Checkpoint(make_ckpt(t, cfg({"symmetric": False})))).linears()


def test_targets_and_ignore(make_ckpt):
    rng = np.random.default_rng(11)
    t, _ = ct_tensors(rng, M)
    t2, _ = ct_tensors(rng, A)
    c = cfg(targets=[M, r"re:.*q_proj$"], ignore=[A])
    specs = open_reader(Checkpoint(make_ckpt({**t, **t2}, c))).linears()
    assert set(specs) == {M, A}
    assert any("ignore" in n for n in specs[A].notes)  # tensors decide, the note says so
    assert not specs[M].notes


def test_exact_name_target_beats_class_target(make_ckpt):
    rng = np.random.default_rng(12)
    t, truth = ct_tensors(rng, M)
    c = cfg({"num_bits": 8}, targets=["Linear"])
    c["config_groups"]["g4"] = {"targets": [M], "format": "pack-quantized",
                                "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                            "strategy": "group", "group_size": 8}}
    r = open_reader(Checkpoint(make_ckpt(t, c)))
    spec = r.linears()[M]
    assert spec.refused is None
    np.testing.assert_allclose(r.read(spec).dequantize().numpy(), truth, rtol=1e-6)


def test_no_matching_group_among_several(make_ckpt):
    t, _ = ct_tensors(np.random.default_rng(13), M)
    c = cfg(targets=["re:.*self_attn.*"])
    c["config_groups"]["g1"] = {"targets": ["re:.*lm_head"], "weights": c["config_groups"]["group_0"]["weights"]}
    with pytest.raises(InputError, match=f"{M}: has quantised tensors but matches no config group"):
        open_reader(Checkpoint(make_ckpt(t, c))).linears()


def test_static_activation_params_are_accounted(make_ckpt):
    t, _ = ct_tensors(np.random.default_rng(14), M)
    t[f"{M}.input_scale"] = torch.ones(1, dtype=torch.bfloat16)
    spec = open_reader(Checkpoint(make_ckpt(t, cfg()))).linears()[M]
    assert f"{M}.input_scale" in spec.keys and spec.notes


@pytest.mark.parametrize("stored", [np.array([16, 24], np.int64), np.array([16, 24], np.int32),
                                    np.array([16, 24], np.int16), np.array([16.0, 24.0], np.float32)])
def test_weight_shape_in_any_dtype_gives_n_and_k(make_ckpt, stored):
    t, truth = ct_tensors(np.random.default_rng(3), n=16, k=24)
    t[f"{M}.weight_shape"] = stored
    r, q = read_one(make_ckpt(t, cfg({})))
    spec = r.linears()[M]
    assert (spec.n, spec.k) == (16, 24) and q.codes.shape == (16, 24)
    np.testing.assert_allclose(q.dequantize().numpy(), truth, rtol=1e-6)


@pytest.mark.parametrize("stored", [np.array([[16, 24]], np.int64), np.array([16, 24, 1], np.int32)])
def test_weight_shape_not_two_numbers_is_refused(make_ckpt, stored):
    t, _ = ct_tensors(np.random.default_rng(4))
    t[f"{M}.weight_shape"] = stored
    with pytest.raises(InputError, match=r"weight_shape: expected \[N, K\]"):
        open_reader(Checkpoint(make_ckpt(t, cfg({})))).linears()


# -- llm-compressor 0.14.0.1's mixed-precision checkpoints (tests/fixtures/README.md) ---------------------
def _decode_8bit_rows(tensors: dict, m: str, rows: int = 4) -> np.ndarray:
    """float64 [rows, K] of an 8-bit pack-quantized module, one python int shift per value (symmetric)."""
    n, k = (int(x) for x in tensors[f"{m}.weight_shape"])
    words = tensors[f"{m}.weight_packed"]
    s = tensors[f"{m}.weight_scale"]
    g = k // s.shape[1]
    out = np.zeros((rows, k))
    for r in range(rows):
        for c in range(k):
            q = ((int(words[r, c // 4]) & 0xFFFFFFFF) >> (8 * (c % 4)) & 0xFF) - 128
            out[r, c] = q * s[r, c // g]
    return out


@pytest.mark.parametrize("name,wide", [("ct_qwen3moe_mixed_w4w8", "model.layers.1.self_attn.o_proj"),
                                       ("ct_qwen3moe_mixed_experts", "model.layers.1.mlp.experts.0.down_proj")])
def test_real_mixed_precision_fixture(name, wide, fixture_dir, raw):
    tensors = raw(fixture_dir(name))
    r = open_reader(Checkpoint(fixture_dir(name)))
    specs = r.linears()
    assert {s.bits for s in specs.values()} == {4, 8} and not any(s.refused for s in specs.values())
    spec = specs[wide]
    assert spec.bits == 8 and spec.fmt == "ct-pack"
    np.testing.assert_allclose(r.read(spec).dense.numpy()[:4], _decode_8bit_rows(tensors, wide), rtol=1e-6)
    for m, s in specs.items():  # the int4 ones as before: the independent decoder
        if s.bits == 4:
            np.testing.assert_allclose(r.read(s).dequantize().numpy(), ct_decode(tensors, m, 32)["w"], rtol=1e-6)


@pytest.mark.parametrize("name,role,path", [("ct_qwen3moe_mixed_w4w8", "attention", "dequant"),
                                            ("ct_qwen3moe_mixed_experts", "expert", "requant")])
def test_real_mixed_precision_converts_and_verifies(name, role, path, fixture_dir, tmp_path):
    import int4pack

    report = int4pack.convert(fixture_dir(name), tmp_path / "out")
    rows = report["plan"]["mixed_precision"]
    assert [(x["role"], x["source"], x["path"]) for x in rows] == [(role, "8-bit", path)]
    wide = [m for m, rec in report["modules"].items() if rec["path"] == path]
    assert len(wide) == rows[0]["modules"] == (8 if role == "attention" else 6)  # 4 projections / 3, 2 layers
    for m in wide:
        if path == "requant":
            assert float(report["modules"][m]["rel_l2"]) <= float(report["modules"][m]["baseline_rel_l2"]) * (1 + 1e-6)
    assert {rec["path"] for m, rec in report["modules"].items() if m not in wide} == {"lossless"}
    assert int4pack.verify(tmp_path / "out", against=fixture_dir(name), processes=False)["ok"]
