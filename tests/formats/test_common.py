"""formats/_common.py: the g_idx read that skips the trivial index, the checkpoint's reads under it, and the
small helpers the readers share (with nibbles.py's unpacking they use)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from int4pack.sources.checkpoint import Checkpoint
from int4pack.errors import InputError
from int4pack.formats._common import all_bytes, g_idx_unless_trivial, read_transposed
from int4pack.nibbles import nibble_rows, unpack_rows

K, GROUP = 64, 16


def _ckpt(make_ckpt, g_idx: np.ndarray) -> Checkpoint:
    return Checkpoint(make_ckpt({"m.g_idx": g_idx, "m.other": np.arange(6, dtype=np.int32)}, {"quant_method": "gptq"}))


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.int16])
def test_trivial_g_idx_is_none_in_every_stored_dtype(make_ckpt, dtype):
    ck = _ckpt(make_ckpt, (np.arange(K) // GROUP).astype(dtype))
    assert g_idx_unless_trivial(ck, "m.g_idx", K, K // GROUP, GROUP) is None


def test_permuted_g_idx_is_returned(make_ckpt):
    g = (np.arange(K) // GROUP).astype(np.int32)
    g[[3, 40]] = g[[40, 3]]
    got = g_idx_unless_trivial(_ckpt(make_ckpt, g), "m.g_idx", K, K // GROUP, GROUP)
    assert got is not None and got.tolist() == g.tolist()


def test_trivial_index_past_the_scales_is_refused(make_ckpt):
    """arange(K) // group names group 3, but the scales hold 3 groups: the range check still runs."""
    ck = _ckpt(make_ckpt, (np.arange(K) // GROUP).astype(np.int32))
    with pytest.raises(InputError, match="out of range"):
        g_idx_unless_trivial(ck, "m.g_idx", K, 3, GROUP)


def test_reads_share_one_descriptor_per_shard_and_close_it(make_ckpt):
    ck = _ckpt(make_ckpt, (np.arange(K) // GROUP).astype(np.int32))
    a = ck.get("m.g_idx")
    fds = dict(ck._fds)
    assert len(fds) == 1
    b = ck.get("m.other")
    assert ck._fds == fds  # the second tensor of the shard: no new descriptor
    a[0] = 99  # private memory: a later read is unaffected
    assert int(ck.get("m.g_idx")[0]) == 0 and b.tolist() == list(range(6))
    ck.close()
    with pytest.raises(OSError):
        os.fstat(next(iter(fds.values())))  # closed
    assert ck.get("m.other").tolist() == list(range(6))  # and reopened on demand
    ck.close()


# -- reads into memory of their own, every dtype ------------------------------------------------------
def _bits(t: torch.Tensor) -> torch.Tensor:
    """The stored bits as integers of the same size (compares NaNs and -0.0 exactly)."""
    size = t.element_size()
    return t.reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])


STORED = {
    "bf16": torch.randn(3, 5).to(torch.bfloat16),
    "f16": torch.tensor([[1.5, -0.0, float("nan")]], dtype=torch.float16),
    "f32": torch.randn(4, 2),
    "f64": torch.randn(2),
    "i64": torch.tensor([-(2**40), 7]),
    "i8": torch.tensor([-128, 5, 127], dtype=torch.int8),
    "u8": torch.arange(250, 256, dtype=torch.uint8),
    "bool": torch.tensor([True, False, True]),
    "f8": torch.tensor([0.5, -2.0, 448.0]).to(torch.float8_e4m3fn),
    "scalar": torch.tensor(3.25),
    "empty": torch.empty(0, 4, dtype=torch.float16),
}


def test_get_and_read_bytes_return_the_stored_bits_in_private_memory(make_ckpt):
    ck = Checkpoint(make_ckpt(dict(STORED), {"quant_method": "gptq"}))
    for name, want in STORED.items():
        got = ck.get(name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(_bits(got), _bits(want)), name
        assert bytes(ck.read_bytes(name)) == bytes(_bits(want).numpy().tobytes()), name
    a, b = ck.get("f32"), ck.read_bytes("f32")
    a.fill_(0)
    b[:] = bytes(len(b))
    assert torch.equal(ck.get("f32"), STORED["f32"])  # neither write reached the next read
    assert bytes(ck.read_bytes("f32")) == STORED["f32"].numpy().tobytes()
    ck.close()


def test_read_into_checks_the_range_and_reads_at_an_offset(make_ckpt):
    ck = Checkpoint(make_ckpt({"t": np.arange(8, dtype=np.int32)}, {"quant_method": "gptq"}))
    buf = bytearray(8)
    ck.read_into("t", memoryview(buf), 12)
    assert np.frombuffer(buf, np.int32).tolist() == [3, 4]
    with pytest.raises(ValueError, match="outside"):
        ck.read_into("t", memoryview(buf), 28)
    ck.close()


def test_a_shard_truncated_after_opening_names_the_file(make_ckpt):
    folder = make_ckpt({"a": np.arange(4, dtype=np.int32), "b": np.arange(1000, dtype=np.int32)},
                       {"quant_method": "gptq"})
    ck = Checkpoint(folder)
    assert ck.get("a").tolist() == [0, 1, 2, 3]  # the descriptor is open now
    shard = folder / "model.safetensors"
    os.truncate(shard, ck.info("b").begin + 100)
    with pytest.raises(InputError, match="model.safetensors: truncated while reading 'b'") as e:
        ck.get("b")
    assert e.value.path == str(shard)
    with pytest.raises(InputError, match="truncated"):
        ck.read_bytes("b")
    ck.close()


@pytest.mark.parametrize("bad", ["../model-b.safetensors", "sub/model-b.safetensors", "..", ""])
def test_an_index_entry_that_is_not_a_file_name_here_is_refused_by_tensor(make_ckpt, bad):
    # the shard-name check runs once per distinct name: a bad name after many good ones still stops it
    tensors = {f"t{i}": np.arange(4, dtype=np.int32) for i in range(6)}
    folder = make_ckpt(tensors, {"quant_method": "gptq"}, shards=[{"t0", "t1", "t2"}, {"t3", "t4", "t5"}])
    idx = folder / "model.safetensors.index.json"
    data = json.loads(idx.read_text())
    ck = Checkpoint(folder)  # as written, it loads: both shards, all six tensors
    assert sorted(ck.tensors) == sorted(tensors) and len({t.file for t in ck.tensors.values()}) == 2
    ck.close()
    data["weight_map"]["t4"] = bad
    idx.write_text(json.dumps(data))
    with pytest.raises(InputError, match=r"tensor 't4' is mapped to .*not a file name in the checkpoint folder"):
        Checkpoint(folder)


# -- helpers of the readers ------------------------------------------------------------------------
def ref_nibble_rows(words: np.ndarray) -> np.ndarray:
    """[A, B] words -> [8A, B]: python ints, row 8a+m is (word >> 4m) & 0xF of row a."""
    a, b = words.shape
    out = np.zeros((8 * a, b), np.uint8)
    for r in range(a):
        for c in range(b):
            w = int(words[r, c]) % 2**32
            for m in range(8):
                out[8 * r + m, c] = (w >> (4 * m)) & 0xF
    return out


def test_unpack_rows_against_python_ints():
    rng = np.random.default_rng(5)
    w = rng.integers(-(2**31), 2**31, (3, 5), dtype=np.int64).astype(np.int32)
    w[0, :3] = [-1, -(2**31), 0x0FFFFFFF]
    ref = ref_nibble_rows(w)
    assert np.array_equal(unpack_rows(torch.from_numpy(w)).numpy(), ref)
    assert np.array_equal(unpack_rows(torch.from_numpy(w.astype(np.int64))).numpy(), ref)  # low 32 bits
    wt = torch.from_numpy(np.ascontiguousarray(w.T)).t()  # a strided view
    assert np.array_equal(unpack_rows(wt).numpy(), ref)
    assert np.array_equal(nibble_rows(w.view(np.uint32)), ref)
    assert unpack_rows(torch.zeros(0, 5, dtype=torch.int32)).shape == (0, 5)


def test_all_bytes():
    assert all_bytes(bytearray(b"\x88" * 12), 0x88) and all_bytes(bytearray(), 0x88)
    assert not all_bytes(bytearray(b"\x88" * 11 + b"\x89"), 0x88)
    assert not all_bytes(bytearray(b"\x77" * 12), 0x88)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 10), (1, 7), (5, 1)])
