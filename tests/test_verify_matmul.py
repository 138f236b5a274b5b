"""verify's W4A8 matmul where torch has no KleidiAI: int4pack's C++ twin of torch's reference kernel
(csrc/verify_kernels/w4a8_matmul.cpp) against torch's own ``_dyn_quant_matmul_4bit`` and against a
float64 model of that kernel's algorithm written here from its description (docs/kleidiai.md §2.3);
and verify's verdicts through the twin against the same runs through torch's op.

Tolerances. The kernel's integer sums are exact; its float steps are, per output, one product per
block, their sum block after block and one multiply by 1 / scale. With bf16 scales each product
float(iacc) * s is exact (an integer of < 2^14 times 8 significant bits fits float32's 24), and
channelwise there is no sum, so the result cannot depend on how a compiler orders or fuses them
(FMA): the twin and torch must agree bit for bit. With fp32 group scales a compiler that fuses
multiply and add (FMA) rounds differently: there the two may differ by the float32 rounding of those
steps, each within 2^-24 of its result: at most (2 blocks + 1) * 2^-24 * recip * sum_b |iacc_b * s_b|
from the float64 model (which both must meet).
"""

from __future__ import annotations

import shutil

import pytest
import torch

import int4pack
from int4pack import _ext, moe
from int4pack.verify import expert_check, matmul
from int4pack.errors import UsageError, VerifyFailed

MM = torch.ops.aten._dyn_quant_matmul_4bit
vk = _ext.load("verify_kernels")
pytestmark = [
    pytest.mark.skipif(vk is None, reason="the C++ library is not built here"),
    pytest.mark.skipif(matmul.twin() is None and vk is not None,
                       reason="torch runs KleidiAI here: verify runs torch's op, not the twin"),
]


def _torch_mm(x, q, s, block):
    n, k = q.shape
    return MM(x, moe.pack_for_matmul(q, s, -1 if block == k else block), block, k, n)


def _model(x, q, s, block, channel):
    """float64 model of torch's reference kernel: (y, bound on float32 rounding of its float steps)."""
    m, k = x.shape
    f = torch.float32
    rows = []
    for r in x:
        lo, hi = torch.clamp(r.min(), max=0.0), torch.clamp(r.max(), min=0.0)
        scale = torch.tensor(1.0, dtype=f) if lo == hi else torch.tensor(255.0, dtype=f) / (hi - lo)
        recip = torch.tensor(1.0, dtype=f) / scale
        dmin, dmax = lo * scale, hi * scale
        qmin, qmax = torch.tensor(-128.0, dtype=f), torch.tensor(127.0, dtype=f)
        err = (qmin + dmin) + (qmax + dmax) if channel else ((qmin + dmin) + qmax) + dmax
        zp = (qmin - dmin) if err > 0 else (qmax - dmax)
        zp = int(torch.round(zp.clamp(-128, 127)))  # lrintf: half to even, as torch.round
        v = (r * scale).double()  # the float32 product, exactly
        qx = (torch.sign(v) * torch.floor(v.abs() + 0.5)).long() + zp  # round half away from zero
        rows.append((qx.clamp(-128, 127) - zp, float(recip)))
    w = ((q.long() + 8) & 15) - 8
    nb = k // block
    sc = s.double().reshape(q.shape[0], nb)
    y, bound = torch.empty(m, q.shape[0], dtype=torch.float64), torch.empty(m, q.shape[0], dtype=torch.float64)
    for i, (xs, recip) in enumerate(rows):
        iacc = (w.reshape(-1, nb, block) * xs.reshape(1, nb, block)).sum(2).double()  # [N, nb], exact
        terms = iacc * sc
        y[i] = terms.sum(1) * recip
        bound[i] = (2 * nb + 1) * 2.0 ** -24 * terms.abs().sum(1) * recip
    return y, bound


