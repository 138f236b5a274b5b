"""Interrupted runs: a SIGKILL then --resume is byte-identical, unrecorded shards are not trusted,
and released tensors keep no pages mapped."""

from __future__ import annotations

import importlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import int4pack
from int4pack.output_folder import workdir, writer
from int4pack.errors import Int4packError, OutputError
from int4pack.sources.checkpoint import Checkpoint
from int4pack.plan import make_plan
from _reference import FIXTURES

from _reliability import (ROOT, _cli, _env, _same_files, _spy_shard_writes, stop_after_jobs, tree_hash)


# --------------------------------------------------------------------------- SIGKILL and --resume

def _finished(work: Path) -> list[str]:
    try:
        return sorted(json.loads((work / writer.PROGRESS).read_text())["shards"])
    except (OSError, ValueError, KeyError):
        return []


def _kill_at(proc: subprocess.Popen, work: Path, shards_done: int, extra_s: float, limit_s: float = 300) -> bool:
    """SIGKILL once ``shards_done`` shards are recorded finished (plus a random extra delay).
    Returns True if the kill landed before the run completed."""
    t0 = time.monotonic()
    while proc.poll() is None and time.monotonic() - t0 < limit_s:
        if work.is_dir() and len(_finished(work)) >= shards_done:
            time.sleep(extra_s)
            break
        time.sleep(0.005)
    if proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return True


