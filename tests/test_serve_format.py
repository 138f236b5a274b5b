"""convert --serve-format kleidiai: the packed serving checkpoint against the plain W4A8 one.

Every blob is checked against two packers run on the plain checkpoint's int4 values: the numpy
reference (``kleidiai.pack_reference``, written from the layout description) and the portable C++
packer. That the portable packer writes torch's own bytes on Arm is proven under QEMU
(tests/arm64/test_arm64_pack.py, 170+ shapes, torch 2.9.1 and 2.10.0).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

import int4pack
from _reference import FIXTURES, load_raw
from int4pack import kleidiai
from int4pack import serve_spec
from int4pack import blobs
from int4pack.cli import app
from int4pack.errors import RefusedError, UsageError

CASES = {  # fixture -> (group, bias-free): group and channel scales, both MoE namings
    "gptq_mixtral_sym": 32,
    "ct_qwen3moe_w4a16_channel": -1,
    "awq_q3": 32,
}


@pytest.fixture(scope="module")
def pair(converted):
    def get(name: str) -> tuple[Path, Path, dict]:
        packed, rep = converted(name, serve_format="kleidiai")
        return converted(name)[0], packed, rep

    return get


def _w4a8_modules(plain: dict) -> list[str]:
    return sorted(k[: -len(".weight_scale")] for k in plain if k.endswith(".weight_scale"))


@pytest.mark.parametrize("name", sorted(CASES))
def test_blobs_are_the_packers_bytes_of_the_plain_ints(pair, name):
    plain_dir, packed_dir, _ = pair(name)
    plain, packed = load_raw(plain_dir), load_raw(packed_dir)
    g = CASES[name]
    mods = _w4a8_modules(plain)
    assert mods and sorted(k[: -len(".weight_packed")] for k in packed if k.endswith(".weight_packed")) == mods
    for m in mods:
        q, s = plain[f"{m}.weight"], plain[f"{m}.weight_scale"]
        block = q.shape[1] if g == -1 else g
        blob = packed[f"{m}.weight_packed"]
        assert blob.dtype == torch.uint8 and blob.shape == (kleidiai.packed_size(*q.shape, block),), m
        assert torch.equal(blob, kleidiai.pack_reference(q, s, None, block)), m
        assert torch.equal(blob, kleidiai.pack_portable(q, s, None, block)), m


def test_fused_parts_join_into_the_fused_blob(pair):
    """What the vLLM plugin loads into one parameter equals what vLLM packs from the plain checkpoint."""
    plain_dir, packed_dir, _ = pair("awq_q3")
    plain, packed = load_raw(plain_dir), load_raw(packed_dir)
    fused = {"model.layers.1.mlp.experts.2": ("gate_proj", "up_proj"),
             "model.layers.0.self_attn": ("q_proj", "k_proj", "v_proj")}
    for prefix, parts in fused.items():
        q = torch.cat([plain[f"{prefix}.{p}.weight"] for p in parts])
        s = torch.cat([plain[f"{prefix}.{p}.weight_scale"] for p in parts])
        joined = torch.cat([packed[f"{prefix}.{p}.weight_packed"] for p in parts])
        assert torch.equal(joined, kleidiai.pack_reference(q, s, None, 32)), prefix


@pytest.mark.parametrize("name", sorted(CASES))
def test_config_records_the_layout(pair, name):
    plain_dir, packed_dir, rep = pair(name)
    qp = json.loads((plain_dir / "config.json").read_text())["quantization_config"]
    qk = json.loads((packed_dir / "config.json").read_text())["quantization_config"]
    assert qk["quant_method"] == "int4pack-kleidiai"
    rec = qk.pop("kleidiai")
    assert {k: v for k, v in qk.items() if k != "quant_method"} == {k: v for k, v in qp.items() if k != "quant_method"}
    g = CASES[name]
    assert (rec["layout"], rec["layout_version"], rec["nr"], rec["kr"], rec["sr"]) == (
        "kleidiai-qsi4c32p/qsi4cxp", 1, 8, 16, 2)
    assert rec["group_size"] == g and rec["scale_dtype"] == ("float32" if g == -1 else "bfloat16")
    assert rep["serve_format"]["format"] == "kleidiai" and rep["serve_format"]["group_size"] == g


@pytest.mark.parametrize("name", sorted(CASES))
def test_nothing_stored_twice(pair, name):
    plain_dir, packed_dir, _ = pair(name)
    plain, packed = load_raw(plain_dir), load_raw(packed_dir)
    mods = set(_w4a8_modules(plain))
    replaced = {f"{m}.{leaf}" for m in mods for leaf in ("weight", "weight_scale", "bias")}
    assert set(packed) == (set(plain) - replaced) | {f"{m}.weight_packed" for m in mods}
    assert not any(t.dtype == torch.int8 for t in packed.values())
    for k in set(packed) & set(plain):  # everything else as in the plain output, byte for byte
        assert packed[k].dtype == plain[k].dtype and torch.equal(packed[k], plain[k]), k
    idx = json.loads((packed_dir / "model.safetensors.index.json").read_text()) if (
        packed_dir / "model.safetensors.index.json").exists() else None
    if idx:
        assert set(idx["weight_map"]) == set(packed)
    size = lambda d: sum(f.stat().st_size for f in d.glob("*.safetensors"))  # noqa: E731
    assert size(packed_dir) < size(plain_dir)


def test_provenance_in_the_shard_headers(pair):
    plain_dir, packed_dir, rep = pair("gptq_mixtral_sym")
    plain = load_raw(plain_dir)
    prov = {}
    for f in packed_dir.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as fh:
            prov.update(json.loads(fh.metadata()["int4pack.tensors"]))
    m = "model.layers.1.block_sparse_moe.experts.3.w2"
    p = prov[f"{m}.weight_packed"]["packed"]
    import zlib

    assert (p["n"], p["k"], p["group_size"], p["bias"]) == (256, 128, 32, False)
    assert p["crc32_q"] == f"{zlib.crc32(plain[f'{m}.weight'].numpy().tobytes()):08x}"
    assert p["crc32_scales"] == f"{zlib.crc32(plain[f'{m}.weight_scale'].view(torch.int16).numpy().tobytes()):08x}"
    # the report keeps it under the source module name (GPTQModel's mlp.experts.E.down_proj here)
    assert any(v.get("packed") == p for v in rep["modules"].values())


def test_verify_passes_and_matches_the_plain_checkpoint(pair):
    plain_dir, packed_dir, _ = pair("gptq_mixtral_sym")
    src = FIXTURES / "gptq_mixtral_sym"
    rk = int4pack.verify(packed_dir, against=src)
    rp = int4pack.verify(plain_dir, against=src)
    assert rk["ok"] and rk["structural"]["serve_format"] == "kleidiai"
    assert rk["structural"]["counts"]["blobs"] == rk["structural"]["counts"]["modules"] == 32
    # the same int4 values through the same kernel: the same numbers as the plain checkpoint
    for a, b in zip(rk["layers"] + rk["dense"], rp["layers"] + rp["dense"]):
        assert a["rel_l2"] == b["rel_l2"] and a["act_rel"] == b["act_rel"]


def _edit(folder: Path, edit) -> None:
    idx_path = folder / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            meta, tensors = fh.metadata(), {k: fh.get_tensor(k) for k in fh.keys()}
        if edit(tensors, meta):
            save_file(tensors, str(f), metadata=meta)
            idx["weight_map"].update(dict.fromkeys(tensors, f.name))
    idx_path.write_text(json.dumps(idx))


BLOB = "model.layers.0.block_sparse_moe.experts.1.w3.weight_packed"


def _problems(r) -> str:
    return json.dumps(r["structural"]["problems"])


@pytest.mark.parametrize("damage, expect", [
    ("data", "row sums disagree"),  # one data byte: the blob's own row sums give it away
    ("scale", "row sums disagree"),  # one bf16 scale inside the blob, the same
    ("swap", "int4 values differ"),  # a well-formed blob of another expert: only the provenance tells
    ("truncate", "expected U8"),
    ("provenance", "no provenance"),
    ("twice", "stored twice"),
])
def test_verify_catches_damaged_blobs(pair, tmp_path, damage, expect):
    _, packed_dir, _ = pair("gptq_mixtral_sym")
    bad = tmp_path / "bad"
    shutil.copytree(packed_dir, bad)
    (bad / "int4pack_report.json").unlink()  # the shard checksums would catch the first two already

    def edit(t, meta):
        if BLOB not in t:
            return False
        b = t[BLOB].clone()
        if damage == "data":
            b[3] ^= 0x10
        elif damage == "scale":
            b[128] ^= 0x01  # block 0's first bf16 scale (group 32: 8 rows x 16 data bytes before it)
        elif damage == "swap":
            b = t[BLOB.replace("experts.1.", "experts.2.")].clone()
        elif damage == "truncate":
            b = b[:-8].clone()
        elif damage == "provenance":
            ent = json.loads(meta["int4pack.tensors"])
            ent[BLOB].pop("packed")
            meta["int4pack.tensors"] = json.dumps(ent)
        elif damage == "twice":
            t[BLOB.replace("weight_packed", "weight")] = torch.zeros(128, 256, dtype=torch.int8)
        t[BLOB] = b
        return True

    _edit(bad, edit)
    r = int4pack.verify(bad, structural_only=True, raise_on_failure=False)
    assert not r["ok"] and BLOB in _problems(r) and expect in _problems(r), _problems(r)


def test_verify_refuses_another_layout_version(pair, tmp_path):
    _, packed_dir, _ = pair("gptq_mixtral_sym")
    bad = tmp_path / "bad"
    shutil.copytree(packed_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["kleidiai"]["layout_version"] = 2
    (bad / "config.json").write_text(json.dumps(cfg))
    r = int4pack.verify(bad, structural_only=True, raise_on_failure=False)
    assert not r["ok"] and "layout_version is 2" in _problems(r)


def test_inspect_shows_the_layout(pair):
    plain_dir, packed_dir, _ = pair("gptq_mixtral_sym")
    r = int4pack.inspect(packed_dir)
    sv = r["serve_format"]
    assert (sv["layout"], sv["layout_version"], sv["nr"], sv["kr"], sv["sr"], sv["group_size"]) == (
        "kleidiai-qsi4c32p/qsi4cxp", 1, 8, 16, 2, 32)
    assert sv["blobs"] == 32 and r["kleidiai_summary"] == {"kleidiai": 32, "fallback": 0}
    assert len(r["moe"]["layers"]) == 2 and r["moe"]["layers"][0]["experts"] == 4
    d = int4pack.inspect(packed_dir, BLOB[: -len(".weight_packed")])
    assert d["layout"] == "groupwise qsi4c32p" and d["tile"]["rows_per_block"] == 8
    assert [p["part"] for p in d["first_block"][:2]] == ["quant block 0: data", "quant block 0: 8 bf16 scales"]
    plain = load_raw(plain_dir)
    assert d["window"]["q"] == plain[BLOB.replace("weight_packed", "weight")][:8, :8].tolist()
    n = int4pack.inspect(packed_dir, "model.norm.weight")  # a tensor that is not a blob
    assert n["layout"].startswith("plain") and n["window"] == [plain["model.norm.weight"][:8].float().tolist()]
    res = CliRunner().invoke(app, ["inspect", str(packed_dir)])
    assert res.exit_code == 0 and "kleidiai-qsi4c32p/qsi4cxp v1" in res.output and "32 KleidiAI blobs" in res.output


def test_cli_serve_format(tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["convert", str(FIXTURES / "gptq_q3_sym"), str(tmp_path / "o"), "--serve-format",
                              "kleidiai"])
    assert res.exit_code == 0, res.output
    assert "serve format: kleidiai" in res.output
    assert json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]["quant_method"] == \
        "int4pack-kleidiai"
    res = runner.invoke(app, ["convert", str(FIXTURES / "gptq_q3_sym"), str(tmp_path / "p"), "--serve-format", "x"])
    assert res.exit_code == 2 and not (tmp_path / "p").exists()
    with pytest.raises(UsageError, match="--serve-format"):
        int4pack.convert(FIXTURES / "gptq_q3_sym", tmp_path / "q", serve_format="int8")


def test_dry_run_plans_the_blobs():
    plain = int4pack.convert(FIXTURES / "gptq_q3_sym", "unused", dry_run=True)
    packed = int4pack.convert(FIXTURES / "gptq_q3_sym", "unused", dry_run=True, serve_format="kleidiai")
    assert packed["plan"]["out_bytes"] < plain["plan"]["out_bytes"]
    assert packed["plan"]["tensors_out"] < plain["plan"]["tensors_out"]


def test_rows_not_in_whole_blocks_stay_plain_or_are_refused_for_experts():
    """A dense linear KleidiAI cannot pack stays plain W4A8 with its vLLM module's other parts; a
    routed expert is refused (the plugin's MoE method takes blobs only)."""
    from int4pack.sources.checkpoint import Checkpoint
    from int4pack.plan import make_plan

    with Checkpoint(FIXTURES / "gptq_q3_sym") as ckpt:
        plan = make_plan(ckpt)
    q = next(s for j in plan.jobs if j.kind == "linear" for s in j.specs if s.name.endswith("self_attn.q_proj"))
    q.n = 12
    out = blobs.packed_plan(plan)
    attn = q.name.rsplit(".", 1)[0]
    assert sorted(out.options[serve_spec.PLAIN_MODULES]) == [f"{attn}.{x}_proj" for x in "kqv"]
    assert "N=12 is not a multiple of 8" in out.options[serve_spec.PLAIN_MODULES][f"{attn}.k_proj"]
    names = {t.name for t in out.outputs}
    assert f"{attn}.k_proj.weight" in names and f"{attn}.k_proj.{serve_spec.SUFFIX}" not in names
    assert f"{attn}.o_proj.{serve_spec.SUFFIX}" in names and f"{attn}.o_proj.weight" not in names
    expert = next(s for j in plan.jobs if j.kind in ("linear", "fold") for s in j.specs if ".experts." in s.name)
    expert.n = 12
    with pytest.raises(RefusedError, match="N=12 is not a multiple of 8.*routed experts as KleidiAI blobs only"):
        blobs.packed_plan(plan)


def _qwen35_quantized_linear_attention(folder: Path) -> dict:
    """ct_qwen35moe_w4a16 with its linear-attention projections int4 too (as llm-compressor writes
    them when they are not in ``ignore``): in_proj_b and in_proj_a have N = 4 (the value heads).
    Returns {module: (q, scales)} of the ints written, from _synth's own quantiser."""
    import _synth

    src = FIXTURES / "ct_qwen35moe_w4a16"
    idx = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for shard in sorted(set(idx.values())):
        with safe_open(str(src / shard), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    la = "model.layers.0.linear_attn"
    ints = {}
    for proj in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
        t, q, sc = _synth.ct_pack_linear(f"{la}.{proj}", tensors.pop(f"{la}.{proj}.weight").float(), 32)
        tensors.update(t)
        ints[f"{la}.{proj}"] = (q, sc)
    folder.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "model.safetensors" for k in tensors}}))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = [m for m in cfg["quantization_config"]["ignore"] if ".linear_attn." not in m]
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    assert ints[f"{la}.in_proj_a"][0].shape == (4, 128)
    return ints


