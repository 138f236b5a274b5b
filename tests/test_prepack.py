"""convert --prepack kleidiai: blobs beside the checkpoint, checked against independent paths."""

from __future__ import annotations

import json

import pytest
import torch

import int4pack
from _reference import FIXTURES, load_raw
from int4pack import kleidiai
from int4pack.errors import InputError
from int4pack.prepack import load_prepacked

pytestmark = pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"real fixtures not found at {FIXTURES}")


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp") / "out"
    report = int4pack.convert(FIXTURES / "gptq_mixtral_sym", out, prepack="kleidiai")
    return out, report


def test_manifest_and_names(packed):
    out, report = packed
    man = json.loads((out / "kleidiai" / "manifest.json").read_text())
    assert (man["nr"], man["kr"], man["sr"]) == ("8", "16", "2")
    assert man["packer"] in ("native", "portable") and report["prepack"]["packer"] == man["packer"]
    names = set(man["tensors"])
    # vLLM's Mixtral names: the experts prefix is the written checkpoint's
    for layer in (0, 1):
        assert f"model.layers.{layer}.block_sparse_moe.experts.w13_packed" in names
        assert f"model.layers.{layer}.block_sparse_moe.experts.w2_packed" in names
    assert sum(1 for n in names if n.endswith(".weight_packed")) == 8  # attention
    # the blobs are not part of the vLLM checkpoint's index
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    assert not any(k.endswith("_packed") for k in idx["weight_map"])


def test_blobs_match_the_numpy_oracle_and_decode_to_the_checkpoint(packed):
    out, _ = packed
    man = json.loads((out / "kleidiai" / "manifest.json").read_text())
    ckpt = load_raw(out)
    blobs = load_raw(out / "kleidiai")
    g = int(man["group_size"])
    for name, ent in man["tensors"].items():
        blob = blobs[name]
        n, k = ent["n"], ent["k"]
        size = kleidiai.packed_size(n, k, g)
        assert blob.dtype == torch.uint8 and blob.shape[-1] == size == ent["bytes"]
        if name.endswith(".weight_packed"):
            mods = [[name[: -len(".weight_packed")]]]
            rows = [blob]
        else:
            prefix, kind = name.rsplit(".", 1)
            e_count = ent["experts"]
            projs = ("w1", "w3") if kind == "w13_packed" else ("w2",)
            mods = [[f"{prefix}.{e}.{p}" for p in projs] for e in range(e_count)]
            rows = list(blob)
        for ms, row in zip(mods, rows):
            q = torch.cat([ckpt[f"{m}.weight"] for m in ms])
            s = torch.cat([ckpt[f"{m}.weight_scale"] for m in ms])
            assert torch.equal(row, kleidiai.pack_reference(q, s, None, g)), name
            dq, ds, _ = kleidiai.unpack(row.contiguous(), n, k, g, has_bias=False)
            assert torch.equal(dq, q) and torch.equal(ds, s), name


def test_load_prepacked_runs_the_matmul(packed):
    out, _ = packed
    name = "model.layers.1.block_sparse_moe.experts.w2_packed"
    ws = load_prepacked(out, name)
    assert len(ws) == 4
    ckpt = load_raw(out)
    q = ckpt["model.layers.1.block_sparse_moe.experts.2.w2.weight"].float()
    s = ckpt["model.layers.1.block_sparse_moe.experts.2.w2.weight_scale"].float()
    n, k = q.shape
    w = q * s.repeat_interleave(k // s.shape[1], dim=1)
    x = torch.randn(5, k)
    y = torch.ops.aten._dyn_quant_matmul_4bit(x, ws[2], 32, k, n)
    ref = x @ w.T
    # int8 per-token activation quantisation: ~1% relative
    assert ((y - ref).norm() / ref.norm()).item() < 0.03


def test_load_prepacked_refuses_wrong_layout_and_truncation(packed, tmp_path):
    out, _ = packed
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    man_p = bad / "kleidiai" / "manifest.json"
    man = json.loads(man_p.read_text())
    man["layout_version"] = "99"
    man_p.write_text(json.dumps(man))
    with pytest.raises(InputError, match="layout_version"):
        load_prepacked(bad, "model.layers.0.block_sparse_moe.experts.w13_packed")
    man["layout_version"] = "1"
    ent = man["tensors"]["model.layers.0.block_sparse_moe.experts.w13_packed"]
    ent["bytes"] -= 8
    man_p.write_text(json.dumps(man))
    with pytest.raises(InputError, match="expected"):
        load_prepacked(bad, "model.layers.0.block_sparse_moe.experts.w13_packed")
