"""The readers, fuzzed: whatever the bytes, only int4pack's own error type comes out."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import int4pack
from int4pack.sources.checkpoint import Checkpoint
from int4pack.errors import Int4packError
from int4pack.formats import open_reader
from int4pack.plan import make_plan
from _reference import FIXTURES

from _reliability import mbi


# --------------------------------------------------------------------------- fuzz the readers

_FUZZ_BASE = "ct_qwen3moe_w4a16_asym_g32"


def _pipeline(folder: Path) -> None:
    """Checkpoint -> open_reader -> verdict/linears -> make_plan: only Int4packError may escape."""
    try:
        with Checkpoint(folder) as ck:
            reader = open_reader(ck)
            reader.verdict()
            reader.linears()
            make_plan(ck)
    except Int4packError as e:
        assert str(e) and e.exit_code in (2, 3, 4, 5), repr(e)


@pytest.fixture(scope="module")
def fuzz_dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz")
    out = {}
    for name in (_FUZZ_BASE, "gptq_q3_descact"):
        d = base / name
        d.mkdir()
        for p in (FIXTURES / name).iterdir():
            shutil.copyfile(p, d / p.name)
        out[name] = d
    return out


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=8)
# INT4PACK_FUZZ_EXAMPLES=5000 for a long local run; the suite keeps it short
_fuzz = settings(max_examples=int(os.environ.get("INT4PACK_FUZZ_EXAMPLES") or 100), deadline=None,
                 derandomize=not os.environ.get("INT4PACK_FUZZ_EXAMPLES"),
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _paths(obj, prefix=()):
    """Every (path, value) in a JSON tree."""
    yield prefix, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _mutate(tree, data):
    """Replace or delete one node of a JSON tree, chosen by hypothesis."""
    paths = [p for p, _ in _paths(tree) if p]
    path = data.draw(st.sampled_from(paths))
    parent = tree
    for k in path[:-1]:
        parent = parent[k]
    if isinstance(parent, dict) and data.draw(st.booleans()):
        del parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(_json)
    return tree


@_fuzz
@given(data=st.data())
def test_fuzz_header_mutations(fuzz_dirs, data):
    """Mutate one node of a real shard header (a dtype, shape, offset, name, metadata...)."""
    name = data.draw(st.sampled_from(sorted(fuzz_dirs)))
    folder = fuzz_dirs[name]
    shard = sorted(folder.glob("*.safetensors"))[0]
    orig = shard.read_bytes()
    try:
        header, blob = mbi._read_raw(shard)
        mbi._write_raw(shard, _mutate(header, data), blob)
        _pipeline(folder)
    finally:
        shard.write_bytes(orig)


@_fuzz
@given(data=st.data(), cut=st.integers(0, 400), flips=st.lists(st.tuples(st.integers(0, 3000), st.integers(1, 255)),
                                                            max_size=6))
def test_fuzz_header_bytes(fuzz_dirs, data, cut, flips):
    """Random byte flips in the header region and random truncation of a real shard."""
    folder = fuzz_dirs[data.draw(st.sampled_from(sorted(fuzz_dirs)))]
    shard = sorted(folder.glob("*.safetensors"))[-1]
    orig = shard.read_bytes()
    try:
        blob = bytearray(orig)
        for pos, x in flips:
            blob[pos % len(blob)] ^= x
        if data.draw(st.booleans()):
            blob = blob[: len(blob) - cut * 97]
        shard.write_bytes(bytes(blob))
        _pipeline(folder)
    finally:
        shard.write_bytes(orig)


@_fuzz
@given(data=st.data(), raw=st.binary(max_size=300))
def test_fuzz_random_files(fuzz_dirs, data, raw):
    """Random bytes as a shard, as config.json or as the index."""
    folder = fuzz_dirs[data.draw(st.sampled_from(sorted(fuzz_dirs)))]
    target = folder / data.draw(st.sampled_from(
        ["config.json", "model.safetensors.index.json", sorted(p.name for p in folder.glob("*.safetensors"))[0]]))
    orig = target.read_bytes()
    try:
        prefix = data.draw(st.sampled_from([b"", b"\x10\x00\x00\x00\x00\x00\x00\x00{", orig[:64]]))
        target.write_bytes(prefix + raw)
        _pipeline(folder)
    finally:
        target.write_bytes(orig)


@_fuzz
@given(data=st.data())
def test_fuzz_config_mutations(fuzz_dirs, data):
    """Mutate one node of a real config.json (quantization_config included) or of the index."""
    folder = fuzz_dirs[data.draw(st.sampled_from(sorted(fuzz_dirs)))]
    target = folder / data.draw(st.sampled_from(["config.json", "config.json", "model.safetensors.index.json"]))
    orig = target.read_bytes()
    try:
        tree = json.loads(orig)
        if target.name == "config.json" and data.draw(st.booleans()):
            tree["quantization_config"] = _mutate(tree["quantization_config"], data)
        else:
            tree = _mutate(tree, data)
        target.write_text(json.dumps(tree))
        _pipeline(folder)
    finally:
        target.write_bytes(orig)


@settings(max_examples=int(os.environ.get("INT4PACK_FUZZ_EXAMPLES") or 100) // 4, deadline=None,
          derandomize=not os.environ.get("INT4PACK_FUZZ_EXAMPLES"),
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 7)),
                                      min_size=1, max_size=40))
def test_fuzz_tensor_data_through_convert(fuzz_dirs, tmp_path, data, flips):
    """Random bit flips in tensor data (scales, zero points, g_idx, codes): a whole convert either
    succeeds or raises Int4packError, and never leaves an OUT behind on failure."""
    folder = fuzz_dirs[data.draw(st.sampled_from(sorted(fuzz_dirs)))]
    shards = sorted(folder.glob("*.safetensors"))
    shard = shards[data.draw(st.integers(0, len(shards) - 1))]
    orig = shard.read_bytes()
    n = int.from_bytes(orig[:8], "little")
    out = tmp_path / f"o{len(list(tmp_path.iterdir()))}"
    try:
        blob = bytearray(orig)
        for where, bit in flips:
            blob[8 + n + int(where * (len(blob) - 8 - n))] ^= 1 << bit
        shard.write_bytes(bytes(blob))
        try:
            int4pack.convert(folder, out)
        except Int4packError as e:
            assert e.exit_code in (3, 4) and (e.tensor or e.path), repr(e)
            assert not out.exists()
    finally:
        shard.write_bytes(orig)
