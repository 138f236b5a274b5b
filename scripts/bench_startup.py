#!/usr/bin/env python3
"""Start-up of a small convert, as a user sees it: seconds from the process's start to its first
line, to the plan's last line ("tensors: ... read -> ... written"), to the moment torch's import
starts and ends, and to the process's end. Beside it, its baselines on the same host: an empty
interpreter, ``python -c "import torch"`` and ``int4pack --help``. Best (minimum) of --repeat runs.

    python scripts/bench_startup.py                       # tests/fixtures/gptq_q3_sym
    python scripts/bench_startup.py SRC --repeat 5 --json F

The command is the installed ``int4pack`` script (or ``python -m int4pack`` with --module), run
with ``-X importtime`` off and an audit hook that stamps torch's import on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAN_LINE = re.compile(r"^\s+tensors: \d+ in -> \d+ out .* written")
# a wrapper: stamps torch's import (start and end) on stderr, then runs the CLI as the console script does
WRAPPER = """
import sys, time
def hook(event, args):
    if event == 'import' and args[0] == 'torch':
        print(f'@torch-start {time.time():.6f}', file=sys.stderr, flush=True)
sys.addaudithook(hook)
sys.argv = ['int4pack', *sys.argv[1:]]
from int4pack.cli import main
import int4pack._lazy as lazy
_load = lazy.load_torch
def load():
    first = 'torch' not in sys.modules
    mod = _load()
    if first:
        print(f'@torch-end {time.time():.6f}', file=sys.stderr, flush=True)
    return mod
lazy.load_torch = load
main()
"""


def timed(cmd: list[str], env: dict) -> dict:
    """Run cmd; seconds from its start to the first stdout line, the plan line, torch's import, the end."""
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, bufsize=1)
    first = plan = None
    for line in p.stdout:
        now = time.time() - t0
        first = now if first is None else first
        if plan is None and PLAN_LINE.match(line):
            plan = now
    err = p.stderr.read()
    rc = p.wait()
    end = time.time() - t0
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {rc}:\n{err[-2000:]}")
    stamps = {k: float(v) - t0 for k, v in re.findall(r"^@(torch-start|torch-end) ([\d.]+)$", err, re.M)}
    return {"first_line_s": first, "plan_s": plan, "torch_start_s": stamps.get("torch-start"),
            "torch_end_s": stamps.get("torch-end"), "total_s": end}


def best(runs: list[dict]) -> dict:
    return {k: min((r[k] for r in runs if r[k] is not None), default=None) for k in runs[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", nargs="?", default=str(ROOT / "tests/fixtures/gptq_q3_sym"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = ap.parse_args()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120"}
    py = sys.executable
    work = Path(tempfile.mkdtemp(prefix="int4pack-startup-"))
    try:
        rows = {}
        rows["python -c pass"] = best([timed([py, "-c", "pass"], env) for _ in range(args.repeat)])
        rows["python -c 'import torch'"] = best([timed([py, "-c", "import torch"], env) for _ in range(args.repeat)])
        rows["int4pack --help"] = best([timed([py, "-c", WRAPPER, "--help"], env) for _ in range(args.repeat)])
        runs = []
        for i in range(args.repeat):
            runs.append(timed([py, "-c", WRAPPER, "convert", args.src, str(work / f"out{i}")], env))
        rows[f"int4pack convert {args.src} OUT"] = best(runs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'command':60s} {'first':>6s} {'plan':>6s} {'torch+':>7s} {'torch=':>7s} {'total':>6s}  (s, best of "
          f"{args.repeat}; torch+/=: its import starts/ends)")
    for name, r in rows.items():
        cells = [f"{r[k]:.2f}" if r[k] is not None else "-" for k in
                 ("first_line_s", "plan_s", "torch_start_s", "torch_end_s", "total_s")]
        print(f"{name[-60:]:60s} {cells[0]:>6s} {cells[1]:>6s} {cells[2]:>7s} {cells[3]:>7s} {cells[4]:>6s}")
    if args.json:
        Path(args.json).write_text(json.dumps({"host_cores": os.cpu_count(), "repeat": args.repeat,
                                               "python": sys.version.split()[0], "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
