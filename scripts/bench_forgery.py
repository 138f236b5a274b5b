"""One changed int4 value in a lossless module of a full-scale output, with no report: does
``verify --against`` catch it, and at what cost?

Builds the 48-layer Qwen3-30B-A3B-shaped GPTQ sym checkpoint (scripts/make_synthetic.py), converts
it in each serving format, moves one int4 value of a lossless expert by one step (the packed
format: the blob repacked with honest provenance and the layout record's blob checks rewritten, a
consistent forgery; tests/corrupt_corpus.py's editors), deletes int4pack_report.json, and runs
``verify --against`` the source in a fresh process. Prints one JSON row per format.

    python scripts/bench_forgery.py [--layers 48] [--workdir DIR] [--json-out rows.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))  # the corrupted-output editors the trust tests use

MODULE = "model.layers.0.mlp.experts.2.up_proj"


def forge(out: Path, packed: bool) -> None:
    from corrupt_corpus import _sync_checks, edit_tensors, one_int

    from int4pack import serve_spec

    edit_tensors(out, one_int(f"{MODULE}.{serve_spec.SUFFIX}" if packed else f"{MODULE}.weight", packed))
    if packed:
        _sync_checks(out)
    (out / "int4pack_report.json").unlink()


VERIFY = r"""
import json, sys, time
t0 = time.perf_counter()
import int4pack
r = int4pack.verify(sys.argv[1], against=sys.argv[2], raise_on_failure=False)
rss = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) / 1024
found = [p for x in r["layers"] + r["dense"] for p in x.get("problems", [])]
print(json.dumps({"seconds": time.perf_counter() - t0, "ok": r["ok"], "verdict": r["verdict"], "rss_mb": rss,
                  "found": [p for p in found if "int4 value(s) differ" in p][:3]}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--serve-formats", nargs="+", default=["compressed-tensors", "kleidiai"])
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json-out", type=Path, default=None)
    a = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from bench_convert import CONVERT_RM, _run
    from make_synthetic import make

    work = a.workdir or Path(tempfile.mkdtemp(prefix="int4pack-forgery-"))
    src = work / f"gptq-sym-{a.layers}L"
    if not src.exists():
        make(src, "gptq-sym", a.layers)
    rows = []
    for serve in a.serve_formats:
        out = work / f"forged-{serve}"
        conv = _run(CONVERT_RM, src, out, 0, serve)
        t0 = time.perf_counter()
        forge(out, serve == "kleidiai")
        forge_s = time.perf_counter() - t0
        os.sync()
        ver = _run(VERIFY, out, src)
        shutil.rmtree(out, ignore_errors=True)
        row = {"layers": a.layers, "serve_format": serve, "cores": os.cpu_count(), "module": MODULE,
               "convert_s": round(conv["seconds"], 2), "forge_s": round(forge_s, 1),
               "verify_against_s": round(ver["seconds"], 2), "ratio": round(ver["seconds"] / conv["seconds"], 2),
               "rss_mb": round(ver["rss_mb"]), "caught": not ver["ok"], "verdict": ver["verdict"][:300],
               "found": ver["found"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if a.json_out:
            a.json_out.write_text(json.dumps(rows, indent=1))
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
