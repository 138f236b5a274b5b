"""Tensor parallelism over the packed format, without vLLM: ``convert --tensor-parallel N`` and the
plugin's loaders give each rank exactly the KleidiAI blobs of its own slices, as vLLM narrows the
plain int8 weights (column parallel along N, row parallel along K). The reference is the numpy
packer (``kleidiai.pack_reference``) run on slices of the *plain* output's int4 values and scales:
a different code path from the portable packer that writes the checkpoint and from the byte
ranges the loaders cut."""

from __future__ import annotations

import json

import pytest
import torch

import int4pack
from _reference import FIXTURES, load_raw
from int4pack import kleidiai
from int4pack import serve_spec
from int4pack import blobs
from int4pack.errors import RefusedError, UsageError
from int4pack.vllm_plugin import _layout

TP = 2


@pytest.fixture(scope="module")
def outs(tmp_path_factory):
    """plain, packed (tp 1) and packed --tensor-parallel 2 outputs of two fixtures (group 32, channel)."""
    d = tmp_path_factory.mktemp("tp")
    res = {}
    for fx in ("ct_qwen3moe_w4a16", "ct_qwen3moe_w4a16_channel"):
        int4pack.convert(FIXTURES / fx, d / fx / "plain")
        int4pack.convert(FIXTURES / fx, d / fx / "packed", serve_format="kleidiai")
        int4pack.convert(FIXTURES / fx, d / fx / "tp2", serve_format="kleidiai", tensor_parallel=TP)
        res[fx] = {k: load_raw(d / fx / k) for k in ("plain", "packed", "tp2")}
        res[fx]["dirs"] = {k: d / fx / k for k in ("plain", "packed", "tp2")}
    return res


def _modules(plain: dict) -> list[str]:
    return sorted(n[: -len(".weight_scale")] for n in plain if n.endswith(".weight_scale"))


