"""Corrupted and forged checkpoints (tests/corrupt_corpus.py): each refused cleanly.

``verify --against SRC`` must fail every case with a clean error (exit 6, or 3 for an unreadable
input; never 0, never 1 = internal error, never a traceback); ``inspect`` must never end in an
internal error; the vLLM plugin's loaders (tested here without vLLM, the way vLLM calls them) must
refuse every same-size corruption of the blobs. Plus the resume and source-symlink rules.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

import int4pack
from _reference import FIXTURES
from corrupt_corpus import build, edit_tensors
from int4pack.serve_spec import SUFFIX, read_record
from int4pack.cli import app
from int4pack.errors import InputError, OutputError


GROUP = "ct_qwen3moe_w4a16"  # group 32; the experts' down_proj has K = 64 = 2 x 32
CHANNEL = "ct_qwen3moe_w4a16_channel"  # the same shapes, channelwise


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("trust")
    int4pack.convert(FIXTURES / GROUP, d / "packed", serve_format="kleidiai")
    int4pack.convert(FIXTURES / GROUP, d / "plain")
    int4pack.convert(FIXTURES / CHANNEL, d / "packed_channel", serve_format="kleidiai")
    sources = {"packed": d / "packed", "plain": d / "plain", "packed_channel": d / "packed_channel"}
    return sources, build(d / "cases", sources)


SOURCE = {"packed": GROUP, "plain": GROUP, "packed_channel": CHANNEL}
runner = CliRunner()


def _run(*args) -> tuple[int, str]:
    r = runner.invoke(app, list(args))
    text = r.output + (r.stderr if r.stderr_bytes is not None else "")
    return r.exit_code, text


def test_the_intact_conversions_pass(corpus):
    sources, _ = corpus
    for key, folder in sources.items():
        code, text = _run("verify", str(folder), "--against", str(FIXTURES / SOURCE[key]), "--layers", "0,")
        assert code == 0, text


CASE_NAMES = [
    *(f"packed_{n}" for n in (
        "flip_byte", "swap_experts", "swap_experts_consistent", "gate_up_swap", "other_layer", "k2g_as_channel",
        "k2g_as_channel_consistent", "prov_n_None", "prov_n_64", "prov_n_1_5", "prov_k_-3", "prov_group_size_96",
        "prov_bias_no", "prov_crc32_q_7", "prov_missing", "prov_not_json", "prov_group_doubled",
        "config_group_doubled", "config_channel", "record_group_size_64", "record_group_size_32",
        "record_scale_dtype_float32", "record_layout_version_99", "record_nr_4", "record_checks_edited",
        "record_checks_garbage", "forged_report")),
    *(f"plain_{n}" for n in ("flip_value", "swap_experts", "gate_up_swap", "other_layer", "config_group_doubled",
                             "forged_report", "scale_dtype", "planted_tensor")),
    *(f"{k}_negated_{w}" for k in ("packed", "plain") for w in ("router", "norm", "embedding", "lm_head",
                                                                  "final_norm")),
    "packed_shard_symlink_outside", "plain_shard_symlink_outside",
]


def test_the_corpus_is_what_the_test_lists(corpus):
    assert sorted(corpus[1]) == sorted(CASE_NAMES)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_verify_against_the_source_refuses(corpus, name):
    case = corpus[1][name]
    code, text = _run("verify", str(case.folder), "--against", str(FIXTURES / SOURCE[case.base]), "--layers", "0,")
    assert code not in (0, 1) and "Traceback" not in text and "internal error" not in text, (case.what, text)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_inspect_never_an_internal_error(corpus, name):
    case = corpus[1][name]
    code, text = _run("inspect", str(case.folder))
    assert code != 1 and "Traceback" not in text and "internal error" not in text, (case.what, text)


def test_forged_report_fails_on_the_source_bound(corpus):
    case = corpus[1]["packed_forged_report"]
    r = int4pack.verify(case.folder, FIXTURES / GROUP, layers="0,", raise_on_failure=False)
    msg = json.dumps(r["layers"])
    assert not r["ok"] and "from the source" in msg and "exceeds its budget" in msg


@pytest.mark.parametrize("kind", ["packed", "plain"])
def test_negated_router_named_as_a_copy(corpus, kind):
    case = corpus[1][f"{kind}_negated_router"]
    r = int4pack.verify(case.folder, FIXTURES / GROUP, layers="0,", raise_on_failure=False)
    assert [p["where"] for p in r["copies"]["problems"]] == ["model.layers.0.mlp.gate.weight"]


def test_without_source_verify_says_what_rests_on_the_report(corpus):
    sources, _ = corpus
    r = int4pack.verify(sources["packed"], layers="0,")
    notes = " ".join(r["trust"])
    assert "--against" in notes and "int4pack_report.json" in notes


def test_stale_crc32c_checksum_found_without_the_extension(corpus, tmp_path, monkeypatch):
    """A crc32c: shard digest is checked with the numpy engine when the extension is off."""
    sources, _ = corpus
    bad = tmp_path / "bad"
    shutil.copytree(sources["plain"], bad)
    rep = json.loads((bad / "int4pack_report.json").read_text())
    shard = sorted(rep["shards"])[0]
    digest = rep["shards"][shard]["data_digest"]
    if not digest.startswith("crc32c:"):  # written without the extension: make it a crc32c one
        from int4pack.output_folder.writer import hash_shard
        monkeypatch.delenv("INT4PACK_NO_EXT", raising=False)
        rep["shards"][shard]["data_digest"] = hash_shard(bad / shard, "crc32c:")["data_digest"]
        (bad / "int4pack_report.json").write_text(json.dumps(rep))
    edit_tensors(bad, lambda t, m: "model.norm.weight" in t and bool(t["model.norm.weight"].mul_(-1).numel()))
    monkeypatch.setenv("INT4PACK_NO_EXT", "1")
    r = int4pack.verify(bad, structural_only=True, raise_on_failure=False)
    assert not r["ok"] and "data checksum mismatch" in json.dumps(r["structural"]["problems"])


# --------------------------------------------------------------------------------- the plugin's loaders


def _load_like_vllm(folder: Path) -> None:
    """What vLLM does with a packed checkpoint, minus vLLM: one ExpertBlobs per MoE layer and one
    DenseBlobs per (fused) linear, each blob handed to its loader, then the after-loading checks."""
    from int4pack.architectures import VLLM_FUSED, classify, vllm_module
    from int4pack.vllm_plugin._layout import DenseBlobs, ExpertBlobs, blob_check

    cfg = json.loads((folder / "config.json").read_text())
    q = cfg["quantization_config"]
    rec = read_record(q)
    groups = q["config_groups"]
    vllm_group = {}
    for g in groups.values():  # one scheme for every target here (the fixtures' configs)
        w = g["weights"]
        gs = -1 if w.get("strategy") == "channel" else int(w["group_size"])
        vllm_group = gs
    blobs: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            blobs.update({k[: -len(SUFFIX) - 1]: fh.get_tensor(k) for k in fh.keys() if k.endswith(SUFFIX)})
    units: dict[str, list[str]] = {}
    for m in blobs:
        units.setdefault(vllm_module(m), []).append(m)
    n_exp = cfg.get("num_experts") or cfg["num_local_experts"]
    for unit, mods in sorted(units.items()):
        if classify(mods[0])[0] == "expert":
            down = next(m for m in mods if m.endswith("down_proj"))
            inter, hidden = cfg["moe_intermediate_size"], cfg["hidden_size"]
            eb = ExpertBlobs(n_exp, hidden, inter, vllm_group, check=blob_check(rec, unit, experts=n_exp))
            params = {w: eb.empty(w) for w in ("w13", "w2")}
            for m in mods:
                e, proj = int(m.split(".")[-2]), m.split(".")[-1]
                shard = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[proj]
                eb.load(torch.nn.Parameter(params["w2" if shard == "w2" else "w13"], requires_grad=False),
                        blobs[m], weight_name=unit, shard_id=shard, expert_id=e)
            assert down
            eb.check_bytes()
        else:
            leaf = unit.rsplit(".", 1)[-1]
            parts = list(VLLM_FUSED.get(leaf, (leaf,)))
            parent = unit.rsplit(".", 1)[0] if leaf in VLLM_FUSED else unit.rsplit(".", 1)[0]
            names = [f"{parent}.{p}" if leaf in VLLM_FUSED else unit for p in parts]
            sizes = [int(cfg["num_attention_heads"] if p == "q_proj" else cfg["num_key_value_heads"]) * cfg["head_dim"]
                     if p in ("q_proj", "k_proj", "v_proj") else None for p in parts]
            k = cfg["hidden_size"] if leaf in ("qkv_proj", "gate_up_proj") else None
            if None in sizes or k is None:
                continue  # o_proj and friends: the expert and qkv checks cover the loader here
            db = DenseBlobs(sizes, k, vllm_group, check=blob_check(rec, unit, parts=len(parts)))
            data = db.empty()
            for i, n in enumerate(names):
                db.load(torch.nn.Parameter(data, requires_grad=False), blobs[n], "qkv"[i])
            db.check_bytes()


def test_plugin_loaders_take_the_intact_checkpoints(corpus):
    sources, _ = corpus
    _load_like_vllm(sources["packed"])
    _load_like_vllm(sources["packed_channel"])


# the same-size corruptions of the blobs or of what the record says of them; the *_consistent and
# forged cases also rewrite the record's blob_checks, which only verify --against can see through
@pytest.mark.parametrize("name", ["packed_flip_byte", "packed_swap_experts", "packed_gate_up_swap",
                                  "packed_k2g_as_channel", "packed_record_checks_edited", "packed_config_channel",
                                  "packed_record_checks_garbage"])
@pytest.mark.parametrize("engine", ["library", "zlib"])
def test_plugin_loaders_refuse_same_size_corruptions(corpus, name, engine, monkeypatch):
    """With either CRC-32 engine: the C++ library's (the plugin takes it where it is built) or zlib's."""
    import zlib

    from int4pack.vllm_plugin import _blob_crc

    if engine == "zlib":
        monkeypatch.setattr(_blob_crc, "engine", lambda: zlib.crc32)
    else:
        assert _blob_crc.engine() is not zlib.crc32, "the C++ library is built by the install"
    case = corpus[1][name]
    with pytest.raises(ValueError) as ei:
        _load_like_vllm(case.folder)
    msg = str(ei.value)
    assert "int4pack-kleidiai" in msg and ("model.layers.0." in msg or "blob_checks" in msg), msg


def test_plugin_refuses_a_packed_checkpoint_whose_checks_were_deleted(corpus, tmp_path, monkeypatch):
    """Deleting blob_checks from config.json must not turn the byte check off: refused at load, unless
    the one opt-out that names the risk is set; a flipped byte then goes through (that is the risk)."""
    from int4pack.vllm_plugin import _layout

    for case in ("packed", "packed_flip_byte"):
        folder = tmp_path / case
        shutil.copytree(corpus[1][case].folder if case != "packed" else corpus[0]["packed"], folder)
        cfg = json.loads((folder / "config.json").read_text())
        del cfg["quantization_config"]["kleidiai"]["blob_checks"]
        (folder / "config.json").write_text(json.dumps(cfg))
        monkeypatch.delenv(_layout.ALLOW_UNCHECKED, raising=False)
        with pytest.raises(ValueError, match="records no blob_checks.*INT4PACK_ALLOW_UNCHECKED_BLOBS=1"):
            _load_like_vllm(folder)
        monkeypatch.setenv(_layout.ALLOW_UNCHECKED, "1")
        _load_like_vllm(folder)
    assert "INT4PACK_ALLOW_UNCHECKED_BLOBS=1" in (Path(__file__).parents[1] / "docs" / "serve-format.md").read_text()


def test_plugin_names_the_corrupted_tensor(corpus):
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight_packed"):
        _load_like_vllm(corpus[1]["packed_flip_byte"].folder)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.0\.down_proj\.weight_packed"):
        _load_like_vllm(corpus[1]["packed_k2g_as_channel"].folder)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.\*\.gate_proj\.weight_packed: "
                                         r"packed with group 32"):
        _load_like_vllm(corpus[1]["packed_config_channel"].folder)


# --------------------------------------------------------------------------------- resume and symlinks


def _interrupted(src: Path, out: Path, monkeypatch) -> Path:
    """A run stopped just before its output was swapped into place: every shard finished."""
    from int4pack.output_folder import writer

    def boom(self):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(writer.OutputDir, "commit", boom)
        with pytest.raises(KeyboardInterrupt):
            int4pack.convert(src, out, max_shard_size="200KB")
    return out.parent / f".{out.name}.int4pack-partial"


def test_resume_refuses_a_planted_shard_with_matching_checksums(tmp_path, monkeypatch):
    from int4pack.output_folder.writer import PROGRESS, hash_shard

    out = tmp_path / "out"
    work = _interrupted(FIXTURES / GROUP, out, monkeypatch)
    prog = json.loads((work / PROGRESS).read_text())
    victim = next(s for s in sorted(prog["shards"]) if _holds(work / s, "model.layers.0.mlp.gate.weight"))
    edit_tensors(work, lambda t, m: "model.layers.0.mlp.gate.weight" in t and bool(
        t["model.layers.0.mlp.gate.weight"].mul_(-1).numel()))
    (work / "model.safetensors.index.json").unlink(missing_ok=True)
    rec = prog["shards"][victim]
    rec.update(hash_shard(work / victim, rec["data_digest"]))
    (work / PROGRESS).write_text(json.dumps(prog))
    with pytest.raises(OutputError, match="kept from an interrupted run"):
        int4pack.convert(FIXTURES / GROUP, out, max_shard_size="200KB", resume=True)
    assert not out.exists() and not (work / victim).exists()
    int4pack.convert(FIXTURES / GROUP, out, max_shard_size="200KB", resume=True)
    int4pack.verify(out, FIXTURES / GROUP, layers="0,")


def test_resume_keeps_honest_shards(tmp_path, monkeypatch):
    out = tmp_path / "out"
    _interrupted(FIXTURES / GROUP, out, monkeypatch)
    rep = int4pack.convert(FIXTURES / GROUP, out, max_shard_size="200KB", resume=True)
    int4pack.verify(out, FIXTURES / GROUP, layers="0,")
    clean = tmp_path / "clean"
    int4pack.convert(FIXTURES / GROUP, clean, max_shard_size="200KB")
    for shard in rep["shards"]:
        assert (out / shard).read_bytes() == (clean / shard).read_bytes()


def _holds(p: Path, name: str) -> bool:
    with safe_open(str(p), "pt") as fh:
        return name in fh.keys()


def test_resume_refuses_a_symlinked_work_folder(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "progress.json").write_text("{}")
    os.symlink(elsewhere, tmp_path / ".out.int4pack-partial")
    code, text = _run("convert", str(FIXTURES / GROUP), str(tmp_path / "out"), "--resume")
    assert code == 5 and "symlink" in text and "Traceback" not in text
    assert sorted(p.name for p in elsewhere.iterdir()) == ["progress.json"]


def test_source_symlink_outside_the_folder_refused(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / GROUP, src)
    secret = tmp_path / "secret.json"
    secret.write_text('{"secret": 1}')
    os.symlink(secret, src / "tokenizer.json")
    code, text = _run("convert", str(src), str(tmp_path / "out"))
    assert code == 3 and "tokenizer.json" in text and "outside the model folder" in text
    assert not (tmp_path / "out").exists()


def test_hub_cache_links_into_its_blobs_are_followed(tmp_path):
    """A hub snapshot is made of symlinks into the repo's blobs/: exactly those are allowed."""
    repo = tmp_path / "hub" / "models--o--m"
    snap, blobs = repo / "snapshots" / "abc", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for p in sorted((FIXTURES / GROUP).iterdir()):
        shutil.copyfile(p, blobs / p.name)
        os.symlink(Path("../../blobs") / p.name, snap / p.name)
    int4pack.convert(snap, tmp_path / "out", dry_run=True)
    os.symlink(FIXTURES / GROUP / "config.json", snap / "extra.json")  # outside the repo
    with pytest.raises(InputError, match="extra.json"):
        int4pack.convert(snap, tmp_path / "out2")


