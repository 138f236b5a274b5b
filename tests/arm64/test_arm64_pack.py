"""Opt-in lane (``pytest -m arm64emu``): int4pack's portable blobs vs torch's real KleidiAI
packer, byte for byte, under QEMU aarch64 emulation (tests/arm64/pack_check.py).

Needs the emulated python from tools/arm64emu/setup.sh (run here if missing, ~50 s;
ARM64EMU_PYTHON overrides the wrapper path). INT4PACK_ARM64_QUICK=1 runs the small matrix.
The full matrix takes ~2-5 minutes (one emulated process; import torch alone is 10-60 s).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.arm64emu

REPO = Path(__file__).resolve().parents[2]
SETUP = REPO / "tools" / "arm64emu" / "setup.sh"
EMU = Path(os.environ.get("ARM64EMU_PYTHON", "/tmp/arm64emu/bin/python3-arm64"))


@pytest.fixture(scope="module")
def emu_python() -> Path:
    if not EMU.exists():
        if not SETUP.exists():
            pytest.fail(f"no emulated python at {EMU} and no setup script at {SETUP}")
        r = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"setup.sh failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert EMU.exists(), f"setup.sh ran but {EMU} is missing"
    return EMU


def test_portable_packer_is_byte_identical_to_kleidiai(emu_python, tmp_path):
    quick = os.environ.get("INT4PACK_ARM64_QUICK", "") not in {"", "0"}
    out = tmp_path / "res.json"
    cmd = [sys.executable, str(REPO / "tests" / "arm64" / "pack_check.py"), "--out", str(tmp_path / "cases"),
           "--emu", str(emu_python), "--json", str(out)] + (["--quick"] if quick else [])
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    finally:
        shutil.rmtree(tmp_path / "cases", ignore_errors=True)  # ~250 MB of inputs and blobs
    print(r.stdout[-4000:])
    assert out.exists(), f"check did not finish (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    s = json.loads(out.read_text())["summary"]
    assert s["cases"] >= (41 if quick else 170)
    assert s["native_uint8"] == s["cases"], "torch did not take the KleidiAI path for every case"
    assert s["identical"] == s["cases"], f"byte mismatches: {s['failures']}"
    assert s["matmul_equal_native"] == s["cases"]
    assert s["max_rel_vs_float"] < 0.03  # int8 activations: ~1% (kleidiai.md §2.4)
    assert s["max_rel_vs_x86"] < 2e-3  # KleidiAI vs torch's x86 reference kernel
    api = s["api"]
    assert api["native_available"] and api["checked"] > 0
    assert api["checked"] == api["auto_native"] == api["unpack_ok"] == api["load_is_blob"]
    assert r.returncode == 0
