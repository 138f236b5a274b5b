"""Reliability: bad input gets one clear error and nothing is lost; interrupted runs resume
byte-identically; the readers only ever raise int4pack's own error type.

The corpus of malformed inputs is built fresh by ``tests/make_bad_inputs.py`` (from the real
fixtures plus small synthetic checkpoints) into a temporary folder. Every case runs through the CLI's
error boundary in-process (typer's CliRunner: fast), and a representative subset, the hub cases and
the tmpfs disk-full case also through the real console entry point in a subprocess.

Run ``pytest tests/test_reliability.py -q -s`` to see the figures.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import int4pack
from int4pack import writer
from int4pack.checkpoint import Checkpoint
from int4pack.cli import app
from int4pack.errors import Int4packError
from int4pack.formats import open_reader
from int4pack.plan import make_plan
from _reference import FIXTURES

ROOT = Path(__file__).resolve().parents[1]

_spec = importlib.util.spec_from_file_location("make_bad_inputs", ROOT / "tests" / "make_bad_inputs.py")
mbi = importlib.util.module_from_spec(_spec)
sys.modules["make_bad_inputs"] = mbi
_spec.loader.exec_module(mbi)
tree_hash = mbi.tree_hash

# cases that also run through the real entry point in a subprocess (one per kind of failure)
SUBPROCESS = ["truncated_shard", "scales_nan", "hub_offline_no_cache", "hub_partial_cache", "disk_full"]
TMPFS_SIZE = "400k"  # the gptq_q3_sym output is ~1.4 MB
runner = CliRunner()


# --------------------------------------------------------------------------- helpers

def _env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "INT4PACK_TEST_"))}
    env["HF_HUB_OFFLINE"] = "1"  # tests never touch the network
    env["HF_HUB_DISABLE_TELEMETRY"] = "1"
    env.update(extra or {})
    return env


def _cli(args: list[str], env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "int4pack", *args], capture_output=True, text=True,
                          env=_env(env), timeout=timeout, cwd=ROOT)


def _looks_complete(folder: Path) -> bool:
    return folder.is_dir() and (folder / "config.json").exists() and any(folder.glob("*.safetensors"))


def _guarded(case, dest: Path) -> Path:
    """The folder whose bytes must not change: the source (the HF cache for hub ids)."""
    return dest / case.name / "hf" if case.hub and (dest / case.name / "hf").exists() else \
        (dest / case.src if not case.hub else dest / case.name)


def _problems(case, dest: Path, code: int, stderr: str, before: dict, debug: bool = False) -> list[str]:
    """Everything wrong with how one bad case failed (empty list: it failed cleanly)."""
    out = case.out_path(dest)
    bad = []
    if code != case.exit:
        bad.append(f"exit {code}, expected {case.exit}")
    if "internal error" in stderr:
        bad.append("not an Int4packError (internal error)")
    if ("Traceback" in stderr) != debug:
        bad.append("traceback shown without --debug" if not debug else "no traceback with --debug")
    errors = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    hints = [ln for ln in stderr.splitlines() if ln.startswith("hint:")]
    if len(errors) != 1:
        bad.append(f"{len(errors)} 'error:' lines")
    if len(hints) != 1:
        bad.append(f"{len(hints)} 'hint:' lines")
    if errors and not any(m in errors[0] for m in case.mention):
        bad.append(f"error line names none of {case.mention}: {errors[0]!r}")
    if tree_hash(_guarded(case, dest)) != before["src"]:
        bad.append("source changed")
    if before["out"] == "absent":
        if os.path.lexists(out):
            bad.append(f"OUT {out} was created")
    elif tree_hash(out) != before["out"]:
        bad.append("the existing OUT was modified")
    if before["out"] == "absent" and _looks_complete(out):
        bad.append("an output that looks complete was left")
    return bad


def _snapshot(case, dest: Path) -> dict:
    return {"src": tree_hash(_guarded(case, dest)), "out": tree_hash(case.out_path(dest))}


class _DiskBudget:
    """A 'disk' with ``budget`` bytes left for shard data: past it, OSError(ENOSPC)."""

    used = 0
    budget = 0


def _limit_disk(monkeypatch, budget: int) -> None:
    """Page-cache writes past the budget raise ENOSPC; a direct write past it writes the pages that
    fit and comes back short, as Linux does on a full file system (tmpfs and ext4 alike)."""
    orig, orig_direct = writer.ShardFile._pwrite, writer.ShardFile._pwrite_direct
    lock = threading.Lock()

    def pwrite(self, buf, offset):
        n = memoryview(buf).nbytes
        with lock:  # workers write in parallel
            if _DiskBudget.used + n > _DiskBudget.budget:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            _DiskBudget.used += n
        return orig(self, buf, offset)

    def pwrite_direct(self, buf, offset):
        with lock:
            fits = min(len(buf), max(0, _DiskBudget.budget - _DiskBudget.used)) // 4096 * 4096
            _DiskBudget.used += fits
        if fits == len(buf):
            return orig_direct(self, buf, offset)
        if fits:
            orig_direct(self, buf[:fits], offset)
        self._direct = False  # what the real method does on a short write
        return fits

    _DiskBudget.used, _DiskBudget.budget = 0, budget
    monkeypatch.setattr(writer.ShardFile, "_pwrite", pwrite)
    monkeypatch.setattr(writer.ShardFile, "_pwrite_direct", pwrite_direct)


def _try_mount_tmpfs(where: Path, size: str) -> bool:
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                       capture_output=True, text=True)
    return r.returncode == 0


# --------------------------------------------------------------------------- the corpus

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    dest = tmp_path_factory.mktemp("bad_inputs") / "corpus"
    cases = mbi.build_corpus(dest, FIXTURES)
    return dest, {c.name: c for c in cases}


@pytest.fixture(scope="module")
def subprocess_results(corpus):
    """The SUBPROCESS cases run (in parallel) through ``python -m int4pack``; disk_full on a real tmpfs
    when mount works here (else it is left to the in-process ENOSPC test)."""
    dest, cases = corpus
    full = dest / "disk_full" / "full"
    mounted = _try_mount_tmpfs(full, TMPFS_SIZE)
    names = [n for n in SUBPROCESS if n != "disk_full" or mounted]
    before = {n: _snapshot(cases[n], dest) for n in names}
    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            futs = {n: pool.submit(_cli, cases[n].cli_args(dest), cases[n].environ(dest)) for n in names}
            # one more: --debug shows the traceback (and nothing else changes)
            debug = pool.submit(_cli, cases["truncated_shard"].cli_args(dest) + ["--debug"],
                                cases["truncated_shard"].environ(dest))
            results = {n: f.result() for n, f in futs.items()}
            results["--debug"] = debug.result()
        after = {n: _problems(cases[n], dest, results[n].returncode, results[n].stderr, before[n]) for n in names}
        leftovers = sorted(p.name for p in full.iterdir()) if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", str(full)], check=False)
    return {"results": results, "problems": after, "mounted": mounted, "tmpfs_leftovers": leftovers}


def test_corpus_is_large_enough(corpus):
    dest, cases = corpus
    bad = [c for c in cases.values() if not c.ok]
    assert len(bad) >= 30
    kinds = {c.exit for c in bad}
    assert {2, 3, 4, 5} <= kinds
    assert json.loads((dest / "cases.json").read_text())[0]["name"] == next(iter(cases))


def test_every_bad_input_fails_cleanly_through_the_cli(corpus, monkeypatch):
    """In-process CLI (same error boundary as the console script) over every case, then --debug."""
    dest, cases = corpus
    problems, tried = {}, 0
    for c in cases.values():
        if c.ok or c.hub and c.env.get("HF_HOME"):  # the offline-hub cases need a fresh interpreter
            continue
        before = _snapshot(c, dest)
        with monkeypatch.context() as m:
            if c.setup == "tmpfs":  # disk full: a size-limited shard writer instead of a small file system
                _limit_disk(m, 400_000)
            r = runner.invoke(app, c.cli_args(dest), catch_exceptions=True)
        tried += 1
        if r.exception and not isinstance(r.exception, SystemExit):
            problems[c.name] = [f"escaped the boundary: {r.exception!r}"]
            continue
        p = _problems(c, dest, r.exit_code, r.stderr, before)
        if p:
            problems[c.name] = p + [r.stderr.strip()[-300:]]
    print(f"\nin-process CLI: {tried} bad inputs tried, {tried - len(problems)} clean errors, "
          f"{sum('Traceback' in ' '.join(v) for v in problems.values())} tracebacks")
    assert not problems, json.dumps(problems, indent=1)


def test_debug_shows_the_traceback(corpus):
    dest, cases = corpus
    for name in ("header_offsets_out_of_range", "scales_negative", "unknown_quant_method"):
        c = cases[name]
        before = _snapshot(c, dest)
        r = runner.invoke(app, c.cli_args(dest) + ["--debug"])
        assert _problems(c, dest, r.exit_code, r.stderr, before, debug=True) == [], r.stderr


def test_subprocess_subset(corpus, subprocess_results):
    dest, cases = corpus
    res = subprocess_results
    print(f"\nsubprocess CLI: {len(res['problems'])} cases, "
          f"{sum(not p for p in res['problems'].values())} clean; tmpfs mounted: {res['mounted']}")
    assert {n: p for n, p in res["problems"].items() if p} == {}
    dbg = res["results"]["--debug"]
    assert dbg.returncode == cases["truncated_shard"].exit
    assert "Traceback" in dbg.stderr and "InputError" in dbg.stderr
    assert sum(ln.startswith("error:") for ln in dbg.stderr.splitlines()) == 1
    hub = res["results"]["hub_offline_no_cache"].stderr
    assert "HF_HUB_OFFLINE" in hub and "hf download int4pack-test/not-cached" in hub
    partial = res["results"]["hub_partial_cache"].stderr
    assert "partial download" in partial
    if res["mounted"]:
        err = res["results"]["disk_full"].stderr
        # the plan writes more than the file system holds: refused before anything is written
        # (running out of space mid-run: test_disk_full_keeps_finished_shards_for_resume)
        assert "not enough free space" in err and "bytes) free" in err
        assert res["tmpfs_leftovers"] == []


def test_legitimate_edge_cases_convert(corpus):
    """Inputs that look odd but are valid: a zero scale over a group at its zero point; a source group
    that does not divide K (auto picks a valid target group)."""
    dest, cases = corpus
    for c in (c for c in cases.values() if c.ok):
        h = tree_hash(dest / c.src)
        r = runner.invoke(app, c.cli_args(dest) + ["--json"])
        assert r.exit_code == 0, (c.name, r.stderr)
        assert _looks_complete(c.out_path(dest)) and tree_hash(dest / c.src) == h


def test_disk_full_keeps_finished_shards_for_resume(tmp_path, monkeypatch):
    """ENOSPC mid-run (size-limited writer): exit 5 naming the file, OUT absent, half-written shard gone;
    --resume after space is freed keeps the finished shards and ends byte-identical."""
    src = FIXTURES / "gptq_q3_sym"
    ref = tmp_path / "ref"
    int4pack.convert(src, ref, max_shard_size="200KB")
    out = tmp_path / "out"
    h = tree_hash(src)
    with monkeypatch.context() as m:
        _limit_disk(m, 700_000)
        r = runner.invoke(app, ["convert", str(src), str(out), "--max-shard-size", "200KB"])
    assert r.exit_code == 5 and "no space left" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not out.exists() and tree_hash(src) == h
    work = tmp_path / ".out.int4pack-partial"
    finished = set(json.loads((work / writer.PROGRESS).read_text())["shards"])
    assert finished and not list(work.glob("*.tmp"))
    rewritten = _spy_shard_writes(monkeypatch)
    int4pack.convert(src, out, max_shard_size="200KB", resume=True)
    assert _same_files(out, ref)
    assert finished.isdisjoint(rewritten) and rewritten


# --------------------------------------------------------------------------- SIGKILL and --resume

def _spy_shard_writes(monkeypatch) -> list[str]:
    seen: list[str] = []
    orig = writer.ShardFile.__init__

    def init(self, path, *a, **kw):
        seen.append(Path(path).name)
        orig(self, path, *a, **kw)

    monkeypatch.setattr(writer.ShardFile, "__init__", init)
    return seen


def _same_files(a: Path, b: Path) -> bool:
    fa = sorted(p.name for p in a.iterdir())
    fb = sorted(p.name for p in b.iterdir())
    return fa == fb and all((a / n).read_bytes() == (b / n).read_bytes() for n in fa)


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


def test_partial_shard_and_unrecorded_shard_are_not_trusted(tmp_path):
    """A leftover .tmp shard and a finished-looking shard missing from progress.json are both redone."""
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
        fp = plan.fingerprint(ck) + f"|{200_000}"
    (work / writer.PROGRESS).write_text(json.dumps({"fingerprint": fp, "shards": {}, "jobs": {}}))
    (work / names[0]).write_bytes((ref / names[0]).read_bytes()[:-10])
    (work / (names[1] + ".tmp")).write_bytes((ref / names[1]).read_bytes()[:5000])
    # and a shard recorded with checksums that no longer match its bytes
    data = (ref / names[2]).read_bytes()
    (work / names[2]).write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    rec = writer.hash_shard(ref / names[2])
    prog = json.loads((work / writer.PROGRESS).read_text())
    prog["shards"][names[2]] = rec
    (work / writer.PROGRESS).write_text(json.dumps(prog))
    int4pack.convert(src, out, max_shard_size="200KB", resume=True)
    assert _same_files(out, ref)


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


# --------------------------------------------------------------------------- fuzz the readers

_FUZZ_BASE = "ct_qwen3moe_w4a16_asym_g32"


def _pipeline(folder: Path) -> None:
    """Checkpoint -> open_reader -> verdict/linears -> make_plan: only Int4packError may escape."""
    try:
        with Checkpoint(folder) as ck:
            reader = open_reader(ck)
            reader.verdict()
            reader.linears()
            make_plan(ck)
    except Int4packError as e:
        assert str(e) and e.exit_code in (2, 3, 4, 5), repr(e)


@pytest.fixture(scope="module")
def fuzz_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz")
    out = {}
    for name in (_FUZZ_BASE, "gptq_q3_descact"):
        d = base / name
        d.mkdir()
        for p in (FIXTURES / name).iterdir():
            shutil.copyfile(p, d / p.name)
        out[name] = d
    return out


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=8)
# INT4PACK_FUZZ_EXAMPLES=5000 for a long local run; the suite keeps it short
_fuzz = settings(max_examples=int(os.environ.get("INT4PACK_FUZZ_EXAMPLES") or 100), deadline=None,
                 derandomize=not os.environ.get("INT4PACK_FUZZ_EXAMPLES"),
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _paths(obj, prefix=()):
    """Every (path, value) in a JSON tree."""
    yield prefix, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _mutate(tree, data):
    """Replace or delete one node of a JSON tree, chosen by hypothesis."""
    paths = [p for p, _ in _paths(tree) if p]
    path = data.draw(st.sampled_from(paths))
    parent = tree
    for k in path[:-1]:
        parent = parent[k]
    if isinstance(parent, dict) and data.draw(st.booleans()):
        del parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(_json)
    return tree


@_fuzz
@given(data=st.data())
def test_fuzz_header_mutations(fuzz_dirs, data):
    """Mutate one node of a real shard header (a dtype, shape, offset, name, metadata...)."""
    name = data.draw(st.sampled_from(sorted(fuzz_dirs)))
    folder = fuzz_dirs[name]
    shard = sorted(folder.glob("*.safetensors"))[0]
    orig = shard.read_bytes()
    try:
        header, blob = mbi._read_raw(shard)
        mbi._write_raw(shard, _mutate(header, data), blob)
        _pipeline(folder)
    finally:
        shard.write_bytes(orig)


@_fuzz
@given(data=st.data(), cut=st.integers(0, 400), flips=st.lists(st.tuples(st.integers(0, 3000), st.integers(1, 255)),
                                                            max_size=6))
def test_fuzz_header_bytes(fuzz_dirs, data, cut, flips):
    """Random byte flips in the header region and random truncation of a real shard."""
    folder = fuzz_dirs[data.draw(st.sampled_from(sorted(fuzz_dirs)))]
    shard = sorted(folder.glob("*.safetensors"))[-1]
    orig = shard.read_bytes()
    try:
        blob = bytearray(orig)
        for pos, x in flips:
            blob[pos % len(blob)] ^= x
        if data.draw(st.booleans()):
            blob = blob[: len(blob) - cut * 97]
        shard.write_bytes(bytes(blob))
        _pipeline(folder)
    finally:
        shard.write_bytes(orig)


@_fuzz
@given(data=st.data(), raw=st.binary(max_size=300))
def test_fuzz_random_files(fuzz_dirs, data, raw):
    """Random bytes as a shard, as config.json or as the index."""
    folder = fuzz_dirs[data.draw(st.sampled_from(sorted(fuzz_dirs)))]
    target = folder / data.draw(st.sampled_from(
        ["config.json", "model.safetensors.index.json", sorted(p.name for p in folder.glob("*.safetensors"))[0]]))
    orig = target.read_bytes()
    try:
        prefix = data.draw(st.sampled_from([b"", b"\x10\x00\x00\x00\x00\x00\x00\x00{", orig[:64]]))
        target.write_bytes(prefix + raw)
        _pipeline(folder)
    finally:
        target.write_bytes(orig)


@_fuzz
@given(data=st.data())
def test_fuzz_config_mutations(fuzz_dirs, data):
    """Mutate one node of a real config.json (quantization_config included) or of the index."""
    folder = fuzz_dirs[data.draw(st.sampled_from(sorted(fuzz_dirs)))]
    target = folder / data.draw(st.sampled_from(["config.json", "config.json", "model.safetensors.index.json"]))
    orig = target.read_bytes()
    try:
        tree = json.loads(orig)
        if target.name == "config.json" and data.draw(st.booleans()):
            tree["quantization_config"] = _mutate(tree["quantization_config"], data)
        else:
            tree = _mutate(tree, data)
        target.write_text(json.dumps(tree))
        _pipeline(folder)
    finally:
        target.write_bytes(orig)


@settings(max_examples=int(os.environ.get("INT4PACK_FUZZ_EXAMPLES") or 100) // 4, deadline=None,
          derandomize=not os.environ.get("INT4PACK_FUZZ_EXAMPLES"),
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 7)),
                                      min_size=1, max_size=40))
def test_fuzz_tensor_data_through_convert(fuzz_dirs, tmp_path, data, flips):
    """Random bit flips in tensor data (scales, zero points, g_idx, codes): a whole convert either
    succeeds or raises Int4packError, and never leaves an OUT behind on failure."""
    folder = fuzz_dirs[data.draw(st.sampled_from(sorted(fuzz_dirs)))]
    shards = sorted(folder.glob("*.safetensors"))
    shard = shards[data.draw(st.integers(0, len(shards) - 1))]
    orig = shard.read_bytes()
    n = int.from_bytes(orig[:8], "little")
    out = tmp_path / f"o{len(list(tmp_path.iterdir()))}"
    try:
        blob = bytearray(orig)
        for where, bit in flips:
            blob[8 + n + int(where * (len(blob) - 8 - n))] ^= 1 << bit
        shard.write_bytes(bytes(blob))
        try:
            int4pack.convert(folder, out)
        except Int4packError as e:
            assert e.exit_code in (3, 4) and (e.tensor or e.path), repr(e)
            assert not out.exists()
    finally:
        shard.write_bytes(orig)


def _fresh_ext(monkeypatch, library):
    from int4pack import _ext

    monkeypatch.setattr(_ext, "library_path", lambda: library)
    monkeypatch.setattr(_ext, "_loaded", {})
    monkeypatch.setattr(_ext, "_error", None)
    monkeypatch.setattr(_ext, "_warned", False)
    monkeypatch.delenv("INT4PACK_NO_EXT", raising=False)
    return _ext


def test_missing_kernels_without_a_compiler_say_what_to_install_in_one_line(tmp_path, monkeypatch):
    """No library and no compiler: one warning per process, one line, naming the cause, what to
    install and the cost; INT4PACK_NO_EXT=1 chooses the slow paths without a warning."""
    import warnings

    from int4pack import _build

    _ext = _fresh_ext(monkeypatch, tmp_path / _build.library_name())
    monkeypatch.setenv("PATH", str(tmp_path))  # no c++, g++ or clang++ to find
    monkeypatch.delenv("CXX", raising=False)
    with pytest.warns(_ext.SlowPathWarning) as got:
        assert _ext.load("convert_kernels") is None
    (w,) = got
    msg = str(w.message)
    assert "\n" not in msg and msg.startswith("no C++ compiler was found")
    assert "apt-get install g++" in msg and "22x slower" in msg and "reinstall int4pack" in msg
    text = warnings.formatwarning(w.message, w.category, w.filename, w.lineno, None)
    assert text.count("\n") == 1, text  # printed as one line: no source line quoted under it
    assert _ext.build_error("kleidiai_pack") == _ext.build_error("convert_kernels")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _ext.load("convert_kernels") is None  # known failure: no second warning
        assert _ext.load("kleidiai_pack") is None  # nor for the other kernels (one library)
        monkeypatch.setattr(_ext, "_warned", False)
        monkeypatch.setenv("INT4PACK_NO_EXT", "1")
        assert _ext.load("kleidiai_pack") is None
        assert _ext.build_error() == "disabled by INT4PACK_NO_EXT"


def test_missing_kernels_with_a_compiler_say_reinstall(tmp_path, monkeypatch):
    from int4pack import _build

    lib = tmp_path / _build.library_name()
    _ext = _fresh_ext(monkeypatch, lib)
    cxx = tmp_path / "bin" / "c++"
    cxx.parent.mkdir()
    cxx.write_text("#!/bin/sh\n")
    cxx.chmod(0o755)
    monkeypatch.setenv("PATH", str(cxx.parent))
    monkeypatch.delenv("CXX", raising=False)
    with pytest.warns(_ext.SlowPathWarning, match="not built when it was installed"):
        assert _ext.load("convert_kernels") is None
    assert str(lib) in _ext.build_error()


def test_unusable_or_stale_kernels_are_refused_not_run(tmp_path, monkeypatch):
    """A file that is no library for this machine, or a library built from other sources than the
    ones beside it, is refused (the pure-torch paths run) with the reason."""
    from int4pack import _build, _ext, _native

    real = _ext.library_path()
    if not real.is_file():
        pytest.fail(f"{real} is missing: pip install -e . (or python -m int4pack._build) builds it")
    bad = tmp_path / _build.library_name()
    bad.write_bytes(b"not an ELF file")
    e = _fresh_ext(monkeypatch, bad)
    with pytest.warns(e.SlowPathWarning, match="cannot be used"):
        assert e.load("convert_kernels") is None
    e = _fresh_ext(monkeypatch, real)
    monkeypatch.setattr(_build, "source_hash", lambda root=None: "0123456789abcdef")
    with pytest.warns(e.SlowPathWarning, match="built from other sources"):
        assert e.load("convert_kernels") is None
    monkeypatch.undo()
    assert _native.open_library(real).i4p_abi_version() == _native.ABI_VERSION


def test_kernel_errors_come_back_as_exceptions_with_the_message():
    """A check that fails inside the library raises with its message (i4p_last_error), and the
    library stays usable."""
    import torch

    from int4pack import kernels

    m = kernels.ext()
    if m is None:
        pytest.fail("the C++ kernels are missing: pip install -e . (or python -m int4pack._build) builds them")
    with pytest.raises(RuntimeError, match="does not fit"):
        m.unpack_ct(torch.zeros(2, 1, dtype=torch.int32), 9, 1)
    with pytest.raises(RuntimeError, match="layout 7 is not read here"):
        m.lossless_job(7, torch.zeros(2, 1, dtype=torch.int32), 2, 8, torch.ones(2, 1), torch.empty(0, dtype=torch.uint8),
                       8, 8, True, 1)
    with pytest.raises(RuntimeError, match="qweight: expected"):
        m.unpack_gptq(torch.zeros(2, 4, dtype=torch.int64), 1)
    assert kernels.crc32c(b"123456789") == 0xE3069283
