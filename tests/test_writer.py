"""writer.ShardFile written out of order from several threads, its checksums, and hash_shard.

Contents are read back with the safetensors library (an independent reader) and CRCs are
recomputed on those bytes by zlib (CRC-32) or a bit-by-bit CRC-32C written here, not taken
from the writer.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import threading
import zlib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import int4pack
from int4pack import writer
from int4pack.errors import OutputError
from int4pack.plan import OutTensor

from _reference import bitwise_crc32c

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
convert_mod = importlib.import_module("int4pack.convert")  # the module (int4pack.convert is the function)


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randint(-8, 8, (64, 96), generator=gen, dtype=torch.int8),
        "a.weight_scale": torch.rand(64, 3, generator=gen).to(torch.bfloat16),
        "b.bias": torch.randn(7, generator=gen),
        "c.empty": torch.empty(0, 4, dtype=torch.int8),
        "d.weight": torch.randint(-8, 8, (33, 128), generator=gen, dtype=torch.int8),
    }


def _plan(ts: dict[str, torch.Tensor]) -> list[OutTensor]:
    names = {torch.int8: "I8", torch.bfloat16: "BF16", torch.float32: "F32"}
    return [OutTensor(k, names[v.dtype], tuple(v.shape)) for k, v in ts.items()]


def _ref_crc(kind: str, raw: bytes) -> int:
    return zlib.crc32(raw) if kind == "crc32" else bitwise_crc32c(raw)


def _read_back(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}


def test_out_of_order_parallel_writes_give_a_valid_shard(tmp_path):
    ts = _tensors()
    sf = writer.ShardFile(tmp_path / "s.safetensors", _plan(ts), {"format": "pt"})
    names = list(ts)[::-1]  # reverse plan order, split over two threads
    crcs = {}

    def put(part):
        for n in part:
            crcs[n] = sf.write(n, ts[n])

    th = [threading.Thread(target=put, args=(names[i::2],)) for i in range(2)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    assert sf.complete()
    rec = sf.finish({"a.weight": {"path": "lossless"}})
    got = _read_back(tmp_path / "s.safetensors")
    assert set(got) == set(ts)
    for n, t in ts.items():
        assert got[n].dtype == t.dtype and torch.equal(got[n], t), n
        raw = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        assert crcs[n] == _ref_crc(sf.digest_kind, raw), n
    assert not (tmp_path / "s.safetensors.tmp").exists()
    # the record matches an independent re-read, and the header carries the per-tensor results
    assert writer.hash_shard(tmp_path / "s.safetensors") == rec
    with safe_open(str(tmp_path / "s.safetensors"), "pt") as fh:
        assert json.loads(fh.metadata()["int4pack.tensors"]) == {"a.weight": {"path": "lossless"}}


def test_checksums_catch_data_and_header_changes(tmp_path):
    ts = _tensors(1)
    p = tmp_path / "s.safetensors"
    sf = writer.ShardFile(p, _plan(ts), {"format": "pt"})
    for n, t in ts.items():
        sf.write(n, t)
    rec = sf.finish({})
    data = bytearray(p.read_bytes())
    n = int.from_bytes(data[:8], "little")
    for where in (8 + n, len(data) - 1, 8 + n + 64 * 96 + 3):  # first, last, inside the scales
        bad = bytearray(data)
        bad[where] ^= 0x10
        p.write_bytes(bytes(bad))
        got = writer.hash_shard(p)
        assert got["data_digest"] != rec["data_digest"] and got["header_sha256"] == rec["header_sha256"], where
    bad = bytearray(data)
    bad[20] = ord("X")  # inside the JSON header
    p.write_bytes(bytes(bad))
    assert writer.hash_shard(p)["header_sha256"] != rec["header_sha256"]
    p.write_bytes(bytes(data[:-5]))  # truncated
    got = writer.hash_shard(p)
    assert got["size"] != rec["size"] and got["data_digest"] != rec["data_digest"]
    p.write_bytes(bytes(data))
    assert writer.hash_shard(p) == rec


def test_digest_kinds(tmp_path, monkeypatch):
    """With the extension a shard gets CRC-32C digests ("crc32c:" prefix); without it zlib's CRC-32
    (a bare hex digest, as releases before 0.3 wrote), and either is re-checked by its own kind."""
    ts = _tensors(3)
    recs = {}
    for hidden in (False, True):
        with monkeypatch.context() as m:
            if hidden:
                m.setattr(writer.kernels, "ext", lambda: None)
            p = tmp_path / f"s{int(hidden)}.safetensors"
            sf = writer.ShardFile(p, _plan(ts), {"format": "pt"})
            for n, t in ts.items():
                assert sf.write(n, t) == _ref_crc(sf.digest_kind, t.contiguous().view(torch.uint8).numpy().tobytes()
                                                  if t.numel() else b"")
            recs[hidden] = (p, sf.digest_kind, sf.finish({}))
    p, kind, rec = recs[True]
    assert kind == "crc32" and not rec["data_digest"].startswith("crc32c:")
    assert writer.hash_shard(p, rec["data_digest"]) == rec  # checked with the extension loaded
    p, kind, rec = recs[False]
    if writer.kernels.ext() is not None:
        assert kind == "crc32c" and rec["data_digest"].startswith("crc32c:")
    assert writer.hash_shard(p, rec["data_digest"]) == rec
    assert writer.hash_shard(p, recs[True][2]["data_digest"])["data_digest"] != rec["data_digest"]


def test_internal_mistakes_are_refused(tmp_path):
    ts = _tensors(2)
    sf = writer.ShardFile(tmp_path / "s.safetensors", _plan(ts), {"format": "pt"})
    with pytest.raises(OutputError, match="not planned"):
        sf.write("zzz", ts["b.bias"])
    with pytest.raises(OutputError, match="planned"):
        sf.write("b.bias", ts["b.bias"].double())
    sf.write("b.bias", ts["b.bias"])
    with pytest.raises(OutputError, match="twice"):
        sf.write("b.bias", ts["b.bias"])
    with pytest.raises(OutputError, match="finished with 1/5"):
        sf.finish({})
    sf.abort()
    assert not any(tmp_path.iterdir())


def test_flushing_open_shards_changes_no_byte(tmp_path, monkeypatch):
    """Write-back of open shards (every FLUSH_BYTES) must not alter the output, and must run."""
    if not (FIXTURES / "gptq_q3_sym").is_dir():
        pytest.skip("../shared/fixtures not found")
    calls = []
    orig = writer.ShardFile.flush

    def flush(self):
        calls.append(self.path.name)
        orig(self)

    ref = tmp_path / "ref"
    int4pack.convert(FIXTURES / "gptq_q3_sym", ref)
    monkeypatch.setattr(convert_mod, "FLUSH_BYTES", 1)
    monkeypatch.setattr(writer.ShardFile, "flush", flush)
    out = tmp_path / "out"
    int4pack.convert(FIXTURES / "gptq_q3_sym", out)
    assert len(calls) > 10
    for p in sorted(ref.iterdir()):
        if p.name == writer.REPORT_NAME:
            continue  # holds timings
        assert hashlib.sha256(p.read_bytes()).digest() == hashlib.sha256((out / p.name).read_bytes()).digest(), p.name
