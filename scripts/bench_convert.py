#!/usr/bin/env python3
"""Conversion speed and memory against a copy baseline measured in the same run.

    python scripts/bench_convert.py --sizes 1 4 --formats gptq-sym gptq-asym awq ct --threads 1 2
    (also ct-asym, autoround; the float sources fp8, ct-fp8, bf16, nvfp4, mxfp4, modelopt-nvfp4:
    scripts/make_synthetic.py; gguf-q4_0, gguf-q4_k, gguf-q6_k, gguf-q8_0 and mlx: scripts/make_synthetic_gguf.py, which
    needs the gguf package)
    python scripts/bench_convert.py --layers 1 --experts 16 --formats all   # every source, small

``--experts N`` keeps the module shapes (2048x768 experts, the attention's) and writes N experts a
layer instead of 128: the per-module cost at a size a 2-core machine converts in seconds.

For each format and input size (GB), it writes a synthetic Qwen3-30B-A3B-shaped checkpoint
(scripts/make_synthetic.py), drops nothing from the page cache (these machines are shared),
then times in fresh subprocesses, each started after os.sync() so that no earlier run's dirty pages
are written back during it (without it the same run took 3 s or 7 s here):
  (a) baseline: read every input byte and write as many bytes as convert's output (cp-like);
  (b) int4pack convert on the same input.
It prints Mparam/s, the ratio convert/baseline and the peak RSS of each subprocess.

Peak RSS is the child's own VmHWM (/proc/self/status). ru_maxrss is not used: Linux carries the
parent's high-water mark into a forked child across exec, so a child of this (torch-importing,
checkpoint-writing) script reported ~600 MB for a 16 MB copy loop.

--compare-tree DIR also times convert from another int4pack checkout (e.g. the previous commit:
`git worktree add /tmp/prev HEAD~1`) on the same input, alternating with this one (ABBA: use an
even --repeat), and reports
this tree's speed over that one's: the only honest before/after on a machine whose speed drifts
between calls.
"""

from __future__ import annotations

import argparse
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
sys.path.insert(1, str(HERE.parent))  # this checkout's int4pack, installed or not
from make_synthetic import make  # noqa: E402
import make_synthetic_gguf  # noqa: E402  (gguf-*, mlx)

LAYER_GB = 0.31

PEAK = r"""
def peak_mb():
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
"""

BASELINE = PEAK + r"""
import os, sys, time, json
src, dst, out_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
t0 = time.perf_counter()
buf = bytearray(1 << 24)
mv = memoryview(buf)
n_in = 0
os.makedirs(dst, exist_ok=True)
with open(os.path.join(dst, "blob"), "wb") as w:
    left = out_bytes
    for f in sorted(os.listdir(src)):
        with open(os.path.join(src, f), "rb") as r:
            while True:
                k = r.readinto(mv)
                if not k:
                    break
                n_in += k
                take = min(left, k)
                w.write(mv[:take]); left -= take
    while left > 0:
        take = min(left, len(buf)); w.write(mv[:take]); left -= take
    w.flush(); os.fsync(w.fileno())
print(json.dumps({"seconds": time.perf_counter() - t0, "in": n_in, "rss_mb": peak_mb()}))
"""

CONVERT = PEAK + r"""
import os, sys, time, json
if os.environ.get("INT4PACK_BENCH_TREE"):  # --compare-tree: ahead of the cwd, which -c puts first
    sys.path.insert(0, os.environ["INT4PACK_BENCH_TREE"])
import int4pack
src, dst, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
serve = sys.argv[4] if len(sys.argv) > 4 else "compressed-tensors"
t0 = time.perf_counter()
r = int4pack.convert(src, dst, threads=threads or None, **({} if serve == "compressed-tensors" else {"serve_format": serve}))
p = r["plan"]
print(json.dumps({"seconds": time.perf_counter() - t0, "plan_seconds": r.get("seconds_plan"),
                  "out_bytes": p["out_bytes"], "paths": p["paths"],
                  "rss_mb": peak_mb(), "module": int4pack.__file__, "workers": r.get("workers")}))
"""


# each timed child first removes the previous run's output (outside its clock)
_RM = "import shutil, sys\nshutil.rmtree(sys.argv[2], ignore_errors=True)\nimport os\nos.sync()\n"
CONVERT_RM = _RM + CONVERT
BASELINE_RM = _RM + BASELINE


def _tree_env(tree: Path | None) -> dict | None:
    """The environment that makes a child import int4pack from ``tree`` (None: $INT4PACK_BENCH_TREE if
    set, else this checkout)."""
    tree = tree or Path(os.environ.get("INT4PACK_BENCH_TREE") or HERE.parent)
    return {**os.environ, "INT4PACK_BENCH_TREE": str(tree.resolve())}


