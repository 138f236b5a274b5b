"""Opt-in lane (``pytest -m arm64emu``): the MoE op on int4pack's prepacked blobs under QEMU aarch64
emulation, on the real KleidiAI kernels (tests/arm64/moe_check.py).

Three results per case, compared on the x86 side: int4pack's op (pure-Python twin) on our blobs
through KleidiAI, vLLM 0.19.1's own ``torch.ops._C.dynamic_4bit_int_moe`` on the same blobs, and
the x86 result (torch's reference kernels), plus a float32 reference.

Needs the emulated pythons from tools/arm64emu/setup.sh and vllm_setup.sh (run here if
missing; ARM64EMU_PYTHON / ARM64EMU_VLLM_PYTHON override the wrapper paths). The vLLM comparison is
skipped, with the reason shown, only when its wrapper is absent and cannot be set up.
INT4PACK_ARM64_QUICK=1 runs 5 cases instead of 16. About 3-5 minutes on a loaded 2-core machine
(the two emulated processes run side by side; importing torch and vLLM under QEMU dominates).
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
TOOLS = REPO / "tools" / "arm64emu"
EMU = Path(os.environ.get("ARM64EMU_PYTHON", "/tmp/arm64emu/bin/python3-arm64"))
EMU_VLLM = Path(os.environ.get("ARM64EMU_VLLM_PYTHON", "/tmp/arm64emu/bin/python3-arm64-vllm0.19.1"))


def _ensure(wrapper: Path, script: str, timeout: int) -> str | None:
    """None when the wrapper exists (after running the setup script if needed), else why not."""
    if wrapper.exists():
        return None
    setup = TOOLS / script
    if not setup.exists():
        return f"no emulated python at {wrapper} and no setup script at {setup}"
    try:
        r = subprocess.run(["bash", str(setup)], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"{setup} did not finish in {timeout} s"
    if r.returncode or not wrapper.exists():
        return f"{setup} failed (rc {r.returncode}, {wrapper} exists: {wrapper.exists()}):\n{r.stderr[-2000:]}"
    return None


@pytest.fixture(scope="module")
def emulators():
    why = _ensure(EMU, "setup.sh", 900)
    if why:
        pytest.skip(f"arm64 emulator unavailable: {why}")
    return EMU, (EMU_VLLM if _ensure(EMU_VLLM, "vllm_setup.sh", 900) is None else None)


@pytest.fixture(scope="module")
def result(emulators, tmp_path_factory):
    emu, emu_vllm = emulators
    quick = os.environ.get("INT4PACK_ARM64_QUICK", "") not in {"", "0"}
    d = tmp_path_factory.mktemp("moe")
    out = d / "res.json"
    cmd = [sys.executable, str(REPO / "tests" / "arm64" / "moe_check.py"), "--out", str(d / "cases"),
           "--emu", str(emu), "--json", str(out)]
    cmd += ["--emu-vllm", str(emu_vllm)] if emu_vllm else ["--no-vllm"]
    cmd += ["--quick"] if quick else []
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    finally:
        shutil.rmtree(d / "cases", ignore_errors=True)
    print(r.stdout[-5000:])
    assert out.exists(), f"check did not finish (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    res = json.loads(out.read_text())
    res["rc"], res["quick"], res["vllm_wrapper"] = r.returncode, quick, emu_vllm
    return res


def test_ours_on_kleidiai_equals_x86_result(result):
    s, rows = result["summary"], result["rows"]
    assert s["cases"] >= (5 if result["quick"] else 16)
    assert s["native_kleidiai"], "torch's KleidiAI path is not live in the emulated python"
    assert s["blob_is_matmul_input"] == s["cases"], "the loader repacked instead of passing the blob through"
    assert s["blobs_decode_to_x86_weights"] == s["cases"]
    # the KleidiAI-vs-reference bound: <= 3e-7 measured (groupwise bit-identical) on every token row;
    # a row whose int8 zero point flips (documented, ~6e-4 per matmul, not seen here) may cost more
    outliers = [r for r in rows if r["ours_vs_x86_row"] > 1e-5]
    assert len(outliers) <= 2, outliers
    assert s["ours_vs_x86_fro"]["max"] < 2e-3, outliers
    assert s["ours_vs_x86_row"]["max"] < 1e-2
    # the tolerance separates: the router weight applied on the wrong side is far outside it
    assert s["ours_vs_wrong_min"] > 0.05


def test_ours_on_kleidiai_vs_float_reference(result):
    rows = result["rows"]
    for r in rows:  # int8 activations through two matmuls: ~1-2 %, never a float path (0)
        assert 1e-3 < r["ours_vs_float"] < 0.03, r


def test_vllm_op_equals_ours(result):
    s, rows = result["summary"], result["rows"]
    if result["vllm_wrapper"] is None:
        pytest.skip(f"no emulated vLLM at {EMU_VLLM} and {TOOLS / 'vllm_setup.sh'} could not make one")
    assert not s["vllm_errors"], s["vllm_errors"]
    assert s["vllm_ran"] == s["cases"]
    n, total = (int(v) for v in s["vllm_pack_identical"].split("/"))
    assert n == total > 0, "vLLM's packing (torch's native packer) wrote other bytes than ours"
    # same KleidiAI kernels, same bucketing and summation order
    assert s["vllm_vs_ours_fro"]["max"] < 1e-6, [r for r in rows if r.get("vllm_vs_ours_fro", 1) >= 1e-6]
    for r in rows:
        assert 1e-3 < r["vllm_vs_float"] < 0.03, r
    assert s["ok"] and result["rc"] == 0
