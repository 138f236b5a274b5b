#!/usr/bin/env python3
"""int4pack's data-free scale search against plain RTN and llm-compressor's minimum-MSE observer.

    python scripts/bench_float_error.py SRC [SRC ...] --lc-python PYTHON [--group 32] [--json OUT]

On the same float weights (each SRC a bf16 checkpoint int4pack reads) and the same symmetric int4
group, per module: the relative L2 error of

* int4pack's search (``w4a8.requantize``: absmax RTN, then a coarse and a fine grid of clipping
  ratios, every scale rounded to bf16 before it is judged);
* plain RTN (``amax / 7``, bf16 scale): the search's own baseline (``baseline_rel_l2``);
* llm-compressor's ``QuantizationModifier`` W4A16 (int4, symmetric, group G, bf16 scales as it
  saves them) with ``observer: mse`` (its ``MovingAverageMSEObserver``: a shrink grid searched under
  the 2.4-norm), run by PYTHON (an environment with llm-compressor; the project's own has none)
  through ``oneshot`` without data, then read back from its compressed-tensors output.

Prints and writes the mean error per module kind (routed experts, attention, shared experts, dense
MLPs) and how many modules int4pack's search has at most RTN's error and at most llm-compressor's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# run by --lc-python: llm-compressor's data-free W4A16 with the MSE observer, saved compressed
PRODUCER = r"""
import sys, torch
from transformers import AutoModelForCausalLM
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
src, out, group = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group,
           "observer": "mse"}
recipe = QuantizationModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
                              ignore=["lm_head", "re:.*mlp\\.gate$", "re:.*router.*", "re:.*shared_expert_gate$"])
oneshot(model=model, recipe=recipe)
model.save_pretrained(out, save_compressed=True)
"""

KINDS = ("expert", "attention", "shared_expert", "dense_mlp")


def rel(a, b) -> float:
    d = (a.double() - b.double()).norm()
    n = b.double().norm()
    return float(d / n) if float(n) else 0.0


def measure(src: Path, lc_python: str, group: int) -> list[dict]:
    import int4pack.formats as formats
    from int4pack.architectures import classify
    from int4pack.sources.checkpoint import Checkpoint
    from int4pack.w4a8 import requantize

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        lc_out = Path(tmp) / "lc"
        subprocess.run([lc_python, "-c", PRODUCER, str(src), str(lc_out), str(group)], check=True)
        with Checkpoint(src) as ck, Checkpoint(lc_out) as lc:
            fr, lr = formats.open_reader(ck), formats.open_reader(lc)
            fs, ls = fr.linears(), lr.linears()
            for m in sorted(set(fs) & set(ls)):
                w = fr.read(fs[m]).dequantize()
                _, _, info = requantize(w, group)
                kind = classify(m)[0]
                rows.append({"source": src.name, "module": m, "kind": kind, "n": fs[m].n, "k": fs[m].k,
                             "int4pack": info["rel_l2"], "rtn": info["baseline_rel_l2"],
                             "llm_compressor_mse": rel(lr.read(ls[m]).dequantize(), w)})
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    out = []
    for kind in KINDS + ("all",):
        rs = [r for r in rows if kind == "all" or r["kind"] == kind]
        if not rs:
            continue
        mean = {k: sum(r[k] for r in rs) / len(rs) for k in ("int4pack", "rtn", "llm_compressor_mse")}
        out.append({"kind": kind, "modules": len(rs), **{f"mean_{k}": v for k, v in mean.items()},
                    "int4pack_le_rtn": sum(r["int4pack"] <= r["rtn"] * (1 + 1e-9) for r in rs),
                    "int4pack_le_llm_compressor": sum(r["int4pack"] <= r["llm_compressor_mse"] for r in rs)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sources", type=Path, nargs="+")
    ap.add_argument("--lc-python", required=True, help="a Python with llm-compressor installed")
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rows = [r for s in a.sources for r in measure(s, a.lc_python, a.group)]
    summary = summarise(rows)
    print(f"group {a.group}, symmetric int4, bf16 scales; mean relative L2 error per module")
    print(f"{'kind':14} {'modules':>7} {'int4pack':>9} {'RTN':>9} {'llm-c mse':>9} {'<=RTN':>6} {'<=llm-c':>7}")
    for s in summary:
        print(f"{s['kind']:14} {s['modules']:7d} {s['mean_int4pack']:9.5f} {s['mean_rtn']:9.5f} "
              f"{s['mean_llm_compressor_mse']:9.5f} {s['int4pack_le_rtn']:6d} {s['int4pack_le_llm_compressor']:7d}")
    if a.json:
        a.json.write_text(json.dumps({"group_size": a.group, "sources": [s.name for s in a.sources],
                                      "summary": summary, "modules": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