def test_resume_refuses_a_work_folder_of_another_user(tmp_path, monkeypatch):
    work = tmp_path / ".out.int4pack-partial"
    work.mkdir()
    (work / "progress.json").write_text("{}")
    monkeypatch.setattr(os, "getuid", lambda: work.stat().st_uid + 1)  # this process runs as someone else
    with pytest.raises(OutputError, match="belongs to another user"):
        int4pack.convert(FIXTURES / GROUP, tmp_path / "out", resume=True)
    assert (work / "progress.json").read_text() == "{}"


# --------------------------------------------------------------------------------- a source that shrinks


_SHRINK = """
import os, sys
import int4pack
import int4pack.output_folder.writer
from int4pack.errors import Int4packError
src, out, fmt = sys.argv[1:4]
shards = sorted(p for p in os.listdir(src) if p.endswith(".safetensors"))
def shrink(name):  # the first expert is computed from the mapped shards; then they shrink
    if shards and ".experts." in name:
        for s in shards:
            p = os.path.join(src, s)
            os.truncate(p, os.path.getsize(p) // 2)
        shards.clear()
SF = int4pack.output_folder.writer.ShardFile
write, write_batch = SF.write, SF.write_batch
SF.write = lambda self, name, data: (shrink(name), write(self, name, data))[1]
SF.write_batch = lambda self, entries, *a: (shrink(entries[0][0]), write_batch(self, entries, *a))[1]
try:
    int4pack.convert(src, out, serve_format=fmt, threads=1)
except Int4packError as e:
    print(f"exit {e.exit_code}: {e}")
    sys.exit(e.exit_code)
"""