def test_qwen35_linear_attention_with_n_4_converts_packed(tmp_path):
    """The packed format decides per vLLM module: in_proj_b + in_proj_a (vLLM's fused in_proj_ba,
    N = 4 each) are written as plain W4A8, named in the plan, the layout record and inspect;
    every other W4A8 module, the experts included, is a blob of the source's ints."""
    ints = _qwen35_quantized_linear_attention(tmp_path / "src")
    rep = int4pack.convert(tmp_path / "src", tmp_path / "out", serve_format="kleidiai")
    la = "model.layers.0.linear_attn"
    assert sorted(rep["plan"][serve_spec.PLAIN_MODULES]) == [f"{la}.in_proj_a", f"{la}.in_proj_b"]
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    rec = cfg["quantization_config"]["kleidiai"]
    (why,) = rec[serve_spec.PLAIN_MODULES].values()
    assert list(rec[serve_spec.PLAIN_MODULES]) == [f"{la}.in_proj_ba"] and "N=4 is not a multiple of 8" in why
    assert f"{la}.in_proj_ba" not in rec[serve_spec.BLOB_CHECKS]["modules"]
    assert f"{la}.in_proj_qkvz" in rec[serve_spec.BLOB_CHECKS]["modules"]
    out = load_raw(tmp_path / "out")
    for proj in ("in_proj_b", "in_proj_a"):
        q, sc = ints[f"{la}.{proj}"]
        assert f"{la}.{proj}.{serve_spec.SUFFIX}" not in out
        assert out[f"{la}.{proj}.weight"].dtype == torch.int8 and torch.equal(out[f"{la}.{proj}.weight"].long(), q)
        assert torch.equal(out[f"{la}.{proj}.weight_scale"], sc)
    for proj in ("in_proj_qkv", "in_proj_z", "out_proj"):
        q, sc = ints[f"{la}.{proj}"]
        assert f"{la}.{proj}.weight" not in out
        assert torch.equal(out[f"{la}.{proj}.{serve_spec.SUFFIX}"], kleidiai.pack_reference(q.to(torch.int8), sc, None, 32))
    experts = [k for k in out if k.startswith("model.layers.") and ".mlp.experts." in k]
    assert experts and [k for k in experts if not k.endswith(serve_spec.SUFFIX)] == []
    v = int4pack.verify(tmp_path / "out", against=tmp_path / "src")
    assert v["ok"], v["verdict"]
    r = CliRunner().invoke(app, ["inspect", str(tmp_path / "out"), "--json"])
    assert r.exit_code == 0, r.output
    mods = json.loads(r.stdout)["modules"]
    assert mods[f"{la}.in_proj_a"]["format"] == "int-quantized" and not mods[f"{la}.in_proj_a"]["kleidiai"]
    assert "N=4 is not a multiple of 8" in mods[f"{la}.in_proj_a"]["kleidiai_reason"]
    assert mods[f"{la}.in_proj_z"]["kleidiai"]


