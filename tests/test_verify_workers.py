"""verify's numerical pass on worker processes gives what its threads give, layer for layer, and
falls back to its own process when a worker dies."""

from __future__ import annotations

import os
import shutil

import pytest

import json

from typer.testing import CliRunner

import int4pack
from _reference import FIXTURES
from int4pack.verify import processes, shard_scan
from int4pack.cli import app
from int4pack.errors import VerifyFailed


def _numbers(r: dict) -> list:
    return r["layers"] + r["dense"]


@pytest.mark.parametrize("serve_format", ["compressed-tensors", "kleidiai"])
def test_processes_give_the_threads_results(converted, serve_format):
    out, _ = converted("gptq_q3_sym", serve_format=serve_format)
    threads = int4pack.verify(out, threads=2, processes=False)
    procs = int4pack.verify(out, threads=3, processes=True)
    assert threads["workers"] == {"kind": "threads", "count": 2}
    assert procs["workers"]["kind"] == "processes" and procs["workers"]["count"] >= 2
    assert procs["ok"] and _numbers(procs) == _numbers(threads) and procs["checked"] == threads["checked"]
    assert procs["structural"]["counts"] == threads["structural"]["counts"]


def test_processes_with_a_source_give_the_threads_results(converted):
    out, _ = converted("awq_q3")
    src = FIXTURES / "awq_q3"
    threads = int4pack.verify(out, against=src, threads=2, processes=False)
    procs = int4pack.verify(out, against=src, threads=2, processes=True)
    assert procs["ok"] and _numbers(procs) == _numbers(threads)
    assert any("weight_rel" in r for r in _numbers(procs))  # the source was read in the workers


def test_a_corrupted_expert_fails_the_same_layer_in_the_workers(converted, tmp_path):
    out = tmp_path / "bad"
    shutil.copytree(converted("awq_q3")[0], out)
    from safetensors.torch import load_file, save_file

    shard = sorted(out.glob("*.safetensors"))[0]
    t = load_file(str(shard))
    name = next(n for n in sorted(t) if ".experts.1." in n and n.endswith("weight_scale"))
    t[name] = t[name] * 2
    save_file(t, str(shard), metadata={"format": "pt"})
    with pytest.raises(VerifyFailed) as ei:
        int4pack.verify(out, against=FIXTURES / "awq_q3", threads=2, processes=True)
    r = ei.value.report
    assert r["workers"]["kind"] == "processes"
    bad = [lay for lay in r["layers"] if not lay["ok"]]
    assert bad and all("expert 1" in "\n".join(lay["problems"]) for lay in bad if not lay.get("skipped"))
    threads = int4pack.verify(out, against=FIXTURES / "awq_q3", threads=2, processes=False, raise_on_failure=False)
    assert _numbers(threads) == _numbers(r)


def test_a_worker_that_dies_leaves_its_layers_to_verify_itself(converted, monkeypatch):
    out, _ = converted("gptq_q3_sym")
    want = int4pack.verify(out, threads=2, processes=False)

    def dies(*args, **kw):
        os._exit(3)  # what the kernel's OOM killer leaves behind

    monkeypatch.setattr(processes, "check_layer", dies)  # the forked workers inherit it
    got = int4pack.verify(out, threads=2, processes=True)
    assert got["ok"] and _numbers(got) == _numbers(want)


def test_workers_that_cannot_start_leave_the_pass_to_threads(converted, monkeypatch):
    out, _ = converted("gptq_q3_sym")
    want = int4pack.verify(out, threads=2, processes=False)

    def cannot_open(*args):
        raise OSError("no such file")  # the output gone between verify's open and the workers'

    monkeypatch.setattr(processes, "_open", cannot_open)
    got = int4pack.verify(out, threads=2, processes=True)
    assert got["workers"] == {"kind": "threads", "count": 2, "processes": "could not start"}
    assert got["ok"] and _numbers(got) == _numbers(want)


def test_progress_in_processes_counts_what_threads_count(converted):
    out, _ = converted("gptq_q3_sym")
    counts = {}
    for mode in (False, True):
        seen = {"layers": 0, "experts": 0, "dense": 0}

        class Rec:
            def phase(self, what): ...

            def start(self, layers, experts, dense):
                seen.update(total=(layers, experts, dense))

            def advance(self, *, layers=0, experts=0, dense=0, what=""):
                seen["layers"] += layers
                seen["experts"] += experts
                seen["dense"] += dense

            def stop(self): ...

        int4pack.verify(out, threads=2, processes=mode, progress=Rec())
        counts[mode] = seen
        assert seen["total"] == (seen["layers"], seen["experts"], seen["dense"])
    assert counts[True] == counts[False]


def test_processes_are_the_default_only_with_cores_and_layers_to_share():
    assert not processes.use_processes(None, 2, 48)  # a 2-core host: threads
    assert not processes.use_processes(None, 16, 1)  # one layer: its experts on threads
    assert processes.use_processes(None, 16, 48)
    assert processes.use_processes(True, 2, 1) and not processes.use_processes(False, 16, 48)
    assert not processes.use_processes(True, 1, 48)  # one worker: no pool at all


def test_the_cli_picks_processes_or_threads(converted):
    out, _ = converted("gptq_q3_sym")
    runner = CliRunner()
    for flag, kind in (("--processes", "processes"), ("--no-processes", "threads")):
        r = runner.invoke(app, ["verify", str(out), "--threads", "2", flag, "--json"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["workers"]["kind"] == kind
    r = runner.invoke(app, ["verify", str(out), "--threads", "2", "--processes", "-v"])
    assert r.exit_code == 0 and "on 2 processes" in r.output, r.output


def test_prefetch_asks_for_the_span_of_the_named_tensors(converted, monkeypatch):
    out, _ = converted("gptq_q3_sym")
    ck = shard_scan.Tapped(out)
    names = sorted(n for n in ck.tensors if ".experts.1." in n and ".layers.0." in n)
    calls = []
    monkeypatch.setattr(shard_scan.os, "posix_fadvise", lambda fd, off, n, advice: calls.append((fd, off, n, advice)))
    ck.prefetch(names)
    infos = [ck.tensors[n] for n in names]
    assert len({i.file for i in infos}) == 1 and len(calls) == 1
    fd, off, n, advice = calls[0]
    assert fd == ck._fd(infos[0].file) and advice == shard_scan.os.POSIX_FADV_WILLNEED
    assert (off, off + n) == (min(i.begin for i in infos), max(i.end for i in infos))
