#!/usr/bin/env python3
"""What the vLLM plugin's per-blob check costs at load, on Qwen3-30B-A3B-sized layers.

    python scripts/bench_blob_crc.py WORK [--layers 2] [--threads 1,2]

Writes a synthetic GPTQ source in Qwen3-30B-A3B shapes (scripts/make_synthetic.py: hidden 2048,
128 experts of 768, group 128), converts it with ``--serve-format kleidiai``, then for each layer
does what the plugin does (int4pack/vllm_plugin/_layout.py): every blob copied into its
ExpertBlobs / DenseBlobs parameter, then ``check_bytes`` (zlib CRC-32 of every blob, one thread
per core, against the layout record's blob_checks). Prints the bytes checked, wall and CPU
seconds of the checks alone, GB/s, and the extrapolation to a full 48-layer 30B-A3B packed
checkpoint (its blobs: ~16 GB).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

HERE = Path(__file__).resolve().parent
FULL_BLOB_GB = 16.0  # a 48-layer Qwen3-30B-A3B packed checkpoint's blobs (docs/serve-format.md)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", default="1,2", help="thread counts to measure the check with")
    a = ap.parse_args()

    import int4pack
    from int4pack.serve_spec import SUFFIX
    from int4pack.architectures import classify, vllm_module
    from int4pack.vllm_plugin import _layout

    src, out = a.work / "src", a.work / "packed"
    if not (src / "config.json").is_file():
        subprocess.run([sys.executable, str(HERE / "make_synthetic.py"), str(src), "--format", "gptq-sym",
                        "--layers", str(a.layers)], check=True)
    if not (out / "config.json").is_file():
        t = time.perf_counter()
        int4pack.convert(src, out, serve_format="kleidiai")
        print(f"convert: {time.perf_counter() - t:.1f} s")
    cfg = json.loads((out / "config.json").read_text())
    rec = cfg["quantization_config"]["kleidiai"]
    blobs: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            blobs.update({k[: -len(SUFFIX) - 1]: fh.get_tensor(k) for k in fh.keys() if k.endswith(SUFFIX)})
    units: dict[str, list[str]] = {}
    for m in blobs:
        units.setdefault(vllm_module(m), []).append(m)
    total = sum(b.numel() for b in blobs.values())
    # what the plugin's loaders hold once loaded: [E, bytes] per MoE layer, [bytes] per (fused) linear
    loaded = []
    for unit, mods in sorted(units.items()):
        g = rec["blob_checks"]["modules"][unit]["group_size"]
        if classify(mods[0])[0] == "expert":
            n_exp = 1 + max(int(m.split(".")[-2]) for m in mods)
            eb = _layout.ExpertBlobs(n_exp, 2048, 768, g, _layout.blob_check(rec, unit, experts=n_exp))
            params = {w: eb.empty(w) for w in ("w13", "w2")}
            for m in mods:
                e, proj = int(m.split(".")[-2]), m.split(".")[-1]
                shard = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[proj]
                eb.load(torch.nn.Parameter(params["w2" if shard == "w2" else "w13"], requires_grad=False),
                        blobs[m], weight_name=unit, shard_id=shard, expert_id=e)
            loaded.append(eb)
        else:
            chk = _layout.blob_check(rec, unit)
            names = [chk.tensor(i)[: -len(SUFFIX) - 1] for i in range(len(chk.names))]
            sizes = [blobs[n].numel() for n in names]
            db = _layout.DenseBlobs([8], 128 if g == -1 else g, g)  # only its data and offsets matter here
            db.check = chk
            db.data = torch.cat([blobs[n] for n in names])
            db.offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
            loaded.append(db)
    print(f"{len(blobs)} blobs, {total / 1e9:.3f} GB in {a.layers} layer(s)")
    res = {}
    for n in (int(x) for x in a.threads.split(",")):
        _layout.MAX_THREADS = n
        w0, c0 = time.perf_counter(), time.process_time()
        for L in loaded:
            L.check_bytes()
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        res[n] = {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "gb_per_s": round(total / 1e9 / wall, 2),
                  "gb_per_cpu_s": round(total / 1e9 / cpu, 2),
                  "full_30b_a3b_s": round(FULL_BLOB_GB / (total / 1e9 / wall), 1)}
        print(f"threads {n}: check {wall:.3f} s wall, {cpu:.3f} s CPU: {res[n]['gb_per_s']} GB/s "
              f"({res[n]['gb_per_cpu_s']} GB per CPU-second); a 48-layer 30B-A3B ({FULL_BLOB_GB:.0f} GB of blobs): "
              f"~{res[n]['full_30b_a3b_s']} s")
    print(json.dumps({"bytes": total, "layers": a.layers, "results": res}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
