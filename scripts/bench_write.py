#!/usr/bin/env python3
"""The write side alone: buffered pwrite vs O_DIRECT for convert's output pattern.

    python scripts/bench_write.py DIR [--gb 1.93] [--chunk-mb 1.5] [--repeat 3]

Writes --gb of 1.5 MB pieces (an expert's int8 q) into one file in DIR, the way convert's writer
does, and times each way (order rotated per round, os.sync() before each, fastest kept):
  buffered   --threads workers, one pwrite at a time (the writer's lock), fdatasync every 256 MB
             on a finisher thread, fsync at the end (convert today);
  direct-N   the file opened O_DIRECT, N workers writing page-aligned pieces with no lock, fsync
             at the end (no page cache: no copy into it and no page allocation per 4 KB).
Prints wall seconds, GB/s and the process's CPU seconds (user + sys) of each.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def _write(path: Path, total: int, chunk: int, threads: int, direct: bool) -> dict:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o644)
    n = total // chunk
    bufs = [mmap.mmap(-1, chunk) for _ in range(threads)]  # page-aligned, as O_DIRECT needs
    for b in bufs:
        b.write(bytes(range(256)) * (chunk // 256))
    lock = threading.Lock()
    local = threading.local()
    ids = iter(range(threads))
    id_lock = threading.Lock()
    fin = ThreadPoolExecutor(max_workers=1)
    pending = []
    done = [0]

    def piece(i: int) -> None:
        if not hasattr(local, "buf"):
            with id_lock:
                local.buf = memoryview(bufs[next(ids)])
        if direct:
            os.pwrite(fd, local.buf, i * chunk)
            return
        with lock:
            os.pwrite(fd, local.buf, i * chunk)
            done[0] += chunk
            if done[0] >= 256 << 20:
                done[0] = 0
                pending.append(fin.submit(os.fdatasync, fd))

    os.sync()
    c0, t0 = os.times(), time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(piece, range(n)))
    for f in pending:
        f.result()
    os.fsync(fd)
    wall = time.perf_counter() - t0
    c1 = os.times()
    os.close(fd)
    fin.shutdown()
    path.unlink()
    return {"seconds": wall, "gb_s": n * chunk / wall / 1e9, "cpu_user": c1.user - c0.user, "cpu_sys": c1.system - c0.system}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--gb", type=float, default=1.93)
    ap.add_argument("--chunk-mb", type=float, default=1.5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--direct-threads", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    chunk = int(a.chunk_mb * (1 << 20)) // 4096 * 4096
    total = int(a.gb * 1e9) // chunk * chunk
    ways = [("buffered", a.threads, False)] + [(f"direct-{t}", t, True) for t in a.direct_threads]
    runs: dict[str, list[dict]] = {w[0]: [] for w in ways}
    for i in range(a.repeat):
        for name, th, direct in ways[i % len(ways):] + ways[: i % len(ways)]:
            runs[name].append(_write(a.dir / "bench_write.bin", total, chunk, th, direct))
    rows = []
    print(f"{total / 1e9:.2f} GB in {chunk} B pieces, best of {a.repeat}")
    print("| way | seconds | runs | GB/s | CPU user+sys s |")
    print("|---|---|---|---|---|")
    for name, _, _ in ways:
        best = min(runs[name], key=lambda r: r["seconds"])
        row = {"way": name, **{k: round(v, 3) for k, v in best.items()}, "all_s": [round(r["seconds"], 2) for r in runs[name]]}
        rows.append(row)
        print(f"| {name} | {row['seconds']} | {row['all_s']} | {row['gb_s']} | {row['cpu_user']}+{row['cpu_sys']} |")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