def test_read_transposed_is_a_private_contiguous_transpose(make_ckpt, dtype, shape):
    s = torch.randn(shape).to(dtype)
    ck = Checkpoint(make_ckpt({"s": s}, {"quant_method": "gptq"}))
    got = read_transposed(ck, "s")
    assert got.dtype == dtype and got.shape == shape[::-1] and got.is_contiguous()
    assert torch.equal(_bits(got), _bits(s.t().contiguous()))
    got.fill_(0)  # its own memory, even where the transpose needed no copy (a dimension of 1)
    assert torch.equal(read_transposed(ck, "s"), s.t())
    ck.close()


def test_non_trivial_g_idx_out_of_range_is_refused(make_ckpt):
    g = (np.arange(K) // GROUP).astype(np.int32)
    g[5] = -1
    with pytest.raises(InputError, match=r"out of range \[-1, 3\]"):
        g_idx_unless_trivial(_ckpt(make_ckpt, g), "m.g_idx", K, K // GROUP, GROUP)


def test_dtype_tables_match_torch():
    """The plan's torch-free dtype tables (safetensors_header.py) against torch's own dtypes."""
    from int4pack.sources import checkpoint
    from int4pack.sources import safetensors_header as c

    assert checkpoint.DTYPE_NAMES is c.DTYPE_NAMES  # as the writer takes them

    for name, (attr, size) in c._DTYPE_SPECS.items():
        dt = getattr(torch, attr)
        assert c.torch_dtype(name) is dt and c.DTYPES[name] is dt and c.DTYPE_NAMES[dt] == name
        assert c.ITEMSIZE[name] == size == torch.empty((), dtype=dt).element_size(), name
        if name in c.NUMPY_DTYPES:
            assert np.dtype(c.NUMPY_DTYPES[name]).itemsize == size
            assert torch.from_numpy(np.zeros(1, c.NUMPY_DTYPES[name])).dtype is dt, name


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8, torch.float16,
                                   torch.float32, torch.float64, torch.bool])