def test_shard_headers_have_room_for_provenance(tmp_path):
    """A blob's header entry (long name, conversion stats, provenance of a bias-carrying module with
    6-digit shapes) fits the room packed shards reserve, which the plain reserve would not."""
    from int4pack.errors import OutputError
    from int4pack.plan import OutTensor
    from int4pack.output_folder.writer import ShardFile

    q = torch.zeros(8, 64, dtype=torch.int8)
    prov = serve_spec.provenance(q, torch.ones(8, 2, dtype=torch.bfloat16), torch.ones(8), 128)
    prov.update(n=151936, k=163840)
    names = [f"model.language_model.layers.{i // 384}.block_sparse_moe.experts.{i % 384}.w3.{serve_spec.SUFFIX}"
             for i in range(600)]
    results = {n: {"path": "requant", "rel_l2": "0.0123457", "max_abs": "0.000123457", "packed": prov} for n in names}
    for extra, ok in ((serve_spec.PROVENANCE_BYTES, True), (0, False)):
        f = ShardFile(tmp_path / f"s{extra}.safetensors", [OutTensor(n, "U8", (16,)) for n in names], {"format": "pt"},
                      extra)
        for n in names:
            f.write(n, torch.zeros(16, dtype=torch.uint8))
        if ok:
            f.finish(results)
            with safe_open(str(tmp_path / f"s{extra}.safetensors"), framework="pt") as fh:
                assert json.loads(fh.metadata()["int4pack.tensors"])[names[-1]]["packed"] == prov
        else:
            with pytest.raises(OutputError, match="grew past"):
                f.finish(results)