def _ref(plain: dict, m: str, rows=None, cols=None, bias=True) -> torch.Tensor:
    """numpy reference blob of rows/cols of plain module m (channelwise: a row keeps its scale)."""
    q, s = plain[f"{m}.weight"], plain[f"{m}.weight_scale"]
    b = plain.get(f"{m}.bias") if bias else None
    n, k = q.shape
    chan = s.shape[1] == 1
    g = k if chan else k // s.shape[1]
    r0, r1 = rows or (0, n)
    c0, c1 = cols or (0, k)
    qs = q[r0:r1, c0:c1]
    ss = s[r0:r1] if chan else s[r0:r1, c0 // g:c1 // g]
    if not chan and qs.shape[1] == g:  # one group: KleidiAI's channelwise layout (fp32 scales)
        ss, chan = ss.float(), True
    return kleidiai.pack_reference(qs, ss, None if b is None else b[r0:r1].float(), qs.shape[1] if chan else g)


@pytest.mark.parametrize("fx", ["ct_qwen3moe_w4a16", "ct_qwen3moe_w4a16_channel"])
def test_converter_stores_row_parallel_modules_per_rank(outs, fx):
    """Row parallel modules: [tp, bytes], row r = the reference blob of columns r*K/tp.. (bias on
    rank 0 only); every other blob is byte for byte the tp 1 output's; the config records the size."""
    o = outs[fx]
    plain, packed, tp2 = o["plain"], o["packed"], o["tp2"]
    mods = _modules(plain)
    rows = [m for m in mods if serve_spec.is_row_parallel(m)]
    assert any(".experts." in m for m in rows) and any(m.endswith("o_proj") for m in rows)
    for m in mods:
        blob = tp2[f"{m}.weight_packed"]
        if m in rows:
            k = plain[f"{m}.weight"].shape[1]
            assert blob.shape[0] == TP and blob.dtype == torch.uint8, m
            for r in range(TP):
                want = _ref(plain, m, cols=(r * k // TP, (r + 1) * k // TP), bias=r == 0)
                assert torch.equal(blob[r], want), (m, r)
        else:
            assert torch.equal(blob, packed[f"{m}.weight_packed"]), m
    rec = serve_spec.read_record(json.loads((o["dirs"]["tp2"] / "config.json").read_text())["quantization_config"])
    assert serve_spec.tensor_parallel_size(rec) == TP
    rec1 = serve_spec.read_record(json.loads((o["dirs"]["packed"] / "config.json").read_text())["quantization_config"])
    assert "tensor_parallel_size" not in rec1 and serve_spec.tensor_parallel_size(rec1) == 1  # tp 1: as before


def test_verify_reads_split_blobs_and_catches_swapped_ranks(outs, tmp_path):
    from int4pack.sources.checkpoint import Checkpoint

    d = outs["ct_qwen3moe_w4a16"]["dirs"]["tp2"]
    with Checkpoint(d) as ck:
        pw = blobs.PackedWeights(ck, {})
        m = "model.layers.0.mlp.experts.1.down_proj"
        assert pw.split(m) == TP and pw.check_blob(m)[0] == []
        q, s, _ = pw.decode(m)
        plain = outs["ct_qwen3moe_w4a16"]["plain"]
        assert torch.equal(q, plain[f"{m}.weight"]) and torch.equal(s, plain[f"{m}.weight_scale"])
        swapped = pw.blob(m).flip(0).contiguous()  # rank 1's blob where rank 0's belongs
        pw.blob = lambda name, _b=swapped: _b
        probs, _ = pw.check_blob(m)
        assert any("CRC-32" in p for p in probs), probs


def test_converter_refuses_what_cannot_be_split(tmp_path):
    # experts' down: K = 64 split 4 ways is 16 per rank, not a whole group of 32
    with pytest.raises(RefusedError, match=r"down_proj.*cannot be split along K for 4 .*K=16 is not a multiple"):
        int4pack.convert(FIXTURES / "ct_qwen3moe_w4a16", tmp_path / "o", serve_format="kleidiai", tensor_parallel=4)
    with pytest.raises(UsageError, match="--serve-format kleidiai only"):
        int4pack.convert(FIXTURES / "ct_qwen3moe_w4a16", tmp_path / "p", tensor_parallel=2)
    assert not (tmp_path / "o").exists() and not (tmp_path / "p").exists()


@pytest.mark.parametrize("fx", ["ct_qwen3moe_w4a16", "ct_qwen3moe_w4a16_channel"])
def test_expert_loader_gives_each_rank_its_slices(outs, fx):
    """vLLM's FusedMoE with tp 2: rank r's w13 = gate rows r*I/2.. then up rows r*I/2.., its w2 =
    down columns r*I/2..; fed through the loader from the --tensor-parallel 2 checkpoint."""
    plain, tp2 = outs[fx]["plain"], outs[fx]["tp2"]
    p = "model.layers.1.mlp.experts"
    inter, hidden = plain[f"{p}.0.gate_proj.weight"].shape
    chan = plain[f"{p}.0.gate_proj.weight_scale"].shape[1] == 1
    ip = inter // TP
    for r in range(TP):
        eb = _layout.ExpertBlobs(4, hidden, ip, -1 if chan else 32, TP, r)
        w13 = torch.nn.Parameter(eb.empty("w13"), requires_grad=False)
        w2 = torch.nn.Parameter(eb.empty("w2"), requires_grad=False)
        for e in range(4):
            for proj, shard, param in (("gate_proj", "w1", w13), ("up_proj", "w3", w13), ("down_proj", "w2", w2)):
                eb.load(param, tp2[f"{p}.{e}.{proj}.weight_packed"], f"{p}.{e}.{proj}", shard, e)
        assert eb.missing() == []
        for e in range(4):
            sl = (r * ip, (r + 1) * ip)
            want13 = torch.cat([_ref(plain, f"{p}.{e}.gate_proj", rows=sl), _ref(plain, f"{p}.{e}.up_proj", rows=sl)])
            assert torch.equal(w13.data[e], want13), (r, e)
            assert torch.equal(w2.data[e], _ref(plain, f"{p}.{e}.down_proj", cols=sl)), (r, e)
            # what vLLM itself would pack on this rank from its narrowed int8 [2I/2, H] and [H, I/2]
            q13 = torch.cat([plain[f"{p}.{e}.gate_proj.weight"][sl[0]:sl[1]], plain[f"{p}.{e}.up_proj.weight"][sl[0]:sl[1]]])
            assert torch.equal(kleidiai.unpack(w13.data[e], 2 * ip, hidden, hidden if chan else 32, False)[0], q13)


def test_expert_loader_refuses_another_split(outs):
    plain, packed, tp2 = (outs["ct_qwen3moe_w4a16"][k] for k in ("plain", "packed", "tp2"))
    p = "model.layers.0.mlp.experts"
    eb = _layout.ExpertBlobs(4, 128, 32, 32, TP, 1)
    w2 = torch.nn.Parameter(eb.empty("w2"), requires_grad=False)
    with pytest.raises(ValueError, match=r"expected uint8 \[2, \d+\] \(one row per tensor parallel rank"):
        eb.load(w2, packed[f"{p}.0.down_proj.weight_packed"], "down", "w2", 0)  # a tp 1 checkpoint's whole blob
    with pytest.raises(ValueError, match="row block"):
        _layout.ExpertBlobs(4, 128, 12, 32, TP, 0)  # 12 rows per rank: not whole 8-row blocks
    rec = serve_spec.layout_record(32, 2)
    _layout.check_tensor_parallel(rec, 2, "x")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4.*packed for 2.*--tensor-parallel 4"):
        _layout.check_tensor_parallel(rec, 4, "model.layers.0.mlp.experts")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2.*packed for 1"):
        _layout.check_tensor_parallel(serve_spec.layout_record(32), 2, "model.layers.0.self_attn.o_proj")


@pytest.mark.parametrize("tp,reps", [(2, 1), (4, 2)])
def test_dense_loader_column_and_row_splits(outs, tp, reps):
    """q/k/v (column parallel, k and v shared by ``reps`` ranks when tp exceeds the 2 kv heads) from
    the whole blobs any packed checkpoint holds; o_proj (row parallel) from the tp 2 checkpoint's rows."""
    plain, packed, tp2 = (outs["ct_qwen3moe_w4a16"][k] for k in ("plain", "packed", "tp2"))
    a = "model.layers.0.self_attn"
    k = plain[f"{a}.q_proj.weight"].shape[1]
    full = [plain[f"{a}.{x}_proj.weight"].shape[0] for x in "qkv"]
    for r in range(tp):
        rows = [full[0] // tp, full[1] * reps // tp, full[2] * reps // tp]
        shards = _layout.column_shards(rows, tp, r, reps, f"{a}.qkv_proj")
        db = _layout.DenseBlobs(rows, k, 32, shards)
        param = torch.nn.Parameter(db.empty(), requires_grad=False)
        for x in "vqk":
            db.load(param, packed[f"{a}.{x}_proj.weight_packed"], x)
        assert db.missing() == []
        starts = [r * rows[0], (r // reps) * rows[1], (r // reps) * rows[2]]
        want = torch.cat([_ref(plain, f"{a}.{x}_proj", rows=(s, s + n)) for x, s, n in zip("qkv", starts, rows)])
        assert torch.equal(param.data, want), r
    if tp == TP:
        ko = plain[f"{a}.o_proj.weight"].shape[1]
        for r in range(TP):
            db = _layout.DenseBlobs([plain[f"{a}.o_proj.weight"].shape[0]], ko // TP, 32, None, (TP, r), f"{a}.o_proj")
            param = torch.nn.Parameter(db.empty(), requires_grad=False)
            db.load(param, tp2[f"{a}.o_proj.weight_packed"])
            assert torch.equal(param.data, _ref(plain, f"{a}.o_proj", cols=(r * ko // TP, (r + 1) * ko // TP), bias=r == 0))
    with pytest.raises(ValueError, match=r"qkv_proj \(part 1\) has 4 rows per tensor parallel rank"):
        _layout.column_shards([16, 4, 4], 8, 0, 1, f"{a}.qkv_proj")


def test_verify_passes_the_split_checkpoint_and_refuses_a_record_of_another_size(outs, tmp_path):
    import shutil

    d = outs["ct_qwen3moe_w4a16_channel"]["dirs"]["tp2"]
    assert int4pack.verify(d, structural_only=True)["ok"]
    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["kleidiai"]["tensor_parallel_size"] = 4
    (bad / "config.json").write_text(json.dumps(cfg))
    r = int4pack.verify(bad, structural_only=True, raise_on_failure=False)
    text = json.dumps(r)
    assert not r["ok"] and "stored for 2 tensor parallel rank(s), the config records tensor_parallel_size 4" in text


def test_cli_passes_tensor_parallel(tmp_path):
    from typer.testing import CliRunner

    from int4pack.cli import app

    out = tmp_path / "o"
    r = CliRunner().invoke(app, ["convert", str(FIXTURES / "ct_qwen3moe_w4a16"), str(out), "--serve-format",
                                 "kleidiai", "--tensor-parallel", "2", "-q"])
    assert r.exit_code == 0, r.output
    rec = json.loads((out / "config.json").read_text())["quantization_config"]["kleidiai"]
    assert rec["tensor_parallel_size"] == 2
    r = CliRunner().invoke(app, ["convert", str(FIXTURES / "ct_qwen3moe_w4a16"), str(tmp_path / "p"),
                                 "--tensor-parallel", "2"])
    assert r.exit_code == 2 and "--serve-format kleidiai only" in r.output


def test_blob_crcs_are_checked_on_every_rank(outs):
    """The recorded CRC-32 of a K-split blob is zlib's over its whole stored [tp, bytes]; each rank
    checks the whole tensor its loader is handed (it keeps only a byte range or a row), so a flipped
    byte anywhere in a blob, even in another rank's share, is refused on every rank, naming the tensor."""
    import zlib

    plain, tp2 = outs["ct_qwen3moe_w4a16"]["plain"], outs["ct_qwen3moe_w4a16"]["tp2"]
    rec = json.loads((outs["ct_qwen3moe_w4a16"]["dirs"]["tp2"] / "config.json").read_text())["quantization_config"]["kleidiai"]
    p, a = "model.layers.1.mlp.experts", "model.layers.0.self_attn"
    down = tp2[f"{p}.0.down_proj.weight_packed"]
    assert down.dim() == 2 and down.shape[0] == TP
    assert rec["blob_checks"]["modules"][p]["crc32"][0][2] == f"{zlib.crc32(down.numpy().tobytes()):08x}"
    inter, hidden = plain[f"{p}.0.gate_proj.weight"].shape
    full = [plain[f"{a}.{x}_proj.weight"].shape[0] for x in "qkv"]
    k, ko = plain[f"{a}.q_proj.weight"].shape[1], plain[f"{a}.o_proj.weight"].shape[1]

    def load_rank(r, blobs):
        eb = _layout.ExpertBlobs(4, hidden, inter // TP, 32, TP, r, check=_layout.blob_check(rec, p, experts=4))
        w13, w2 = (torch.nn.Parameter(eb.empty(w), requires_grad=False) for w in ("w13", "w2"))
        for e in range(4):
            for proj, shard, param in (("gate_proj", "w1", w13), ("up_proj", "w3", w13), ("down_proj", "w2", w2)):
                eb.load(param, blobs[f"{p}.{e}.{proj}.weight_packed"], f"{p}.{e}.{proj}", shard, e)
        rows = [n // TP for n in full]
        qkv = _layout.DenseBlobs(rows, k, 32, _layout.column_shards(rows, TP, r, 1, f"{a}.qkv_proj"),
                                 check=_layout.blob_check(rec, f"{a}.qkv_proj", parts=3))
        qp = torch.nn.Parameter(qkv.empty(), requires_grad=False)
        for x in "qkv":
            qkv.load(qp, blobs[f"{a}.{x}_proj.weight_packed"], x)
        o = _layout.DenseBlobs([plain[f"{a}.o_proj.weight"].shape[0]], ko // TP, 32, None, (TP, r), f"{a}.o_proj",
                               check=_layout.blob_check(rec, f"{a}.o_proj", parts=1))
        op = torch.nn.Parameter(o.empty(), requires_grad=False)
        o.load(op, blobs[f"{a}.o_proj.weight_packed"])
        return eb, qkv, o

    for r in range(TP):
        for b in load_rank(r, tp2):
            b.check_bytes()  # the bytes convert wrote pass on every rank
    bad = dict(tp2)
    d = down.clone()
    d[1, 5] ^= 1  # rank 1's row of expert 0's down
    bad[f"{p}.0.down_proj.weight_packed"] = d
    q = tp2[f"{a}.q_proj.weight_packed"].clone()
    q[-1] ^= 0x10  # the last rows of q: rank 1's byte range
    bad[f"{a}.q_proj.weight_packed"] = q
    o = tp2[f"{a}.o_proj.weight_packed"].clone()
    o[0, 0] ^= 0x80  # rank 0's row of o_proj
    bad[f"{a}.o_proj.weight_packed"] = o
    for r in range(TP):
        eb, qkv, ob = load_rank(r, bad)
        with pytest.raises(ValueError, match=rf"{p}\.0\.down_proj\.weight_packed"):
            eb.check_bytes()
        with pytest.raises(ValueError, match=rf"{a}\.q_proj\.weight_packed"):
            qkv.check_bytes()
        with pytest.raises(ValueError, match=rf"{a}\.o_proj\.weight_packed"):
            ob.check_bytes()
