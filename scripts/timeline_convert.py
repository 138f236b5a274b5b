#!/usr/bin/env python3
"""Where one whole `int4pack.convert` run spends its wall time: python scripts/timeline_convert.py SRC OUT [--threads 2]

profile_convert.py times a worker's stages in isolation; this runs the real convert (OUT is
replaced) with its functions wrapped, and prints per kind of event (job = read + compute of one
job; write = one tensor into the page cache, waiting for the writer's lock included; flush and
finish = the finisher's write-back and shard close; init = opening a shard) the count, the wall
and CPU seconds summed over threads, and when the first started and the last ended; then
--bucket-second slices with how many threads were busy in each kind, and the first events in
order. A run whose workers wait shows up as slices where job + write stay under --threads (or
as a stall before the first job: that is how the 0.4-0.6 s extension load was found).
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import int4pack  # noqa: E402
from int4pack import writer as W  # noqa: E402

C = importlib.import_module("int4pack.convert")  # the module (int4pack.convert is also the function)

_t0 = 0.0
_events: list[tuple[str, int, float, float, float]] = []  # kind, thread, start, end, CPU seconds
_lock = threading.Lock()


def _wrap(owner, attr: str, kind: str) -> None:
    fn = getattr(owner, attr)

    def timed(*a, **kw):
        t, c = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **kw)
        finally:
            with _lock:
                _events.append((kind, threading.get_ident(), t - _t0, time.perf_counter() - _t0, time.thread_time() - c))

    setattr(owner, attr, timed)


def main() -> None:
    global _t0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("out", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bucket", type=float, default=0.25, help="slice width in seconds")
    ap.add_argument("--first", type=int, default=12, help="how many of the first events to list")
    a = ap.parse_args()
    _wrap(C, "run_job", "job")
    _wrap(W.ShardFile, "__init__", "init")
    _wrap(W.ShardFile, "write", "write")
    _wrap(W.ShardFile, "flush", "flush")
    _wrap(W.ShardFile, "finish", "finish")
    shutil.rmtree(a.out, ignore_errors=True)
    os.sync()  # no earlier run's dirty pages written back during this one
    r0 = os.times()
    _t0 = time.perf_counter()
    rep = int4pack.convert(a.src, a.out, threads=a.threads)
    total = time.perf_counter() - _t0
    r1 = os.times()
    print(f"total {total:.2f} s (plan {rep.get('seconds_plan')} s), process CPU user {r1.user - r0.user:.2f} s, "
          f"sys {r1.system - r0.system:.2f} s")
    kinds: dict[str, dict] = {}
    for kind, tid, s, e, cpu in _events:
        d = kinds.setdefault(kind, {"n": 0, "wall": 0.0, "cpu": 0.0, "first": s, "last": e, "threads": set()})
        d["n"] += 1
        d["wall"] += e - s
        d["cpu"] += cpu
        d["first"], d["last"] = min(d["first"], s), max(d["last"], e)
        d["threads"].add(tid)
    for kind, d in kinds.items():
        print(f"  {kind:6s} n={d['n']:6d}  wall {d['wall']:6.2f} s  CPU {d['cpu']:6.2f} s  "
              f"first {d['first']:5.2f}  last {d['last']:5.2f}  threads {len(d['threads'])}")
    cols = ("job", "write", "flush", "finish", "init")
    busy = [dict.fromkeys(cols, 0.0) for _ in range(int(total / a.bucket) + 1)]
    for kind, _, s, e, _ in _events:
        i = int(s / a.bucket)
        while i < len(busy) and i * a.bucket < e:
            busy[i][kind] += max(0.0, min(e, (i + 1) * a.bucket) - max(s, i * a.bucket)) / a.bucket
            i += 1
    print("threads busy per slice:\n  from s  " + "  ".join(f"{c:>6s}" for c in cols))
    for i, row in enumerate(busy):
        print(f"  {i * a.bucket:6.2f}  " + "  ".join(f"{row[c]:6.2f}" for c in cols))
    print("first events (kind, thread, start, end, CPU s):")
    for kind, tid, s, e, cpu in sorted(_events, key=lambda ev: ev[2])[: a.first]:
        print(f"  {kind:6s} {tid % 10000:5d} {s:7.3f} {e:7.3f} {cpu:6.3f}")


if __name__ == "__main__":
    main()
