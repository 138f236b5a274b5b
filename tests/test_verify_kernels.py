"""verify's fast paths against the paths they replace: each blob checked in one C++ call
(decode with its checks, repack, compare) against the torch decoder and the numpy packer; the
experts' weights dequantised into reused buffers with their squared sums against float64; the
error prediction from those sums against the squared-matrix formula in float64; and verify's
reports through the buffers against the same run without them."""

from __future__ import annotations

import json
import os
import shutil
import zlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import int4pack
from int4pack import _ext, blobs, kleidiai, moe
from int4pack.verify import expert_check
from int4pack.sources.checkpoint import Checkpoint
from int4pack.errors import InputError
from int4pack.serve_spec import SUFFIX, read_record
from int4pack.w4a8 import dequantize_w4a8

pytestmark = pytest.mark.skipif(_ext.load("verify_kernels") is None, reason="the C++ library is not built here")

SHAPES = [(13, 64, 32, True), (13, 64, 64, False), (20, 48, 48, True), (24, 256, 128, False), (8, 64, 32, False)]


def _blob(n, k, g, has_bias, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    s = torch.rand(n, 1, generator=gen) + 0.01 if g == k else (torch.rand(n, k // g, generator=gen) + 0.01).bfloat16()
    bias = torch.randn(n, generator=gen) if has_bias else None
    return kleidiai.pack_reference(q, s, bias, g), q


def _oracle(blob, n, k, g, has_bias):
    """(problem or None, decode, repack differs) from the torch decoder and the numpy packer."""
    try:
        q, s, b = kleidiai.unpack_torch(blob, n, k, g, has_bias, check=True)
    except InputError as e:
        return str(e), None, None
    return None, (q, s, b), not torch.equal(kleidiai.pack_reference(q, s, b, g), blob)


@pytest.mark.parametrize("n, k, g, has_bias", SHAPES)
def test_verify_blob_equals_the_torch_decoder_and_the_numpy_packer(n, k, g, has_bias):
    lib = _ext.load("kleidiai_pack")
    blob, q0 = _blob(n, k, g, has_bias, seed=n + k)
    cases = [blob]
    for pos in (0, 5, blob.numel() // 2, blob.numel() - 1, blob.numel() - 40, blob.numel() - 20):
        bad = blob.clone()
        bad[pos] ^= 0x11
        cases.append(bad)
    # a bias of -0.0 where there is none: the decode's checks take it for zero, only the repack tells
    neg = blob.clone().reshape(-1, blob.numel() // ((n + 7) // 8))
    neg[:, -1] = 0x80
    cases.append(neg.reshape(-1))
    scratch: dict = {}
    seen = set()
    for c in cases:
        bad, crcs, q, s, b = lib.verify_blob(c, n, k, g, has_bias, scratch)
        assert crcs[0] == f"{zlib.crc32(c.numpy().tobytes()):08x}"
        why, dec, differs = _oracle(c, n, k, g, has_bias)
        if why is not None:
            assert bad & 63 and kleidiai.unpack_problem(bad, n, k, g) == why
            seen.add("decode")
            continue
        assert not bad & 63 and bool(bad & 64) == differs
        seen.add("repack" if differs else "clean")
        assert torch.equal(q, dec[0]) and torch.equal(s.float(), dec[1].float()) and s.dtype == dec[1].dtype
        assert (b is None and dec[2] is None) or torch.equal(b, dec[2])
        assert crcs[1:] == [None if t is None else f"{zlib.crc32(t.contiguous().view(torch.uint8).numpy().tobytes()):08x}"
                            for t in dec]
    assert torch.equal(lib.verify_blob(blob, n, k, g, has_bias, scratch)[2], q0)
    assert "clean" in seen and "decode" in seen and (has_bias or "repack" in seen)


def _edit(folder, name, fn):
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            meta, t = fh.metadata(), {k: fh.get_tensor(k) for k in fh.keys()}
        if name in t:
            t[name] = fn(t[name].clone(), t)
            save_file(t, str(f), metadata=meta)


BLOB = "model.layers.0.block_sparse_moe.experts.1.w3." + SUFFIX


@pytest.mark.parametrize("damage", ["none", "data", "scale", "swap", "bias"])
def test_check_blob_in_one_call_equals_check_blob(converted, tmp_path, damage):
    src, _ = converted("gptq_mixtral_sym", serve_format="kleidiai")
    out = tmp_path / "o"
    shutil.copytree(src, out)

    def hurt(b, t):
        if damage == "data":
            b[3] ^= 0x10
        elif damage == "scale":
            b[128] ^= 0x01
        elif damage == "swap":
            b = t[BLOB.replace("experts.1.", "experts.2.")].clone()
        elif damage == "bias":  # -0.0 in row 0's bias of the last block: passes the decode, not the repack
            b[-32:-28] = torch.tensor([0, 0, 0, 0x80], dtype=torch.uint8)
        return b

    if damage != "none":
        _edit(out, BLOB, hurt)
    with Checkpoint(out) as ck:
        pw = blobs.PackedWeights(ck, read_record(ck.quant_config))
        scratch: dict = {}
        flagged = 0
        for m in pw.modules:
            want, dec0 = pw.check_blob(m)
            got, dec1 = pw.check_blob(m, scratch)
            assert got == want, m
            flagged += bool(got)
            assert (dec0 is None) == (dec1 is None)
            if dec0 is not None:
                for a, b in zip(dec0, dec1):
                    assert (a is None and b is None) or torch.equal(a, b)
    assert flagged == (0 if damage == "none" else 1)


@pytest.mark.parametrize("n, k, g", [(24, 64, 32), (24, 64, -1), (16, 256, 128), (5, 96, 32)])
def test_dequant_sq_is_dequantize_and_its_squared_sums(n, k, g):
    vk = _ext.load("verify_kernels")
    gen = torch.Generator().manual_seed(n * k)
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    s = torch.rand(n, 1, generator=gen) + 0.01 if g == -1 else (torch.rand(n, k // g, generator=gen) + 0.01).bfloat16()
    out, rows, cols = torch.full((n, k), 7.0), torch.full((n,), 7.0), torch.full((k,), 7.0)
    vk.dequant_sq(q, s, out, row_sq=rows, col_sq=cols)
    assert torch.equal(out, dequantize_w4a8(q, s, g))  # the same products
    w = (q.double() * s.double().repeat_interleave(k // s.shape[1], dim=1)) ** 2
    torch.testing.assert_close(rows.double(), w.sum(1), rtol=1e-6, atol=0)
    torch.testing.assert_close(cols.double(), w.sum(0), rtol=1e-6, atol=0)
    assert vk.dequant_sq(q, s, out) is out  # the sums are optional
    with pytest.raises(RuntimeError):
        vk.dequant_sq(q, s, torch.empty(n, k + 2))


@pytest.mark.parametrize("m, n, k, g", [(3, 24, 64, 32), (1, 24, 64, -1), (5, 16, 256, 128), (2, 5, 96, 32),
                                        (4, 40, 2048, 128), (0, 8, 64, 32)])
def test_reference_from_int4_values_is_a_float_matmul_on_the_dequantised_weights(m, n, k, g):
    """x @ dequantize_w4a8(q, s)^T against float64: float32 sums over k (16 lanes, then pairwise) are off
    by at most (k / 16 + 4 + 2) roundings of 2^-24 of sum |x w|; the squared sums are dequant_sq's bits."""
    vk = _ext.load("verify_kernels")
    gen = torch.Generator().manual_seed(m * n * k)
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    s = torch.rand(n, 1, generator=gen) + 0.01 if g == -1 else (torch.rand(n, k // g, generator=gen) + 0.01).bfloat16()
    x = torch.randn(m, k, generator=gen)
    rows, cols = torch.full((n,), 7.0), torch.full((k,), 7.0)
    y = vk.w4a8_reference(x, q, s, row_sq=rows, col_sq=cols)
    w = dequantize_w4a8(q, s, g).double()
    want, mag = x.double() @ w.t(), x.double().abs() @ w.abs().t()
    assert y.shape == (m, n) and torch.all((y.double() - want).abs() <= (k / 16 + 6) * 2.0 ** -24 * mag)
    w_rows, w_rows_ref, w_cols_ref = torch.empty(n, k), torch.empty(n), torch.empty(k)
    vk.dequant_sq(q, s, w_rows, row_sq=w_rows_ref, col_sq=w_cols_ref)
    assert torch.equal(rows, w_rows_ref) and torch.equal(cols, w_cols_ref)
    assert torch.equal(vk.w4a8_reference(x, q, s), y)  # the sums are optional
    with pytest.raises(RuntimeError):
        vk.w4a8_reference(x[:, :-2].contiguous(), q, s)


@pytest.mark.parametrize("kind", [0, 1, 2])
def test_act_noise_is_the_propagated_noise_formula(kind):
    """The C++ prediction against moe.propagated_noise (torch, float32 sums): the same formula, sums in
    double instead of float32 over I = 48 terms and exp in another library: agree within 1e-5."""
    vk = _ext.load("verify_kernels")
    gen = torch.Generator().manual_seed(kind)
    m, h, i = 6, 64, 48
    x = torch.randn(m, h, generator=gen)
    x[0] = x[0].abs()  # a row without negative values: the step's min(0, min x) is 0
    y13 = torch.randn(m, 2 * i, generator=gen) * 5  # past the SwiGLU clamps at +-7 too
    act = moe.activation(y13[:, :i], y13[:, i:], kind).contiguous()
    sq13, sq2 = torch.rand(2 * i, generator=gen), torch.rand(i, generator=gen)
    got = vk.act_noise(x, y13, act, sq13, sq2, kind)
    want = moe.propagated_noise(x, y13, act, sq13, sq2, h, kind)
    assert got.shape == (m,) and (want > 0).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    with pytest.raises(RuntimeError):
        vk.act_noise(x, y13[:, :-2].contiguous(), act, sq13, sq2, kind)


@pytest.mark.parametrize("kind", [0, 1])
@pytest.mark.parametrize("activations, weight_var", [(True, None), (False, [1e-4, 2e-4, 3e-4]), (True, [1e-4, 0, 5e-5])])
def test_expert_noise_equals_the_squared_matrix_form(kind, activations, weight_var):
    gen = torch.Generator().manual_seed(kind)
    t, h, i = 5, 64, 32
    x = torch.randn(t, h, generator=gen)
    w13 = torch.randn(2 * i, h, generator=gen) * 0.1
    w2 = torch.randn(h, i, generator=gen) * 0.1
    got = moe.expert_noise(x, w13, w2, kind, activations=activations, weight_var=weight_var).double()
    # the first-order propagation written out in float64, the output variance as a [T, H] matrix
    xd, a, b = x.double(), w13.double(), w2.double()
    y13 = xd @ a.t()
    g_, u = y13[:, :i], y13[:, i:]
    if kind == 1:
        gc, uc = g_.clamp(max=7.0), u.clamp(-7.0, 7.0)
        sg = torch.sigmoid(gc * 1.702)
        act = (uc + 1) * gc * sg
        dg = (uc + 1) * (sg + 1.702 * gc * sg * (1 - sg)) * (g_ < 7.0)
        du = gc * sg * (u.abs() < 7.0)
    else:
        sg = torch.sigmoid(g_)
        act = g_ * sg * u
        dg, du = u * sg * (1 + g_ * (1 - sg)), g_ * sg
    step = lambda r: (r.amax(1).clamp(min=0) - r.amin(1).clamp(max=0)) / 255  # noqa: E731
    var13 = torch.zeros_like(y13)
    var_in2 = torch.zeros(t, dtype=torch.float64)
    if activations:
        var13 += (step(xd) ** 2 / 12)[:, None] * (a * a).sum(1)[None, :]
        var_in2 += step(act) ** 2 / 12
    if weight_var is not None:
        xx = (xd * xd).sum(1, keepdim=True)
        var13[:, :i] += weight_var[0] * xx
        var13[:, i:] += weight_var[1] * xx
    var_act = dg * dg * var13[:, :i] + du * du * var13[:, i:] + var_in2[:, None]
    var_y = var_act @ (b * b).t()
    if weight_var is not None:
        var_y = var_y + weight_var[2] * (act * act).sum(1, keepdim=True)
    torch.testing.assert_close(got, var_y.sum(1), rtol=1e-4, atol=0)


def test_get_reads_into_a_buffer_that_fits(converted):
    out, _ = converted("gptq_q3_sym")
    with Checkpoint(out) as ck:
        name = next(n for n, i in ck.tensors.items() if i.dtype == "I8")
        want = ck.get(name)
        buf = torch.empty(want.numel(), dtype=torch.int8)
        got = ck.get(name, out=buf)
        assert got.data_ptr() == buf.data_ptr() and got.shape == want.shape and torch.equal(got, want)
        other = torch.zeros(want.numel() + 1, dtype=torch.int8)
        got = ck.get(name, out=other)  # does not fit: a tensor of its own, the buffer untouched
        assert got.data_ptr() != other.data_ptr() and torch.equal(got, want) and not other.any()


@pytest.mark.parametrize("serve_format", ["compressed-tensors", "kleidiai"])
def test_verify_through_the_buffers_equals_verify_without(converted, monkeypatch, serve_format):
    out, _ = converted("gptq_q3_sym", serve_format=serve_format)
    src = int4pack.verify(out, raise_on_failure=False, threads=2)
    assert src["ok"] and src["layers"]
    monkeypatch.setattr(expert_check.ExpertBuffers, "of", staticmethod(lambda *a: None))
    plain = int4pack.verify(out, raise_on_failure=False, threads=2)
    for a, b in zip(src["layers"], plain["layers"]):
        for key in ("ok", "tokens", "experts_checked", "matmul"):
            assert a[key] == b[key], key
        # the same kernel numbers; the float reference from the int4 values (w4a8_reference) sums in
        # another order than torch's matmul on the dequantised weights: ~1e-7 of the outputs, which are
        # ~1e-2 of them apart (rel_l2, act_rel), and the squared sums in another order (act_pred)
        for key in ("rel_l2", "act_rel", "max_abs", "act_pred"):
            assert a[key] == pytest.approx(b[key], rel=1e-4), key
    for r in (src, plain):
        for key in ("seconds", "scan_seconds", "check_seconds"):
            r["structural"].pop(key)
    strip = lambda r: json.dumps({k: v for k, v in r.items() if k not in ("timing", "layers")}, sort_keys=True)  # noqa: E731
    assert strip(src) == strip(plain)


def test_crc32_is_zlibs():
    vk = _ext.load("verify_kernels")
    rng = torch.Generator().manual_seed(5)
    for n in list(range(0, 200)) + [1 << 16, (1 << 20) + 13]:
        b = torch.randint(0, 256, (n,), generator=rng, dtype=torch.uint8)
        for init in (0, 0xDEADBEEF, 0xFFFFFFFF):
            assert vk.crc32(b, init) == zlib.crc32(b.numpy().tobytes(), init), (n, init)
    assert vk.crc32(b"") == 0 and vk.crc32(os.urandom(0)) == 0
    assert vk.crc32(b"123456789") == 0xCBF43926  # the CRC-32 check value


@pytest.mark.parametrize("n", [1, 31, 64, 65, 127, 1000, (1 << 20) + 77])
def test_int8_range_matches_torch(n):
    """The structural pass's int4 range check reads min and max from one C++ pass (AVX2 where the CPU
    has it): the same bounds as torch.aminmax, the extremes placed in the vector body, its last
    block and the scalar tail, and split over threads."""
    vk = _ext.load("verify_kernels")
    gen = torch.Generator().manual_seed(n)
    for trial in range(6):
        x = torch.randint(-8, 8, (n,), generator=gen, dtype=torch.int8)
        if trial:  # one out-of-range value somewhere: at the start, inside, at the very end
            at = [0, n // 2, n - 1, max(0, n - 64), int(torch.randint(n, (1,), generator=gen))][trial - 1]
            x[at] = -128 if trial % 2 else 127
        want = tuple(int(v) for v in torch.aminmax(x))
        assert vk.int8_range(x) == want
        assert vk.int8_range(x, threads=2) == want
        if n > 1:  # an unaligned start
            assert vk.int8_range(x[1:]) == tuple(int(v) for v in torch.aminmax(x[1:]))


@pytest.mark.parametrize("n,k,g", [(24, 256, 128), (13, 64, 32), (8, 96, 96)])
def test_reference_group_sums_and_the_scale_error_from_them(n, k, g):
    """w4a8_reference's per-group sums of q^2 equal torch's, and the exact path's scale error from
    them equals ||q * s - q * s_src||^2 of the float64 matrices."""
    from int4pack.verify.exact_ints import scale_error_sq_groups

    vk = _ext.load("verify_kernels")
    gen = torch.Generator().manual_seed(n * k + g)
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    s_src = torch.rand(n, k // g, generator=gen) * 0.01 + 0.001
    s = s_src.bfloat16()
    gsq = torch.empty(n, k // g)
    vk.w4a8_reference(torch.randn(2, k, generator=gen), q, s, group_sq=gsq)
    assert torch.equal(gsq.double(), (q.double() ** 2).reshape(n, k // g, g).sum(-1))
    qd = q.double()
    sd, ssd = (t.double().repeat_interleave(g, dim=1) for t in (s, s_src))
    want = float(((qd * sd - qd * ssd) ** 2).sum())
    assert scale_error_sq_groups(gsq, s, s_src) == pytest.approx(want, rel=1e-12)