@pytest.mark.parametrize("fixture", ["gptq_q3_sym", GROUP, "awq_q3"])
@pytest.mark.parametrize("fmt", ["compressed-tensors", "kleidiai"])
def test_a_source_shard_truncated_mid_run_is_a_clean_error(tmp_path, fixture, fmt):
    """The shards are mapped; a mapped page past the end of a file that shrank is SIGBUS (exit 135,
    no message) unless every mapped read checks the size first."""
    import subprocess
    import sys

    if not (FIXTURES / fixture).is_dir():
        pytest.skip(f"no fixture {fixture}")
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / fixture, src)
    r = subprocess.run([sys.executable, "-c", _SHRINK, str(src), str(tmp_path / "out"), fmt],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr[-2000:])
    assert ".safetensors: truncated" in r.stdout and "Traceback" not in r.stderr, r.stdout
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------- missing tensors, other sources


@pytest.mark.parametrize("kind,victim", [("plain", "model.layers.0.mlp.experts.0.down_proj.weight"),
                                         ("packed", "model.layers.0.mlp.experts.0.down_proj.weight_packed"),
                                         ("packed", "model.layers.0.mlp.experts.1.gate_proj.weight_packed")])
@pytest.mark.parametrize("against", [False, True])
def test_a_removed_tensor_is_named_not_an_internal_error(corpus, tmp_path, kind, victim, against):
    from corrupt_corpus import reseal

    f = tmp_path / kind
    shutil.copytree(corpus[0][kind], f)
    edit_tensors(f, lambda t, m: victim in t and t.pop(victim) is not None)
    reseal(f)
    args = ["verify", str(f), "--layers", "0,"] + (["--against", str(FIXTURES / GROUP)] if against else [])
    for extra in ([], ["--json"]):
        code, text = _run(*args, *extra)
        assert code == 6 and "internal error" not in text and "Traceback" not in text, text
        expert = victim.rsplit(".", 2)[0]  # model.layers.0.mlp.experts.N
        assert expert in text, text