def test_two_schemes_packed(tmp_path):
    """Per-module schemes (DeepSeek-V3 synthetic: kv_b_proj channel, the rest group 32): each blob is
    packed at its module's group, recorded in its provenance, and verify checks it against the config
    group that names the module."""
    import _synth

    _synth.write_ct_deepseek_v3(tmp_path / "src")
    int4pack.convert(tmp_path / "src", tmp_path / "plain")
    rep = int4pack.convert(tmp_path / "src", tmp_path / "packed", serve_format="kleidiai")
    assert rep["serve_format"]["group_size"] is None and rep["serve_format"]["scale_dtype"] == "per module"
    plain, packed = load_raw(tmp_path / "plain"), load_raw(tmp_path / "packed")
    pw_groups = {}
    for m in _w4a8_modules(plain):
        q, s = plain[f"{m}.weight"], plain[f"{m}.weight_scale"]
        block = q.shape[1] if s.dtype == torch.float32 else q.shape[1] // s.shape[1]
        pw_groups[m] = -1 if s.dtype == torch.float32 else block
        assert torch.equal(packed[f"{m}.weight_packed"], kleidiai.pack_reference(q, s, None, block)), m
    assert set(pw_groups.values()) == {-1, 32}
    r = int4pack.verify(tmp_path / "packed", against=tmp_path / "src")
    assert r["ok"] and r["structural"]["counts"]["blobs"] == len(pw_groups)
    assert int4pack.inspect(tmp_path / "packed", "model.layers.1.self_attn.kv_b_proj")["layout"] == \
        "channelwise qsi4cxp"
    # the config names o_proj (group 32 in its blob) in the channel group first: verify says so
    cfg = json.loads((tmp_path / "packed" / "config.json").read_text())
    groups = cfg["quantization_config"]["config_groups"]
    chan = next(k for k, g in groups.items() if g["weights"]["strategy"] == "channel")
    groups[chan]["targets"].insert(0, "model.layers.0.self_attn.o_proj")
    (tmp_path / "packed" / "config.json").write_text(json.dumps(cfg))
    r = int4pack.verify(tmp_path / "packed", structural_only=True, raise_on_failure=False)
    assert "packed with group 32, but the config's group for the module is -1" in _problems(r), _problems(r)


