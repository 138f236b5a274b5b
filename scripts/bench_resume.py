#!/usr/bin/env python3
"""--resume after the last shard against a fresh convert, measured in the same run.

    python scripts/bench_resume.py --layers 3 --format gptq-sym --repeat 3
    python scripts/bench_resume.py --layers 48 --format gptq-sym --max-shard-size 1.5GB --repeat 3  # 16 cores
    python scripts/bench_resume.py --layers 3 --check-kept  # every kept byte read, as with --check-kept

It writes a synthetic Qwen3-30B-A3B-shaped checkpoint (scripts/make_synthetic.py), then, per repeat,
in fresh subprocesses each started after os.sync():
  (a) fresh: ``int4pack convert SRC OUT`` into an empty place;
  (b) a run stopped just before it swaps its work folder into place (every shard finished: what a
      kill after the last shard leaves; not timed), then ``--resume`` of it, timed.
Each time is the child's wall clock from its start to its exit (interpreter start and imports
included: what a user waits), and convert()'s own seconds beside it. It prints the ratio
resume/fresh (best of each, and per repeat), checks that the resumed output's files are
byte-identical to the fresh one's, and exits 1 if they are not.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from make_synthetic import make  # noqa: E402

CHILD = r"""
import json, os, sys, time
sys.path.insert(0, os.environ["INT4PACK_BENCH_TREE"])
import int4pack
mode, src, dst, shard, threads, serve, check = sys.argv[1:8]
kw = dict(max_shard_size=shard, threads=int(threads) or None, serve_format=serve)
if mode == "stop":  # every shard finished, stopped before the rename into OUT
    from int4pack.output_folder import writer
    def stop(self):
        raise KeyboardInterrupt
    writer.OutputDir.commit = stop
    try:
        int4pack.convert(src, dst, **kw)
    except KeyboardInterrupt:
        pass
    print(json.dumps({}))
else:
    t = time.perf_counter()
    r = int4pack.convert(src, dst, resume=mode == "resume", check_kept=mode == "resume" and check == "1", **kw)
    print(json.dumps({"convert_s": time.perf_counter() - t, "shards": len(r["shards"]),
                      "kept": len(r.get("resume", {}).get("kept_shards", [])), "workers": r.get("workers"),
                      "unread": len(r.get("resume", {}).get("kept_unread", [])),
                      "out_bytes": r["plan"]["out_bytes"]}))
"""


def _child(*args) -> dict:
    env = {**os.environ, "INT4PACK_BENCH_TREE": str(HERE.parent)}
    os.sync()  # no earlier run's dirty pages written back during this one
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", CHILD, *map(str, args)], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    if res.returncode != 0:
        raise SystemExit(f"{args[0]} run failed:\n{res.stderr[-3000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["wall_s"] = wall
    return out


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default="gptq-sym", help="make_synthetic.py's --format")
    ap.add_argument("--layers", type=int, default=3, help="0.31 GB of int4 per layer")
    ap.add_argument("--max-shard-size", default="200MB", help="several shards, as a real model has")
    ap.add_argument("--threads", type=int, default=0, help="0: convert's default")
    ap.add_argument("--serve-format", default="compressed-tensors", choices=["compressed-tensors", "kleidiai"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warm", action="store_true",
                    help="read the kept shards once before the timed resume (they are in the page cache, as the "
                         "source is for the fresh run); without it, the resume reads what the stopped run wrote "
                         "with O_DIRECT, from the disk")
    ap.add_argument("--check-kept", action="store_true",
                    help="resume with --check-kept: every kept byte read against its checksums (without it, shards "
                         "unchanged since they were written are kept on their records)")
    ap.add_argument("--workdir", type=Path, default=None, help="kept (with its source) if given")
    ap.add_argument("--json", type=Path, default=None, help="also write the result here")
    a = ap.parse_args()
    work = a.workdir or Path(tempfile.mkdtemp(prefix="int4pack-bench-resume-"))
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"{a.format}-{a.layers}L"
    if not src.exists():
        t = time.perf_counter()
        make(src, a.format, a.layers)
        print(f"wrote {src} in {time.perf_counter() - t:.1f} s", flush=True)
    fresh_out, resumed_out = work / "fresh", work / "resumed"
    opts = (a.max_shard_size, a.threads, a.serve_format, int(a.check_kept))
    runs = []
    same = True
    for i in range(a.repeat):
        for d in (fresh_out, resumed_out, resumed_out.parent / f".{resumed_out.name}.int4pack-partial"):
            shutil.rmtree(d, ignore_errors=True)
        fresh = _child("fresh", src, fresh_out, *opts)
        _child("stop", src, resumed_out, *opts)
        if a.warm:
            for p in resumed_out.parent.glob(f".{resumed_out.name}.int4pack-partial/*.safetensors"):
                with open(p, "rb") as fh:
                    while fh.read(16 << 20):
                        pass
        resumed = _child("resume", src, resumed_out, *opts)
        if resumed["kept"] != resumed["shards"]:
            raise SystemExit(f"resume kept {resumed['kept']} of {resumed['shards']} shards")
        if i == 0:
            same = _digests(fresh_out) == _digests(resumed_out)
        runs.append({"fresh_wall_s": round(fresh["wall_s"], 2), "resume_wall_s": round(resumed["wall_s"], 2),
                     "fresh_convert_s": round(fresh["convert_s"], 2), "resume_convert_s": round(resumed["convert_s"], 2),
                     "ratio_wall": round(resumed["wall_s"] / fresh["wall_s"], 3)})
        print(json.dumps(runs[-1]), flush=True)
    best_f = min(r["fresh_wall_s"] for r in runs)
    best_r = min(r["resume_wall_s"] for r in runs)
    result = {"format": a.format, "layers": a.layers, "serve_format": a.serve_format, "warm": a.warm,
              "check_kept": a.check_kept, "kept_unread": resumed["unread"],
              "in_gb": round(sum(p.stat().st_size for p in src.iterdir()) / 1e9, 2),
              "out_gb": round(fresh["out_bytes"] / 1e9, 2), "shards": fresh["shards"], "workers": fresh["workers"],
              "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
              "fresh_s": best_f, "resume_s": best_r, "ratio": round(best_r / best_f, 3),
              "fresh_convert_s": min(r["fresh_convert_s"] for r in runs),
              "resume_convert_s": min(r["resume_convert_s"] for r in runs),
              "ratio_convert": round(min(r["resume_convert_s"] for r in runs) / min(r["fresh_convert_s"] for r in runs), 3),
              "byte_identical": same, "runs": runs}
    print(json.dumps(result))
    print(f"\nresume after the last shard / fresh convert: {result['ratio']:.3f} "
          f"({best_r:.2f} s / {best_f:.2f} s, best of {a.repeat}; convert() alone: "
          f"{result['resume_convert_s']:.2f} s / {result['fresh_convert_s']:.2f} s = {result['ratio_convert']:.3f}); "
          f"{result['shards']} shards, {result['out_gb']} GB out, kept shards {'in the page cache' if a.warm else 'read from the disk'}; resumed bytes "
          f"{'identical to' if same else 'DIFFER from'} the fresh run's")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
