#!/usr/bin/env python3
"""Where convert's peak RSS goes: one conversion in this (fresh) process, sampled as it runs.

    python scripts/rss_convert.py SRC OUT [--threads 2] [--trace]

Prints one JSON line: VmHWM; the anonymous / file-backed split (RssAnon / RssFile from
/proc/self/status, sampled every 10 ms) at the sampled peak and the peak of each; glibc's heap
(mallinfo2: arena bytes, in use, free, mmapped) at the end; minor/major faults, user and system
CPU seconds and faults per job of the convert call alone; with --trace, the peak of Python's own
heap (tracemalloc; slows the run). The baseline after `import int4pack` and the extension load
is reported as base_rss_mb. Compare 1 GB and 4 GB inputs (scripts/make_synthetic.py, 3 and 13
layers) to see what grows with the model.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import resource
import shutil
import threading
import time
import tracemalloc

FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def status() -> dict[str, float]:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, val = line.partition(":")
            if key in FIELDS:
                out[key] = int(val.split()[0]) / 1024
    return out


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap() -> dict[str, int] | None:
    try:
        f = ctypes.CDLL(None).mallinfo2  # glibc 2.33+
    except (AttributeError, OSError, TypeError):
        return None
    f.restype = MallInfo2
    m = f()
    mb = 1 << 20
    return {"arena_mb": round(m.arena / mb), "in_use_mb": round(m.uordblks / mb), "free_mb": round(m.fordblks / mb),
            "mmapped_mb": round(m.hblkhd / mb)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--trace", action="store_true", help="also the peak of Python's heap (tracemalloc)")
    a = ap.parse_args()
    shutil.rmtree(a.out, ignore_errors=True)
    import int4pack
    from int4pack import kernels

    kernels.ext()
    base = status()
    samples: list[dict] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.01):
            samples.append({**status(), "t": time.perf_counter()})

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    if a.trace:
        tracemalloc.start()
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    report = int4pack.convert(a.src, a.out, threads=a.threads)
    r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    stop.set()
    th.join()
    end = status()
    samples.append({**end, "t": t1})
    top = max(samples, key=lambda s: s["VmRSS"])
    jobs = sum(report["plan"]["paths"].values())
    row = {"src": a.src, "jobs": jobs, "seconds": round(t1 - t0, 2), "base_rss_mb": round(base["VmRSS"]),
           "vmhwm_mb": round(end["VmHWM"]),
           "at_peak": {"anon_mb": round(top["RssAnon"]), "file_mb": round(top["RssFile"]),
                       "when": round((top["t"] - t0) / (t1 - t0), 2)},
           "peak_anon_mb": round(max(s["RssAnon"] for s in samples)),
           "peak_file_mb": round(max(s["RssFile"] for s in samples)),
           "minflt": r1.ru_minflt - r0.ru_minflt, "majflt": r1.ru_majflt - r0.ru_majflt,
           "minflt_per_job": round((r1.ru_minflt - r0.ru_minflt) / max(jobs, 1), 1),
           "cpu_user_s": round(r1.ru_utime - r0.ru_utime, 2), "cpu_sys_s": round(r1.ru_stime - r0.ru_stime, 2),
           "heap_at_end": heap()}
    if a.trace:
        row["python_heap_peak_mb"] = round(tracemalloc.get_traced_memory()[1] / (1 << 20), 1)
    shutil.rmtree(a.out, ignore_errors=True)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
