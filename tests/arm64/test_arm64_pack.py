"""Opt-in lane (``pytest -m arm64emu``): int4pack's portable blobs vs torch's real KleidiAI
packer, byte for byte, under QEMU aarch64 emulation (tests/arm64/pack_check.py).

Needs the emulated python from tools/arm64emu/setup.sh (run here if missing, ~50 s;
ARM64EMU_PYTHON overrides the wrapper path). INT4PACK_ARM64_QUICK=1 runs the small matrix.
The full matrix takes ~2-5 minutes (one emulated process; import torch alone is 10-60 s).
``test_aarch64_library_packs_kleidiai_bytes`` also cross-builds int4pack's own C++ library for
aarch64 with the zig that setup.sh installs (~2.5 min on 2 cores, when missing or stale) and packs
every case with it under emulation.
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
HOSTTOOLS = Path(os.environ.get("ARM64EMU_PREFIX", "/tmp/arm64emu")) / "hosttools"  # ziglang, from setup.sh


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


@pytest.fixture(scope="module")
def aarch64_library(emu_python) -> Path:
    """int4pack/_kernels-aarch64.so from the sources beside it: cross-built with zig's clang++ when
    missing or built from other sources (the library embeds its sources' hash)."""
    sys.path.insert(0, str(REPO))
    from int4pack import _build

    lib = _build.HERE / _build.library_name("aarch64")
    if lib.exists() and _build.source_hash().encode() in lib.read_bytes():
        return lib
    assert (HOSTTOOLS / "ziglang").is_dir(), f"no ziglang in {HOSTTOOLS}: run bash tools/arm64emu/setup.sh"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{HOSTTOOLS}",
           "CXX": f"{sys.executable} -m ziglang c++ -target aarch64-linux-gnu.2.17"}
    r = subprocess.run([sys.executable, "-m", "int4pack._build", "--machine", "aarch64"], env=env,
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0 and lib.exists(), r.stderr[-3000:]
    return lib


def test_aarch64_library_packs_kleidiai_bytes(emu_python, aarch64_library, tmp_path):
    """int4pack's C++ packer, built for aarch64 and run there, against torch's KleidiAI packer."""
    quick = os.environ.get("INT4PACK_ARM64_QUICK", "") not in {"", "0"}
    out = tmp_path / "res.json"
    cmd = [sys.executable, str(REPO / "tests" / "arm64" / "pack_check.py"), "--out", str(tmp_path / "cases"),
           "--emu", str(emu_python), "--json", str(out), "--arm-lib"] + (["--quick"] if quick else [])
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    finally:
        shutil.rmtree(tmp_path / "cases", ignore_errors=True)
    print(r.stdout[-4000:])
    assert out.exists(), f"check did not finish (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    s = json.loads(out.read_text())["summary"]
    assert s["cases"] >= (41 if quick else 170)
    assert s["arm_lib"]["library"] == str(aarch64_library)
    assert s["arm_lib"]["identical"] == s["native_uint8"] == s["cases"], s.get("failures")
    assert r.returncode == 0


def test_aarch64_library_checksums_match_zlib(emu_python, aarch64_library):
    """The aarch64 build's CRC-32 and CRC-32C (Arm CRC32 instructions where the core has them, as
    QEMU's neoverse-n2 does, and the table path) against zlib and a bitwise CRC-32C."""
    r = subprocess.run([str(emu_python), str(REPO / "tests" / "arm64" / "crc_check.py")], capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["checked"] == 14 * 6 and res["bad"] == []