def test_verify_against_another_model_says_so(corpus):
    other = FIXTURES / "gptq_q3_sym"  # a Qwen3-MoE of other sizes
    for extra in ([], ["--json"]):
        code, text = _run("verify", str(corpus[0]["plain"]), "--against", str(other), "--layers", "0,", *extra)
        assert code == 6 and "internal error" not in text, text
        assert "is not the checkpoint this output was converted from" in text and "hidden_size" in text, text


@pytest.mark.parametrize("fmt", ["compressed-tensors", "kleidiai"])
def test_a_dense_bf16_output_verifies_against_its_source(tmp_path, fmt):
    """verify plans the source with the --dense the output records, not the default."""
    out = tmp_path / "out"
    int4pack.convert(FIXTURES / GROUP, out, dense="bf16", serve_format=fmt)
    code, text = _run("verify", str(out), "--against", str(FIXTURES / GROUP))
    assert code == 0, text
    rep = int4pack.verify(out, FIXTURES / GROUP, layers="0,")
    assert rep["copies"]["ok"] and rep["copies"]["checked"] > 0


# --------------------------------------------------------------------------------- NaN, infinity, absurd values

ROUTER = "model.layers.0.mlp.gate.weight"
SCALE0 = "model.layers.0.mlp.experts.0.gate_proj.weight_scale"


