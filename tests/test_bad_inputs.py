"""Bad input gets one clear error and nothing is lost.

The corpus of malformed inputs is built fresh by ``tests/make_bad_inputs.py`` (from the real
fixtures plus small synthetic checkpoints) into a temporary folder. Every case runs through the CLI's
error boundary in-process (typer's CliRunner: fast), and a representative subset, the hub cases and
the tmpfs disk-full case also through the real console entry point in a subprocess.

Run ``pytest tests/test_bad_inputs.py -q -s`` to see the figures.
"""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

import int4pack
from int4pack.output_folder import writer
from int4pack.cli import app
from _reference import FIXTURES
from _reliability import (SUBPROCESS, TMPFS_SIZE, _cli, _limit_disk, _looks_complete, _problems,
                             _same_files, _snapshot, _spy_shard_writes, _try_mount_tmpfs, mbi, runner,
                             tree_hash)


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
