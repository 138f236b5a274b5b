"""tests/vllm/probe.py without vLLM: one failed engine must not break the next input.

The failure seen under QEMU: with several inputs in one process, an engine that failed while
starting (vLLM refusing an MLA head size) stayed alive through its traceback, and its teardown,
run later by the garbage collector in the middle of the next model's engine, destroyed that
engine's process groups ("pipeline model parallel group is not initialized"). The stand-in engine
here behaves the same way: it joins the process group when it starts, it is kept alive by a
reference cycle (as vLLM's engine objects are), and its teardown leaves the group.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GROUP: list = []  # the process's "parallel group": the engines that joined it and did not leave


class _Engine:
    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self.me = self  # a cycle: only the garbage collector frees it
        GROUP.append(model_dir)

    def __del__(self):  # vLLM's engine shuts down and destroys the process groups
        GROUP.clear()


class _LLM:
    def __init__(self, model, **_kw):
        self.engine = _Engine(model)
        if "refused" in model:
            raise NotImplementedError("MLA head size 64 is not supported on CPU (only 320, 512, 576)")
        self.llm_engine = types.SimpleNamespace(model_config=types.SimpleNamespace(quantization="compressed-tensors"))

    def apply_model(self, fn):
        return [{}]

    def generate(self, prompts, sp, use_tqdm=False):
        gc.collect()  # the next model's allocations run the collector, as a real engine's do
        if self.engine.model_dir not in GROUP:
            raise AssertionError("pipeline model parallel group is not initialized")
        out = types.SimpleNamespace(token_ids=[3, 4], logprobs=None)
        return [types.SimpleNamespace(outputs=[out], prompt_logprobs=None)]


@pytest.fixture
def probe(monkeypatch):
    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = _LLM, lambda **kw: kw
    ps = types.ModuleType("vllm.distributed.parallel_state")
    ps.cleanup_dist_env_and_memory = lambda: None
    for name, mod in {"vllm": vllm, "vllm.distributed": types.ModuleType("vllm.distributed"),
                      "vllm.distributed.parallel_state": ps}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    spec = importlib.util.spec_from_file_location("vllm_probe", REPO / "tests" / "vllm" / "probe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    stats = types.SimpleNamespace(reset=lambda: None, result=lambda d: {})
    state = {"import_vllm_s": 0.0, "vllm": "stand-in", "torch": "stand-in", "moe_op_schema": None, "calls": {},
             "load_stats": stats, "routes": []}
    monkeypatch.setattr(mod, "_setup", lambda: state)
    monkeypatch.setattr(mod, "engine_options", lambda pp: {"enforce_eager": True})
    GROUP.clear()
    gc.collect()
    return mod


def _model(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"vocab_size": 8}))
    return d


def test_a_failed_engine_is_torn_down_before_the_next_input(probe, tmp_path):
    bad, good = _model(tmp_path, "refused_mla"), _model(tmp_path, "ok")
    items = [f"{bad}={tmp_path / 'bad.json'}", f"{good}={tmp_path / 'good.json'}"]
    gc.disable()  # the collector runs where the next engine runs it, not at a moment of its own
    try:
        assert probe.probe_inputs(items, [1, 2], 2, "float32") == 1
    finally:
        gc.enable()
    first = json.loads((tmp_path / "bad.json").read_text())
    second = json.loads((tmp_path / "good.json").read_text())
    assert first["error"].startswith("NotImplementedError: MLA head size 64")
    assert "error" not in second, second.get("error")
    assert second["token_ids"] == [3, 4]


def test_the_control_a_failed_engine_left_to_the_collector_breaks_the_next(probe, tmp_path):
    """The same two inputs run as the probe ran them before: the failure caught and dropped, the
    engine left to the garbage collector. The next model's generate loses its group, as under
    QEMU; the test above passes only because the probe tears the failed engine down at once."""
    bad, good = _model(tmp_path, "refused_mla"), _model(tmp_path, "ok")
    gc.disable()
    try:
        try:
            probe.run(str(bad), [1, 2], 2, "float32")
        except NotImplementedError:
            pass
        with pytest.raises(AssertionError, match="pipeline model parallel group is not initialized"):
            probe.run(str(good), [1, 2], 2, "float32")
    finally:
        gc.enable()
