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
from _reference import FIXTURES, awq_decode, bitwise_crc32c, ct_decode, gptq_decode, load_all, load_raw
from _synth import pack_k
from int4pack import batch, kernels, kleidiai
from int4pack.errors import InputError
from int4pack.plan import OutTensor
from int4pack.output_folder.writer import ShardFile

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


# ------------------------------------------------------------------------------ the requant batch

needs_requant = pytest.mark.skipif(ext is None or not ext.requant_ok, reason="requant runs on AVX2/FMA CPUs only")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ GEMM: column 8j + AWQ_ORDER[i] in nibble i of word j


def _awq_words(u: np.ndarray) -> np.ndarray:
    """uint4 [R, N] -> int32 [R, N/8] in AWQ's nibble order."""
    out = np.zeros((u.shape[0], u.shape[1] // 8), dtype=np.uint32)
    for i, col in enumerate(AWQ_ORDER):
        out |= u[:, col::8].astype(np.uint32) << np.uint32(4 * i)
    return out.view(np.int32)


def _tiny_asym(layout: str, *, zeros: np.ndarray | None = None, scale: float | None = None, stype=np.float16):
    """One asymmetric module [N=16, K=64], group 32, in one buffer as a mapped shard holds it:
    (buffer, descriptor row without outputs, its tensors by their checkpoint names)."""
    rng = np.random.default_rng(11)
    n, k, g = 16, 64, 32
    u = rng.integers(0, 16, size=(k, n))
    z = rng.integers(1, 15, size=(k // g, n)) if zeros is None else zeros  # [G, N]; no v1 F nibble
    scales = (rng.random((k // g, n)) * 0.01 + 0.001).astype(stype)
    if scale is not None:
        scales[1, 5] = scale
    if layout == "awq":
        words, zw, code, zbyte = _awq_words(u), _awq_words(z), 3, 0x88
    elif layout == "gptq":  # GPTQ v1: stored zero = zero - 1, packed along N
        words, zw, code, zbyte = pack_k(u), pack_k((z - 1).T.astype(np.uint32) & 15).T.copy(), 2, 0x77
    elif layout == "gptq_v2":  # GPTQ v2: the zero as it is
        words, zw, code, zbyte = pack_k(u), pack_k(z.T.astype(np.uint32)).T.copy(), 2, 0x88
    else:  # compressed-tensors: words [N, K/8] along K, zero points [N/8, G] along N, scales [N, G]
        words, zw, code, zbyte = pack_k(u).T.copy(), pack_k(z.T.astype(np.uint32)), 1, 0x88
        scales = scales.T.copy()
    t = {"m.qweight": words, "m.scales": scales, "m.qzeros": zw}
    if layout == "ct":
        t = {"m.weight_packed": words, "m.weight_scale": scales, "m.weight_zero_point": zw,
             "m.weight_shape": np.array([n, k])}
    src = bytearray(16) + words.tobytes() + scales.tobytes() + zw.tobytes()
    w0, s0 = 16, 16 + words.nbytes
    z0 = s0 + scales.nbytes
    row = [code, w0, *words.shape, n, k, s0, 0 if stype == np.float32 else 1, int(layout != "ct"), k // g, z0,
           zw.nbytes, zbyte,
           -1, 0, g, g, g, 1, -1, -1, -1, 0, 0]
    return src, row, t


def _run_requant(src: bytearray, rows: list[list[int]], out_bytes: int):
    from int4pack.kernels import search_points

    buf = np.frombuffer(bytearray(src), dtype=np.uint8)
    out = bytearray(out_bytes)
    coarse, fine = search_points(True)
    res, tot, zg = ext.requant_batch(buf.ctypes.data, buf.nbytes, np.array(rows, dtype=np.int64), out,
                                     coarse.numpy(), fine.numpy(), 1)
    return res, tot, zg, out


def _record(layout: str, t: dict):
    """The module as the readers give it (codes, scales, zero points), decoded by the independent
    decoders of tests/_reference.py."""
    from int4pack.records import LinearSpec, QuantLinear

    if layout == "ct":
        d = ct_decode(t, "m", 32)
        u, z, s = d["codes"], d["zeros"], t["m.weight_scale"]
    else:
        d = awq_decode(t, "m") if layout == "awq" else gptq_decode(t, "m", v1=layout == "gptq")
        u, z, s = d["u"], d["z"], t["m.scales"].T.copy()
    n, k = u.shape
    spec = LinearSpec(name="m", fmt=layout[:4], n=n, k=k, bits=4, group_size=32, sym=False, act_order=False, keys=(),
                      scale_dtype="F16")
    return QuantLinear(spec, torch.from_numpy(u.astype(np.uint8)), torch.from_numpy(s),
                       torch.from_numpy(z.astype(np.uint8)), None, None)


@needs_requant
@pytest.mark.parametrize("layout", ["gptq", "gptq_v2", "awq", "ct"])
@pytest.mark.parametrize("packed", [False, True])
def test_requant_module_by_hand_is_the_torch_twins_and_the_per_module_calls(layout, packed):
    from int4pack import w4a8

    src, row, t = _tiny_asym(layout)
    n, k = 16, 64
    if packed:
        size = kleidiai.packed_size(n, k, 32)
        row[batch._OUTBLOB], row[batch._BLOBBYTES] = 0, size
    else:
        size = n * k + n * 2 * 2
        row[batch._OUTQ], row[batch._OUTS] = 0, n * k
    res, tot, zg, out = _run_requant(src, [row], size)
    assert res[0, 0] == 0
    ql = _record(layout, t)
    twin = w4a8._requant_torch(ql, 32, True)  # torch's search on the decoded codes
    sb = twin.scales.contiguous().view(torch.int16).numpy().tobytes()
    if packed:
        assert bytes(out) == kleidiai.pack_reference(twin.q, twin.scales, None, 32).numpy().tobytes()
        assert res[0, batch._ZLIB_Q] == zlib.crc32(twin.q.numpy().tobytes())
        assert res[0, batch._ZLIB_S] == zlib.crc32(sb) and res[0, batch._ZLIB_BLOB] == zlib.crc32(bytes(out))
        assert res[0, batch._CRC_A] == bitwise_crc32c(bytes(out))
    else:
        assert bytes(out[: n * k]) == twin.q.numpy().tobytes() and bytes(out[n * k:]) == sb
        assert res[0, batch._CRC_A] == bitwise_crc32c(bytes(out[: n * k]))
        assert res[0, batch._CRC_B] == bitwise_crc32c(bytes(out[n * k:]))
    # the sums and their info: those of the per-module C++ call on the same record, exactly
    one = w4a8.requant_job(ql, 32)
    info = kernels.requant_info(True, tot[0].tolist(), int(zg[0]))
    info["exact_ints"] = False
    assert info == one.error
    assert info["rel_l2"] == pytest.approx(twin.error["rel_l2"], rel=1e-6)


@needs_requant
def test_requant_modules_it_does_not_take_are_handed_back_unwritten():
    size = 16 * 64 + 16 * 2 * 2
    for layout, kw, status in [
        ("awq", dict(zeros=np.full((2, 16), 8)), 100),  # every zero point 8: lossless per module
        ("gptq", dict(zeros=np.full((2, 16), 8)), 100),
        ("gptq", dict(zeros=np.full((2, 16), 16)), 100),  # a v1 stored F nibble: the reader notes it
        ("awq", dict(scale=1e-21, stype=np.float32), 100),  # a tiny scale: a close call, torch decides it
        ("gptq", dict(scale=-0.5), 2),  # a negative scale (row 5, group 1): refused by the per-module path
    ]:
        src, row, _ = _tiny_asym(layout, **kw)
        row[batch._OUTQ], row[batch._OUTS] = 0, 16 * 64
        res, _, _, out = _run_requant(src, [row], size)
        assert res[0, 0] == status, (layout, kw)
        # no scales nor checksums (a close call's q may be in place: the per-job bytes overwrite it)
        assert bytes(out[16 * 64:]) == bytes(len(out) - 16 * 64) and not res[0, 4:].any(), (layout, kw)
        if "scale" not in kw or kw["scale"] < 0:
            assert bytes(out) == bytes(len(out)), (layout, kw)
    assert res[0, 1:4].tolist() == [5, 1, 0]


# ------------------------------------------------------------------------------ the writer


def test_buffer_positions_keep_each_run_as_far_into_a_page_as_in_the_file():
    from int4pack.batch import buffer_positions

    # neighbours in the file stay neighbours; a run that starts 2048 into a page starts 2048 into one
    assert buffer_positions([(2048, 10240), (12288, 8192)]) == [2048, 12288]
    # a gap in the file (another batch's bytes between): the next run moves to 100 past a page
    assert buffer_positions([(0, 10240), (409700, 20)]) == [0, 12388]
    # the same offset within a page: no room lost
    assert buffer_positions([(0, 4000), (8192, 96)]) == [0, 4096]
    assert buffer_positions([]) == []


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


def _convert_both(src: Path, out: Path, monkeypatch, **kw) -> tuple[Path, Path, dict]:
    """Both conversions; their reports the same but for where and how long (and the workers' count)."""
    a, b = out / "batched", out / "per_job"
    rep = int4pack.convert(src, a, **kw)
    monkeypatch.setattr(batch, "ENABLED", False)
    rep_b = int4pack.convert(src, b, **kw)
    monkeypatch.setattr(batch, "ENABLED", True)
    varies = ("seconds", "seconds_plan", "workers")
    assert json.dumps({k: v for k, v in rep.items() if k not in varies}).replace(str(a), "OUT") == \
        json.dumps({k: v for k, v in rep_b.items() if k not in varies}).replace(str(b), "OUT")
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
    if name == "gptq_q3_descact":  # act-order: nothing lossless; what a batch takes, it hands back (g_idx)
        assert counted["batched"] == counted["handed_back"]
    else:
        assert lossless and counted["batched"] >= lossless - 8 and counted["handed_back"] == 0


@needs_requant
@pytest.mark.parametrize("serve_format", ["compressed-tensors", "kleidiai"])
@pytest.mark.parametrize("name", ["gptq_q3_asym", "awq_q3", "ct_qwen3moe_w4a16_asym_g32", "awqpack_mixtral",
                                  "dense_qwen3moe", "dense_glm4moe", "fp8_qwen3moe_block32", "ct_qwen3moe_fp8_block",
                                  "mlx_qwen3moe_mixed", "mlx_q3_4bit_g64", "mlx_q3_mixed_4_8", "gguf_q3_q4_0",
                                  "gguf_q3_q4_k_m", "gguf_q3_q8_0", "gguf_qwen3moe_q4_0", "gguf_qwen3moe_q4_k_m"])
def test_requant_batches_write_the_per_job_bytes_and_report(tmp_path, monkeypatch, counted, name, serve_format):
    """Asymmetric int4 sources and bf16/FP8/MLX/GGUF ones (decoded in the batches) requantised in the C++
    batches: the files and the report of the per-job path (w4a8.requantize after the readers' decoding),
    byte for byte."""
    a, b, rep = _convert_both(FIXTURES / name, tmp_path, monkeypatch, serve_format=serve_format)
    _same_files(a, b)
    requant = sum(1 for m in rep["modules"].values() if m["path"] == "requant")
    assert requant and counted["handed_back"] == 0
    assert counted["batched"] >= requant - 8


@needs_requant
@pytest.mark.parametrize("serve_format", ["compressed-tensors", "kleidiai"])
def test_awq_zero_points_all_8_are_handed_back_and_lossless(tmp_path, monkeypatch, counted, serve_format):
    src = FIXTURES / "awq_q3"
    m = "model.layers.1.mlp.experts.1.down_proj"  # in one shard (layer 0's expert 1 spans two: per job)

    def eights(arr):
        arr.view(np.uint32)[:] = 0x88888888

    _edit(src, tmp_path / "src", f"{m}.qzeros", eights)
    a, b, rep = _convert_both(tmp_path / "src", tmp_path, monkeypatch, serve_format=serve_format)
    _same_files(a, b)
    assert counted["handed_back"] == 1 and rep["modules"][m]["path"] == "lossless"


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
@pytest.mark.parametrize("fixture", ["gptq_q3_sym", "awq_q3"])
def test_a_refused_scale_is_refused_with_the_same_message(tmp_path, monkeypatch, serve_format, fixture):
    src = FIXTURES / fixture
    # (awq_q3: a requant module in one shard)
    m = _expert(src) if fixture == "gptq_q3_sym" else "model.layers.1.mlp.experts.1.down_proj"

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
    from int4pack.sources.checkpoint import Checkpoint
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
        # every lossless module is batched; one whose tensors lie in two source files is a batch of
        # its own, read into a buffer of its own (staged) at the offsets its row gives
        assert not [u for u in got if not isinstance(u, batch.Batch) and u in linear]
        staged = [b for b in batches if b.staged is not None]
        assert staged and all(len(b.jobs) == 1 and b.source is None for b in staged)
        for b in staged:
            files = {ck.info(key).file for key in b.jobs[0].specs[0].keys}
            assert len(files) > 1 and len(b.staged) >= 2
            offsets = [off for _, off in b.staged]
            assert offsets[0] == 0 and all(o % 64 == 0 for o in offsets) and offsets == sorted(offsets)
            assert b.rows[0][1] == offsets[0] and b.rows[0][6] == offsets[1]  # the words, the scales
        assert not any(b.staged for b in batches if b.source is not None)
        assert batches and batches[0].jobs == linear[:3]
        assert not any(isinstance(u, batch.Batch) for u in batch.units(jobs, plan.reader, shard_of, {"s1", "s2"}, False))


def test_a_shard_is_mapped_once_whatever_the_threads(tmp_path):
    """The batch reads the source by address: a second mapping made by a racing thread would replace
    the first and unmap it under the reader (a crash seen once in 30 conversions before the lock)."""
    import threading

    from int4pack.sources.checkpoint import Checkpoint

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


def test_one_stats_builder_for_the_batches_and_the_torch_jobs():
    """A module's report entry, written by hand: 6 significant digits in the report, 3 on a terminal,
    the same builder for the C++ batches' lossless and requant entries and convert's torch jobs."""
    convert = importlib.import_module("int4pack.convert")
    from int4pack.error_stats import ErrorStats, module_stats, short_number

    e = {"rel_l2": 0.0123456789, "max_abs": 2.0, "cosine": 0.99999994, "baseline_rel_l2": None, "exact_ints": True}
    want = {"path": "lossless", "role": "expert", "group_size": 32, "rel_l2": "0.0123457", "max_abs": "2",
            "cosine": "1", "baseline_rel_l2": None, "exact_ints": True}
    assert module_stats("lossless", "expert", 32, e) == want
    assert batch._stats(ErrorStats, [0.0, 4.0, 4.0, 4.0, 0.0], "expert", -1) == {
        "path": "lossless", "role": "expert", "group_size": -1, "rel_l2": "0", "max_abs": "0", "cosine": "1",
        "baseline_rel_l2": None, "exact_ints": True}

    class W:
        path, group_size, error = "lossless", 32, e

    assert convert._w_stats(W, "expert") == want
    assert [short_number(x) for x in (None, "", "0.0123457", 2, 0.99999994)] == ["-", "-", "0.0123", "2", "1"]


def test_the_batch_columns_and_job_statuses_are_the_librarys():
    """batch.py's descriptor and result columns against the table the library exports (named once in
    convert_kernels.h), and every job status the library can return worded by w4a8._refusal."""
    from int4pack import w4a8
    from int4pack.records import LinearSpec, QuantLinear

    t = kernels.ext().tables()
    f, r = t["batch_field"], t["batch_result"]
    names = ("layout", "words", "d0", "d1", "n", "k", "scales", "scale_type", "scales_kn", "src_groups", "zeros",
             "zeros_bytes", "zero_byte", "gidx", "gidx_item", "gidx_group", "src_group", "g", "bf16", "out_q",
             "out_s", "out_blob", "blob_bytes")
    cols = (batch._LAYOUT, batch._WORDS, batch._D0, batch._D1, batch._N, batch._K, batch._SCALES, batch._STYPE,
            batch._KN, batch._GS, batch._ZEROS, batch._ZBYTES, batch._ZBYTE, batch._GIDX, batch._GITEM,
            batch._GGROUP, batch._SRCG, batch._G, batch._BF16, batch._OUTQ, batch._OUTS, batch._OUTBLOB,
            batch._BLOBBYTES)
    assert dict(zip(names, cols)) == {n: f[n] for n in names} and batch.FIELDS == f["fields"]
    assert (batch._CRC_A, batch._CRC_B, batch._ZLIB_Q, batch._ZLIB_S, batch._ZLIB_BLOB, batch._KEPT_INTS) == tuple(
        r[n] for n in ("crc_a", "crc_b", "zlib_q", "zlib_s", "zlib_blob", "kept_ints"))
    assert batch._SCALE_TYPES == t["scale_type"]
    assert t["job_status"]["done"] == 0 and len(set(t["job_status"].values())) == len(t["job_status"]) == 6
    spec = LinearSpec(name="m", fmt="gptq", n=8, k=64, group_size=32, sym=True, act_order=False, bits=4,
                      scale_dtype="F16", has_bias=False, keys=("m.scales",))
    ql = QuantLinear(spec=spec, codes=torch.zeros(8, 64, dtype=torch.uint8), scales=torch.ones(8, 2), zeros=None)
    said = {w4a8._refusal(ql, v, [1, 0, 0]).args[0] for k, v in t["job_status"].items() if k != "done"}
    assert len(said) == 5 and any("NaN or Inf scale at row 1" in s for s in said)


@needs_requant
def test_a_float_source_module_the_reader_refuses_is_handed_back_and_refused(tmp_path, monkeypatch, counted):
    """An e4m3 NaN byte: the batch hands the module back and the reader's refusal is what the user
    reads, the same as without batches."""
    src = FIXTURES / "fp8_qwen3moe_block32"
    m = "model.layers.1.mlp.experts.1.down_proj"

    shutil.copytree(src, tmp_path / "src")
    for f in sorted((tmp_path / "src").glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            if f"{m}.weight" not in fh.keys():
                continue
            meta, tensors = fh.metadata(), {k: fh.get_tensor(k) for k in fh.keys()}
        raw = tensors[f"{m}.weight"].view(torch.uint8).clone()
        raw.view(-1)[5] = 0x7F  # an e4m3 NaN
        tensors[f"{m}.weight"] = raw.view(torch.float8_e4m3fn)
        save_file(tensors, str(f), metadata=meta)
    with pytest.raises(InputError) as batched:
        int4pack.convert(tmp_path / "src", tmp_path / "a")
    monkeypatch.setattr(batch, "ENABLED", False)
    with pytest.raises(InputError) as per_job:
        int4pack.convert(tmp_path / "src", tmp_path / "b")
    assert str(batched.value) == str(per_job.value) and m in str(batched.value)
    assert counted["handed_back"] == 1


@needs_requant
def test_every_worker_computes_a_batch_at_once(tmp_path, monkeypatch):
    """A batch takes its output buffer before it computes: with fewer buffers than workers, the
    other workers wait while cores sit idle (16 workers once shared 8 buffers)."""
    import threading
    import time

    workers, busy, most = 12, [0], [0]
    lock = threading.Lock()
    run = batch._run

    def timed_run(*a, **kw):
        with lock:
            busy[0] += 1
            most[0] = max(most[0], busy[0])
        try:
            time.sleep(0.2)  # long enough for every worker to reach its own batch
            return run(*a, **kw)
        finally:
            with lock:
                busy[0] -= 1

    monkeypatch.setattr(batch, "_run", timed_run)
    monkeypatch.setattr(batch, "BATCH_MODULES", 1)  # one module a batch: dozens of batches
    rep = int4pack.convert(FIXTURES / "fp8_qwen3moe_block32", tmp_path / "out", threads=workers,
                           serve_format="kleidiai")
    assert rep["workers"] == workers
    assert most[0] == workers
