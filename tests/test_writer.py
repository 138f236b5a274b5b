"""writer.ShardFile written out of order from several threads, its checksums, and hash_shard.

Contents are read back with the safetensors library (an independent reader) and CRCs are
recomputed on those bytes by zlib (CRC-32) or a bit-by-bit CRC-32C written here, not taken
from the writer.
"""

from __future__ import annotations

import hashlib
import json
import threading
import zlib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import int4pack
from int4pack import kernels, pipeline
from int4pack.output_folder import writer
from int4pack.errors import OutputError
from int4pack.plan import OutTensor

from _reference import FIXTURES, bitwise_crc32c



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
                m.setattr(kernels, "ext", lambda: None)
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
    if kernels.ext() is not None:
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
    calls = []
    orig = writer.ShardFile.flush

    def flush(self):
        calls.append(self.path.name)
        orig(self)

    ref = tmp_path / "ref"
    int4pack.convert(FIXTURES / "gptq_q3_sym", ref)
    monkeypatch.setattr(pipeline, "FLUSH_BYTES", 1)
    monkeypatch.setattr(writer.ShardFile, "flush", flush)
    out = tmp_path / "out"
    int4pack.convert(FIXTURES / "gptq_q3_sym", out)
    assert len(calls) > 10
    for p in sorted(ref.iterdir()):
        if p.name == writer.REPORT_NAME:
            continue  # holds timings
        assert hashlib.sha256(p.read_bytes()).digest() == hashlib.sha256((out / p.name).read_bytes()).digest(), p.name


# ----------------------------------------------------------------------------- direct writes

class _Chunked:
    """A tensor's bytes handed over in odd-sized pieces, as checkpoint.TensorBytes hands a copied one."""

    def __init__(self, raw: bytes, piece: int):
        self.raw, self.piece, self.nbytes = raw, piece, len(raw)

    def chunks(self):
        for i in range(0, self.nbytes, self.piece):
            yield memoryview(self.raw)[i:i + self.piece]


