"""KleidiAI blobs on x86: C++ packer vs the numpy reference, a hand-indexed layout oracle,
torch's size formulas, decoding, refusals, and matmul through torch's fallback.

The proof against torch's real packer (byte equality under QEMU) is tests/arm64/.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from int4pack import kleidiai as K
from int4pack.errors import InputError

NS = [1, 7, 8, 9, 64, 100]
KS = [64, 128, 256]
GROUPS = [32, 64, 128, -1]


def cases():
    for n, k, g, bias in itertools.product(NS, KS, GROUPS, (False, True)):
        if g != -1 and (k % g or g == k):
            continue
        yield n, k, g, bias


def make(n, k, g, bias, seed=0):
    gen = torch.Generator().manual_seed(seed * 7919 + n * 131 + k * 7 + (g % 1000) + bias)
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    if g == -1 or g == k:
        s = torch.rand(n, 1, generator=gen) * 0.02 + 1e-4
    else:
        s = (torch.rand(n, k // g, generator=gen) * 0.02 + 1e-4).to(torch.bfloat16)
    b = torch.randn(n, generator=gen) if bias else None
    return q, s, b


@pytest.fixture(scope="module")
def ext():
    if os.environ.get("INT4PACK_NO_EXT", "") not in {"", "0"}:
        pytest.skip("C++ extension disabled by INT4PACK_NO_EXT")
    mod = K._ext_mod()
    assert mod is not None, f"kleidiai_pack did not build: {K._ext.build_error('kleidiai_pack')}"
    return mod


# --- sizes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n,k,g", [(n, k, g) for n, k, g, b in cases() if not b] + [(512, 512, 128), (13, 48, -1)])
def test_packed_size_matches_torch(n, k, g, monkeypatch):
    from torch._meta_registrations import get_kai_packed_weight_size

    bl = k if g == -1 else g
    assert K.packed_size(n, k, g) == get_kai_packed_weight_size(4, n, k, bl)
    # the op's meta kernel, as on a KleidiAI build (the flag is False in the x86 wheel)
    monkeypatch.setattr(torch.backends.kleidiai, "is_available", lambda: True)
    w = torch.empty(n, k // 2, dtype=torch.uint8, device="meta")
    s = torch.empty(n, 1, device="meta") if bl == k else torch.empty(n, k // bl, dtype=torch.bfloat16, device="meta")
    out = torch.ops.aten._dyn_quant_pack_4bit_weight(w, s, None, bl, k, n)
    assert out.dtype == torch.uint8 and out.numel() == K.packed_size(n, k, g)
    assert K.pack_reference(*make(n, k, g, False), g).numel() == out.numel()


def test_packed_size_doc_example():
    assert K.packed_size(512, 512, 128) == 139_264  # kleidiai.md §1.5


# --- bytes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n,k,g,bias", list(cases()))
def test_portable_equals_reference(ext, n, k, g, bias):
    q, s, b = make(n, k, g, bias)
    ref = K.pack_reference(q, s, b, g)
    out = K.pack_portable(q, s, b, g)
    assert out.dtype == torch.uint8 and out.dim() == 1
    assert out.numel() == K.packed_size(n, k, g)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("n,k,g", [(13, 48, -1), (9, 80, -1), (3, 2, -1)])
def test_channelwise_k_not_multiple_of_32(ext, n, k, g):
    q, s, b = make(n, k, g, True)
    assert torch.equal(K.pack_portable(q, s, b, g), K.pack_reference(q, s, b, g))


def _nib(v):
    return int(v) & 0xF


@pytest.mark.parametrize("g", [32, 64, -1])
def test_layout_by_hand(g):
    """A few bytes located by hand from kleidiai.md §1.5 (independent of the reshape code)."""
    n, k = 11, 128
    q, s, b = make(n, k, g, True, seed=3)
    blob = K.pack_portable(q, s, b, g)
    stride = K.packed_size(n, k, g) // 2  # two 8-row blocks
    gg = k if g == -1 else g
    per_qblock = gg // 2 * 8 + (0 if g == -1 else 16)

    def data_byte(row, kk):  # offset of the byte that holds k=kk (low nibble) for a row
        blk, r = divmod(row, 8)
        qb, kin = divmod(kk, gg)
        c, rem = divmod(kin, 32)
        seg, i = divmod(rem, 8)
        return blk * stride + qb * per_qblock + c * 128 + seg * 64 + r * 8 + i

    for row, kk in [(0, 0), (3, 10), (7, 72), (8, 33), (10, 100)]:  # kk % 32 < 16: low nibbles
        want = _nib(q[row, kk]) | _nib(q[row, kk + 16]) << 4
        assert blob[data_byte(row, kk)] == want, (row, kk)
    # padded rows 11..15 repeat row 10
    assert blob[data_byte(15, 40)] == _nib(q[10, 40]) | _nib(q[10, 56]) << 4
    tail = blob[2 * stride - 96:2 * stride] if g == -1 else blob[2 * stride - 64:2 * stride]
    if g == -1:  # int32 sums ×16, fp32 scales /16, fp32 bias, for rows 8..15
        sums = tail[:32].view(torch.int32)
        assert sums[1] == int(q[9].sum()) * 16 and sums[7] == int(q[10].sum()) * 16
        sc = tail[32:64].view(torch.float32)
        assert sc[0] == s[8, 0] / 16 and sc[6] == s[10, 0] / 16
        bi = tail[64:96].view(torch.float32)
    else:
        # bf16 scales of quant block 1 for rows 0..7 follow that block's data
        off = per_qblock + gg // 2 * 8
        assert torch.equal(blob[off:off + 16].view(torch.bfloat16), s[:8, 1])
        sums = tail[:32].view(torch.float32)
        exact = (q[9].double().reshape(-1, gg) * s[9].double()[:, None]).sum()
        assert abs(float(sums[1]) - float(exact)) <= 1e-5 * max(1.0, abs(float(exact)))
        bi = tail[32:64].view(torch.float32)
    assert bi[2] == b[10] and bi[7] == b[10] and bi[0] == b[8]


def test_no_bias_stores_zeros():
    q, s, _ = make(9, 64, 32, False)
    blob = K.pack_reference(q, s, None, 32).reshape(2, -1)
    assert blob[:, -32:].eq(0).all()


def test_pack_experts_matches_single(ext):
    e, n, k, g = 5, 13, 256, 64
    qs, ss, bs = zip(*(make(n, k, g, True, seed=i) for i in range(e)))
    q, s, b = torch.stack(qs), torch.stack(ss), torch.stack(bs)
    out = K.pack_experts(q, s, b, g)
    assert out.shape == (e, K.packed_size(n, k, g))
    for i in range(e):
        assert torch.equal(out[i], K.pack_reference(qs[i], ss[i], bs[i], g))
    assert torch.equal(K.pack_experts(q, s, b, g, threads=1), out)
    # channelwise, no bias, scales [E, N, 1]
    qs, ss, _ = zip(*(make(n, k, -1, False, seed=i) for i in range(e)))
    out = K.pack_experts(torch.stack(qs), torch.stack(ss), None, -1)
    for i in range(e):
        assert torch.equal(out[i], K.pack_reference(qs[i], ss[i], None, -1))


def test_fallback_without_extension(monkeypatch):
    q, s, b = make(9, 128, 32, True)
    want = K.pack_reference(q, s, b, 32)
    monkeypatch.setattr(K, "_ext_mod", lambda: None)
    assert torch.equal(K.pack_portable(q, s, b, 32), want)
    assert torch.equal(K.pack_experts(q[None], s[None], b[None], 32)[0], want)
    blob, used = K.pack(q, s, b, 32)  # on Arm torch's own packer, the same bytes
    assert used == ("native" if K.native_kleidiai_available() else "reference") and torch.equal(blob, want)


# --- decode --------------------------------------------------------------------------------


@pytest.mark.parametrize("n,k,g,bias", list(cases()) + [(13, 48, -1, True)])
def test_unpack_round_trip(n, k, g, bias):
    q, s, b = make(n, k, g, bias)
    blob, _ = K.pack(q, s, b, g)
    q2, s2, b2 = K.unpack(blob, n, k, g, bias)
    assert torch.equal(q2, q)
    assert s2.dtype == s.dtype and torch.equal(s2.reshape(s.shape), s)
    assert (b2 is None) if not bias else torch.equal(b2, b)


def test_unpack_detects_corruption():
    n, k, g = 9, 128, 32
    q, s, b = make(n, k, g, True)
    blob = K.pack_reference(q, s, b, g)
    stride = blob.numel() // 2
    bad = blob.clone()
    bad[stride - 64] ^= 1  # a row-sum byte of block 0
    with pytest.raises(InputError, match="row sums"):
        K.unpack(bad, n, k, g, True)
    bad = blob.clone()
    bad[stride + 8] ^= 0x10  # block 1, row 9: a padding row that must repeat row 8
    with pytest.raises(InputError):
        K.unpack(bad, n, k, g, True)
    with pytest.raises(InputError, match="bias"):
        K.unpack(blob, n, k, g, False)


# --- refusals ------------------------------------------------------------------------------


def test_check_blob_refusals():
    n, k, g = 9, 128, 32  # (K=64, g=32 has exactly the channelwise size: K/g == 2)
    q, s, b = make(n, k, g, False)
    blob = K.pack_reference(q, s, b, g)
    K.check_blob(blob, n, k, g)
    with pytest.raises(InputError, match="uint8"):
        K.check_blob(blob.float(), n, k, g)
    with pytest.raises(InputError, match="bytes"):
        K.check_blob(blob[:-1], n, k, g)
    with pytest.raises(InputError, match="bytes"):
        K.check_blob(blob.reshape(2, -1), n, k, g)
    with pytest.raises(InputError, match="bytes"):
        K.check_blob(blob, n, k, -1)  # a groupwise blob is not a channelwise one
    with pytest.raises(InputError, match="contiguous"):
        K.check_blob(torch.stack([blob, blob], 1)[:, 0], n, k, g)
    # torch's x86 float32 format is refused, not reinterpreted (on Arm torch writes KleidiAI bytes)
    if not K.native_kleidiai_available():
        fb = torch.ops.aten._dyn_quant_pack_4bit_weight(K.nibble_pack(q), s, None, g, k, n)
        with pytest.raises(InputError):
            K.check_blob(fb, n, k, g)


def test_input_refusals():
    q, s, b = make(8, 128, 32, True)
    with pytest.raises(InputError, match="bfloat16"):
        K.pack(q, s.float(), b, 32)
    with pytest.raises(InputError, match="float32"):
        K.pack(q, torch.ones(8, 1, dtype=torch.bfloat16), b, -1)
    for bad_g in (16, 48, 96, 0):
        with pytest.raises(InputError, match="group size"):
            K.pack(q, s, b, bad_g)
    with pytest.raises(InputError, match=r"\[N, K/g\]"):
        K.pack(q, s[:, :2], b, 32)
    with pytest.raises(InputError, match="bias"):
        K.pack(q, s, b[:7], 32)
    with pytest.raises(InputError, match="int8"):
        K.pack(q.to(torch.int32), s, b, 32)
    with pytest.raises(InputError, match=r"\[-8, 7\]"):
        K.nibble_pack(torch.full((2, 4), 8, dtype=torch.int8))
    with pytest.raises(InputError):
        K.pack(q, s, b, 32, packer="fast")


def test_nibble_pack_contract():
    q = torch.tensor([[-8, 7, 0, -1], [3, -3, 5, -5]], dtype=torch.int8)
    assert K.nibble_pack(q).tolist() == [[0x0 | 0xF << 4, 0x8 | 0x7 << 4], [0xB | 0x5 << 4, 0xD | 0x3 << 4]]


# --- host detection and matmul -------------------------------------------------------------


@pytest.mark.skipif(K.platform.machine().lower() in {"aarch64", "arm64"}, reason="x86 behaviour")
def test_native_unavailable_on_x86():
    assert K.native_kleidiai_available() is False
    q, s, b = make(8, 64, 32, False)
    with pytest.raises(InputError, match="not available"):
        K.pack(q, s, b, 32, packer="native")
    assert K.pack(q, s, b, 32, packer="portable")[1] in {"portable", "reference"}


def _float_ref(x, q, s, b, g):
    n, k = q.shape
    bl = k if g == -1 else g
    w = (q.double().reshape(n, k // bl, bl) * s.double().reshape(n, k // bl, 1)).reshape(n, k)
    return x.double() @ w.T + (b.double() if b is not None else 0)


@pytest.mark.parametrize("n,k,g,bias", [(64, 256, 32, True), (100, 256, 128, False), (64, 256, -1, True),
                                        (9, 128, -1, False), (200, 512, 64, True)])
def test_load_for_matmul(n, k, g, bias):
    q, s, b = make(n, k, g, bias)
    blob, _ = K.pack(q, s, b, g)
    w = K.load_for_matmul(blob, n, k, g, bias)
    bl = k if g == -1 else g
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(5))
    y = torch.ops.aten._dyn_quant_matmul_4bit(x, w, bl, k, n)
    assert y.shape == (16, n) and y.dtype == torch.float32
    ref = _float_ref(x, q, s, b, g)
    rel = float((y.double() - ref).norm() / ref.norm())
    assert rel < 0.02, rel  # int8 activations cost ~1% (kleidiai.md §2.4)
    # decoding is exact: identical to torch packing the canonical tensors itself
    direct = torch.ops.aten._dyn_quant_pack_4bit_weight(K.nibble_pack(q), s, b, bl, k, n)
    assert torch.equal(torch.ops.aten._dyn_quant_matmul_4bit(x, direct, bl, k, n), y)


@pytest.mark.skipif(K.platform.machine().lower() in {"aarch64", "arm64"},
                    reason="x86 behaviour: torch on Arm writes KleidiAI bytes, not its float32 format")
def test_load_for_matmul_refuses_float_blob():
    q, s, b = make(8, 64, 32, False)
    fb = torch.ops.aten._dyn_quant_pack_4bit_weight(K.nibble_pack(q), s, None, 32, 64, 8)
    with pytest.raises(InputError):
        K.load_for_matmul(fb, 8, 64, 32, False)


def test_cpp_decoder_equals_the_torch_decoder_and_names_the_same_damage():
    # kleidiai.unpack runs the C++ decoder (csrc/kleidiai_pack/kleidiai_unpack.cpp); unpack_torch
    # is its twin, written from the layout with tensor reshapes: same tensors, same first complaint
    import pytest
    import torch

    from int4pack import _ext, kleidiai
    from int4pack.errors import InputError

    if _ext.load("verify_kernels") is None:
        pytest.skip("the C++ library is not built here")
    gen = torch.Generator().manual_seed(3)
    for n, k, g, has_bias in [(13, 64, 32, True), (13, 64, 64, False), (20, 48, 48, True), (24, 256, 128, False)]:
        q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
        s = torch.rand(n, 1, generator=gen) + 0.01 if g == k else (torch.rand(n, k // g, generator=gen) + 0.01).bfloat16()
        bias = torch.randn(n, generator=gen) if has_bias else None
        blob = kleidiai.pack_reference(q, s, bias, g)
        a, b = kleidiai.unpack(blob, n, k, g, has_bias), kleidiai.unpack_torch(blob, n, k, g, has_bias)
        assert torch.equal(a[0], q) and all(x is None and y is None or torch.equal(x, y) for x, y in zip(a, b))
        for pos in (0, blob.numel() // 2, blob.numel() - 1, blob.numel() - 40):
            bad = blob.clone()
            bad[pos] ^= 0x11
            msgs = []
            for fn in (kleidiai.unpack, kleidiai.unpack_torch):
                try:
                    fn(bad, n, k, g, has_bias)
                    msgs.append(None)
                except InputError as e:
                    msgs.append(str(e))
            assert msgs[0] == msgs[1], (n, k, g, pos)


def test_cpp_dequant_and_reference_layout_equal_torch():
    import pytest
    import torch

    from int4pack import _ext, moe, w4a8

    if _ext.load("verify_kernels") is None:
        pytest.skip("the C++ library is not built here")
    gen = torch.Generator().manual_seed(4)
    for n, k, g in [(24, 64, 32), (24, 64, -1), (16, 256, 128)]:
        q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
        s = torch.rand(n, 1, generator=gen) + 0.01 if g == -1 else (torch.rand(n, k // g, generator=gen) + 0.01).bfloat16()
        block = k if g == -1 else g
        sf = s.float()
        want = q.float() * sf.reshape(n, 1) if g == -1 else (q.float().view(n, -1, g) * sf.view(n, -1, 1)).view(n, k)
        assert torch.equal(w4a8.dequantize_w4a8(q, s, g), want)
        # torch's own packer writes its float32 reference layout on x86 (and on Arm without KleidiAI)
        from int4pack import kleidiai

        if not kleidiai.native_kleidiai_available():
            assert torch.equal(moe._fallback_pack(q, s, block), moe._torch_pack(q, s, block))
