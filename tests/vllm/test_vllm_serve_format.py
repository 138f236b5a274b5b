"""Opt-in lane (``pytest -m vllm``): the packed serving format (``convert --serve-format kleidiai``)
served through int4pack's vLLM plugin under QEMU gives exactly the plain checkpoint's tokens and
logprobs, with no expert packed at load (scripts/vllm_arm_e2e.py --serve-format kleidiai).

The same versions, dtypes and fixtures as test_vllm_arm.py (INT4PACK_VLLM_FIXTURES picks them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_vllm_arm import DEFAULT, REPO, RUNS, wrapper_for

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("version,dtype", RUNS, ids=[f"{v}-{d}" for v, d in RUNS])
def test_packed_checkpoints_serve_like_the_plain_ones(version, dtype, tmp_path):
    wrapper_for(version)
    env = os.environ.get("INT4PACK_VLLM_FIXTURES", DEFAULT)
    names = [] if env.strip() == "all" else env.split()
    out = tmp_path / "res.json"
    cmd = [sys.executable, str(REPO / "scripts" / "vllm_arm_e2e.py"), *names, "--vllm", version, "--dtype", dtype,
           "--serve-format", "kleidiai", "--work", str(tmp_path / "work"), "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600 * max(len(names), 4))
    print(r.stdout[-6000:])
    assert out.exists(), f"e2e did not finish (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    res = json.loads(out.read_text())
    assert res["serve_format"] == "kleidiai" and res["results"], res
    for f in res["results"]:
        assert f["loaded"], f"{f['input']}: {f.get('error')} at {f.get('error_where')}"
        assert f["serve_format"] == "kleidiai" and f["quantization"] == "int4pack-kleidiai", f
        assert f["moe_method"] == "KleidiAIPackedMoEMethod" and f["moe_kernel_called"], f
        assert f["dense_kernel"] == "CompressedTensorsW4A8Int/KleidiAIPackedLinearMethod", f
        assert f["experts_packed_at_load"] == 0 and f["vs_plain"]["plain_experts_packed_at_load"] > 0, f
        assert f["vs_plain"]["plain_quantization"] == "compressed-tensors", f["vs_plain"]
        assert f["vs_plain"]["tokens_identical"] and f["vs_plain"]["logprobs_identical"], f["vs_plain"]
        assert f["passed"], f["fails"]
    assert res["ok"] and r.returncode == 0


@pytest.mark.parametrize("version", sorted({v for v, _ in RUNS}))
def test_the_plugin_refuses_a_torch_without_kleidiai(version, tmp_path):
    """With torch's packer writing its float32 reference format (a torch built without KleidiAI;
    tests/vllm/load_stats.py --torch-without-kleidiai), vLLM must fail before loading the packed checkpoint,
    with the plugin's reason. (vLLM's aarch64 builds die with SIGILL on a CPU without dotprod.)"""
    wrapper = wrapper_for(version)
    sys.path.insert(0, str(REPO / "tests" / "vllm"))
    from lane_plugin import plugin_env

    import int4pack

    out = tmp_path / "packed"
    int4pack.convert(REPO / "tests" / "fixtures" / "gptq_q3_sym", out, serve_format="kleidiai")
    res = tmp_path / "load.json"
    r = subprocess.run([str(wrapper), str(REPO / "tests" / "vllm" / "load_stats.py"), str(out), "--json", str(res),
                        "--torch-without-kleidiai"], env=plugin_env(tmp_path), capture_output=True, text=True,
                       timeout=3600)
    got = json.loads(res.read_text())
    assert r.returncode == 1 and "int4pack-kleidiai checkpoint cannot be served here" in got["error"], got
    assert "no KleidiAI path on this host" in got["error"] and "token_ids" not in got
    assert got.get("load_seconds") is None  # refused before any weight was read