def _run(code: str, *args, env=None) -> dict:
    env = env or _tree_env(None)
    r0 = os.times()
    res = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env)
    r1 = os.times()
    if res.returncode != 0:
        raise SystemExit(f"subprocess failed:\n{res.stderr[-3000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    # CPU of the whole child (interpreter start and imports included): user and kernel seconds
    out["cpu_user"] = r1.children_user - r0.children_user
    out["cpu_sys"] = r1.children_system - r0.children_system
    return out


def _best(code: str, repeat: int, *args, env=None) -> dict:
    """The fastest of ``repeat`` runs (these machines are shared: the minimum is the least disturbed)."""
    runs = [_run(code, *args, env=env) for _ in range(repeat)]
    best = min(runs, key=lambda r: r["seconds"])
    best["all_seconds"] = [round(r["seconds"], 2) for r in runs]
    best["plan_all"] = [r.get("plan_seconds") for r in runs]
    return best


def _least(seconds: list) -> float | None:
    """The fastest of the runs' plan seconds: the serial validation before any job, part of convert_s,
    small and steadier than the whole (None from a tree that does not report it)."""
    known = [x for x in seconds if x is not None]
    return round(min(known), 3) if known else None


def print_table(header: list[str], rows: list[list]) -> None:
    """A markdown table."""
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")


def _params(folder: Path) -> int:
    """Quantised parameters in the source: 8 per packed int32 word of qweight/weight_packed, 2 per U8
    E2M1 pair (FP4), 1 per FP8 weight, and the 2-D float weights of the decoder layers but the
    routers (a bf16 source: what convert quantises)."""
    from safetensors import safe_open

    float_source = "quantization_config" not in json.loads((folder / "config.json").read_text())
    n = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                sl = fh.get_slice(k)
                shape, dtype = sl.get_shape(), sl.get_dtype()
                if len(shape) != 2:
                    continue
                if k.endswith((".qweight", ".weight_packed")):
                    n += shape[0] * shape[1] * (2 if dtype == "U8" else 8)
                elif k.endswith(".weight") and dtype == "U8":  # ModelOpt NVFP4
                    n += shape[0] * shape[1] * 2
                elif k.endswith(".weight") and (dtype.startswith("F8") or (
                        float_source and ".layers." in k and not k.endswith("mlp.gate.weight"))):
                    n += shape[0] * shape[1]
    return n


ALL = ("gptq-sym", "gptq-asym", "awq", "ct", "ct-asym", "autoround", "fp8", "ct-fp8", "bf16", "nvfp4", "mxfp4",
       "modelopt-nvfp4", "gguf-q4_0", "gguf-q4_k", "gguf-q6_k", "gguf-q8_0", "mlx")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=float, nargs="+", default=[1.0], help="input sizes in GB")
    ap.add_argument("--formats", nargs="+", default=["gptq-sym", "gptq-asym", "awq", "ct"],
                    help=f"source formats, or all: {' '.join(ALL)}")
    ap.add_argument("--experts", type=int, default=128, help="experts a layer (128: Qwen3-30B-A3B's)")
    ap.add_argument("--threads", type=int, nargs="+", default=[2], help="0: convert's default")
    ap.add_argument("--layers", type=int, default=None,
                    help="input size as a layer count (48: the full Qwen3-30B-A3B shape, 15.7 GB); overrides --sizes")
    ap.add_argument("--serve-formats", nargs="+", default=["compressed-tensors"],
                    choices=["compressed-tensors", "kleidiai"], help="output formats to convert to")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--input-dir", type=Path, default=None,
                    help="write the synthetic inputs here instead of --workdir (outputs stay there): a tmpfs "
                         "such as /dev/shm where the disk cannot hold a 48-layer float input and its output")
    ap.add_argument("--repeat", type=int, default=1, help="time each case this many times, keep the fastest")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--compare-tree", type=Path, default=None,
                    help="another int4pack checkout to time on the same inputs (see above)")
    a = ap.parse_args()
    if a.formats == ["all"]:
        a.formats = list(ALL)
    if a.compare_tree is not None and not (a.compare_tree / "int4pack" / "__init__.py").is_file():
        raise SystemExit(f"--compare-tree {a.compare_tree}: no int4pack package there")
    from int4pack import kernels
    print("convert_kernels extension:", "loaded" if kernels.ext() is not None else "not available (torch twins)")
    work = a.workdir or Path(tempfile.mkdtemp(prefix="int4pack-bench-"))
    rows = []
    for fmt in a.formats:
        for gb in ([None] if a.layers else a.sizes):
            layers = a.layers or max(1, round(gb / LAYER_GB))
            src = (a.input_dir or work) / (f"{fmt}-{layers}L" + ("" if a.experts == 128 else f"-{a.experts}E"))
            if not src.exists():
                t0 = time.perf_counter()
                if fmt in make_synthetic_gguf.FORMATS:
                    make_synthetic_gguf.make(src, fmt, layers, experts=a.experts)
                else:
                    make(src, fmt, layers, experts=a.experts)
                print(f"wrote {src} in {time.perf_counter() - t0:.1f} s", flush=True)
            size = sum(p.stat().st_size for p in src.iterdir())
            params = make_synthetic_gguf.params(src) if fmt in make_synthetic_gguf.FORMATS else _params(src)
            bases: dict[int, dict] = {}  # one baseline per output size: it does not depend on the threads
            for serve, th in [(sv, th) for sv in a.serve_formats for th in a.threads]:
                dst = work / "out"
                shutil.rmtree(dst, ignore_errors=True)
                other = None
                if a.compare_tree is None:
                    conv = _best(CONVERT_RM, a.repeat, src, dst, th, serve)
                else:  # alternate the two trees, first one then the other (ABBA), so a drift of the
                    # machine, and the slower first run after the previous case, hit both alike
                    runs = []
                    for i in range(a.repeat):
                        pair = [None, None]
                        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
                            pair[which] = _run(CONVERT_RM, src, dst, th, serve,
                                               env=_tree_env(a.compare_tree if which else None))
                        runs.append(pair)
                    conv = min((r[0] for r in runs), key=lambda r: r["seconds"])
                    other = min((r[1] for r in runs), key=lambda r: r["seconds"])
                    conv["all_seconds"] = [round(r[0]["seconds"], 2) for r in runs]
                    other["all_seconds"] = [round(r[1]["seconds"], 2) for r in runs]
                    conv["plan_all"] = [r[0].get("plan_seconds") for r in runs]
                    other["plan_all"] = [r[1].get("plan_seconds") for r in runs]
                if conv["out_bytes"] not in bases:
                    bases[conv["out_bytes"]] = _best(BASELINE_RM, a.repeat, src, dst, conv["out_bytes"])
                base = bases[conv["out_bytes"]]
                shutil.rmtree(dst, ignore_errors=True)
                row = {"format": fmt, "serve_format": serve, "layers": layers, "experts": a.experts,
                       "in_gb": round(size / 1e9, 2), "mparams": round(params / 1e6, 1),
                       "threads": th or "default", "workers": conv.get("workers"),
                       "mparam_s": round(params / conv["seconds"] / 1e6, 1),
                       "convert_s": round(conv["seconds"], 2), "baseline_s": round(base["seconds"], 2),
                       "ratio": round(conv["seconds"] / base["seconds"], 2),
                       "convert_cpu_user_s": round(conv["cpu_user"], 2), "convert_cpu_sys_s": round(conv["cpu_sys"], 2),
                       "convert_all_s": conv["all_seconds"], "baseline_all_s": base["all_seconds"],
                       "rss_mb": round(conv["rss_mb"]), "baseline_rss_mb": round(base["rss_mb"]),
                       "paths": conv["paths"], "plan_s": _least(conv["plan_all"])}
                if other is not None:
                    row.update({"other_tree": str(a.compare_tree), "other_mparam_s": round(params / other["seconds"] / 1e6, 1),
                                "other_convert_s": round(other["seconds"], 2), "other_all_s": other["all_seconds"],
                                "other_rss_mb": round(other["rss_mb"]), "other_module": other["module"],
                                "other_cpu_user_s": round(other["cpu_user"], 2), "other_cpu_sys_s": round(other["cpu_sys"], 2),
                                "cpu_speedup_vs_other": round((other["cpu_user"] + other["cpu_sys"]) /
                                                              (conv["cpu_user"] + conv["cpu_sys"]), 3),
                                "speedup_vs_other": round(other["seconds"] / conv["seconds"], 3),
                                "other_plan_s": _least(other["plan_all"])})
                rows.append(row)
                print(json.dumps(row), flush=True)
                if a.json:  # after every row: a run cut short keeps what it measured
                    a.json.write_text(json.dumps(rows, indent=1))
            if not a.workdir or a.input_dir:
                shutil.rmtree(src, ignore_errors=True)
    print()
    print_table(["format", "serve format", "input GB", "threads", "Mparam/s", "convert s", "baseline s",
                 "convert/baseline", "convert CPU user+sys s", "peak RSS MB", "baseline RSS MB", "plan s"],
                [[r["format"], r["serve_format"], r["in_gb"], r["threads"], r["mparam_s"], r["convert_s"], r["baseline_s"], r["ratio"],
                  f"{r['convert_cpu_user_s']}+{r['convert_cpu_sys_s']}", r["rss_mb"], r["baseline_rss_mb"], r["plan_s"]]
                 for r in rows])
    if a.compare_tree is not None:
        print()
        print_table(["format", "input GB", "threads", "Mparam/s this tree", f"Mparam/s {a.compare_tree}", "speedup",
                     "CPU s this / that", "CPU speedup", "peak RSS MB this / that", "plan s this / that"],
                    [[f"{r['format']} {r['serve_format']}", r["in_gb"], r["threads"], r["mparam_s"], r["other_mparam_s"],
                      r["speedup_vs_other"],
                      f"{r['convert_cpu_user_s'] + r['convert_cpu_sys_s']:.2f} / {r['other_cpu_user_s'] + r['other_cpu_sys_s']:.2f}",
                      r["cpu_speedup_vs_other"],
                      f"{r['rss_mb']} / {r['other_rss_mb']}", f"{r['plan_s']} / {r['other_plan_s']}"] for r in rows])
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
