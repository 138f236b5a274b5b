#!/usr/bin/env python3
"""Proof on Arm (QEMU) that the packed format's tensor parallel pieces are torch's own KleidiAI
blobs of each rank's slice, and that the ranks' matmuls add up to the whole layer's.

Two halves, as pack_check.py:
  x86 side (this repo's python): converts fixtures with ``--serve-format kleidiai --tensor-parallel
      2`` and plain, and writes per case the int4 values and scales of a whole matrix (from the plain
      output), the stored pieces (a row parallel module's [2, bytes]; a column parallel module's
      whole blob), random activations and a float64 reference ``x @ W.T``;
  emulated side (``--emulated DIR``, torch + safetensors only, no int4pack): packs each rank's slice
      with ``torch.ops.aten._dyn_quant_pack_4bit_weight`` (real KleidiAI), compares the bytes with the
      stored piece (row parallel: row r; column parallel: the byte range of rows r*N/2..), and runs
      ``_dyn_quant_matmul_4bit`` per rank: row parallel outputs summed (vLLM's all-reduce), column
      parallel ones joined, against the float64 reference.

Usage:  python tests/arm64/tp_check.py [--out DIR] [--emu /tmp/arm64emu/bin/python3-arm64-torch2.13.0] [--json FILE]
Exit status 0 only if every piece is byte-identical and every matmul is within tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

TP = 2
REL_TOL = 0.03  # int8 per-token activation quantisation: ~1% relative vs float64 (pack_check.py)
CASES = {  # fixture -> modules (row parallel: split along K; column parallel: along N)
    "ct_qwen3moe_w4a16": ["model.layers.0.mlp.experts.1.down_proj", "model.layers.1.self_attn.o_proj",
                          "model.layers.0.mlp.experts.2.gate_proj", "model.layers.1.self_attn.q_proj"],
    "ct_qwen3moe_w4a16_channel": ["model.layers.1.mlp.experts.0.down_proj", "model.layers.0.self_attn.o_proj",
                                  "model.layers.1.mlp.experts.3.up_proj"],
    "gptq_q3_sym": ["model.layers.0.mlp.experts.0.down_proj", "model.layers.0.mlp.experts.0.up_proj"],
}


def x86_side(out: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import torch
    from safetensors.torch import save_file

    import int4pack
    from int4pack import serve_spec
    from int4pack.sources.checkpoint import Checkpoint

    fixtures = Path(__file__).resolve().parents[1] / "fixtures"
    tensors, meta = {}, []
    gen = torch.Generator().manual_seed(29)
    for fx, mods in CASES.items():
        int4pack.convert(fixtures / fx, out / fx / "plain", overwrite=True)
        int4pack.convert(fixtures / fx, out / fx / "tp2", overwrite=True, serve_format="kleidiai", tensor_parallel=TP)
        with Checkpoint(out / fx / "plain") as pl, Checkpoint(out / fx / "tp2") as pk:
            for m in mods:
                q, s = pl.get(f"{m}.weight"), pl.get(f"{m}.weight_scale")
                n, k = q.shape
                chan = s.shape[1] == 1
                g = k if chan else k // s.shape[1]
                w = q.double() * (s.double() if chan else s.double().repeat_interleave(g, dim=1))
                x = torch.randn(5, k, generator=gen)
                key = f"c{len(meta)}"
                tensors.update({f"{key}.q": q, f"{key}.s": s, f"{key}.x": x, f"{key}.ref": x.double() @ w.T,
                                f"{key}.stored": pk.get(f"{m}.{serve_spec.SUFFIX}")})
                meta.append({"key": key, "fixture": fx, "module": m, "n": n, "k": k, "group": g,
                             "split": "K" if serve_spec.is_row_parallel(m) else "N"})
    save_file(tensors, str(out / "cases.safetensors"))
    (out / "cases.json").write_text(json.dumps(meta))


def _nibbles(q):
    import torch

    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()


def emulated_side(d: Path) -> int:
    import platform

    import torch
    from safetensors.torch import load_file

    t = load_file(str(d / "cases.safetensors"))
    meta = json.loads((d / "cases.json").read_text())
    res = {"machine": platform.machine(), "torch": torch.__version__, "qemu_cpu": os.environ.get("QEMU_CPU"),
           "cases": []}
    ok = True
    for c in meta:
        key, n, k, g = c["key"], c["n"], c["k"], c["group"]
        q, s, x, ref, stored = (t[f"{key}.{a}"] for a in ("q", "s", "x", "ref", "stored"))
        chan = g == k
        r_out = {**c, "ranks": []}
        parts = []
        for r in range(TP):
            if c["split"] == "K":
                kp = k // TP
                qs = q[:, r * kp:(r + 1) * kp].contiguous()
                ss = s if chan else s[:, r * kp // g:(r + 1) * kp // g]
                block = kp if chan or kp == g else g
                if block == kp:
                    ss = ss.float().reshape(n, 1)
                bias = None  # the fixtures' row parallel modules have no bias
                mine = stored[r]
                blob = torch.ops.aten._dyn_quant_pack_4bit_weight(_nibbles(qs), ss.contiguous(), bias, block, kp, n)
                y = torch.ops.aten._dyn_quant_matmul_4bit(x[:, r * kp:(r + 1) * kp].contiguous(), mine, block, kp, n)
            else:
                np_ = n // TP
                qs = q[r * np_:(r + 1) * np_].contiguous()
                ss = s[r * np_:(r + 1) * np_].contiguous()
                if chan:
                    ss = ss.float().reshape(np_, 1)
                per = stored.numel() // (n // 8)
                mine = stored[r * np_ // 8 * per:(r + 1) * np_ // 8 * per]
                blob = torch.ops.aten._dyn_quant_pack_4bit_weight(_nibbles(qs), ss, None, g, k, np_)
                y = torch.ops.aten._dyn_quant_matmul_4bit(x, mine, g, k, np_)
            same = blob.dtype == torch.uint8 and blob.numel() == mine.numel() and torch.equal(blob, mine)
            r_out["ranks"].append({"rank": r, "bytes": int(mine.numel()), "identical_to_torch": bool(same)})
            ok &= bool(same)
            parts.append(y)
        y = sum(parts) if c["split"] == "K" else torch.cat(parts, dim=1)
        rel = float((y.double() - ref).norm() / ref.norm())
        r_out["rel_l2_vs_float64"] = rel
        ok &= rel < REL_TOL
        res["cases"].append(r_out)
    res["ok"] = ok
    (d / "emulated.json").write_text(json.dumps(res, indent=1))
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/int4pack_tp_check")
    ap.add_argument("--emu", default=os.environ.get("ARM64EMU_PYTHON", "/tmp/arm64emu/bin/python3-arm64-torch2.13.0"))
    ap.add_argument("--emulated", metavar="DIR", help=argparse.SUPPRESS)
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.emulated:
        return emulated_side(Path(a.emulated))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    x86_side(out)
    r = subprocess.run([a.emu, __file__, "--emulated", str(out)], capture_output=True, text=True, timeout=3600)
    res_path = out / "emulated.json"
    if not res_path.exists():
        print(r.stdout[-3000:], r.stderr[-3000:], file=sys.stderr)
        return 2
    res = json.loads(res_path.read_text())
    for c in res["cases"]:
        print(f"{c['fixture']:28s} {c['module']:44s} split {c['split']} group {c['group']:4d} "
              f"identical {all(x['identical_to_torch'] for x in c['ranks'])} rel {c['rel_l2_vs_float64']:.4f}")
    print(f"torch {res['torch']} on {res['machine']} ({res['qemu_cpu']}): ok={res['ok']}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
