"""The suite's shared fixtures: the real producer fixtures, one cache of their conversions, raw
tensors read with the safetensors library, and a tiny checkpoint writer.

``FIXTURES`` (the folder of real producer checkpoints) is defined once, in _reference.py, which
test modules import for the reference decoders; a missing fixture folder fails, never skips.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import int4pack
from _reference import FIXTURES


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """converted(name, **convert_options) -> (output folder, report) of ``int4pack.convert`` on the
    fixture ``name``, converted once per session. Read only: copy it before changing anything."""
    cache = {}

    def get(name: str, **kw):
        key = (name, tuple(sorted(kw.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(name) / "out"
            cache[key] = (out, int4pack.convert(FIXTURES / name, out, **kw))
        return cache[key]

    return get


@pytest.fixture
def fixture_dir():
    """fixture_dir(name) -> path of a real producer fixture under tests/fixtures (missing data fails)."""

    def get(name: str) -> Path:
        p = FIXTURES / name
        assert p.is_dir(), f"fixture {name} missing under {FIXTURES}"
        return p

    return get


@pytest.fixture
def raw():
    """raw(folder) -> {name: numpy array} straight from safetensors, independent of int4pack.Checkpoint.

    Ints stay as stored; floats are widened to float64 (numpy has no bf16).
    """

    def load(folder: Path) -> dict[str, np.ndarray]:
        out = {}
        for f in sorted(Path(folder).glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    t = fh.get_tensor(k)
                    out[k] = t.double().numpy() if t.is_floating_point() else t.numpy()
        return out

    return load


@pytest.fixture
def make_ckpt(tmp_path):
    """make_ckpt(tensors, qcfg, shards=None, name="ckpt") -> folder.

    ``shards`` is an optional list of sets of tensor names, one per shard; with it an index is
    written, so one module's tensors can be split across files.
    """

    def make(tensors: dict, qcfg: dict, shards: list[set] | None = None, name: str = "ckpt",
             model_type: str = "qwen3_moe") -> Path:
        folder = tmp_path / name
        folder.mkdir()
        cfg = {"model_type": model_type, "architectures": ["X"], "quantization_config": qcfg}
        (folder / "config.json").write_text(json.dumps(cfg))
        tensors = {k: (torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v).contiguous()
                   for k, v in tensors.items()}
        if not shards:
            save_file(tensors, str(folder / "model.safetensors"))
            return folder
        wmap = {}
        for i, names in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file({k: tensors[k] for k in names}, str(folder / fname))
            wmap.update({k: fname for k in names})
        assert set(wmap) == set(tensors), "every tensor must be in one shard"
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
        return folder

    return make


@pytest.fixture
def counted(monkeypatch):
    """How many jobs ran inside convert's C++ batches and how many the C++ handed back, during the test."""
    from int4pack import batch

    seen = {"batched": 0, "handed_back": 0}
    run = batch.run_batch

    def counting(b, *a, **k):
        seen["batched"] += len(b.jobs)
        per_job = a[-1]

        def back(job):
            seen["handed_back"] += 1
            return per_job(job)

        return run(b, *a[:-1], back, **k)

    monkeypatch.setattr(batch, "run_batch", counting)
    return seen