def _source_with(tmp_path, edit) -> Path:
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / GROUP, src)
    edit_tensors(src, edit)
    return src


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_convert_names_a_non_finite_copied_tensor(tmp_path, value):
    src = _source_with(tmp_path, lambda t, m: ROUTER in t and t[ROUTER].view(-1).__setitem__(5, value) is None)
    for fmt in ("compressed-tensors", "kleidiai"):
        code, text = _run("convert", str(src), str(tmp_path / fmt), "--serve-format", fmt)
        assert code == 3 and ROUTER in text and "NaN or infinite" in text and "Traceback" not in text, text
        assert not (tmp_path / fmt).exists()


def test_convert_names_an_absurd_source_scale(tmp_path):
    src = _source_with(tmp_path, lambda t, m: SCALE0 in t and t[SCALE0].view(-1).__setitem__(3, 3e38) is None)
    for fmt in ("compressed-tensors", "kleidiai"):
        code, text = _run("convert", str(src), str(tmp_path / fmt), "--serve-format", fmt)
        assert code == 3 and SCALE0 in text and "above 65536" in text and "Traceback" not in text, text
        assert not (tmp_path / fmt).exists()


def _flip_scale_exponent(t, meta) -> bool:
    if SCALE0 not in t:
        return False
    bits = t[SCALE0].view(torch.int16).view(-1)
    bits[3] ^= 0x4000  # the top exponent bit of a bf16 scale of ~0.01: ~2.7e36
    return True