def _case(seed, m, n, k, block, scale_dtype, kind):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    s = (torch.rand(n, k // block, generator=gen) * 0.02 + 1e-4).to(scale_dtype)
    x = torch.randn(m, k, generator=gen) * 10.0 ** (seed % 5 - 2)
    if kind == "positive":
        x = x.abs()
    elif kind == "negative":
        x = -x.abs()
    elif kind == "zero rows":
        x[::2] = 0.0
    elif kind == "ties":  # values on the half steps of the int8 grid: round-half-away matters
        x = torch.randint(-100, 101, (m, k), generator=gen).float() + 0.5
        x[:, 0] = 127.5  # range 255: the scale is 1, every value is a tie
        x[:, 1] = -127.5
    return x, q, s


CASES = [  # m, n, k, block (k: channelwise), scale dtype, input kind
    (1, 24, 64, 32, torch.bfloat16, "normal"),
    (3, 40, 256, 64, torch.bfloat16, "normal"),
    (9, 17, 512, 128, torch.bfloat16, "positive"),  # more rows than the AVX2 loop's 8 at a time
    (17, 8, 2048, 128, torch.bfloat16, "negative"),
    (4, 12, 384, 128, torch.bfloat16, "zero rows"),
    (5, 16, 256, 32, torch.bfloat16, "ties"),
    (2, 33, 256, 256, torch.float32, "normal"),  # channelwise, K a multiple of 32
    (3, 9, 98, 98, torch.float32, "ties"),  # channelwise, K with a 2-value tail
    (6, 20, 1000, 1000, torch.float32, "positive"),
    (4, 16, 512, 32, torch.float32, "normal"),  # fp32 group scales: FMA or not decides the last bits
    (3, 16, 2048, 64, torch.float32, "negative"),
]


@pytest.mark.parametrize("simd", [True, False], ids=["simd", "portable"])
@pytest.mark.parametrize("m, n, k, block, scale_dtype, kind", CASES)
def test_twin_is_torchs_reference_kernel(m, n, k, block, scale_dtype, kind, simd):
    x, q, s = _case(m * n + k, m, n, k, block, scale_dtype, kind)
    ref = _torch_mm(x, q, s, block)
    got = vk.w4a8_matmul(x, q, s, block, simd=simd)
    model, bound = _model(x, q, s, block, channel=block == k)
    assert torch.all((ref.double() - model).abs() <= bound)  # the model is torch's kernel
    assert torch.all((got.double() - model).abs() <= bound)
    if scale_dtype == torch.bfloat16 or block == k:
        assert torch.equal(got, ref)
    else:
        assert torch.all((got.double() - ref.double()).abs() <= 2 * bound)


def test_twin_splits_rows_over_threads_without_changing_a_bit():
    x, q, s = _case(3, 5, 300, 512, 128, torch.bfloat16, "normal")
    one = vk.w4a8_matmul(x, q, s, 128, threads=1)
    assert torch.equal(vk.w4a8_matmul(x, q, s, 128, threads=3), one)
    assert torch.equal(one, _torch_mm(x, q, s, 128))


def test_twin_takes_a_values_nibble_as_torchs_packer_stores_it():
    # out of [-8, 7] (a value the structural pass flags): torch's packer keeps its low nibble
    x, q, s = _case(4, 3, 16, 128, 32, torch.bfloat16, "normal")
    q[0, :6] = torch.tensor([8, 9, -9, 100, -128, 127], dtype=torch.int8)
    assert torch.equal(vk.w4a8_matmul(x, q, s, 32), _torch_mm(x, q, s, 32))


def test_twin_refuses_what_it_cannot_run():
    x, q, s = _case(5, 2, 8, 128, 32, torch.bfloat16, "normal")
    with pytest.raises(RuntimeError, match="one per block"):
        vk.w4a8_matmul(x, q, s, 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        vk.w4a8_matmul(x, q, torch.ones(8, 8, dtype=torch.bfloat16), 16)
    with pytest.raises(RuntimeError, match="expected a contiguous torch.float32"):
        vk.w4a8_matmul(x.bfloat16(), q, s, 32)
    assert not matmul.fits(q.float(), s, 32) and not matmul.fits(q, s, 64)
    assert matmul.fits(q, s, 32)


def _corrupt_rows(q):
    """Rows 0-7 of a weight matrix negated (-q - 1 keeps [-8, 7]): far beyond activation noise."""
    q = q.clone()
    q[:8] = -q[:8] - 1
    return q


@pytest.mark.parametrize("fixture", ["gptq_q3_sym", "ct_qwen3moe_w4a16_channel"])
def test_weights_only_the_kernel_sees_fail_alike_through_the_twin_and_torch(converted, monkeypatch, fixture):
    """The kernel's weights differ from the references' (as a bad blob would on Arm): verify fails
    the same layers with the same figures whichever matmul runs; intact, both pass alike."""
    out, _ = converted(fixture)
    runs = {}
    for which in ("twin", "torch"):
        monkeypatch.setenv(matmul.ENV, "auto" if which == "twin" else "torch")
        runs[which] = int4pack.verify(out, dense=False, raise_on_failure=False, threads=2)
    assert runs["twin"]["ok"] and runs["torch"]["ok"] and runs["twin"]["layers"]

    real_matmul, real_pack = matmul.matmul, moe.pack_for_matmul

    def bad_matmul(vk_, x, q, s, block):  # every matrix the twin multiplies
        return real_matmul(vk_, x, _corrupt_rows(q), s, block)

    def bad_pack(q, s, g, out=None):  # every matrix torch's op is given
        return real_pack(_corrupt_rows(q), s, g, out=out)

    monkeypatch.setattr(matmul, "matmul", bad_matmul)
    monkeypatch.setattr(expert_check.moe_mod, "pack_for_matmul", bad_pack)
    bad = {}
    for which in ("twin", "torch"):
        monkeypatch.setenv(matmul.ENV, "auto" if which == "twin" else "torch")
        with pytest.raises(VerifyFailed) as ei:
            int4pack.verify(out, dense=False, threads=2)
        bad[which] = ei.value.report
    for which, r in runs.items():
        want = matmul.TWIN if which == "twin" else matmul.TORCH
        assert {lay["matmul"] for lay in r["layers"]} == {want}
    for a, b in zip(bad["twin"]["layers"], bad["torch"]["layers"]):
        assert not a["ok"] and not b["ok"]
        assert any("activation-quantisation error" in p for p in a["problems"])
        assert a["problems"] == b["problems"]
        assert a["act_rel"] == pytest.approx(b["act_rel"], rel=1e-6) and a["act_rel"] > 3 * a["act_pred"]
    assert bad["twin"]["verdict"] == bad["torch"]["verdict"]


def test_setting_forces_torch_and_the_report_says_which_ran(converted, monkeypatch):
    out, _ = converted("gptq_q3_sym")
    r = int4pack.verify(out, layers=[0], threads=1)
    assert r["kernel"]["op"] == "int4pack verify_kernels w4a8_matmul" and "setting" not in r["kernel"]
    assert r["layers"][0]["matmul"] == "int4pack" and r["layers"][0]["weights"] == "the int4 values as read"
    assert all(d["matmul"] == "int4pack" for d in r["dense"])
    monkeypatch.setenv(matmul.ENV, "torch")
    f = int4pack.verify(out, layers=[0], threads=1)
    assert f["kernel"] == {"matmul": "torch reference (x86 fallback)", "op": "torch.ops.aten._dyn_quant_matmul_4bit",
                           "moe_op": "python", "setting": "INT4PACK_VERIFY_MATMUL=torch"}
    assert f["layers"][0]["matmul"] == "torch" and f["layers"][0]["weights"] == "packed on the fly"
    assert all(d["matmul"] == "torch" for d in f["dense"])
    for a, b in zip(r["layers"] + r["dense"], f["layers"] + f["dense"]):
        assert a["rel_l2"] == b["rel_l2"] and a["act_rel"] == b["act_rel"]  # bf16 group scales: the same bits
    monkeypatch.setenv(matmul.ENV, "fast")
    with pytest.raises(UsageError, match="INT4PACK_VERIFY_MATMUL"):
        int4pack.verify(out, layers=[0])


def test_packed_checkpoint_on_x86_runs_the_twin_on_the_decoded_blobs(converted, tmp_path):
    out, _ = converted("gptq_q3_sym", serve_format="kleidiai")
    r = int4pack.verify(shutil.copytree(out, tmp_path / "o"), threads=2)
    assert r["ok"] and {lay["matmul"] for lay in r["layers"]} == {"int4pack"}