def test_llama4_q_k_rows_in_vllms_rotary_order_verify_against_the_source(pair, tmp_path):
    """Llama-4's packed q_proj/k_proj blobs hold their rows in vLLM's rotary order, recorded in their
    provenance: verify compares the source's rows in that order and passes. The same output with the
    record dropped (the rows stay reordered) fails against the source: the order is checked, not assumed."""
    import shutil

    plain_dir, packed_dir, _ = pair("ct_llama4_w4a16")
    src = FIXTURES / "ct_llama4_w4a16"
    tc = json.loads((packed_dir / "config.json").read_text())["text_config"]
    m = "language_model.model.layers.1.self_attn.q_proj"
    plain = load_raw(plain_dir)
    h, (n, k) = tc["num_attention_heads"], plain[f"{m}.weight"].shape
    order = [hh * (n // h) + 2 * j + p for hh in range(h) for p in (0, 1) for j in range(n // h // 2)]
    want = kleidiai.pack_reference(plain[f"{m}.weight"][order], plain[f"{m}.weight_scale"][order], None, 32)
    assert torch.equal(load_raw(packed_dir)[f"{m}.weight_packed"], want)
    r = int4pack.verify(packed_dir, against=src, raise_on_failure=False)
    assert r["ok"], r["verdict"]
    bad = tmp_path / "bad"
    shutil.copytree(packed_dir, bad)

    def edit(tensors, meta):
        ent = json.loads(meta.get("int4pack.tensors") or "{}")
        if f"{m}.weight_packed" not in ent:
            return False
        assert ent[f"{m}.weight_packed"]["packed"].pop(serve_spec.ROTARY) == h
        meta["int4pack.tensors"] = json.dumps(ent)
        return True

    _edit(bad, edit)
    r = int4pack.verify(bad, against=src, raise_on_failure=False)
    # (the rewritten shard's checksum is a structural problem too; the rows are the numerical pass's)
    assert not r["ok"] and "out of tolerance" in r["verdict"] and m in r["verdict"], r["verdict"]


def test_laguna_per_head_attention_gate_stays_plain(converted):
    """Laguna's per-head attention gate g_proj (N = heads, 2 or 4 in the llm-compressor fixture) is
    not fused by vLLM but has no whole row block: plain W4A8, named; the rest packed, verify passes."""
    out, rep = converted("ct_laguna_w4a16", serve_format="kleidiai")
    rec = serve_spec.read_record(json.loads((out / "config.json").read_text())["quantization_config"])
    plain = rec[serve_spec.PLAIN_MODULES]
    assert plain and all(m.endswith(".self_attn.g_proj") for m in plain)
    assert all("row blocks for tensor parallel ranks" in why for why in plain.values())
    raw = load_raw(out)
    for m in plain:
        assert raw[f"{m}.weight"].dtype == torch.int8 and f"{m}.{serve_spec.SUFFIX}" not in raw
    assert any(k.endswith(f"self_attn.q_proj.{serve_spec.SUFFIX}") for k in raw)
    assert int4pack.verify(out, against=FIXTURES / "ct_laguna_w4a16")["ok"]