def test_a_flipped_scale_exponent_fails_verify_without_a_report(corpus, tmp_path):
    f = tmp_path / "plain"
    shutil.copytree(corpus[0]["plain"], f)
    edit_tensors(f, _flip_scale_exponent)
    (f / "int4pack_report.json").unlink()
    rep = int4pack.verify(f, layers="0,", raise_on_failure=False)
    assert not rep["ok"] and "PASS" not in rep["verdict"]
    assert any(p["where"] == SCALE0[: -len(".weight_scale")] and "above 65536" in p["message"]
               for p in rep["structural"]["problems"]), rep["structural"]["problems"]


def test_a_non_finite_figure_never_passes(corpus, tmp_path):
    """A NaN router copied into the output (and into the source it is checked against): the layer's
    figures are NaN or infinite, which must fail, never print PASS ... rel_l2 inf."""
    from int4pack.output_folder.writer import tensor_crc

    nan_router = lambda t, m: ROUTER in t and t[ROUTER].view(-1).__setitem__(0, float("nan")) is None

    def resealed_nan_router(t, meta):  # and its header CRC rewritten: the structural pass lets it by
        if not nan_router(t, meta):
            return False
        ents = json.loads(meta["int4pack.tensors"])
        kind = next(k for k in ("crc32c", "crc32") if k in ents[ROUTER])
        ents[ROUTER][kind] = f"{tensor_crc(t[ROUTER], kind):08x}"
        meta["int4pack.tensors"] = json.dumps(ents, sort_keys=True, separators=(",", ":"))
        return True

    src = _source_with(tmp_path, nan_router)
    for kind in ("plain", "packed"):
        f = tmp_path / kind
        shutil.copytree(corpus[0][kind], f)
        edit_tensors(f, resealed_nan_router)
        (f / "int4pack_report.json").unlink()
        for against in (None, src):
            rep = int4pack.verify(f, against, layers="0,", raise_on_failure=False)
            assert not rep["ok"] and rep["verdict"].startswith("FAIL"), (kind, against, rep["verdict"])
            layer = next(L for L in rep["layers"] if L["layer"] == "model.layers.0.mlp")
            assert any("non-finite" in p for p in layer["problems"]), layer["problems"]