def _paged_tensors(seed: int = 4) -> dict[str, torch.Tensor]:
    """Whole-page tensors (one spans three 4 MB stages) mixed, in plan order, with odd-sized ones."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "a.norm": torch.randn(5, generator=gen),  # 20 B
        "b.weight": torch.randint(-8, 8, (768, 2048), generator=gen, dtype=torch.int8),  # 1.5 MB
        "b.weight_scale": torch.rand(768, 16, generator=gen).to(torch.bfloat16),  # 6 pages
        "c.bias": torch.randn(3, generator=gen).to(torch.bfloat16),
        "d.big": torch.randint(-128, 127, (9 << 20,), generator=gen, dtype=torch.int8),  # 2.25 stages
        "e.empty": torch.empty(0, dtype=torch.int8),
        "f.weight": torch.randint(-8, 8, (64, 128), generator=gen, dtype=torch.int8),  # 2 pages
    }


def _o_direct_works(folder: Path) -> bool:
    """Whether this file system takes O_DIRECT, asked without the writer's code."""
    import os
    if not hasattr(os, "O_DIRECT"):
        return False
    p = folder / "probe"
    p.write_bytes(b"")
    try:
        os.close(os.open(p, os.O_WRONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        p.unlink()


def _write_shard(path: Path, ts: dict, *, piece: int = 1_000_003) -> dict:
    """Write ``ts`` from two threads in reverse order ("d.big" in odd-sized pieces); each returned
    CRC is checked against the bitwise definition (or zlib's CRC-32) of the tensor's bytes."""
    sf = writer.ShardFile(path, _plan(ts), {"format": "pt"})
    names = list(ts)[::-1]

    wrong = []

    def put(part):
        for n in part:
            t = ts[n]
            raw = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
            if sf.write(n, _Chunked(raw, piece) if n == "d.big" else t) != _ref_crc(sf.digest_kind, raw):
                wrong.append(n)

    th = [threading.Thread(target=put, args=(names[i::2],)) for i in range(2)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    assert sf.complete() and not wrong, wrong
    return sf.finish({})


def _stages_idle() -> bool:
    return len(writer._stages._free) == writer._stages._made


def test_whole_page_tensors_lie_page_aligned_and_read_back(tmp_path, monkeypatch):
    """The layout: data from a page boundary, whole-page tensors first (each page-aligned), the rest
    after; contents and CRCs as an independent reader and CRC see them, written directly where the
    file system takes O_DIRECT, and the same bytes as the page-cache-only writer."""
    monkeypatch.setattr(writer, "DIRECT_IO", True)  # whatever INT4PACK_DIRECT_IO says here
    ts = _paged_tensors()
    direct_calls = []
    orig = writer.ShardFile._pwrite_direct

    def spy(self, buf, off):
        direct_calls.append((off, len(buf)))
        return orig(self, buf, off)

    monkeypatch.setattr(writer.ShardFile, "_pwrite_direct", spy)
    p = tmp_path / "d.safetensors"
    rec = _write_shard(p, ts)
    data = p.read_bytes()
    n = int.from_bytes(data[:8], "little")
    assert (8 + n) % 4096 == 0
    header = json.loads(data[8:8 + n])
    spans = {k: v["data_offsets"] for k, v in header.items() if k != "__metadata__"}
    paged = [k for k, t in ts.items() if t.numel() * t.element_size() % 4096 == 0]
    assert max(spans[k][1] for k in paged) <= min(spans[k][0] for k in ts if k not in paged)
    assert all(spans[k][0] % 4096 == 0 for k in paged)
    got = _read_back(p)
    for k, t in ts.items():
        assert torch.equal(got[k], t), k
    assert writer.hash_shard(p) == rec
    if _o_direct_works(tmp_path):
        assert sum(b for _, b in direct_calls) == sum(ts[k].numel() * ts[k].element_size() for k in paged)
        assert all(off % 4096 == 0 and b % 4096 == 0 for off, b in direct_calls)
    else:
        assert not direct_calls
    assert _stages_idle()
    monkeypatch.setattr(writer, "DIRECT_IO", False)
    q = tmp_path / "b.safetensors"
    assert _write_shard(q, ts) == rec and q.read_bytes() == data


def test_refused_direct_write_falls_back_to_the_page_cache(tmp_path, monkeypatch):
    """EINVAL from a direct write (a file system that opens O_DIRECT but will not write it): the same
    bytes end up in the file through the page cache, and direct writes stop for that file."""
    import errno
    import os

    ts = _paged_tensors(5)
    ref = tmp_path / "ref.safetensors"
    with monkeypatch.context() as m:
        m.setattr(writer, "DIRECT_IO", False)
        rec = _write_shard(ref, ts)
    real, direct_fds, refused = os.pwrite, set(), []
    monkeypatch.setattr(writer, "_open_direct", lambda path: direct_fds.add(fd := os.open(path, os.O_WRONLY)) or fd)

    def pwrite(fd, buf, off):
        if fd in direct_fds:
            refused.append(off)
            raise OSError(errno.EINVAL, "direct write refused")
        return real(fd, buf, off)

    monkeypatch.setattr(writer.os, "pwrite", pwrite)
    p = tmp_path / "f.safetensors"
    assert _write_shard(p, ts) == rec and p.read_bytes() == ref.read_bytes()
    assert len(refused) == 1  # the first refusal turns direct writes off
    assert _stages_idle()


def test_failed_direct_write_surfaces_and_leaves_no_shard(tmp_path, monkeypatch):
    """An I/O error in the I/O thread (not EINVAL) stops the shard: the next write or finish raises
    the disk error, nothing is renamed into place, and every staging buffer is given back."""
    import errno
    import os

    real, direct_fds = os.pwrite, set()
    monkeypatch.setattr(writer, "_open_direct", lambda path: direct_fds.add(fd := os.open(path, os.O_WRONLY)) or fd)

    def pwrite(fd, buf, off):
        if fd in direct_fds:
            raise OSError(errno.EIO, "I/O error")
        return real(fd, buf, off)

    monkeypatch.setattr(writer.os, "pwrite", pwrite)
    ts = _paged_tensors(6)
    p = tmp_path / "e.safetensors"
    sf = writer.ShardFile(p, _plan(ts), {"format": "pt"})
    with pytest.raises(OutputError, match="cannot write"):
        for n, t in ts.items():
            sf.write(n, t)
        sf.finish({})
    sf.abort()
    assert not p.exists() and not sf.tmp.exists()
    assert _stages_idle()


def _blob_tensors(seed: int = 7) -> dict[str, torch.Tensor]:
    """In plan order, as the packed format's experts: a blob of whole pages (down), two blobs of 2.5
    pages each (gate, up: together whole pages), twice; odd-sized tensors before and after."""
    gen = torch.Generator().manual_seed(seed)

    def blob(nbytes):
        return torch.randint(-128, 127, (nbytes,), generator=gen, dtype=torch.int8)

    return {"a.norm": torch.randn(5, generator=gen),  # 20 B
            "e0.down": blob(8192), "e0.gate": blob(10240), "e0.up": blob(10240),
            "e1.down": blob(8192), "e1.gate": blob(10240), "e1.up": blob(10240),
            "z.bias": torch.randn(3, generator=gen).to(torch.bfloat16)}


def test_pairs_that_fill_whole_pages_lie_together_and_go_to_the_disk_directly(tmp_path, monkeypatch):
    """Two tensors whose sizes add up to whole pages lie next to each other, the pair from a page
    boundary, in plan order with the whole-page tensors; batches of them go directly wherever a
    buffer's position lies as far into a page as the file offset, also when a batch ends inside a
    pair; the file is the same, byte for byte, as the page-cache-only writer's of one tensor at a time."""
    import mmap

    ts = _blob_tensors()
    raw = {k: t.contiguous().view(torch.uint8).numpy().tobytes() for k, t in ts.items()}
    ref = tmp_path / "ref.safetensors"
    with monkeypatch.context() as m:
        m.setattr(writer, "DIRECT_IO", False)
        one = writer.ShardFile(ref, _plan(ts), {"format": "pt"})
        for name in ts:
            one.write(name, ts[name])
        rec = one.finish({})
    data = ref.read_bytes()
    n = int.from_bytes(data[:8], "little")
    spans = {k: v["data_offsets"] for k, v in json.loads(data[8:8 + n]).items() if k != "__metadata__"}
    lead = ["e0.down", "e0.gate", "e0.up", "e1.down", "e1.gate", "e1.up"]
    at = 0
    for k in lead:  # hand-computed: 8192 + 2 * 10240 = 7 pages per expert, from offset 0
        assert spans[k] == [at, at + len(raw[k])], k
        at += len(raw[k])
    assert at == 14 * 4096 and sorted(spans[k][0] for k in ("a.norm", "z.bias")) == [at, at + 20]
    assert _read_back(ref)["e1.up"].equal(ts["e1.up"])

    monkeypatch.setattr(writer, "DIRECT_IO", True)
    direct = []
    orig = writer.ShardFile._pwrite_direct

    def spy(self, buf, off):
        direct.append((off - 8 - self.header_len, len(buf)))
        return orig(self, buf, off)

    monkeypatch.setattr(writer.ShardFile, "_pwrite_direct", spy)

    def batch(sf, names, shift):
        """``names`` laid out in a fresh page-aligned buffer from ``shift``; returns the buffer."""
        buf = memoryview(mmap.mmap(-1, 1 << 16))
        entries, pos = [], shift
        for k in names:
            buf[pos: pos + len(raw[k])] = raw[k]
            entries.append((k, pos, one.crc[k]))
            pos += len(raw[k])
        given = []
        sf.write_batch(entries, buf, given.append)
        return given

    for shift, expect in ((2048, [(0, 11 * 4096), (12 * 4096, 8192)]), (0, [(0, 11 * 4096)])):
        p = tmp_path / f"b{shift}.safetensors"
        two = writer.ShardFile(p, _plan(ts), {"format": "pt"})
        direct.clear()
        # a batch that ends inside the second pair (11.5 pages from a page), then a batch of its up
        # blob at a buffer position as far into a page as its offset (2048: its whole pages go
        # directly) or not (0: no direct write)
        batch(two, lead[:5], 0)
        batch(two, ["e1.up"], shift)
        two.write("a.norm", ts["a.norm"])
        two.write("z.bias", ts["z.bias"])
        assert two.finish({}) == rec and p.read_bytes() == data
        if _o_direct_works(tmp_path):
            assert sorted(direct) == expect, shift
        else:
            assert not direct
        assert _stages_idle()


# ----------------------------------------------------------------------------- the modules' shape

CONVERT_IO = ("convert", "pipeline", "writer", "workdir", "checksums", "workers")


def test_no_module_imports_a_private_name_of_converts_modules():
    """Checksums, the output folder and the job pool each have a public face: no module of int4pack
    reaches into their private names (verify/shard_scan.py took the writer's checksum code that way)."""
    import ast

    root = Path(int4pack.__file__).resolve().parent
    bad = []
    for p in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").rsplit(".", 1)[-1] in CONVERT_IO:
                bad += [f"{p.relative_to(root)}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert bad == []
    for name in CONVERT_IO:  # and each stays short enough to read
        path = next(p for p in (root / f"{name}.py", root / "output_folder" / f"{name}.py") if p.exists())
        lines = len(path.read_text().splitlines())
        assert lines <= 500, (name, lines)


def test_the_report_is_written_as_the_standard_library_encodes_it():
    """report_pieces (one line per entry at the second level, its entries through one C encoder made
    once) against the json module's own encoding of each part: the same text, and the same object."""
    from int4pack.output_folder.workdir import report_pieces

    mods = {f"m.{i}": {"rel_l2": f"{i / 7:.6g}", "max_abs": 2.5e-07 * i, "packed": {"crc32": f"{i:08x}", "n": 8},
                       "exact_ints": i % 2 == 0, "baseline_rel_l2": None, "nan": float("nan"), "é\n\"": "x"}
            for i in range(50)}
    report = {"modules": mods, "tensors": {"b": "copied", "a": "converted:m.1"}, "int4pack_version": "0.1.0",
              "plan": {"paths": {"lossless": 3}, "experts_per_layer": [4]}}
    enc = json.JSONEncoder(sort_keys=True, separators=(", ", ": ")).encode

    def level2(d):
        return "{\n" + ",\n".join(f"    {json.dumps(k)}: {enc(v)}" for k, v in sorted(d.items())) + "\n  }"
    want = "{\n" + ",\n".join(f"  {json.dumps(k)}: " + (level2(v) if isinstance(v, dict) else enc(v))
                              for k, v in sorted(report.items())) + "\n}"
    got = "".join(report_pieces(report))
    assert got == want
    assert json.dumps(json.loads(got), sort_keys=True) == json.dumps(report, sort_keys=True)