def test_sigkill_then_resume_is_byte_identical(tmp_path, monkeypatch):
    """Several runs killed at random points (parallel, a slowed writer so kills land mid-run); each is
    resumed; a finished shard is corrupted in the work folder before some resumes and must be rewritten."""
    src = FIXTURES / "gptq_q3_asym"  # requant path: real compute between writes
    args = ["--max-shard-size", "100KB"]
    ref = tmp_path / "ref"
    int4pack.convert(src, ref, max_shard_size="100KB")
    n_shards = len(list(ref.glob("*.safetensors")))
    assert n_shards >= 8
    h = tree_hash(src)
    rng = random.Random(6)
    trials = [(rng.randrange(0, n_shards - 1), rng.uniform(0, 0.12)) for _ in range(6)]
    env = {"INT4PACK_TEST_SLOW_WRITE_MS": "15"}
    outs = [tmp_path / f"t{i}" / "out" for i in range(len(trials))]
    for o in outs:
        o.parent.mkdir()
    procs = [subprocess.Popen([sys.executable, "-m", "int4pack", "convert", str(src), str(o), *args, "-q"],
                              env=_env(env), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for o in outs]
    with ThreadPoolExecutor(max_workers=len(procs)) as pool:
        killed = list(pool.map(lambda a: _kill_at(*a), [
            (p, o.parent / ".out.int4pack-partial", k, x) for p, o, (k, x) in zip(procs, outs, trials)]))
    for p in procs:
        p.stderr.close()

    figures = []
    for i, (o, was_killed) in enumerate(zip(outs, killed)):
        work = o.parent / ".out.int4pack-partial"
        if not was_killed:
            figures.append((i, "completed before the kill", _same_files(o, ref)))
            continue
        assert not o.exists(), "a killed run left an OUT"
        done = _finished(work)
        corrupted = None
        if i % 2 == 0 and done:  # flip one data byte of a finished shard: it must not be trusted
            corrupted = done[len(done) // 2]
            blob = bytearray((work / corrupted).read_bytes())
            blob[-1] ^= 0xFF
            (work / corrupted).write_bytes(bytes(blob))
        if i == 1:  # one resume through the real CLI
            r = _cli(["convert", str(src), str(o), *args, "--resume", "-q"])
            assert r.returncode == 0, r.stderr
            rewritten = None
        else:
            with monkeypatch.context() as m:
                rewritten = _spy_shard_writes(m)
                int4pack.convert(src, o, max_shard_size="100KB", resume=True)
        same = _same_files(o, ref)
        if rewritten is not None:
            kept = set(done) - {corrupted}
            assert kept.isdisjoint(rewritten), f"trial {i}: verified shards were rewritten"
            if corrupted:
                assert corrupted in rewritten, f"trial {i}: the corrupted shard {corrupted} was trusted"
        figures.append((i, f"killed after {len(done)}/{n_shards} shards" + (
            f", {corrupted} corrupted" if corrupted else ""), same))
    assert tree_hash(src) == h
    interrupted = [f for f in figures if f[1].startswith("killed")]
    print(f"\nresume: {sum(f[2] for f in interrupted)}/{len(interrupted)} interrupted runs resumed "
          f"byte-identically; " + "; ".join(f"#{i} {what}" for i, what, _ in figures))
    assert all(same for _, _, same in figures), figures
    assert len(interrupted) >= 4, f"too few kills landed mid-run: {figures}"


def test_partial_shard_and_unrecorded_shard_are_not_trusted(tmp_path, monkeypatch):
    """A leftover .tmp shard and a finished-looking shard missing from progress.json are both redone
    (and an honest recorded one, beside them, is kept)."""
    src = FIXTURES / "gptq_q3_sym"
    ref = tmp_path / "ref"
    int4pack.convert(src, ref, max_shard_size="200KB")
    names = sorted(p.name for p in ref.glob("*.safetensors"))
    out = tmp_path / "out"
    work = tmp_path / ".out.int4pack-partial"
    work.mkdir()
    # a plausible-looking state: progress with the right fingerprint but no finished shards, a
    # truncated copy of shard 1 under its final name and a half shard 2 as .tmp
    with Checkpoint(src) as ck:
        plan = make_plan(ck)
        fp = importlib.import_module("int4pack.convert").work_fingerprint(plan, ck, 200_000, False)
    (work / writer.PROGRESS).write_text(json.dumps({"fingerprint": fp, "shards": {}, "jobs": {}}))
    (work / names[0]).write_bytes((ref / names[0]).read_bytes()[:-10])
    (work / (names[1] + ".tmp")).write_bytes((ref / names[1]).read_bytes()[:5000])
    # and a shard recorded with checksums that no longer match its bytes
    data = (ref / names[2]).read_bytes()
    (work / names[2]).write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    rec = writer.hash_shard(ref / names[2])
    prog = json.loads((work / writer.PROGRESS).read_text())
    prog["shards"][names[2]] = rec
    shutil.copyfile(ref / names[3], work / names[3])
    prog["shards"][names[3]] = writer.hash_shard(ref / names[3])
    (work / writer.PROGRESS).write_text(json.dumps(prog))
    rewritten = _spy_shard_writes(monkeypatch)
    int4pack.convert(src, out, max_shard_size="200KB", resume=True)
    assert _same_files(out, ref)
    assert set(names[:3]) <= set(rewritten) and names[3] not in rewritten


def _mapped_pages(m, lo: int, hi: int) -> int:
    """How many pages of bytes [lo, hi) of mmap m are mapped in this process (/proc/self/pagemap)."""
    import ctypes
    import struct

    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    first, last = (base + lo) // 4096, (base + hi - 1) // 4096
    with open("/proc/self/pagemap", "rb") as pm:
        pm.seek(first * 8)
        data = pm.read((last - first + 1) * 8)
    return sum(struct.unpack_from("<Q", data, 8 * i)[0] >> 63 for i in range(last - first + 1))


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="needs Linux /proc/self/pagemap")
def test_released_tensors_keep_no_pages_mapped(tmp_path):
    """view() then release() of neighbouring tensors in file order, as convert's workers read them:
    mapping a tensor maps the resident pages of the 64 KB blocks around it (fault-around), so a
    released neighbour's pages came back and stayed (the RSS grew with the model's size). None of
    the released tensors may keep a page mapped."""
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text("{}")
    names = [f"t{i:03d}" for i in range(48)]
    save_file({n: torch.full((5000,), i, dtype=torch.int32) for i, n in enumerate(names)},  # 20000 B each
              str(tmp_path / "model.safetensors"))
    with Checkpoint(tmp_path) as ck:
        for i, n in enumerate(names):
            assert int(ck.view(n).sum()) == 5000 * i
            ck.release(n)
        m = ck._maps["model.safetensors"]
        first, last = ck.info(names[0]), ck.info(names[-1])
        assert _mapped_pages(m, first.begin, last.end) == 0


# --------------------------------------------------------------------------- the work folder's windows

SMALL = FIXTURES / "ct_qwen3moe_w4a16"


@pytest.fixture(scope="module")
def clean_small(tmp_path_factory) -> Path:
    ref = tmp_path_factory.mktemp("clean") / "out"
    int4pack.convert(SMALL, ref, max_shard_size="200KB")
    return ref


def _early_states(work: Path) -> list:
    """What a run killed between making its work folder and its first progress.json rename leaves."""
    return [
        lambda: None,  # just made
        lambda: (work / writer.LOCK).write_text(""),  # locked, no id yet
        lambda: ((work / writer.LOCK).write_text("123\n"), (work / (writer.MARKER + ".tmp")).write_text("{")),
        lambda: ((work / writer.LOCK).write_text("123\n"), (work / writer.MARKER).write_text("{}"),
                 (work / (writer.PROGRESS + ".tmp")).write_text('{"finger')),
    ]


@pytest.mark.parametrize("how", ["--resume", "plain", "--overwrite"])
def test_a_run_killed_before_its_first_progress_is_taken_up(tmp_path, clean_small, how):
    out = tmp_path / "out"
    work = writer.partial_folder(out)
    for i, state in enumerate(_early_states(work)):
        work.mkdir()
        state()
        int4pack.convert(SMALL, out, max_shard_size="200KB", resume=how == "--resume", overwrite=how == "--overwrite")
        assert _same_files(out, clean_small), (how, i)
        assert not work.exists()
        assert not any((out / n).exists() for n in (writer.LOCK, writer.MARKER, writer.PROGRESS))
        shutil.rmtree(out)


def _commit_cut_at(step: int, monkeypatch) -> None:
    """commit() stopped (as by SIGKILL) just before its ``step``-th change of the file system."""
    calls = {"n": 0}

    def cut(fn):
        def go(*a, **k):
            calls["n"] += 1
            if calls["n"] == step:
                raise KeyboardInterrupt
            return fn(*a, **k)
        return go

    for name in ("replace", "unlink", "rename"):
        monkeypatch.setattr(workdir.os, name, cut(getattr(os, name)))
    monkeypatch.setattr(workdir.shutil, "rmtree", cut(shutil.rmtree))


@pytest.mark.parametrize("first", ["new", "--overwrite"])
@pytest.mark.parametrize("step", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("how", ["--resume", "plain", "--overwrite"])
def test_a_run_killed_inside_commit_is_resumed_or_whole(tmp_path, clean_small, monkeypatch, first, step, how):
    """A run (into a new OUT, or --overwrite of one) cut at each step of its commit (OUT aside, the
    work folder in, its work files out): the next run of each kind ends with the whole output and no
    work files, never 'not ours'; one without --overwrite may only refuse an OUT that is whole."""
    out = tmp_path / "out"
    if first == "--overwrite":
        int4pack.convert(SMALL, out, max_shard_size="200KB")
    with monkeypatch.context() as m:
        real = writer.OutputDir.commit

        def commit(self):
            with monkeypatch.context() as mm:
                _commit_cut_at(step, mm)
                real(self)
        m.setattr(writer.OutputDir, "commit", commit)
        try:
            int4pack.convert(SMALL, out, max_shard_size="200KB", overwrite=first == "--overwrite")
            cut = False
        except KeyboardInterrupt:
            cut = True
    work = writer.partial_folder(out)
    assert out.is_dir() or work.is_dir()
    overwrite = how == "--overwrite" or first == "--overwrite"
    try:
        int4pack.convert(SMALL, out, max_shard_size="200KB", resume=how == "--resume", overwrite=overwrite)
    except Int4packError as e:
        assert not overwrite and "already exists" in str(e), (step, how, e)
    assert _same_files(out, clean_small), (step, how)
    assert not any((out / n).exists() for n in (writer.LOCK, writer.MARKER, writer.PROGRESS))
    assert cut or step > 3


def test_a_dangling_symlink_out_is_refused_before_the_work(tmp_path):
    out = tmp_path / "out"
    os.symlink(tmp_path / "nowhere", out)
    called = []
    with pytest.raises(OutputError, match="symlink.*does not exist"):
        int4pack.convert(SMALL, out, on_plan=called.append)
    assert not called and not writer.partial_folder(out).exists() and out.is_symlink()


@pytest.mark.parametrize("resume", [False, True])
def test_one_writer_per_output(tmp_path, resume):
    """A second run into the OUT a first is writing is refused, naming the first's process, and
    leaves the first's work folder as it was."""
    out = tmp_path / "out"
    with Checkpoint(SMALL) as ck:
        fp = make_plan(ck).fingerprint(ck)
    first = writer.OutputDir.open(out, SMALL, fp, overwrite=False, resume=False)
    (first.work / "model.safetensors").write_bytes(b"half written")
    before = sorted(p.name for p in first.work.iterdir())
    try:
        with pytest.raises(OutputError, match=f"another int4pack run \\(process {os.getpid()}\\)"):
            int4pack.convert(SMALL, out, resume=resume)
        assert sorted(p.name for p in first.work.iterdir()) == before
        assert (first.work / "model.safetensors").read_bytes() == b"half written"
        r = _cli(["convert", str(SMALL), str(out)])
        assert r.returncode == 5 and f"process {os.getpid()}" in r.stderr and "Traceback" not in r.stderr, r.stderr
    finally:
        first.release()
    int4pack.convert(SMALL, out, resume=resume)  # the lock is gone with its holder
    assert not writer.partial_folder(out).exists()


# --------------------------------------------------------------------------- what --resume does not redo

def _stopped_at_commit(src: Path, out: Path, monkeypatch, **kw) -> Path:
    """A run stopped just before its output was swapped into place: every shard finished."""
    def stop(self):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(writer.OutputDir, "commit", stop)
        with pytest.raises(KeyboardInterrupt):
            int4pack.convert(src, out, **kw)
    return writer.partial_folder(out)


def _count_jobs(monkeypatch) -> list:
    """Every job convert computes, per job (run_job) or in a C++ batch (batch.run_batch)."""
    from int4pack import batch
    conv = importlib.import_module("int4pack.convert")  # int4pack.convert is the function

    ran: list = []
    real_job, real_batch = conv.run_job, batch.run_batch

    def job(j, *a, **k):
        ran.append(j.key)
        return real_job(j, *a, **k)

    def run_batch(b, *a, **k):
        ran.extend(j.key for j in b.jobs)
        return real_batch(b, *a, **k)

    monkeypatch.setattr(conv, "run_job", job)
    monkeypatch.setattr(batch, "run_batch", run_batch)
    return ran


@pytest.mark.parametrize("fmt", ["compressed-tensors", "kleidiai"])
def test_resume_after_the_last_shard_runs_no_job_and_writes_a_fresh_runs_bytes(tmp_path, monkeypatch, fmt):
    """Stopped after its last shard: --resume computes nothing (no source read, requant or packing for
    kept shards), and every file of OUT (shards, index, config, report) equals a fresh run's."""
    kw = dict(max_shard_size="200KB", serve_format=fmt)
    fresh = tmp_path / "fresh"
    want = int4pack.convert(SMALL, fresh, **kw)
    out = tmp_path / "out"
    work = _stopped_at_commit(SMALL, out, monkeypatch, **kw)
    assert len(_finished(work)) == len(want["shards"]) > 1
    ran = _count_jobs(monkeypatch)
    rewritten = _spy_shard_writes(monkeypatch)
    got = int4pack.convert(SMALL, out, resume=True, **kw)
    assert ran == [] and rewritten == []
    assert got["resume"]["kept_shards"] == sorted(want["shards"])
    assert _same_files(out, fresh)
    assert json.loads(json.dumps(got["modules"])) == json.loads(json.dumps(want["modules"]))


def _spy_hashed(monkeypatch) -> list:
    """The kept shards a resume reads against their checksums (each bytes read counted once)."""
    real, read = workdir.hash_shards, []

    def hashed(shards, *a, **k):
        read.extend(Path(p).name for p, _, _ in shards)
        return real(shards, *a, **k)

    monkeypatch.setattr(workdir, "hash_shards", hashed)
    return read


def test_resume_keeps_shards_unchanged_since_written_without_reading_them(tmp_path, monkeypatch):
    """Stopped after its last shard: shards untouched since they were closed are kept on their records
    (no data byte read), --check-kept reads each once, and a shard rewritten in place with its mtime
    put back, or one copied into place (a new inode), is read, a changed one redone. Each output's
    bytes equal a fresh run's."""
    kw = dict(max_shard_size="200KB")
    fresh = tmp_path / "fresh"
    want = int4pack.convert(SMALL, fresh, **kw)
    names = sorted(want["shards"])
    assert len(names) >= 3

    out = tmp_path / "a" / "out"
    _stopped_at_commit(SMALL, out, monkeypatch, **kw)
    with monkeypatch.context() as m:
        read = _spy_hashed(m)
        got = int4pack.convert(SMALL, out, resume=True, **kw)
    assert read == [] and got["resume"]["kept_shards"] == got["resume"]["kept_unread"] == names
    assert _same_files(out, fresh)

    out = tmp_path / "b" / "out"
    _stopped_at_commit(SMALL, out, monkeypatch, **kw)
    with monkeypatch.context() as m:
        read = _spy_hashed(m)
        got = int4pack.convert(SMALL, out, resume=True, check_kept=True, **kw)
    assert sorted(read) == names and got["resume"]["kept_unread"] == [] and got["resume"]["kept_shards"] == names
    assert _same_files(out, fresh)

    out = tmp_path / "c" / "out"
    work = _stopped_at_commit(SMALL, out, monkeypatch, **kw)
    edited, moved = work / names[0], work / names[1]
    st = edited.stat()
    with open(edited, "r+b") as fh:  # one data byte flipped, size and mtime put back
        fh.seek(st.st_size - 1)
        b = fh.read(1)
        fh.seek(st.st_size - 1)
        fh.write(bytes([b[0] ^ 0x01]))
    os.utime(edited, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert edited.stat().st_mtime_ns == st.st_mtime_ns and edited.stat().st_size == st.st_size
    shutil.copy2(moved, moved.with_name("copy"))  # the same bytes, another file, the same mtime
    os.replace(moved.with_name("copy"), moved)
    with monkeypatch.context() as m:
        read = _spy_hashed(m)
        rewritten = _spy_shard_writes(m)
        got = int4pack.convert(SMALL, out, resume=True, **kw)
    assert sorted(read) == names[:2] and names[0] in rewritten and names[1] not in rewritten
    assert got["resume"]["kept_unread"] == names[2:] and names[1] in got["resume"]["kept_shards"]
    assert _same_files(out, fresh)


def test_check_kept_without_resume_is_a_usage_error(tmp_path):
    r = _cli(["convert", str(SMALL), str(tmp_path / "out"), "--check-kept"])
    assert r.returncode == 2 and "--check-kept" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_resume_runs_only_the_jobs_of_shards_not_kept(tmp_path, monkeypatch):
    """Stopped mid-run: the jobs whose outputs all lie in kept shards do not run again; the others do,
    and the output's bytes equal a fresh run's."""
    src = FIXTURES / "gptq_q3_asym"  # requant: the jobs skipped are the expensive kind
    fresh = tmp_path / "fresh"
    int4pack.convert(src, fresh, max_shard_size="100KB")
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        stop_after_jobs(m, 25)
        with pytest.raises(KeyboardInterrupt):
            int4pack.convert(src, out, max_shard_size="100KB", threads=1)
    kept = set(_finished(writer.partial_folder(out)))
    assert kept
    with Checkpoint(src) as ck:
        plan = make_plan(ck)
    layout = {t.name: n for n, s in zip(writer.shard_names(len(writer.assign_shards(plan.outputs, 100_000))),
                                        writer.assign_shards(plan.outputs, 100_000)) for t in s}
    needed = sorted(j.key for j in plan.jobs if any(layout[t.name] not in kept for t in j.outputs))
    ran = _count_jobs(monkeypatch)
    int4pack.convert(src, out, max_shard_size="100KB", resume=True)
    assert sorted(k for k in ran if k in {j.key for j in plan.jobs if j.kind != "copy"}) == \
        [k for k in needed if k in {j.key for j in plan.jobs if j.kind != "copy"}]
    assert len(needed) < len(plan.jobs)
    assert _same_files(out, fresh)


def test_resume_keeps_no_shard_of_a_source_edited_with_its_mtime_put_back(tmp_path, monkeypatch):
    """A source file changed in place after the interruption, its size and mtime put back (as
    ``touch -r`` or ``cp -p`` would): nothing is kept, and the output equals a fresh run's of the
    edited source."""
    src = tmp_path / "src"
    shutil.copytree(SMALL, src)
    out = tmp_path / "out"
    work = _stopped_at_commit(src, out, monkeypatch, max_shard_size="200KB")
    assert _finished(work)
    shard = next(src.glob("*.safetensors"))
    with Checkpoint(src) as ck:
        info = ck.info("model.layers.0.mlp.gate.weight")  # a router: copied as it is
        assert info.file == shard.name
    st = shard.stat()
    with open(shard, "r+b") as fh:  # begin: the tensor's offset in the file
        fh.seek(info.begin + 1)
        b = fh.read(1)
        fh.seek(info.begin + 1)
        fh.write(bytes([b[0] ^ 0x40]))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert shard.stat().st_mtime_ns == st.st_mtime_ns and shard.stat().st_size == st.st_size
    rewritten = _spy_shard_writes(monkeypatch)
    rep = int4pack.convert(src, out, max_shard_size="200KB", resume=True)
    assert rep["resume"]["kept_shards"] == [] and sorted(rewritten) == sorted(rep["shards"])
    fresh = tmp_path / "fresh"
    int4pack.convert(src, fresh, max_shard_size="200KB")
    assert _same_files(out, fresh)
    clean = tmp_path / "clean"
    int4pack.convert(SMALL, clean, max_shard_size="200KB")
    assert not _same_files(out, clean)  # the edit reached the output


# --------------------------------------------------------------------------- a shard cut under the C++ read

# the console script (sys.argv[3:]) with a source shard cut after every size check Python makes,
# just before the Nth call of a function that reads it: "batch", the C++ lossless batch (the shard
# it maps, cut below its first module's words, whose pages Python mapped already); "job", the C++
# lossless job of one module; "unpack", the unpacking of a module's words (C++, or torch without
# the library) -- both on the words Checkpoint.view gave, cut below them
_CUT_RUN = r"""
import mmap, os, sys
from int4pack import kernels
from int4pack.sources.checkpoint import Checkpoint
mode, nth = sys.argv[1], int(sys.argv[2])
real_mapping, real_view, seen = Checkpoint.mapping, Checkpoint.view, {"calls": 0}
def mapping(self, shard):
    seen["path"] = os.path.join(self.folder, shard)
    return real_mapping(self, shard)
def view(self, name):
    t = self.info(name)
    seen["path"], seen["at"] = os.path.join(self.folder, t.file), t.begin
    return real_view(self, name)
def cut_before(real, at):
    def call(*a, **k):
        seen["calls"] += 1
        if seen["calls"] == nth:
            os.truncate(seen["path"], at(a) // mmap.PAGESIZE * mmap.PAGESIZE)
        return real(*a, **k)
    return call
Checkpoint.mapping, Checkpoint.view = mapping, view
if mode == "batch":
    lib = type(kernels.ext())
    lib.lossless_batch = cut_before(lib.lossless_batch, lambda a: int(a[3][:, 1].min()))
elif mode == "job":
    lib = type(kernels.ext())
    lib.lossless_job = cut_before(lib.lossless_job, lambda a: seen["at"])
else:
    kernels.unpack_gptq = cut_before(kernels.unpack_gptq, lambda a: seen["at"])
sys.argv = ["int4pack", *sys.argv[3:]]
from int4pack.cli import main
main()
"""


def _cut_run(mode: str, nth: int, args: list, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _CUT_RUN, mode, str(nth), *map(str, args)], cwd=ROOT,
                          env=_env(env), capture_output=True, text=True, timeout=600)


def _cut_source(tmp_path: Path, kernels_for: str | None) -> tuple[Path, dict]:
    """A copy of gptq_q3_sym to cut, and its shards' bytes; skipped without the C++ library where
    ``kernels_for`` names what needs it."""
    from int4pack import kernels

    if kernels_for and kernels.ext() is None:
        pytest.skip(f"{kernels_for} needs the C++ kernels")
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "gptq_q3_sym", src)
    return src, {p: p.read_bytes() for p in src.glob("*.safetensors")}


def _the_cut_one(whole: dict) -> Path:
    cut = [p for p, b in whole.items() if p.stat().st_size < len(b)]
    assert len(cut) == 1, "the run did not reach the call that cuts its shard"
    return cut[0]


@pytest.mark.skipif(not hasattr(signal, "SIGBUS"), reason="POSIX signals")
def test_a_shard_cut_under_a_cpp_batch_is_a_clean_error_and_resumes(tmp_path):
    """A source shard cut while the C++ batch reads its mapped bytes (past every size check Python
    can make) is the truncated-shard error naming the file, exit 3, not a SIGBUS. What it leaves
    does not look complete: no OUT, only checksummed shards recorded; once the source is whole
    again --resume gives a fresh run's bytes."""
    src, whole = _cut_source(tmp_path, "the C++ batch")
    fresh = tmp_path / "fresh"
    int4pack.convert(src, fresh, max_shard_size="100KB")
    out = tmp_path / "out"
    r = _cut_run("batch", 12, ["convert", src, out, "--max-shard-size", "100KB", "--threads", "1", "-q"])
    cut = _the_cut_one(whole)
    assert r.returncode == 3, (r.returncode, r.stderr[-2000:])
    assert f"{cut.name}: truncated" in r.stderr and "download it again" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "Fatal Python error" not in r.stderr, r.stderr
    work = writer.partial_folder(out)
    assert not out.exists() and work.is_dir()
    recorded = json.loads((work / writer.PROGRESS).read_text())["shards"]
    assert recorded, "the fault came before any shard was finished"
    assert len(recorded) < len(list(fresh.glob("*.safetensors")))
    # no unfinished shard left: the recorded ones and the work folder's own files
    assert {p.name for p in work.iterdir()} == set(recorded) | {workdir.PROGRESS, workdir.MARKER, workdir.LOCK,
                                                         workdir.PLAN_RECORD}
    for name, rec in recorded.items():  # what the progress file vouches for is whole
        assert writer.hash_shard(work / name, rec["data_digest"]) == {k: rec[k] for k in writer.CHECKSUM_KEYS}
        assert (work / name).read_bytes() == (fresh / name).read_bytes()
    assert not (work / "config.json").exists() and not (work / writer.REPORT_NAME).exists()

    r = _cli(["convert", str(src), str(out), "--max-shard-size", "100KB", "--resume"])  # still cut
    assert r.returncode == 3 and cut.name in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not out.exists()
    cut.write_bytes(whole[cut])
    int4pack.convert(src, out, max_shard_size="100KB", resume=True)
    assert _same_files(out, fresh)


@pytest.mark.skipif(not hasattr(signal, "SIGBUS"), reason="POSIX signals")
@pytest.mark.parametrize("mode,env", [("job", {"INT4PACK_BATCH": "0"}), ("unpack", {"INT4PACK_NO_EXT": "1"})])
def test_a_shard_cut_under_one_module_is_a_clean_error(tmp_path, mode, env):
    """The per-module path: the C++ job on words read in place from the mapped shard, and, without
    the C++ library, torch's unpacking (the words are then read into memory of their own, as torch
    on a page of a cut file could not be stopped). The shard cut under either is the truncated-shard
    error naming it (without the library: at the next read of that shard), exit 3, no OUT."""
    src, whole = _cut_source(tmp_path, "the C++ job" if mode == "job" else None)
    out = tmp_path / "out"
    r = _cut_run(mode, 5, ["convert", src, out, "--threads", "1", "-q"], env)
    cut = _the_cut_one(whole)
    assert r.returncode == 3, (r.returncode, r.stderr[-2000:])
    assert f"{cut.name}: truncated" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not out.exists()


@pytest.mark.skipif(not hasattr(signal, "SIGBUS"), reason="POSIX signals")
def test_a_source_shard_cut_under_verify_against_is_named(tmp_path):
    """verify --against unpacks the source's words in place (C++): a shard cut under it fails the
    layers that read it, naming the shard, instead of ending verify with SIGBUS."""
    src, whole = _cut_source(tmp_path, "verify's unpacking in place")
    out = tmp_path / "out"
    int4pack.convert(src, out)
    r = _cut_run("unpack", 3, ["verify", out, "--against", src, "--threads", "1"])
    cut = _the_cut_one(whole)
    assert r.returncode == 6, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])  # verify's failure
    # the layer the cut hit (no tensor named: the kernel's fault), then those reading the shard after
    assert f"the checkpoint holds ({cut.name}: truncated: the file is" in r.stdout, r.stdout
    assert "Traceback" not in r.stderr, r.stderr

