"""convert's lossless batch (int4pack/batch.py, csrc/convert_kernels/batch.cpp, crc32.cpp).

The C++ on a tiny hand-built module against numpy and zlib; its CRC-32 against zlib and its
scale conversion against torch for every 16-bit pattern; then whole conversions of the fixtures
with batches and without (the per-job path), compared byte for byte in both serve formats, and
against the independent GPTQ decoder and the numpy KleidiAI packer; and the modules a batch hands
back (zero points off 8, a negative scale) converted or refused exactly as without batches.
"""

from __future__ import annotations

import filecmp
import importlib
import json
import mmap
import random
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import int4pack
from _reference import FIXTURES, bitwise_crc32c, gptq_decode, load_all, load_raw
from _synth import pack_k
from int4pack import batch, kernels, kleidiai
from int4pack.errors import InputError
from int4pack.plan import OutTensor
from int4pack.writer import ShardFile

convert_mod = importlib.import_module("int4pack.convert")
ext = kernels.ext()
needs_ext = pytest.mark.skipif(ext is None, reason="the batch runs in the C++ library only")


# ------------------------------------------------------------------------------ the C++ pieces


@needs_ext
@pytest.mark.parametrize("clmul", [True, False])
def test_crc32_is_zlibs(clmul):
    was = ext.use_crc32_clmul(clmul)
    try:
        rng = random.Random(3)
        for n in [*range(0, 200), 1000, 4096, 65536 + 7]:
            data = bytes(rng.getrandbits(8) for _ in range(n))
            start = rng.getrandbits(32)
            assert ext.crc32(data) == zlib.crc32(data), n
            assert ext.crc32(data, start) == zlib.crc32(data, start), n
    finally:
        ext.use_crc32_clmul(was)


@needs_ext
@pytest.mark.parametrize("dtype,code", [(torch.float16, 1), (torch.bfloat16, 2)])
def test_scales_to_float_is_torchs_cast_for_every_pattern(dtype, code):
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    x = bits.view(dtype)
    got = torch.from_numpy(ext.scales_to_float(bits.numpy().tobytes(), 1 << 16, 1, code, False)).view(-1)
    want = x.float()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


@needs_ext
def test_scales_to_float_transposes_a_g_n_layout():
    s = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float16)  # stored [G=2, N=3]
    got = ext.scales_to_float(s.numpy().tobytes(), 3, 2, 1, True)
    assert got.tolist() == [[1.0, 4.0], [2.0, 5.0], [3.0, 6.0]]
    got = ext.scales_to_float(np.float32([[1, 2], [3, 4], [5, 6]]).tobytes(), 3, 2, 0, False)
    assert got.tolist() == [[1, 2], [3, 4], [5, 6]]


