#!/usr/bin/env python3
"""How far convert is from its two floors, measured in one run: python scripts/floor_convert.py SRC [--repeat 3]

Times, each in a fresh subprocess started after os.sync() (order rotated per round, fastest kept):
  convert     int4pack.convert as it is;
  write-only  the same pipeline with every job's result ready-made (zero tensors of the planned
              dtypes and shapes): no reads, no unpacking, no requant; every byte still goes through
              the writer (checksum, staging, direct or page-cache writes, write-back, fsync);
  compute     the reads and the compute with their checksums and staging copies, but no tensor data
              written (ShardFile's page-cache and direct writes and write-back skipped; headers,
              index and report still written);
  baseline    bench_convert's copy baseline: read the input, write as many bytes, fsync.
convert near write-only means the writer (page cache and disk) bounds it; near compute, the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_convert import BASELINE_RM, CONVERT_RM, _params, _run, print_table  # noqa: E402

# the stubs go in ahead of bench_convert's convert child; they patch before convert is called
STUBS = r"""
import sys as _s
import int4pack as _i
_C, _W = _s.modules["int4pack.convert"], _s.modules["int4pack.output_folder.writer"]
_MODE = __import__("os").environ["INT4PACK_FLOOR"]
if _MODE == "write-only":
    import torch as _t
    from int4pack.sources.safetensors_header import DTYPES as _D
    _ready = {}
    def _made(t):
        key = (t.dtype, t.shape)
        if key not in _ready:
            _ready[key] = _t.zeros(t.shape, dtype=_D[t.dtype])
        return _ready[key]
    _C.run_job = lambda job, ckpt, reader, plan: ([(t.name, _made(t)) for t in job.outputs], {})
elif _MODE == "compute":
    _W.ShardFile._pwrite_data = _W.ShardFile._pwrite
    _W.ShardFile._pwrite = lambda self, buf, off: None if off >= 8 + self.header_len else self._pwrite_data(buf, off)
    _W.ShardFile._pwrite_direct = lambda self, buf, off: len(buf)
    _W.ShardFile.flush = lambda self: None
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="scratch output folder (default: beside SRC)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    dst = a.out or a.src.with_name(a.src.name + "-floor-out")
    params = _params(a.src)
    modes = ["convert", "write-only", "compute", "baseline"]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    out_bytes = None
    for i in range(a.repeat):
        for m in modes[i % len(modes):] + modes[: i % len(modes)]:
            if m == "baseline":
                if out_bytes is None:
                    continue  # sized by a convert run (the first round starts with convert)
                r = _run(BASELINE_RM, a.src, dst, out_bytes)
            else:
                env = {**os.environ, "INT4PACK_FLOOR": m}
                r = _run(CONVERT_RM if m == "convert" else STUBS + CONVERT_RM, a.src, dst, a.threads, env=env)
                out_bytes = out_bytes or r["out_bytes"]
            runs[m].append(r)
    rows = []
    conv = min(r["seconds"] for r in runs["convert"])
    for m in modes:
        best = min(runs[m], key=lambda r: r["seconds"])
        rows.append({"mode": m, "seconds": round(best["seconds"], 3), "all_s": [round(r["seconds"], 2) for r in runs[m]],
                     "mparam_s": round(params / best["seconds"] / 1e6, 1), "vs_convert": round(best["seconds"] / conv, 3),
                     "cpu_user_s": round(best["cpu_user"], 2), "cpu_sys_s": round(best["cpu_sys"], 2),
                     "plan_s": best.get("plan_seconds")})
    print(f"{a.src}: {params / 1e9:.2f} Gparam, {out_bytes / 1e9:.2f} GB out, {a.threads} threads, best of {a.repeat}")
    print_table(["mode", "seconds", "runs", "Mparam/s", "/ convert", "child CPU user+sys s", "plan s"],
                [[r["mode"], r["seconds"], r["all_s"], r["mparam_s"], r["vs_convert"],
                  f"{r['cpu_user_s']}+{r['cpu_sys_s']}", r["plan_s"]] for r in rows])
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    shutil.rmtree(dst, ignore_errors=True)


if __name__ == "__main__":
    main()