def test_array_reads_what_get_reads(make_ckpt, dtype):
    """Checkpoint.array (numpy, the plan's reads) against Checkpoint.get (torch), in every dtype numpy has."""
    t = (torch.arange(-6, 6).reshape(3, 4) * 37).to(dtype)
    ck = Checkpoint(make_ckpt({"m.x": t}, {"quant_method": "gptq"}))
    got = ck.array("m.x")
    assert got.shape == (3, 4) and torch.equal(torch.from_numpy(got.copy()), ck.get("m.x"))


def test_array_refuses_what_numpy_cannot_hold(make_ckpt):
    ck = Checkpoint(make_ckpt({"m.x": torch.ones(2, dtype=torch.bfloat16)}, {"quant_method": "gptq"}))
    with pytest.raises(InputError, match="m.x.*BF16"):
        ck.array("m.x")


def test_nibble_cols_against_python_ints():
    from int4pack.nibbles import nibble_cols, unpack_cols

    w = np.random.default_rng(3).integers(-2**31, 2**31, size=(3, 5), dtype=np.int64).astype(np.int32)
    want = [[(int(w[a, j]) % 2**32 >> (4 * m)) & 0xF for j in range(5) for m in range(8)] for a in range(3)]
    assert nibble_cols(w.view(np.uint32)).tolist() == want
    assert unpack_cols(torch.from_numpy(w)).tolist() == want  # the torch twin
