#!/usr/bin/env python3
"""Throughput of int4pack's portable KleidiAI packer on a Qwen3-30B-A3B-sized expert set.

Per layer: 128 experts, w13 [1536, 2048] and w2 [2048, 768] (int4 values held as int8), group
128 and channelwise. GB/s counts int4 input bytes (N*K/2 per expert). The baseline is a plain
copy of that many bytes (``Tensor.copy_`` into a preallocated buffer, and ``clone``) in the
same run, so the ratio says how far packing is from memory speed on this host. Packing into a
reused buffer is compared with ``copy_``; packing into a fresh tensor with ``clone`` (both pay
the page faults of new memory).

Usage:  python scripts/bench_pack.py [--threads T] [--experts E] [--repeat R] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from int4pack import kleidiai  # noqa: E402

SHAPES = {"w13": (1536, 2048), "w2": (2048, 768)}


def best_of(fn, repeat: int) -> float:
    fn()  # warm-up (page faults, thread pool start)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None, help="torch/ATen threads (default: torch's)")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if kleidiai._ext_mod() is None:
        print("C++ packer unavailable: " + str(kleidiai._ext.build_error("kleidiai_pack")), file=sys.stderr)
        return 1
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        q = torch.randint(-8, 8, (a.experts, n, k), generator=gen, dtype=torch.int8)
        int4_bytes = a.experts * n * k // 2
        src = torch.randint(0, 256, (int4_bytes,), generator=gen, dtype=torch.uint8)
        dst = torch.empty_like(src)
        t_copy = best_of(lambda: dst.copy_(src), a.repeat)
        t_clone = best_of(lambda: src.clone(), a.repeat)
        for g in (128, -1):
            if g == -1:
                s = torch.rand(a.experts, n, 1, generator=gen) * 0.01
            else:
                s = (torch.rand(a.experts, n, k // g, generator=gen) * 0.01).to(torch.bfloat16)
            b = torch.randn(a.experts, n, generator=gen)
            out_bytes = a.experts * kleidiai.packed_size(n, k, g)
            buf = torch.empty((a.experts, out_bytes // a.experts), dtype=torch.uint8)
            t_pack = best_of(lambda: kleidiai.pack_experts(q, s, b, g, out=buf), a.repeat)
            t_alloc = best_of(lambda: kleidiai.pack_experts(q, s, b, g), a.repeat)
            del buf
            row = {
                "tensor": name, "shape": [a.experts, n, k], "group": g, "threads": threads,
                "int4_MB": round(int4_bytes / 1e6, 1), "out_MB": round(out_bytes / 1e6, 1),
                "pack_s": round(t_pack, 4), "pack_GBps": round(int4_bytes / t_pack / 1e9, 2),
                "copy_GBps": round(int4_bytes / t_copy / 1e9, 2),
                "pack_alloc_GBps": round(int4_bytes / t_alloc / 1e9, 2),
                "clone_GBps": round(int4_bytes / t_clone / 1e9, 2),
            }
            # into a reused buffer vs copy_; allocating a fresh output vs clone (page faults both)
            row["pack_vs_copy"] = round(row["pack_GBps"] / row["copy_GBps"], 3)
            row["pack_alloc_vs_clone"] = round(row["pack_alloc_GBps"] / row["clone_GBps"], 3)
            rows.append(row)
            print(f"{name} [{a.experts},{n},{k}] g={g if g > 0 else 'channel':>7} threads={threads}: "
                  f"pack->buf {row['pack_GBps']:5.2f} GB/s vs copy_ {row['copy_GBps']:5.2f} "
                  f"(x{row['pack_vs_copy']:.2f}) | pack->new {row['pack_alloc_GBps']:5.2f} GB/s vs clone "
                  f"{row['clone_GBps']:5.2f} (x{row['pack_alloc_vs_clone']:.2f})", flush=True)
        del q
    total_bytes = sum(r["int4_MB"] for r in rows) * 1e6
    total_s = sum(r["pack_s"] for r in rows)
    print(f"all four: {total_bytes / 1e6:.0f} MB int4 in {total_s:.2f} s = {total_bytes / total_s / 1e9:.2f} GB/s "
          f"(one layer, both layouts)")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
