"""--resume of a run interrupted after its last shard takes the plan from the record that run wrote
(output_folder/plan_record.py): while every source file is as it was, no source header or tensor
is read again, and the output is byte-identical to a fresh run's; a source changed in between is
planned again, and its output is the changed source's."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import int4pack
from int4pack.output_folder import workdir, writer
from int4pack.sources.checkpoint import Checkpoint
from _reference import FIXTURES
from _reliability import ROOT, _env, _same_files, stop_after_jobs

conv = importlib.import_module("int4pack.convert")
SYM = FIXTURES / "gptq_q3_sym"


def _interrupted(src: Path, out: Path, monkeypatch, where: str, **kw) -> None:
    """A run stopped after its last shard: before it writes the index (``shards``, as a kill there
    leaves it), or just before the rename into OUT (``commit``)."""
    with monkeypatch.context() as m:
        if where == "shards":
            real = conv._write_shards

            def stop(*a, **k):
                real(*a, **k)
                raise KeyboardInterrupt
            m.setattr(conv, "_write_shards", stop)
        else:
            def cut(self):
                raise KeyboardInterrupt
            m.setattr(writer.OutputDir, "commit", cut)
        with pytest.raises(KeyboardInterrupt):
            int4pack.convert(src, out, **kw)
    assert (writer.partial_folder(out) / workdir.PLAN_RECORD).is_file()


def _source_reads(monkeypatch) -> Counter:
    """Counts of the source's opening, header reads and tensor reads (a GPTQ g_idx, zero points...)."""
    counts: Counter = Counter()
    for name in ("__init__", "_add_shard", "read_bytes", "read_into", "raw", "view"):
        orig = getattr(Checkpoint, name)

        def spy(self, *a, _orig=orig, _name=name, **k):
            counts[_name] += 1
            return _orig(self, *a, **k)
        monkeypatch.setattr(Checkpoint, name, spy)
    return counts


@pytest.mark.parametrize("fixture,fmt,where", [
    ("gptq_q3_descact", "compressed-tensors", "shards"),  # act-order: the plan reads every g_idx
    ("gptq_q3_sym", "kleidiai", "commit"),
    ("gptq_q3_sym", "kleidiai", "shards"),
    ("ct_qwen3moe_w4a16", "compressed-tensors", "commit"),
])
def test_a_resume_after_the_last_shard_reads_nothing_of_the_source(tmp_path, monkeypatch, fixture, fmt, where):
    kw = dict(max_shard_size="200KB", serve_format=fmt)
    ref = tmp_path / "ref"
    int4pack.convert(FIXTURES / fixture, ref, **kw)
    out = tmp_path / "out"
    _interrupted(FIXTURES / fixture, out, monkeypatch, where, **kw)
    reads = _source_reads(monkeypatch)
    r = int4pack.convert(FIXTURES / fixture, out, resume=True, **kw)
    assert r["resume"]["plan_reused"] is True
    assert r["resume"]["kept_shards"] == sorted(p.name for p in ref.glob("*.safetensors"))
    assert dict(reads) == {}, "the source was read again"
    assert _same_files(out, ref)
    assert not (out / workdir.PLAN_RECORD).exists()


