"""Opt-in lane (``pytest -m arm64emu``): the packed format's tensor parallel pieces against torch's
real KleidiAI packer and matmul under QEMU aarch64 emulation (tests/arm64/tp_check.py): each rank's
blob is byte for byte torch's pack of its slice, and the ranks' matmuls add up to the layer's.

Needs the emulated torch 2.13.0 from tools/arm64emu/setup.sh (ARM64EMU_PYTHON overrides the wrapper)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.arm64emu

REPO = Path(__file__).resolve().parents[2]
EMU = Path(os.environ.get("ARM64EMU_PYTHON", "/tmp/arm64emu/bin/python3-arm64-torch2.13.0"))


def test_tensor_parallel_pieces_are_torch_blobs_of_each_rank(tmp_path):
    if not EMU.exists():
        pytest.fail(f"no emulated python at {EMU}: run tools/arm64emu/setup.sh")
    out = tmp_path / "res.json"
    r = subprocess.run([sys.executable, str(REPO / "tests" / "arm64" / "tp_check.py"), "--out", str(tmp_path / "c"),
                        "--emu", str(EMU), "--json", str(out)], capture_output=True, text=True, timeout=3600)
    assert out.exists(), f"check did not finish (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    res = json.loads(out.read_text())
    assert res["machine"] == "aarch64" and len(res["cases"]) == 9
    assert {c["split"] for c in res["cases"]} == {"K", "N"}
    for c in res["cases"]:
        assert all(x["identical_to_torch"] for x in c["ranks"]), c
        assert c["rel_l2_vs_float64"] < 0.03, c
    assert res["ok"] and r.returncode == 0
