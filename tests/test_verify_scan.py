"""verify reads the output once: the numerical pass's reads are checksummed on the way (a
``Tapped`` checkpoint) and the shard scan reads only the rest; a packed blob is checked and decoded
once. The checksums are compared with the writer's own re-read of the shard (``hash_shard``)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import int4pack
from int4pack.verify import shard_scan
from int4pack.sources import checkpoint
from int4pack.output_folder.writer import hash_shard


def _count_reads(monkeypatch) -> Counter:
    """Bytes read per tensor name, by ``Checkpoint.get`` and friends and by the shard scan."""
    seen: Counter = Counter()
    real_read, real_part = checkpoint.Checkpoint._read, shard_scan._scan_part

    def read(self, t, buf, offset, want):
        seen[t.name] += want
        return real_read(self, t, buf, offset, want)

    def part(path, base, items, kind):
        for (a, b), name, _ in items:
            seen[name] += b - a
        return real_part(path, base, items, kind)

    monkeypatch.setattr(checkpoint.Checkpoint, "_read", read)
    monkeypatch.setattr(shard_scan, "_scan_part", part)
    return seen


@pytest.mark.parametrize("serve_format", ["compressed-tensors", "kleidiai"])
def test_every_weight_is_read_once(converted, monkeypatch, serve_format):
    out, _ = converted("gptq_q3_sym", serve_format=serve_format)
    ckpt = checkpoint.Checkpoint(out)
    sizes = {n: i.nbytes for n, i in ckpt.tensors.items()}
    seen = _count_reads(monkeypatch)
    r = int4pack.verify(out, threads=2)
    assert r["ok"] and r["checked"]["experts"] > 0
    missed = [n for n in sizes if seen[n] < sizes[n]]
    assert not missed  # every byte is read: checksummed
    weights = [n for n in sizes if ckpt.tensors[n].dtype in ("I8", "U8")]  # int4 values, blobs
    assert weights and {n: seen[n] for n in weights} == {n: sizes[n] for n in weights}
    if serve_format == "kleidiai":
        assert r["structural"]["counts"]["blobs"] == len(weights)  # every blob checked, from the one read


def test_taps_match_the_writers_checksums(converted):
    out, _ = converted("gptq_q3_sym")
    ck = shard_scan.Tapped(out)
    ck.kinds = shard_scan.shard_kinds(ck, None)
    names = sorted(ck.tensors)[:40]
    for n in names:
        ck.get(n)
    for shard in {ck.tensors[n].file for n in names}:
        per: dict = {}
        kind = ck.kinds[shard]
        hash_shard(out / shard, "crc32c:" if kind == "crc32c" else None, per_tensor=per)
        for n in names:
            if ck.tensors[n].file == shard:
                crc, rng = ck.taps[(shard, n)]
                assert crc == per[n], n
                x = ck.get(n)
                want = (int(x.min()), int(x.max())) if x.dtype == torch.int8 else None
                assert rng == want, n


def test_a_byte_changed_where_only_the_numerical_pass_reads_fails_the_checksum(converted, tmp_path, monkeypatch):
    """A weight's byte changed within int4 range: only the tap's checksum can see it (no source)."""
    import shutil

    out = tmp_path / "bad"
    shutil.copytree(converted("gptq_q3_sym")[0], out)
    ckpt = checkpoint.Checkpoint(out)
    name = next(n for n, i in sorted(ckpt.tensors.items()) if ".experts." in n and i.dtype == "I8")
    info = ckpt.tensors[name]
    pos = info.begin + 5
    ckpt.close()
    with open(out / info.file, "r+b") as fh:
        fh.seek(pos)
        v = int.from_bytes(fh.read(1), "little", signed=True)
        fh.seek(pos)
        fh.write((v + 1 if v < 7 else v - 1).to_bytes(1, "little", signed=True))
    seen = _count_reads(monkeypatch)
    r = int4pack.verify(out, threads=2, dense=False, raise_on_failure=False)
    assert seen[name] == info.nbytes  # read once, by the numerical pass
    assert not r["ok"] and "data checksum mismatch" in str(r["structural"]["problems"])


@pytest.mark.parametrize("threads", [1, 2])
def test_an_int8_value_outside_int4_where_the_numerical_pass_reads_is_named(converted, tmp_path, threads):
    """A weight value outside [-8, 7], without the report's checksums: the range its one read found
    (the tap) flags the module, with the value, whichever thread read it."""
    import shutil

    out = tmp_path / "bad"
    shutil.copytree(converted("gptq_q3_sym")[0], out)
    (out / "int4pack_report.json").unlink()
    ckpt = checkpoint.Checkpoint(out)
    name = next(n for n, i in sorted(ckpt.tensors.items()) if ".experts." in n and i.dtype == "I8")
    info = ckpt.tensors[name]
    ckpt.close()
    with open(out / info.file, "r+b") as fh:
        fh.seek(info.begin + info.nbytes - 1)
        fh.write((100).to_bytes(1, "little", signed=True))
    r = int4pack.verify(out, threads=threads, dense=False, raise_on_failure=False)
    assert r["checked"]["experts"] > 0  # the expert went through the numerical pass
    assert not r["ok"]
    assert any(p["where"] == name.rsplit(".", 1)[0] and "outside int4 [-8, 7]" in p["message"]
               and ", 100]" in p["message"] for p in r["structural"]["problems"]), r["structural"]["problems"]