def _tiny_source(zero_word: int = 0x77777777, scale: float | None = None):
    """One GPTQ module [N=8, K=64], group 32, laid out in one buffer as a mapped shard would be:
    (buffer, descriptor row without outputs, codes u [N, K], scales fp16 [N, G])."""
    rng = np.random.default_rng(7)
    n, k, g = 8, 64, 32
    u = rng.integers(0, 16, size=(k, n))
    words = pack_k(u).tobytes()
    scales = (rng.random((k // g, n)) * 0.01 + 0.001).astype(np.float16)
    if scale is not None:
        scales[1, 5] = scale
    zeros = np.full((k // g, n // 8), zero_word, dtype=np.uint32).tobytes()
    src = bytearray(16) + words + scales.tobytes() + zeros  # words from byte 16 (aligned)
    w0, s0 = 16, 16 + len(words)
    z0 = s0 + scales.nbytes
    row = [2, w0, k // 8, n, n, k, s0, 1, 1, k // g, z0, len(zeros), 0x77, -1, 0, g, g, g, 1, -1, -1, -1, 0, 0]
    return src, row, u.T.astype(np.int64), scales.T


def _run(src: bytearray, rows: list[list[int]], out_bytes: int):
    buf = np.frombuffer(bytearray(src), dtype=np.uint8)  # the C++ reads it by address: keep it alive
    out = bytearray(out_bytes)
    res, tot = ext.lossless_batch(buf.ctypes.data, buf.nbytes, np.array(rows, dtype=np.int64), out, 1)
    return res, tot, out


@needs_ext
def test_one_module_by_hand_default_format():
    src, row, u, s16 = _tiny_source()
    n, k = u.shape
    row[batch._OUTQ], row[batch._OUTS] = 0, n * k  # weight, then its bf16 scales
    res, tot, out = _run(src, [row], n * k + n * 2 * 2)
    assert res[0, 0] == 0
    q = np.frombuffer(bytes(out[: n * k]), dtype=np.int8).reshape(n, k)
    assert (q == u - 8).all()  # the codes less the zero point, bit for bit
    sb = torch.from_numpy(s16.copy()).to(torch.bfloat16)  # torch's round to nearest even
    assert bytes(out[n * k:]) == sb.contiguous().view(torch.int16).numpy().tobytes()
    assert res[0, batch._CRC_A] == bitwise_crc32c(bytes(out[: n * k]))
    assert res[0, batch._CRC_B] == bitwise_crc32c(bytes(out[n * k:]))
    # the cast's error, in float64: w = q * s16, v = q * bf16(s16)
    w = (u - 8) * np.repeat(s16.astype(np.float64), 32, axis=1)
    v = (u - 8) * np.repeat(sb.double().numpy(), 32, axis=1)
    dd, ww, vv, wv, mx = tot[0]
    assert dd == pytest.approx(((v - w) ** 2).sum(), rel=1e-12)
    assert ww == pytest.approx((w * w).sum(), rel=1e-12)
    assert vv == pytest.approx((v * v).sum(), rel=1e-12) and wv == pytest.approx((w * v).sum(), rel=1e-12)
    assert mx == pytest.approx(np.abs(v - w).max(), rel=1e-12)


@needs_ext
def test_one_module_by_hand_packed_format():
    src, row, u, s16 = _tiny_source()
    n, k = u.shape
    size = kleidiai.packed_size(n, k, 32)
    row[batch._OUTBLOB], row[batch._BLOBBYTES] = 0, size
    res, _, out = _run(src, [row], size)
    assert res[0, 0] == 0
    q = torch.from_numpy((u - 8).astype(np.int8))
    sb = torch.from_numpy(s16.copy()).to(torch.bfloat16)
    assert bytes(out) == kleidiai.pack_reference(q, sb, None, 32).numpy().tobytes()
    assert res[0, batch._CRC_A] == bitwise_crc32c(bytes(out))
    assert res[0, batch._ZLIB_Q] == zlib.crc32(q.numpy().tobytes())
    assert res[0, batch._ZLIB_S] == zlib.crc32(sb.contiguous().view(torch.int16).numpy().tobytes())
    assert res[0, batch._ZLIB_BLOB] == zlib.crc32(bytes(out))


@needs_ext
def test_modules_it_does_not_take_are_handed_back_unwritten():
    src, row, u, _ = _tiny_source(zero_word=0x77777778)  # one zero point of 9 per word
    row[batch._OUTQ], row[batch._OUTS] = 0, 512
    res, _, out = _run(src, [row], 512 + 32)
    assert res[0, 0] == 100 and bytes(out) == bytes(len(out))
    src, row, _, _ = _tiny_source(scale=-0.5)  # a negative scale at row 5, group 1: refused, with its place
    row[batch._OUTQ], row[batch._OUTS] = 0, 512
    res, _, _ = _run(src, [row], 512 + 32)
    assert res[0, :4].tolist() == [2, 5, 1, 0]


@needs_ext
def test_a_source_outside_the_mapping_is_an_error_not_a_read():
    src, row, _, _ = _tiny_source()
    row[batch._OUTQ], row[batch._OUTS] = 0, 512
    row[batch._SCALES] = len(src) - 2
    with pytest.raises(RuntimeError, match="outside the mapping"):
        _run(src, [row], 512 + 32)


# ------------------------------------------------------------------------------ the writer


def test_write_batch_writes_the_same_file_as_write(tmp_path):
    ts = [OutTensor("a", "U8", (4096,)), OutTensor("b", "U8", (100,)), OutTensor("c", "U8", (8192,)),
          OutTensor("d", "U8", (50,))]
    data = {t.name: torch.randint(0, 256, (t.nbytes,), dtype=torch.uint8) for t in ts}
    one = ShardFile(tmp_path / "one.safetensors", ts, {"format": "pt"})
    for name, t in data.items():
        one.write(name, t)
    two = ShardFile(tmp_path / "two.safetensors", ts, {"format": "pt"})
    # file order: a, c (whole pages), then b, d; a page-aligned buffer in that order
    buf = memoryview(mmap.mmap(-1, 16384))
    pos = {}
    at = 0
    for name in ("a", "c", "b", "d"):
        pos[name] = at
        buf[at: at + len(data[name])] = data[name].numpy().tobytes()
        at += len(data[name])
    given = []
    two.write_batch([(n, pos[n], one.crc[n]) for n in ("a", "c", "b")], buf, given.append)
    two.write("d", data["d"])
    assert one.finish({}) == two.finish({})
    assert given == [buf]  # the buffer handed back once, after its bytes were written
    assert (tmp_path / "one.safetensors").read_bytes() == (tmp_path / "two.safetensors").read_bytes()


# ------------------------------------------------------------------------------ whole conversions


@pytest.fixture
def counted(monkeypatch):
    """How many jobs ran inside batches and how many the C++ handed back, during the test."""
    seen = {"batched": 0, "handed_back": 0}
    run = batch.run_batch

    def counting(b, *a, **k):
        seen["batched"] += len(b.jobs)
        per_job = a[-1]

        def back(job):
            seen["handed_back"] += 1
            return per_job(job)

        return run(b, *a[:-1], back, **k)

    monkeypatch.setattr(batch, "run_batch", counting)
    return seen


def _convert_both(src: Path, out: Path, monkeypatch, **kw) -> tuple[Path, Path, dict]:
    a, b = out / "batched", out / "per_job"
    rep = int4pack.convert(src, a, **kw)
    monkeypatch.setattr(batch, "ENABLED", False)
    int4pack.convert(src, b, **kw)
    monkeypatch.setattr(batch, "ENABLED", True)
    return a, b, rep


def _same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for n in names:
        assert filecmp.cmp(a / n, b / n, shallow=False), n


@needs_ext
@pytest.mark.parametrize("serve_format", ["compressed-tensors", "kleidiai"])
@pytest.mark.parametrize("name", ["gptq_q3_sym", "gptq_mixtral_sym", "ct_qwen3moe_w4a16",
                                  "ct_qwen3moe_w4a16_channel", "gptq_q3_descact"])
def test_batches_write_the_per_job_bytes(tmp_path, monkeypatch, counted, name, serve_format):
    a, b, rep = _convert_both(FIXTURES / name, tmp_path, monkeypatch, serve_format=serve_format)
    _same_files(a, b)
    lossless = sum(1 for m in rep["modules"].values() if m["path"] == "lossless")
    if name == "gptq_q3_descact":  # act-order: nothing lossless to batch
        assert counted["batched"] == 0
    else:
        assert lossless and counted["batched"] >= lossless - 8 and counted["handed_back"] == 0


@needs_ext
def test_batched_output_against_the_independent_decoder_and_packer(tmp_path, counted):
    src = FIXTURES / "gptq_q3_sym"
    int4pack.convert(src, tmp_path / "plain")
    int4pack.convert(src, tmp_path / "packed", serve_format="kleidiai")
    assert counted["batched"] > 0
    t, plain, packed = load_all(src), load_raw(tmp_path / "plain"), load_raw(tmp_path / "packed")
    for m in [k[: -len(".qweight")] for k in t if k.endswith(".qweight") and ".experts." in k]:
        ref = gptq_decode(t, m, v1=True)
        q = plain[f"{m}.weight"]
        assert np.array_equal(q.numpy().astype(np.int64), ref["u"] - ref["z"][:, ref["g_idx"]]), m
        s = torch.from_numpy(ref["s"].astype(np.float16)).to(torch.bfloat16)
        assert torch.equal(plain[f"{m}.weight_scale"], s), m
        assert torch.equal(packed[f"{m}.weight_packed"], kleidiai.pack_reference(q, s, None, q.shape[1] // s.shape[1]))


def _edit(src: Path, dst: Path, name: str, edit) -> None:
    """A copy of the fixture ``src`` with the tensor ``name`` changed by ``edit(numpy array)``."""
    shutil.copytree(src, dst)
    for f in sorted(dst.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            if name not in fh.keys():
                continue
            meta = fh.metadata()
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        a = tensors[name].numpy().copy()
        edit(a)
        tensors[name] = torch.from_numpy(a)
        save_file(tensors, str(f), metadata=meta)
        return
    raise AssertionError(f"{name} not in {src}")


def _expert(src: Path) -> str:
    t = load_raw(src)
    return sorted(k[: -len(".qweight")] for k in t if k.endswith(".qweight") and ".experts.1." in k)[0]


@needs_ext
@pytest.mark.parametrize("serve_format", ["compressed-tensors", "kleidiai"])
def test_zero_points_off_8_are_requantised_by_the_per_job_path(tmp_path, monkeypatch, counted, serve_format):
    src = FIXTURES / "gptq_q3_sym"
    m = _expert(src)

    def off(a):
        a.view(np.uint32)[0, 0] = 0x77777778  # zero point 9 for one group of 8 rows of one column word

    _edit(src, tmp_path / "src", f"{m}.qzeros", off)
    a, b, rep = _convert_both(tmp_path / "src", tmp_path, monkeypatch, serve_format=serve_format)
    _same_files(a, b)
    assert counted["handed_back"] == 1 and rep["modules"][m]["path"] == "requant"


@needs_ext
@pytest.mark.parametrize("serve_format", ["compressed-tensors", "kleidiai"])
def test_a_refused_scale_is_refused_with_the_same_message(tmp_path, monkeypatch, serve_format):
    src = FIXTURES / "gptq_q3_sym"
    m = _expert(src)

    def negative(a):
        a[1, 3] = -abs(a[1, 3]) - 0.01  # scales are stored [G, N]: row 3, group 1

    _edit(src, tmp_path / "src", f"{m}.scales", negative)
    errors = []
    for on in (True, False):
        monkeypatch.setattr(batch, "ENABLED", on)
        with pytest.raises(InputError) as e:
            int4pack.convert(tmp_path / "src", tmp_path / f"out{on}", serve_format=serve_format)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and f"{m}.scales: negative scale at row 3, group 1" in errors[0]


def test_units_batch_runs_within_one_shard_only(tmp_path):
    """units(): consecutive batchable jobs of one output shard (a run of one is a batch too), trusted
    shards never batched."""
    from int4pack.checkpoint import Checkpoint
    from int4pack.plan import make_plan

    if ext is None:
        pytest.skip("no batches without the C++ library")
    with Checkpoint(FIXTURES / "gptq_q3_sym") as ck:
        plan = make_plan(ck)
        jobs = plan.jobs
        linear = [j for j in jobs if j.kind == "linear" and j.paths.get(j.specs[0].name) == "lossless"]
        shard_of = {t.name: ("s1" if j in linear[:3] else "s2") for j in jobs for t in j.outputs}
        got = list(batch.units(jobs, plan.reader, shard_of, set(), False))
        batches = [u for u in got if isinstance(u, batch.Batch)]
        assert [j for u in got for j in (u.jobs if isinstance(u, batch.Batch) else [u])] == jobs
        assert all(len({shard_of[j.outputs[0].name] for j in b.jobs}) == 1 for b in batches)
        # a lossless module left out of the batches is one whose tensors lie in two source files
        singles = [u for u in got if not isinstance(u, batch.Batch) and u in linear]
        assert all(len({ck.info(key).file for key in u.specs[0].keys}) > 1 for u in singles)
        assert len(singles) < len(linear) - 3
        assert batches and batches[0].jobs == linear[:3]
        assert not any(isinstance(u, batch.Batch) for u in batch.units(jobs, plan.reader, shard_of, {"s1", "s2"}, False))


def test_a_shard_is_mapped_once_whatever_the_threads(tmp_path):
    """The batch reads the source by address: a second mapping made by a racing thread would replace
    the first and unmap it under the reader (a crash seen once in 30 conversions before the lock)."""
    import threading

    from int4pack.checkpoint import Checkpoint

    for _ in range(20):
        with Checkpoint(FIXTURES / "gptq_q3_sym") as ck:
            shard = ck.shards[0]
            start = threading.Barrier(8)
            got = []

            def grab():
                start.wait()
                got.append(ck.mapping(shard)[0])

            threads = [threading.Thread(target=grab) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert len(set(got)) == 1 and got[0] == ck.mapping(shard)[0]
