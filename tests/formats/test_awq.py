"""AWQ GEMM reader: AutoAWQ fixtures against an independent numpy decoder, and tiny synthetic files."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _reference import awq_decode
from int4pack.sources.checkpoint import Checkpoint
from int4pack.errors import InputError, RefusedError
from int4pack.formats import open_reader
from int4pack.formats.awq import AWQReader

ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # logical column 8j + ORDER[i] is in nibble i (formats.md §2)


@pytest.mark.parametrize("name", ["awq_q3", "awqpack_mixtral"])
def test_real_fixture_matches_reference(name, fixture_dir, raw):
    folder = fixture_dir(name)
    tensors = raw(folder)
    reader = open_reader(Checkpoint(folder))
    assert isinstance(reader, AWQReader)
    v = reader.verdict()
    assert (v.format, v.detail) == ("awq", "awq gemm")
    specs = reader.linears()
    assert set(specs) == {k[: -len(".qweight")] for k in tensors if k.endswith(".qweight")}
    assert specs, "fixture has quantised modules"
    for m, spec in specs.items():
        assert set(spec.keys) == {k for k in tensors if k.rsplit(".", 1)[0] == m}
        ref = awq_decode(tensors, m)
        q = reader.read(spec)
        assert q.g_idx is None and q.codes.dtype == torch.uint8
        np.testing.assert_array_equal(q.codes.numpy(), ref["u"])
        zeros = np.full(ref["z"].shape, 8) if q.zeros is None else q.zeros.numpy()
        np.testing.assert_array_equal(zeros, ref["z"])
        np.testing.assert_array_equal(q.scales.double().numpy(), ref["s"])
        np.testing.assert_allclose(q.dequantize().numpy(), ref["w"], rtol=1e-6, atol=0)


def test_real_mixtral_router_not_quantised(fixture_dir):
    reader = open_reader(Checkpoint(fixture_dir("awqpack_mixtral")))
    specs = reader.linears()
    assert not any(m.endswith("block_sparse_moe.gate") for m in specs)
    assert any(m.endswith("experts.0.w1") for m in specs)
    assert any("modules_to_not_convert" in e for e in reader.verdict().evidence)


# -- synthetic ----------------------------------------------------------------------------------------
def pack_awq(u: np.ndarray) -> np.ndarray:
    """[R, N] codes -> int32 [R, N/8] with explicit loops in AWQ order."""
    r, n = u.shape
    out = np.zeros((r, n // 8), dtype=np.int64)
    for a in range(r):
        for j in range(n // 8):
            out[a, j] = sum(int(u[a, 8 * j + ORDER[i]]) << (4 * i) for i in range(8))
    return out.astype(np.uint32).view(np.int32)


M = "model.layers.0.mlp.experts.0.up_proj"


def cfg(**kw):
    base = {"quant_method": "awq", "bits": 4, "group_size": 16, "version": "gemm", "zero_point": True}
    base.update(kw)
    return base


def awq_tensors(rng, k=32, n=16, group=16, bias=False):
    g = k // group
    z = rng.integers(0, 16, (g, n))
    u = rng.integers(0, 16, (k, n))
    s = rng.uniform(0.01, 0.05, (g, n)).astype(np.float16)
    t = {f"{M}.qweight": pack_awq(u), f"{M}.qzeros": pack_awq(z), f"{M}.scales": s}
    if bias:
        t[f"{M}.bias"] = rng.normal(0, 1, n).astype(np.float16)
    gi = np.arange(k) // group
    return t, ((u - z[gi]) * s.astype(np.float64)[gi]).T


def test_hand_checked_order(make_ckpt):
    # row of codes equal to their column index: nibble i holds column ORDER[i]
    u = np.tile(np.arange(8), (16, 1))
    assert int(pack_awq(u)[0, 0]) == 0x75316420
    t = {f"{M}.qweight": pack_awq(u), f"{M}.qzeros": pack_awq(np.zeros((1, 8), int)),
         f"{M}.scales": np.ones((1, 8), np.float16)}
    reader = open_reader(Checkpoint(make_ckpt(t, cfg(group_size=-1))))
    q = reader.read(reader.linears()[M])
    assert q.codes[:, 0].tolist() == list(range(8))
    assert q.dequantize()[:, 0].tolist() == list(range(8))  # zero point 0, scale 1


def test_synthetic_sharded_with_bias(make_ckpt):
    t, truth = awq_tensors(np.random.default_rng(0), bias=True)
    shards = [{f"{M}.qweight"}, {f"{M}.qzeros", f"{M}.scales", f"{M}.bias"}]
    reader = open_reader(Checkpoint(make_ckpt(t, cfg(), shards=shards)))
    spec = reader.linears()[M]
    assert (spec.n, spec.k, spec.groups, spec.has_bias) == (16, 32, 2, True)
    assert set(spec.keys) == set(t)
    q = reader.read(spec)
    np.testing.assert_allclose(q.dequantize().numpy(), truth, rtol=1e-6)
    np.testing.assert_array_equal(q.bias.numpy(), t[f"{M}.bias"])


def test_zero_points_all_8_are_dropped_and_one_off_is_kept(make_ckpt):
    t, truth = awq_tensors(np.random.default_rng(2))
    z = np.full((2, 16), 8)
    t[f"{M}.qzeros"] = pack_awq(z)
    reader = open_reader(Checkpoint(make_ckpt(t, cfg(), name="all8")))
    assert reader.read(reader.linears()[M]).zeros is None
    z[1, 13] = 9
    t[f"{M}.qzeros"] = pack_awq(z)
    reader = open_reader(Checkpoint(make_ckpt(t, cfg(), name="one_off")))
    q = reader.read(reader.linears()[M])
    np.testing.assert_array_equal(q.zeros.numpy(), z.T)


@pytest.mark.parametrize("version", ["gemv", "GEMV_FAST", "marlin", "exllama", "something"])
def test_other_versions_refused(make_ckpt, version):
    t, _ = awq_tensors(np.random.default_rng(1))
    reader = open_reader(Checkpoint(make_ckpt(t, cfg(version=version))))
    with pytest.raises(RefusedError, match=f"AWQ version '{version.lower()}'") as e:
        reader.verdict()
    assert "gemm" in e.value.hint.lower()
    with pytest.raises(RefusedError):
        reader.linears()


@pytest.mark.parametrize("over,match", [({"zero_point": False}, "zero_point"),
                                        ({"bits": 3, "w_bit": None}, "bits=3")])
def test_refused_configs(make_ckpt, over, match):
    t, _ = awq_tensors(np.random.default_rng(2))
    with pytest.raises(RefusedError, match=match):
        open_reader(Checkpoint(make_ckpt(t, cfg(**over)))).linears()


def test_shape_mismatch_names_tensor(make_ckpt):
    t, _ = awq_tensors(np.random.default_rng(3))
    t[f"{M}.qzeros"] = np.zeros((3, 2), np.int32)
    with pytest.raises(InputError, match=f"{M}.qzeros: shape") as e:
        open_reader(Checkpoint(make_ckpt(t, cfg()))).linears()
    assert e.value.tensor == f"{M}.qzeros"


def test_missing_scales_names_module(make_ckpt):
    t, _ = awq_tensors(np.random.default_rng(4))
    del t[f"{M}.scales"]
    with pytest.raises(InputError, match=f"{M}: has a qweight but no scales"):
        open_reader(Checkpoint(make_ckpt(t, cfg()))).linears()
