#!/usr/bin/env python3
"""--resume after the last shard against a fresh convert, measured in the same run.

    python scripts/bench_resume.py --layers 3 --format gptq-sym --repeat 3
    python scripts/bench_resume.py --layers 48 --format gptq-sym --max-shard-size 1.5GB --repeat 3  # 16 cores
    python scripts/bench_resume.py --layers 3 --check-kept  # every kept byte read, as with --check-kept
    python scripts/bench_resume.py --layers 4 --repeat 4 --compare-tree /tmp/prev  # before/after, one run

It writes a synthetic Qwen3-30B-A3B-shaped checkpoint (scripts/make_synthetic.py), then, per repeat,
in fresh subprocesses each started after os.sync():
  (a) fresh: ``int4pack convert SRC OUT`` into an empty place;
  (b) a run stopped just before it swaps its work folder into place (every shard finished: what a
      kill after the last shard leaves; not timed), then ``--resume`` of it, timed.
Each time is the child's wall clock from its start to its exit (interpreter start and imports
included: what a user waits), and convert()'s own seconds beside it. It prints the ratio
resume/fresh (best of each, and per repeat), checks that the resumed output's files are
byte-identical to the fresh one's, and exits 1 if they are not. Each tree's package is byte-compiled
first (as ``pip install`` leaves it): without its .pyc files every child would compile the modules it
imports, which a user pays once.

--compare-tree DIR runs the same (fresh, stopped, resume) trio with another int4pack checkout
(e.g. ``git worktree add /tmp/prev HEAD~1``) on the same source, alternating with this tree (ABBA:
use an even --repeat), and reports both trees' ratios and this tree's resume over that one's: the
honest before/after on a machine whose speed drifts between calls.
"""

from __future__ import annotations

import argparse
import compileall
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
                      "plan_reused": r.get("resume", {}).get("plan_reused"),
                      "out_bytes": r["plan"]["out_bytes"]}))
"""


def _child(*args, tree: Path = HERE.parent) -> dict:
    env = {**os.environ, "INT4PACK_BENCH_TREE": str(tree)}
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
    ap.add_argument("--compare-tree", type=Path, default=None,
                    help="another int4pack checkout to measure on the same source, alternating (see above)")
    a = ap.parse_args()
    trees = [HERE.parent] + ([a.compare_tree.resolve()] if a.compare_tree else [])
    for tree in trees:
        if not (tree / "int4pack" / "__init__.py").is_file():
            raise SystemExit(f"{tree}: no int4pack package there")
        compileall.compile_dir(tree / "int4pack", quiet=1)
    work = a.workdir or Path(tempfile.mkdtemp(prefix="int4pack-bench-resume-"))
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"{a.format}-{a.layers}L"
    if not src.exists():
        t = time.perf_counter()
        make(src, a.format, a.layers)
        print(f"wrote {src} in {time.perf_counter() - t:.1f} s", flush=True)
    fresh_out, resumed_out = work / "fresh", work / "resumed"
    opts = (a.max_shard_size, a.threads, a.serve_format, int(a.check_kept))
    runs: list[list[dict]] = [[] for _ in trees]
    same = [True for _ in trees]
    last: list[dict] = [{} for _ in trees]
    for i in range(a.repeat):
        for which in (range(len(trees)) if i % 2 == 0 else reversed(range(len(trees)))):
            tree = trees[which]
            for d in (fresh_out, resumed_out, resumed_out.parent / f".{resumed_out.name}.int4pack-partial"):
                shutil.rmtree(d, ignore_errors=True)
            fresh = _child("fresh", src, fresh_out, *opts, tree=tree)
            _child("stop", src, resumed_out, *opts, tree=tree)
            if a.warm:
                for p in resumed_out.parent.glob(f".{resumed_out.name}.int4pack-partial/*.safetensors"):
                    with open(p, "rb") as fh:
                        while fh.read(16 << 20):
                            pass
            resumed = _child("resume", src, resumed_out, *opts, tree=tree)
            if resumed["kept"] != resumed["shards"]:
                raise SystemExit(f"{tree}: resume kept {resumed['kept']} of {resumed['shards']} shards")
            if i < 2:
                same[which] = same[which] and _digests(fresh_out) == _digests(resumed_out)
            last[which] = {"fresh": fresh, "resumed": resumed}
            runs[which].append({"fresh_wall_s": round(fresh["wall_s"], 2), "resume_wall_s": round(resumed["wall_s"], 2),
                                "fresh_convert_s": round(fresh["convert_s"], 2),
                                "resume_convert_s": round(resumed["convert_s"], 2),
                                "plan_reused": resumed.get("plan_reused"),
                                "ratio_wall": round(resumed["wall_s"] / fresh["wall_s"], 3)})
            print(json.dumps({"tree": str(tree), **runs[which][-1]}), flush=True)
    results = [_summary(a, src, trees[k], runs[k], last[k], same[k]) for k in range(len(trees))]
    result = results[0]
    if len(trees) > 1:
        result["other"] = results[1]
        result["resume_speedup_vs_other"] = round(results[1]["resume_s"] / result["resume_s"], 3)
    print(json.dumps(result))
    for r in results:
        print(f"\n{r['tree']}: resume after the last shard / fresh convert: {r['ratio']:.3f} "
              f"({r['resume_s']:.2f} s / {r['fresh_s']:.2f} s, best of {a.repeat}; convert() alone: "
              f"{r['resume_convert_s']:.2f} s / {r['fresh_convert_s']:.2f} s = {r['ratio_convert']:.3f}); "
              f"{r['shards']} shards, {r['out_gb']} GB out, kept shards {'in the page cache' if a.warm else 'read from the disk'}; resumed bytes "
              f"{'identical to' if r['byte_identical'] else 'DIFFER from'} the fresh run's")
    if len(trees) > 1:
        print(f"\nresume, this tree ({result['tree']}) over {trees[1]} ({results[1]['tree']}): "
              f"{result['resume_speedup_vs_other']:.2f}x faster")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(0 if all(same) else 1)


def _commit(tree: Path) -> str:
    """The tree's commit (with "+" where its files differ from it): what a result row names, not a path."""
    def git(*args):
        return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short=12", "HEAD")
    return (head + ("+" if git("status", "--porcelain", "--untracked-files=no") else "")) if head else "unknown"


def _summary(a, src: Path, tree: Path, runs: list[dict], last: dict, same: bool) -> dict:
    best_f = min(r["fresh_wall_s"] for r in runs)
    best_r = min(r["resume_wall_s"] for r in runs)
    fresh, resumed = last["fresh"], last["resumed"]
    return {"tree": _commit(tree), "format": a.format, "layers": a.layers, "serve_format": a.serve_format, "warm": a.warm,
            "check_kept": a.check_kept, "kept_unread": resumed["unread"], "plan_reused": resumed.get("plan_reused"),
            "in_gb": round(sum(p.stat().st_size for p in src.iterdir()) / 1e9, 2),
            "out_gb": round(fresh["out_bytes"] / 1e9, 2), "shards": fresh["shards"], "workers": fresh["workers"],
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "fresh_s": best_f, "resume_s": best_r, "ratio": round(best_r / best_f, 3),
            "fresh_convert_s": min(r["fresh_convert_s"] for r in runs),
            "resume_convert_s": min(r["resume_convert_s"] for r in runs),
            "ratio_convert": round(min(r["resume_convert_s"] for r in runs) / min(r["fresh_convert_s"] for r in runs), 3),
            "byte_identical": same, "runs": runs}


if __name__ == "__main__":
    main()
