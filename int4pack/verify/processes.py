"""verify's numerical pass on worker processes.

A thread of verify spends most of an expert in C++ and torch calls that let go of the GIL, but
takes it back between them, dozens of times per expert: on a 16-core x86-64 host a 16-layer
check ran no faster on 16 threads than on 4 (docs/performance.md). With many cores and layers
the pass runs on processes instead: each opens the output (a ``Tapped`` checkpoint) and the
source once, then runs whole MoE layers and dense modules on one core, and hands back each
result with its clock, the checksums of what it read and the packed modules it checked on the
way. The workers fork from verify's process, which has torch imported already.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import torch

from ..errors import Int4packError
from .dense_linear import check_linear
from .moe_layer import check_layer
from .threads import Clock, PerThread
from .shard_scan import Tapped
from .source import Source
from .module_checks import ModuleChecks, Problems
from .structure import read_report
from .w4a8_output import W4A8Output

__all__ = ["MIN_WORKERS", "use_processes", "guarded", "Workers", "start"]

MIN_WORKERS = 4  # below this, threads (4 threads ran 2.3x one; more ran no faster: W6 in docs/performance.md)


def use_processes(processes: bool | None, workers: int, layers: int) -> bool:
    """``processes`` as asked, or (None) when there are enough cores and MoE layers to share;
    never where processes cannot fork."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return False
    if processes is not None:
        return bool(processes) and workers > 1
    return workers >= MIN_WORKERS and layers >= MIN_WORKERS


def guarded(name: str, kind: str, run) -> dict | None:
    """One layer's numerical pass; a checkpoint value that makes it fail (a shape or group the
    structural pass let through) fails that layer, naming it, instead of ending verify."""
    try:
        return run()
    except Int4packError as e:
        why = str(e)
    except KeyError as e:  # a tensor or projection the checkpoint lacks (the structural pass names it)
        why = f"{e.args[0] if e.args else e!s} is missing"
    except (RuntimeError, ValueError, IndexError) as e:
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    key = "layer" if kind == "moe" else "module"
    return {key: name, "kind": kind, "ok": False, "skipped": True,
            "problems": [f"the numerical pass could not run on what the checkpoint holds ({why})"]}


_state: dict = {}  # a worker's output, source and buffers, opened once by _open


def _open(folder: str, kinds: dict, against: str | None, label: str | None, dense: str = "w4a8") -> None:
    torch.set_num_threads(1)
    ckpt = Tapped(folder)
    ckpt.kinds = kinds
    src = None
    if against is not None:
        src = Source(against, None, dense)
        src.label = label
    output = W4A8Output(ckpt)
    _state.update(output=output, checks=ModuleChecks(output), src=src, report=read_report(ckpt, Problems()),
                  work=PerThread(dict))


def _handback(clock: Clock) -> tuple[dict, dict, dict, tuple[int, int]]:
    taps, done = _state["output"].ckpt.taps, _state["checks"].done
    handed = dict(taps), dict(done)
    taps.clear()
    done.clear()
    return clock.s, *handed, (os.getpid(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def _layer(p: str, ins: dict):
    output, src, report = _state["output"], _state["src"], _state["report"]
    clock = Clock()
    r = guarded(p, "moe", lambda: check_layer(output, p, src, report, ins, clock, pool=None, work=_state["work"]))
    return (r, *_handback(clock))


def _dense(m: str, x: torch.Tensor):
    output, src, report = _state["output"], _state["src"], _state["report"]
    clock = Clock()
    r = guarded(m, "dense", lambda: check_linear(output, m, src, report, x, clock))
    return (r, *_handback(clock))


def _ready() -> bool:
    return True


class Workers:
    """``count`` worker processes for one verify, forked when made (before the caller starts any
    thread: a fork copies no other thread, and none of their locks); ``run`` takes the tasks in,
    results come back to ``done(kind, name, result)``, their clocks, checksums and module checks into
    ``checks``."""

    def __init__(self, checks: ModuleChecks, count: int, src: Source | None):
        self.checks, self.count = checks, count
        output = checks.output
        self.peak_kb: dict[int, int] = {}  # each worker's peak RSS (KB), from its hand-backs
        against = None if src is None else str(src.ckpt.folder)
        # fork: no second import of torch, and a script calling verify is not run again (spawn
        # and forkserver import the caller's __main__ in every worker)
        self.pool = ProcessPoolExecutor(max_workers=count, mp_context=multiprocessing.get_context("fork"),
                                        initializer=_open, initargs=(str(output.ckpt.folder), dict(output.ckpt.kinds),
                                                                     against, None if src is None else src.label,
                                                                     "w4a8" if src is None else src.dense))
        try:
            self.pool.submit(_ready).result()  # a fork context starts every worker at the first task
        except BaseException:
            self.close()
            raise

    def run(self, layers: dict, dense: dict, clock: Clock, done, fallback) -> None:
        """layers {prefix: moe_inputs}, dense {module: rows}; ``fallback(kind, name)`` runs a task in
        this process where the workers could not (a worker killed, processes refused)."""
        futs = [(self.pool.submit(_layer, p, ins), "moe", p) for p, ins in layers.items()]
        futs += [(self.pool.submit(_dense, m, x), "dense", m) for m, x in dense.items()]
        for f, kind, name in futs:
            try:
                r, s, taps, checked, (pid, rss_kb) = f.result()
            except (BrokenProcessPool, OSError):
                done(kind, name, fallback(kind, name))
                continue
            self.peak_kb[pid] = max(self.peak_kb.get(pid, 0), rss_kb)
            clock.add(s)
            self.checks.output.ckpt.taps.update(taps)
            self.checks.done.update(checked)
            done(kind, name, r)

    def peak_rss_mb(self) -> int:
        """The workers' peak RSS added up (pages shared with verify's process counted in each)."""
        return round(sum(self.peak_kb.values()) / 1024)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def start(checks: ModuleChecks, count: int, src: Source | None) -> Workers | None:
    """``count`` workers, or None where they cannot start (a worker that cannot open the output or
    the source, a process limit): the numerical pass then runs on threads."""
    try:
        return Workers(checks, count, src)
    except (BrokenProcessPool, OSError):
        return None
