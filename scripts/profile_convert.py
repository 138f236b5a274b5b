#!/usr/bin/env python3
"""Where convert's time goes, section by section (CPU seconds per section).

    python scripts/profile_convert.py SRC [--jobs 200] [--threads 1] [--cprofile]

Runs the first --jobs conversion jobs of SRC's plan in --threads worker threads of this process,
the way convert's workers do, and times each stage separately: the reader (mapping or reading the source tensors, and
any unpacking), the W4A8 compute with its checks (lossless / requant; the one-pass lossless
kernel also unpacks), then what the writer does per output byte (the write into the page
cache, and the checksum). Prints seconds, share and Mparam/s per stage, and the wall time: with
two threads, CPU per stage that grows over one thread's shows where the workers get in each
other's way (compare with two one-thread processes run side by side).
--cprofile adds the top functions by own time (with one thread).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from int4pack import _ext, kernels  # noqa: E402
from int4pack.checkpoint import Checkpoint  # noqa: E402
from int4pack.convert import check_scales  # noqa: E402
from int4pack.plan import make_plan  # noqa: E402
from int4pack.w4a8 import lossless_fast, requant_fast, to_w4a8  # noqa: E402
from int4pack.writer import _CHECKSUMS, digest_kind, to_bytes  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("--jobs", type=int, default=200)
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="workers in this process (convert's pool)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    ext = kernels.ext()
    print(f"extension: {'loaded' if ext is not None else 'MISSING: ' + str(_ext.build_error('convert_kernels'))}")
    with Checkpoint(a.src) as ck:
        plan = make_plan(ck)
        jobs = [j for j in plan.jobs if j.kind in ("linear", "fold")][: a.jobs]
        params = sum(s.n * s.k for j in jobs for s in j.specs)
        paths = sorted({p for j in jobs for p in j.paths.values()})
        check = _CHECKSUMS[digest_kind()][1]  # what the writer uses
        prof = cProfile.Profile() if a.cprofile else None
        if prof:
            prof.enable()
        wall = time.perf_counter()
        if a.threads == 1:  # in this thread, where cProfile sees it
            parts = [_run(jobs, ck, plan, check)]
        else:  # thread i takes jobs i, i+N, ...: the way convert's pool hands them out
            with ThreadPoolExecutor(a.threads) as pool:
                parts = list(pool.map(lambda i: _run(jobs[i::a.threads], ck, plan, check), range(a.threads)))
        wall = time.perf_counter() - wall
        if prof:
            prof.disable()
    t = {k: sum(p[k] for p in parts) for k in parts[0]}
    total = sum(t.values())
    print(f"{a.src.name}: {len(jobs)} jobs, {params / 1e6:.0f} Mparam, paths {paths}, {a.threads} thread(s), "
          "CPU seconds summed over threads")
    for k, v in t.items():
        print(f"  {k:12s} {v:7.3f} s  {100 * v / total:5.1f} %  ({params / max(v, 1e-9) / 1e6:8.0f} Mparam/s alone)")
    print(f"  {'total':12s} {total:7.3f} s  -> {params / total / 1e6:.0f} Mparam/s per thread")
    print(f"  {'wall':12s} {wall:7.3f} s  -> {params / wall / 1e6:.0f} Mparam/s")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


def _run(jobs, ck, plan, check) -> dict:
    """One worker: read, compute, write into its own temporary file, checksum; CPU seconds per stage."""
    torch.set_num_threads(1)
    t = {k: 0.0 for k in ("read", "w4a8+checks", "write", "checksum")}
    clock = time.thread_time
    fd, tmp = tempfile.mkstemp(prefix="int4pack-prof-")
    crc = 0
    off = 0
    try:
        for j in jobs:
            t1 = clock()
            qls = [plan.reader.read(s, unpack=j.kind != "linear") for s in j.specs]
            t2 = clock()
            outs = []
            for ql in qls:  # what convert.run_job does for a linear job (codes may stay packed)
                w = lossless_fast(ql, j.group_size)
                if w is None:
                    w = requant_fast(ql, j.group_size)
                if w is None:
                    ql = ql.unpacked()
                    check_scales(ql)
                    w = to_w4a8(ql, j.group_size)
                outs.append(w)
            for s in j.specs:
                for key in s.keys:
                    ck.release(key)
            t3 = clock()
            bufs = [to_bytes(x) for w in outs for x in (w.q, w.scales)]
            for b in bufs:
                os.pwrite(fd, b, off)
                off += len(b)
            t4 = clock()
            for b in bufs:
                crc = check(b, crc)
            t5 = clock()
            t["read"] += t2 - t1
            t["w4a8+checks"] += t3 - t2
            t["write"] += t4 - t3
            t["checksum"] += t5 - t4
    finally:
        os.close(fd)
        os.unlink(tmp)
    return t


if __name__ == "__main__":
    main()
