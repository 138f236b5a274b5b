#!/usr/bin/env python3
"""What the vLLM plugin's per-blob check costs at load, on Qwen3-30B-A3B-sized layers.

    python scripts/bench_blob_crc.py WORK [--layers 2] [--threads 1,2] [--repeat 5] [--engines native,zlib]

Writes a synthetic GPTQ source in Qwen3-30B-A3B shapes (scripts/make_synthetic.py: hidden 2048,
128 experts of 768, group 128), converts it with ``--serve-format kleidiai``, then for each layer
does what the plugin does (int4pack/vllm_plugin/_layout.py): every blob copied into its
ExpertBlobs / DenseBlobs parameter (each expert blob's CRC-32 taken by the plugin's checking thread
once it is copied, while the load goes on), then ``check_bytes`` (the rest of the CRC-32s on one
thread per core, and the comparison with the layout record's blob_checks). ``--threads``: how many
threads check_bytes takes (the plugin: one per core, at most 16). ``--engines``: the CRC-32 by the C++ library, which the plugin takes where it is built, and
by zlib, its fallback. The cost of the checks is the checked load's time over the same load with no
checks, plus the records read (``blob_check``: each module's record, refused where it is missing or
out of shape) and ``check_bytes``; the share is that cost over the checked load. The load is the
cheapest there is: the blobs read from the checkpoint (safetensors, from the page cache once
converted) and copied into fresh parameters as the plugin's loaders copy them, on one torch thread
(torch's parallel copies, on a shared host, time their OpenMP threads waiting for the other jobs);
a vLLM load also reads the disk and builds the model, so the share is an upper bound. ``--cold``
drops the checkpoint's pages from the page cache before each load: the blobs come from the disk. The cases
run in turn ``--repeat`` times; the least of each is reported (a shared host only adds time).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch
from safetensors import safe_open

HERE = Path(__file__).resolve().parent
FULL_BLOB_GB = 16.0  # a 48-layer Qwen3-30B-A3B packed checkpoint's blobs (docs/serve-format.md)


class _Clock:
    """Wall and CPU seconds summed over start/stop pairs."""

    def __init__(self):
        self.wall = self.cpu = 0.0

    def start(self) -> None:
        self._w, self._c = time.perf_counter(), time.process_time()

    def stop(self) -> None:
        self.wall += time.perf_counter() - self._w
        self.cpu += time.process_time() - self._c


def _evict(out: Path) -> None:
    """The packed checkpoint's pages out of the page cache (clean pages: no root needed)."""
    for f in out.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _load(out: Path, rec: dict, checked: bool = True):
    """What the plugin's loaders hold once loaded ([E, bytes] per MoE layer, [bytes] per (fused)
    linear), the blobs' count and bytes, the load's clock and its record reads' (blob_check) clock."""
    from int4pack.architectures import classify, vllm_module
    from int4pack.serve_spec import SUFFIX
    from int4pack.vllm_plugin import _layout

    torch.set_num_threads(1)
    load, record = _Clock(), _Clock()
    load.start()
    blobs: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            blobs.update({k[: -len(SUFFIX) - 1]: fh.get_tensor(k) for k in fh.keys() if k.endswith(SUFFIX)})
    units: dict[str, list[str]] = {}
    for m in blobs:
        units.setdefault(vllm_module(m), []).append(m)
    loaded = []
    for unit, mods in sorted(units.items()):
        g = rec["blob_checks"]["modules"][unit]["group_size"]
        record.start()
        n_exp = 1 + max(int(m.split(".")[-2]) for m in mods) if classify(mods[0])[0] == "expert" else None
        chk = _layout.blob_check(rec, unit, experts=n_exp) if checked else None
        record.stop()
        if n_exp is not None:
            eb = _layout.ExpertBlobs(n_exp, 2048, 768, g, check=chk)
            params = {w: eb.empty(w) for w in ("w13", "w2")}
            for m in mods:
                e, proj = int(m.split(".")[-2]), m.split(".")[-1]
                shard = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[proj]
                eb.load(torch.nn.Parameter(params["w2" if shard == "w2" else "w13"], requires_grad=False),
                        blobs[m], weight_name=unit, shard_id=shard, expert_id=e)
            loaded.append(eb)
        else:
            names = [chk.tensor(i)[: -len(SUFFIX) - 1] for i in range(len(chk.names))] if chk else sorted(mods)
            sizes = [blobs[n].numel() for n in names]
            db = _layout.DenseBlobs([8], 128 if g == -1 else g, g)  # only its data and offsets matter here
            db.check = chk
            db.data = torch.cat([blobs[n] for n in names])
            db.offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
            loaded.append(db)
    load.stop()
    load.wall -= record.wall
    load.cpu -= record.cpu
    return loaded, len(blobs), sum(b.numel() for b in blobs.values()), load, record


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", default="1,2", help="thread counts to measure the check with")
    ap.add_argument("--repeat", type=int, default=5, help="loads (and checks per thread count) to take the least of")
    ap.add_argument("--engines", default="native,zlib", help="CRC-32 engines to time: native (the C++ library), zlib")
    ap.add_argument("--cold", action="store_true",
                    help="drop the checkpoint's pages from the page cache before each load (a load from the disk)")
    a = ap.parse_args()

    import int4pack
    from int4pack.vllm_plugin import _blob_crc

    src, out = a.work / "src", a.work / "packed"
    if not (src / "config.json").is_file():
        subprocess.run([sys.executable, str(HERE / "make_synthetic.py"), str(src), "--format", "gptq-sym",
                        "--layers", str(a.layers)], check=True)
    if not (out / "config.json").is_file():
        t = time.perf_counter()
        int4pack.convert(src, out, serve_format="kleidiai")
        print(f"convert: {time.perf_counter() - t:.1f} s")
    rec = json.loads((out / "config.json").read_text())["quantization_config"]["kleidiai"]
    threads = [int(x) for x in a.threads.split(",")]
    native = _blob_crc.engine()
    if native is zlib.crc32 and "native" in a.engines.split(","):
        raise SystemExit("the C++ library is not built here: `python -m int4pack._build`, or --engines zlib")
    engines = {"native": native, "zlib": zlib.crc32}
    cases = [(e, n) for e in a.engines.split(",") for n in threads]
    best: dict = {}  # the least wall and CPU seconds of each measurement

    def keep(key, wall: float, cpu: float) -> None:
        w, c = best.get(key, (wall, cpu))
        best[key] = (min(w, wall), min(c, cpu))

    for _ in range(max(1, a.repeat)):  # the cases in turn, so that a drift of the host hits all alike
        for case in [None] + cases:  # None: the same load with no checks (the plugin's opt-out)
            if case is not None:
                _blob_crc.MAX_THREADS = case[1]  # check_bytes' threads (for what the checking thread has not summed)
                _blob_crc.engine = lambda e=case[0]: engines[e]
            if a.cold:
                _evict(out)
            loaded, count, total, load, record = _load(out, rec, checked=case is not None)
            keep(("load", case), load.wall, load.cpu)
            keep(("record", case), record.wall, record.cpu)
            if case is not None:
                w0, c0 = time.perf_counter(), time.process_time()
                for L in loaded:
                    L.check_bytes()
                keep(("check", case), time.perf_counter() - w0, time.process_time() - c0)
            del loaded
    bare_wall, bare_cpu = best[("load", None)]
    print(f"{count} blobs, {total / 1e9:.3f} GB in {a.layers} layer(s); load with no checks {bare_wall:.3f} s wall, "
          f"{bare_cpu:.3f} s CPU (least of {a.repeat})")
    res = {}
    for e, n in cases:
        (lw, lc), (rw, rc), (cw, cc) = (best[(k, (e, n))] for k in ("load", "record", "check"))
        # the checks' cost: the checked load over the unchecked one (the CRCs taken as each blob is
        # copied), the records read, and check_bytes (the comparison, and any blob not yet summed)
        wall, cpu = max(0.0, lw - bare_wall) + rw + cw, max(0.0, lc - bare_cpu) + rc + cc
        res[f"{e}_{n}"] = r = {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "gb_per_s": round(total / 1e9 / max(wall, 1e-6), 2),
                               "gb_per_cpu_s": round(total / 1e9 / max(cpu, 1e-6), 2),
                               "full_30b_a3b_s": round(FULL_BLOB_GB / (total / 1e9) * wall, 2),
                               "of_load_wall": round(wall / (bare_wall + wall), 4),
                               "of_load_cpu": round(cpu / (bare_cpu + cpu), 4)}
        print(f"{e}, threads {n}: checks {wall:.3f} s wall, {cpu:.3f} s CPU ({r['gb_per_cpu_s']} GB per CPU-second); "
              f"a 48-layer 30B-A3B ({FULL_BLOB_GB:.0f} GB of blobs): ~{r['full_30b_a3b_s']} s; the checks are "
              f"{100 * r['of_load_wall']:.1f}% of the checked load's wall time, {100 * r['of_load_cpu']:.1f}% of its CPU time")
    print(json.dumps({"bytes": total, "layers": a.layers, "repeat": a.repeat, "load_wall_s": round(bare_wall, 3),
                      "load_cpu_s": round(bare_cpu, 3), "results": res}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