def test_a_resume_that_reuses_the_plan_imports_neither_torch_nor_numpy(tmp_path, monkeypatch):
    out = tmp_path / "out"
    _interrupted(SYM, out, monkeypatch, "shards", serve_format="kleidiai")
    code = ("import sys, int4pack; r = int4pack.convert(sys.argv[1], sys.argv[2], resume=True, "
            "serve_format='kleidiai'); print(r['resume']['plan_reused'], [m for m in ('torch', 'numpy') "
            "if m in sys.modules])")
    res = subprocess.run([sys.executable, "-c", code, str(SYM), str(out)], capture_output=True, text=True,
                         env=_env(), cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["True", "[]"], res.stdout


def _edit_a_tensor_in_place(src: Path) -> None:
    """One bf16 value of a copied tensor (a norm) changed in its shard, the shard's mtime put back."""
    with Checkpoint(src) as ck:
        name = next(n for n, t in sorted(ck.tensors.items()) if n.endswith("norm.weight") and t.dtype == "BF16")
        t = ck.tensors[name]
    path = src / t.file
    st = path.stat()
    with open(path, "r+b") as fh:
        fh.seek(t.begin)
        lo = fh.read(1)
        fh.seek(t.begin)
        fh.write(bytes([lo[0] ^ 1]))  # the lowest mantissa bit: a finite value stays finite
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_mtime_ns == st.st_mtime_ns and path.stat().st_size == st.st_size


def _replace_a_shard_by_a_copy(src: Path) -> None:
    shard = sorted(src.glob("*.safetensors"))[0]
    shutil.copy2(shard, shard.with_name("copy"))
    os.replace(shard.with_name("copy"), shard)  # the same bytes and mtime, another inode


def _rewrite_config_unchanged(src: Path) -> None:
    p = src / "config.json"
    p.write_bytes(p.read_bytes())


def _add_a_file(src: Path) -> None:
    (src / "generation_config.json").write_text('{"do_sample": true}\n')


def _forge_the_recorded_header(src: Path, work: Path) -> None:
    """The record says another header: as if a shard's header had changed behind the same stat."""
    p = work / workdir.PLAN_RECORD
    rec = json.loads(p.read_text())
    ent = next(e for e in rec["source"] if e[0].endswith(".safetensors"))
    ent[-1] = "0" * 64
    p.write_text(json.dumps(rec))


@pytest.mark.parametrize("change", [_edit_a_tensor_in_place, _replace_a_shard_by_a_copy, _rewrite_config_unchanged,
                                    _add_a_file, _forge_the_recorded_header])
def test_a_source_changed_between_runs_is_planned_again(tmp_path, monkeypatch, change):
    src = tmp_path / "src"
    shutil.copytree(SYM, src)
    out = tmp_path / "out"
    _interrupted(src, out, monkeypatch, "shards", max_shard_size="200KB")
    if change is _forge_the_recorded_header:
        change(src, writer.partial_folder(out))
    else:
        change(src)
    reads = _source_reads(monkeypatch)
    r = int4pack.convert(src, out, resume=True, max_shard_size="200KB")
    assert r["resume"]["plan_reused"] is False
    assert reads["_add_shard"] > 0
    monkeypatch.undo()
    ref = tmp_path / "ref"
    int4pack.convert(src, ref, max_shard_size="200KB")  # the source as it is now
    assert _same_files(out, ref)
    if change is _edit_a_tensor_in_place:
        old = tmp_path / "old"
        int4pack.convert(SYM, old, max_shard_size="200KB")
        assert not _same_files(out, old)


def test_a_resume_with_shards_left_plans_the_source_and_keeps_the_record(tmp_path, monkeypatch):
    """Shards left to write: their jobs read the source, so it is planned; the record stays, and a
    second interruption, after the last shard, then resumes without planning."""
    out = tmp_path / "out"
    kw = dict(max_shard_size="100KB", threads=1)
    ref = tmp_path / "ref"
    int4pack.convert(SYM, ref, **kw)
    with monkeypatch.context() as m:
        stop_after_jobs(m, 30)  # past the first shards, before the last
        with pytest.raises(KeyboardInterrupt):
            int4pack.convert(SYM, out, **kw)
    work = writer.partial_folder(out)
    done = json.loads((work / workdir.PROGRESS).read_text())["shards"]
    assert 0 < len(done) < len(list(ref.glob("*.safetensors")))
    reads = _source_reads(monkeypatch)
    _interrupted(SYM, out, monkeypatch, "shards", resume=True, **kw)
    assert reads["_add_shard"] > 0  # planned: the rest of the jobs read the source
    monkeypatch.undo()
    reads = _source_reads(monkeypatch)
    r = int4pack.convert(SYM, out, resume=True, **kw)
    assert r["resume"]["plan_reused"] is True and dict(reads) == {}
    assert _same_files(out, ref)


def test_the_cli_says_the_plan_was_taken_from_the_interrupted_run(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from int4pack.cli import app

    out = tmp_path / "out"
    _interrupted(SYM, out, monkeypatch, "commit")
    r = CliRunner().invoke(app, ["convert", str(SYM), str(out), "--resume"])
    assert r.exit_code == 0, r.output
    assert "nothing left but the index, config and report; the plan is the interrupted run's (the source is as" in \
        " ".join(r.output.split())