# --------------------------------------------------------------------------------- lossless ints, exactly


LOSSLESS_CASES = [  # (fixture, module): an expert's projections, a dense linear, a folded act-order down
    (GROUP, "model.layers.0.mlp.experts.2.up_proj"),
    (GROUP, "model.layers.0.self_attn.o_proj"),
    (CHANNEL, "model.layers.0.mlp.experts.1.down_proj"),
    ("gptq_q3_sym", "model.layers.1.mlp.experts.3.gate_proj"),
    ("gptq_q3_descact", "model.layers.0.mlp.experts.0.down_proj"),
]


@pytest.mark.parametrize("fmt", ["compressed-tensors", "kleidiai"])
@pytest.mark.parametrize("fixture,module", LOSSLESS_CASES)
def test_one_changed_int_of_a_lossless_module_fails_verify_against(tmp_path, fmt, fixture, module):
    """With no report to tighten the budget, the float error of one changed int is far inside the
    lossless budget (2^-8): only comparing the ints with the source's finds it."""
    from corrupt_corpus import _sync_checks, one_int

    out = tmp_path / "out"
    int4pack.convert(FIXTURES / fixture, out, serve_format=fmt)
    rep = int4pack.verify(out, FIXTURES / fixture, layers=f"{module.split('.')[2]},")
    assert rep["ok"], rep["verdict"]
    packed = fmt == "kleidiai"
    edit_tensors(out, one_int(f"{module}.{SUFFIX}" if packed else f"{module}.weight", packed))
    if packed:
        _sync_checks(out)
    (out / "int4pack_report.json").unlink()
    rep = int4pack.verify(out, FIXTURES / fixture, layers=f"{module.split('.')[2]},", raise_on_failure=False)
    assert not rep["ok"], rep["verdict"]
    found = [p for r in rep["layers"] + rep["dense"] for p in r["problems"]]
    assert any(f"{module}: lossless from the source, but 1 int4 value(s) differ" in p for p in found), found


def test_a_changed_scale_of_a_lossless_module_fails_verify_against(corpus, tmp_path):
    """A scale 16x off (one low exponent bit) in a lossless module: its scales must equal the source's cast."""
    f = tmp_path / "plain"
    shutil.copytree(corpus[0]["plain"], f)

    def edit(t, meta):
        if SCALE0 not in t:
            return False
        t[SCALE0].view(torch.int16).view(-1)[3] ^= 0x0200  # the exponent's 3rd bit: x16 or /16
        return True
    edit_tensors(f, edit)
    (f / "int4pack_report.json").unlink()
    rep = int4pack.verify(f, FIXTURES / GROUP, layers="0,", raise_on_failure=False)
    found = [p for r in rep["layers"] for p in r["problems"]]
    assert not rep["ok"] and any("1 scale(s) differ from the source's" in p for p in found), found


@pytest.mark.parametrize("kind", ["plain", "packed"])
@pytest.mark.parametrize("report", ["deleted", "resealed"])
def test_a_copied_tensor_changed_in_place_fails_plain_verify(corpus, tmp_path, kind, report):
    """Copied tensors carry a CRC of their own in their shard header: a negated router fails
    verify without --against, with the report gone or its shard checksums recomputed."""
    from corrupt_corpus import reseal

    f = tmp_path / kind
    shutil.copytree(corpus[0][kind], f)
    edit_tensors(f, lambda t, m: ROUTER in t and bool(t[ROUTER].mul_(-1).numel()))
    if report == "deleted":
        (f / "int4pack_report.json").unlink()
    else:
        reseal(f)
    rep = int4pack.verify(f, layers="0,", raise_on_failure=False)
    assert not rep["ok"], rep["verdict"]
    assert any(p["where"] == ROUTER and "changed after convert" in p["message"]
               for p in rep["structural"]["problems"]), rep["structural"]["problems"]
