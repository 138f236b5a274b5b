"""Streaming, resumable safetensors output.

Every output tensor's dtype and shape is known from the plan, so each shard's header (and
so every tensor's offset) is fixed before any data is computed: tensors are streamed to
disk one at a time and memory stays bounded by the tensors in flight. Per-tensor results
(path, error) go into a reserved, space-padded slot of the header when the shard is
finished, which keeps offsets unchanged.

Atomicity: the whole output is built in a hidden sibling folder and renamed at the end; a
shard is written as ``<name>.tmp`` and renamed when complete; ``progress.json`` there records
each finished shard's checksums so ``--resume`` can trust (after re-checking) what it keeps.

Long: the shard file, its checksums and the output folder share one write path (staging
buffers, direct writes, the header slot, the rename); split, each part would reach into the others.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import mmap
import os
import shutil
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ._lazy import torch, torch_loaded
from .errors import InputError, OutputError
from .groups import MAX_SCALE
from .plan import OutTensor
from .workdir import partial_folder

__all__ = [
    "PROGRESS",
    "assign_shards",
    "shard_names",
    "ShardFile",
    "OutputDir",
    "hash_shard",
    "hash_shards",
    "CHECKSUM_KEYS",
    "to_bytes",
    "PAGE",
    "copy_checksums",
]

PROGRESS = "progress.json"
SCALE_SUFFIX = ".weight_scale"  # the default format's W4A8 scales: checked as they are written
REPORT_NAME = "int4pack_report.json"  # what marks a folder as an int4pack output
# test hook: INT4PACK_TEST_SLOW_WRITE_MS=N sleeps N ms before each tensor is written, so that a
# test's SIGKILL lands mid-run on small fixtures (tests/test_resume.py); unset in normal use
try:
    _SLOW_WRITE_S = max(0.0, float(os.environ.get("INT4PACK_TEST_SLOW_WRITE_MS") or 0) / 1000)
except ValueError:
    _SLOW_WRITE_S = 0.0
_META_RESERVE_PER_TENSOR = 200  # bytes of header reserved for each tensor's result entry
_META_RESERVE_BASE = 8192
_SPACES = memoryview(b" " * 65536)
# O_DIRECT: offsets, lengths and buffer addresses in whole pages (no logical block size in use is larger)
PAGE = 4096
_STAGE_BYTES = 4 << 20  # one direct write
_CACHE_WRITE = 1 << 20  # bytes of one batch write through the page cache (write_batch)
_STAGES = 8  # staging buffers in all: the direct writes queued behind the disk (32 MB)
# INT4PACK_DIRECT_IO=0 sends every byte through the page cache (as int4pack 0.1.0 did)
DIRECT_IO = os.environ.get("INT4PACK_DIRECT_IO", "1").strip() not in ("0", "false", "no", "off")


def assign_shards(outputs: list[OutTensor], max_bytes: int) -> list[list[OutTensor]]:
    """Fill shards in order; a tensor larger than max_bytes gets a shard of its own."""
    shards: list[list[OutTensor]] = []
    cur: list[OutTensor] = []
    size = 0
    for t in outputs:
        if cur and size + t.nbytes > max_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += t.nbytes
    if cur:
        shards.append(cur)
    return shards


def shard_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


_BYTE_DTYPES: tuple = ()  # uint8 and int8, once torch is imported


def to_bytes(t: torch.Tensor | memoryview | bytes) -> memoryview:
    """A zero-copy byte view of a tensor (or pass-through for raw bytes)."""
    global _BYTE_DTYPES
    if isinstance(t, (memoryview, bytes, bytearray)):
        return memoryview(t).cast("B") if isinstance(t, memoryview) else memoryview(t)
    if not _BYTE_DTYPES:
        _BYTE_DTYPES = (torch.uint8, torch.int8)
    if t.dtype in _BYTE_DTYPES and t.is_contiguous() and not t.requires_grad and t.numel():
        return memoryview(t.numpy()).cast("B")  # blobs and int8 weights: one torch call, not five
    t = t.detach().contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def _file_order(tensors: list[OutTensor]) -> tuple[list[OutTensor], int]:
    """A shard's file order and the bytes of its leading span: tensors of whole pages and pairs of
    tensors whose bytes add up to whole pages (the packed format's gate and up blobs: 199.5 pages
    each at 30B-A3B's shapes), in plan order from a page boundary, so that a run of them goes to the
    disk with O_DIRECT; then the others (norms, biases: a few KB)."""
    lead: list[OutTensor] = []
    waiting: dict[int, OutTensor] = {}  # bytes past a page -> a tensor waiting for its partner
    for t in tensors:
        part = t.nbytes % PAGE
        if not part:
            lead.append(t)
        elif (partner := waiting.pop(PAGE - part, None)) is not None:
            lead += (partner, t)
        else:
            waiting.setdefault(part, t)
    led = {id(t) for t in lead}
    return lead + [t for t in tensors if id(t) not in led], sum(t.nbytes for t in lead)


def _open_direct(path: Path) -> int | None:
    """A second, O_DIRECT descriptor of ``path``, or None where the system or file system has none
    (tmpfs and some FUSE file systems refuse it: their writes go through the page cache)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not (DIRECT_IO and flag):
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError:
        return None


class BufferPool:
    """Page-aligned buffers (anonymous mappings, reused: fresh memory costs page faults) of
    ``nbytes`` each, made as needed up to ``count``; taking one waits while all are in use or queued
    behind the disk, so the workers slow to the disk's pace."""

    def __init__(self, count: int, nbytes: int) -> None:
        self.count, self.nbytes = count, nbytes
        self._free: list[memoryview] = []
        self._made = 0
        self._cv = threading.Condition()

    def take(self) -> memoryview:
        with self._cv:
            while not self._free and self._made >= self.count:
                self._cv.wait()
            if self._free:
                return self._free.pop()
            self._made += 1
        return memoryview(mmap.mmap(-1, self.nbytes))

    def give(self, buf: memoryview) -> None:
        with self._cv:
            self._free.append(buf)
            self._cv.notify()


_stages = BufferPool(_STAGES, _STAGE_BYTES)  # direct writes of single tensors


def _copy_crc32(src: memoryview, dst: memoryview, crc: int) -> int:
    dst[: len(src)] = src
    return zlib.crc32(dst[: len(src)], crc)


def _header_raw(planned: dict[str, tuple[OutTensor, int]], meta: dict[str, str]) -> bytes:
    """json.dumps({"__metadata__": meta, name: entry, ...}, separators=(",", ":")), built from the
    planned tensors and their data offsets only when it is written."""
    parts = ['{"__metadata__":', json.dumps(meta, separators=(",", ":"))]
    kinds: dict[tuple, str] = {}  # (dtype, shape) -> its JSON: a few per model (every expert repeats them)
    for name, (t, off) in planned.items():
        kind = kinds.get((t.dtype, t.shape))
        if kind is None:
            kind = kinds[t.dtype, t.shape] = (f'{{"dtype":{json.dumps(t.dtype)},"shape":'
                                              f'{json.dumps(list(t.shape), separators=(",", ":"))},"data_offsets":[')
        parts.append(f',{json.dumps(name)}:{kind}{off},{off + t.nbytes}]}}')
    parts.append("}")
    return "".join(parts).encode()


def json_pieces(obj, depth: int = 2) -> Iterator[str]:
    """json.dumps(obj, sort_keys=True) in pieces: dicts with string keys split down to ``depth``."""
    if isinstance(obj, dict) and obj and depth > 0 and all(type(k) is str for k in obj):
        sep = "{"
        for k, v in sorted(obj.items()):
            yield f"{sep}{json.dumps(k)}: "
            yield from json_pieces(v, depth - 1)
            sep = ", "
        yield "}"
    else:
        yield json.dumps(obj, sort_keys=True)


def report_pieces(obj, level: int = 0, depth: int = 2):
    """The report as JSON, one line per entry down to ``depth`` (one line per module), compact below;
    in pieces, so a large report is written without a copy of it in memory, each line by the C encoder."""
    if isinstance(obj, dict) and obj and level < depth:
        pad, sep = "  " * (level + 1), "{\n"
        for k, v in sorted(obj.items()):
            yield f"{sep}{pad}{json.dumps(str(k))}: "
            yield from report_pieces(v, level + 1, depth)
            sep = ",\n"
        yield "\n" + "  " * level + "}"
    else:
        yield json.dumps(obj, sort_keys=True, separators=(", ", ": "))


def index_pieces(total_size: int, weight_map: dict[str, str]):
    """json.dumps({"metadata": ..., "weight_map": sorted}, indent=2) + newline, in pieces."""
    yield f'{{\n  "metadata": {{\n    "total_size": {int(total_size)}\n  }},\n  "weight_map": {{'
    sep = "\n"
    for name in sorted(weight_map):
        yield f"{sep}    {json.dumps(name)}: {json.dumps(weight_map[name])}"
        sep = ",\n"
    yield "\n  }\n}\n" if weight_map else "}\n}\n"


# a scale's dtype -> (its bits as unsigned ints, the sign bit cleared, the shift to float32's bits)
_SCALE_VIEWS = {"BF16": ("<u2", 0x7FFF, 16), "F32": ("<u4", 0x7FFFFFFF, 0)}
_SCALE_LIMIT = struct.unpack("<I", struct.pack("<f", MAX_SCALE))[0]  # non-negative floats order as their bits


def check_scale_bytes(name: str, buf, dtype: str) -> None:
    """Refuse W4A8 scales (a ``.weight_scale`` tensor's bytes, as written) that are NaN, infinite or
    above ``MAX_SCALE``: they come from a damaged source value (a 3e38 scale) and would make the
    output compute garbage. One pass over the scales' bits (1/16 of the int8 weight's bytes or less)."""
    import numpy as np

    view = _SCALE_VIEWS.get(dtype)
    if view is None or not len(buf):
        return
    x = np.frombuffer(buf, dtype=view[0])
    if (int((x & view[1]).max()) << view[2]) <= _SCALE_LIMIT:
        return
    f = (x.astype("<u4") << view[2]).view("<f4") if view[2] else x.view("<f4")
    bad = ~(np.abs(f) <= MAX_SCALE)
    raise InputError(f"{name}: {int(bad.sum())} scale(s) NaN, infinite or above {MAX_SCALE:g} (the first "
                     f"{float(f[np.flatnonzero(bad)[0]]):.3g}): the source's scales or weights are damaged",
                     tensor=name, hint="No model's weights are that large; download the source again.")


def check_scale_tensors(tensors) -> None:
    """``check_scale_bytes`` of a job's W4A8 scales among its (name, tensor) pairs, before they are
    packed into blobs (where the writer does not see them)."""
    for name, data in tensors:
        if name.endswith(SCALE_SUFFIX) and torch_loaded() and isinstance(data, torch.Tensor):
            from .checkpoint import DTYPE_NAMES

            check_scale_bytes(name, to_bytes(data), DTYPE_NAMES.get(data.dtype))


def _disk_error(path: Path, e: OSError) -> OutputError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return OutputError(f"{path}: no space left on the device", path=str(path),
                           hint="Free some space (or pick another OUT) and re-run with --resume; "
                                "finished shards are kept.")
    return OutputError(f"{path}: cannot write ({e.strerror or e})", path=str(path),
                       hint="Check permissions and free space, then re-run with --resume.")


class ShardFile:
    """One safetensors shard whose tensors are written at precomputed offsets, in any order.

    ``write`` is thread-safe (``os.pwrite`` at the tensor's offset), so convert's workers write
    their own results in parallel; ``finish`` (one thread, once every tensor is in) writes the
    header, fsyncs and renames ``<name>.tmp`` to its final name.

    Tensors of whole pages, and pairs that fill whole pages together, lie first, from a page
    boundary (``_file_order``), and are written with O_DIRECT where the file system takes it: the
    worker copies a single tensor of whole pages into staging buffers (checksumming as it copies), or
    hands over a batch's buffer (``write_batch``), and the shard's I/O thread writes those straight
    to the disk, with no copy into the page cache and no page allocated per 4 KB there, while the
    worker goes on computing. The header, partial pages and the other tensors go through the page
    cache, as everything does where O_DIRECT is refused.
    """

    def __init__(self, path: Path, tensors: list[OutTensor], meta: dict[str, str], entry_bytes: int = 0):
        self.path = path
        self.tmp = path.with_name(path.name + ".tmp")
        self.tensors, self.direct_bytes = _file_order(tensors)  # file order; its leading span
        self.meta = dict(meta)
        # name -> (planned tensor, data offset): no header entry dicts (~400 B per tensor, kept all run)
        self._planned: dict[str, tuple[OutTensor, int]] = {}
        off = 0
        for t in self.tensors:
            self._planned[t.name] = (t, off)
            off += t.nbytes
        self.data_size = off
        # entry_bytes: more room per tensor for callers whose results say more (blob provenance)
        reserve = _META_RESERVE_BASE + (_META_RESERVE_PER_TENSOR + entry_bytes) * len(tensors)
        probe = _header_raw(self._planned, {**self.meta, "int4pack.tensors": " " * reserve})
        # data from a page boundary (the JSON header is padded with spaces, as safetensors allows)
        self.header_len = -(-(8 + len(probe)) // PAGE) * PAGE - 8
        self.digest_kind = digest_kind()  # crc32c with the extension, else zlib's crc32
        self.crc: dict[str, int] = {}  # tensor -> CRC of its bytes, once written
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._dfd: int | None = None  # the O_DIRECT descriptor, if the file system gave one
        self._direct = False
        self._io: ThreadPoolExecutor | None = None  # the direct writes, in the order they are staged
        self._io_error: BaseException | None = None  # the first failed direct write's
        try:
            self._fh = open(self.tmp, "wb")
            self._fh.write(b"\0" * (8 + self.header_len))  # placeholder, rewritten by finish()
            self._fh.flush()
            if self.direct_bytes:
                self._dfd = _open_direct(self.tmp)
            if self._dfd is not None:
                # full size up front: direct writes then never extend the file
                os.ftruncate(self._fh.fileno(), 8 + self.header_len + self.data_size)
                self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="int4pack-io")
            self._direct = self._dfd is not None
        except OSError as e:
            self.abort()
            raise _disk_error(self.tmp, e) from e

    def complete(self) -> bool:
        return len(self.crc) == len(self.tensors)

    def _pwrite(self, buf: memoryview, offset: int) -> None:
        fd = self._fh.fileno()
        while len(buf):
            n = os.pwrite(fd, buf, offset)
            buf, offset = buf[n:], offset + n

    def write(self, name: str, data) -> int:
        """Write one planned tensor (a tensor, bytes, or chunked TensorBytes); returns its CRC."""
        want, begin = self._planned.get(name, (None, 0))
        if want is None:
            raise OutputError(f"internal: {name!r} is not planned in {self.path.name}", tensor=name)
        if torch_loaded() and isinstance(data, torch.Tensor):  # no tensor exists before torch does
            from .checkpoint import DTYPE_NAMES
            if DTYPE_NAMES.get(data.dtype) != want.dtype or tuple(data.shape) != want.shape:
                raise OutputError(f"internal: {name} is {data.dtype}{tuple(data.shape)}, "
                                  f"planned {want.dtype}{want.shape}", tensor=name)
        chunks = data.chunks() if hasattr(data, "chunks") else None  # checkpoint.TensorBytes: streamed
        buf = to_bytes(data) if chunks is None else None
        if _SLOW_WRITE_S:
            time.sleep(_SLOW_WRITE_S)
        got = len(buf) if buf is not None else data.nbytes
        if got != want.nbytes:
            raise OutputError(f"internal: {name} has {got} bytes, planned {want.nbytes}", tensor=name)
        if buf is not None and name.endswith(SCALE_SUFFIX):
            check_scale_bytes(name, buf, want.dtype)
        off = 8 + self.header_len + begin
        pieces = chunks if buf is None else (buf,)
        crc = 0
        check = _CHECKSUMS[self.digest_kind][1]
        try:
            if self._io_error is not None:
                raise self._io_error
            if self._direct and begin < self.direct_bytes and begin % PAGE == 0 == want.nbytes % PAGE:
                crc, pieces = self._stage_direct(pieces, off), ()
            elif self._io is not None:
                # through the page cache, but written by the I/O thread too: with many workers, each
                # waiting its turn at the write lock here was a quarter of their time (16 threads,
                # the packed format, whose gate/up blobs are not whole pages)
                crc, pieces = self._stage_direct(pieces, off, direct=False), ()
            for piece in pieces:
                crc = check(piece, crc)  # releases the GIL: workers checksum in parallel
                # one writer at a time: ext4 takes the inode lock for each write anyway, and
                # writers queued on it spin in the kernel (measured: 18% of CPU with 2 workers)
                with self._write_lock:
                    self._pwrite(piece, off)
                off += len(piece)
        except OSError as e:
            raise _disk_error(self.tmp, e) from e
        with self._lock:
            if name in self.crc:
                raise OutputError(f"internal: {name} written twice in {self.path.name}", tensor=name)
            self.crc[want.name] = crc  # the plan's name string: the caller's may be a fresh copy
        return crc

    def place(self, name: str) -> tuple[OutTensor, int]:
        """A planned tensor and its offset in the data (file order: see ``_file_order``)."""
        got = self._planned.get(name)
        if got is None:
            raise OutputError(f"internal: {name!r} is not planned in {self.path.name}", tensor=name)
        return got

    def write_batch(self, entries: list[tuple[str, int, int]], buf: memoryview, release=None) -> None:
        """Write planned tensors whose bytes lie in ``buf`` (page-aligned memory, e.g. an anonymous
        mapping): ``entries`` (name, position in buf, CRC of its bytes) in file order. Tensors next to
        each other in the file and in ``buf`` go out in one write; its whole pages go directly where a
        position in ``buf`` lies as far into its page as the tensor's offset in the file (the rest,
        at most a page at each end, through the page cache). Queued for the I/O thread where the
        file has one (``release(buf)`` is called once the bytes are written, or dropped after a
        failure), else written here; thread-safe, as ``write``."""
        spans: list[list[int]] = []  # [data offset, position in buf, bytes]
        for name, pos, _ in entries:
            t, begin = self.place(name)
            if name.endswith(SCALE_SUFFIX):
                check_scale_bytes(name, buf[pos: pos + t.nbytes], t.dtype)
            last = spans[-1] if spans else None
            if last is not None and last[0] + last[2] == begin and last[1] + last[2] == pos:
                last[2] += t.nbytes
            else:
                spans.append([begin, pos, t.nbytes])
        if _SLOW_WRITE_S:
            time.sleep(_SLOW_WRITE_S * len(entries))
        queued = False
        try:
            if self._io_error is not None:
                raise self._io_error
            with self._lock:
                for name, _, crc in entries:
                    if name in self.crc:
                        raise OutputError(f"internal: {name} written twice in {self.path.name}", tensor=name)
                    self.crc[self._planned[name][0].name] = crc
            if self._io is not None:
                self._io.submit(self._write_spans, spans, buf, release)
                queued = True
            else:
                self._write_spans(spans, buf, None)
        except OSError as e:
            raise _disk_error(self.tmp, e) from e
        finally:
            if not queued and release is not None:
                release(buf)

    def _write_spans(self, spans: list[list[int]], buf: memoryview, release) -> None:  # I/O thread, or a worker
        try:
            for begin, pos, nbytes in spans:
                if self._io_error is not None:
                    return
                piece, off = buf[pos: pos + nbytes], 8 + self.header_len + begin  # the data starts on a page
                lo = hi = 0  # the span's whole pages: piece[lo:hi]
                if self._direct and (pos - off) % PAGE == 0:
                    lo = min(nbytes, -off % PAGE)
                    hi = lo + (nbytes - lo) // PAGE * PAGE
                self._cached(piece[:lo], off)
                if hi > lo:
                    done = lo + self._pwrite_direct(piece[lo:hi], off + lo)
                    self._cached(piece[done:hi], off + done)  # the rest of a refused direct write
                self._cached(piece[hi:], off + hi)
        except BaseException as e:
            if release is None:
                raise
            self._io_error = self._io_error or e  # raised by the next write, or by finish
        finally:
            if release is not None:
                release(buf)

    def _cached(self, piece: memoryview, off: int) -> None:
        """``piece`` through the page cache, 1 MB at a time: one write per span (~5 MB) took about
        twice the CPU per byte (Linux 6.18, 2-core x86-64)."""
        for done in range(0, len(piece), _CACHE_WRITE):
            with self._write_lock:
                self._pwrite(piece[done: done + _CACHE_WRITE], off + done)

    def _stage_direct(self, pieces, off: int, direct: bool = True) -> int:
        """Copy ``pieces`` (one tensor of whole pages, at a page-aligned ``off``) into staging buffers,
        checksumming as they are copied, and queue each full buffer for the I/O thread; returns the
        CRC. Whole stages only, and the tensor's last: pieces of any size keep each write aligned.
        ``direct`` False: any tensor, which the I/O thread writes through the page cache."""
        copy = _CHECKSUMS[self.digest_kind][2]
        stage, fill, crc = None, 0, 0
        try:
            for piece in pieces:
                piece = memoryview(piece)
                while len(piece):
                    if stage is None:
                        stage = _stages.take()
                    n = min(len(piece), len(stage) - fill)
                    crc = copy(piece[:n], stage[fill:], crc)
                    fill, piece = fill + n, piece[n:]
                    if fill == len(stage):
                        stage, full = None, stage
                        self._io.submit(self._drain, full, fill, off, direct)
                        off, fill = off + fill, 0
            if stage is not None:
                stage, last = None, stage
                self._io.submit(self._drain, last, fill, off, direct)
        finally:
            if stage is not None:  # a failed read or copy: the buffer goes back unwritten
                _stages.give(stage)
        return crc

    def _drain(self, stage: memoryview, n: int, off: int, direct: bool = True) -> None:  # the I/O thread
        try:
            if self._io_error is None:
                done = self._pwrite_direct(stage[:n], off) if direct and self._direct else 0
                if done < n:  # refused: the rest through the page cache (a full disk says so there)
                    with self._write_lock:
                        self._pwrite(stage[done:n], off + done)
        except BaseException as e:  # raised by the next write, or by finish
            self._io_error = self._io_error or e
        finally:
            _stages.give(stage)

    def _pwrite_direct(self, buf: memoryview, off: int) -> int:
        """One direct write of ``buf``; returns how much was written. A short write (disk full) or
        EINVAL (direct writes refused after all) turns direct writes off for this file."""
        written = 0
        try:
            written = os.pwrite(self._dfd, buf, off)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
        if written < len(buf):
            self._direct = False
        return written

    def flush(self) -> None:
        """Push what is written so far to the disk (so the final fsync has little left to wait for)."""
        try:
            os.fdatasync(self._fh.fileno())
        except OSError as e:
            raise _disk_error(self.tmp, e) from e

    def finish(self, results: dict[str, dict]) -> dict:
        """Write the final header (with per-tensor results), fsync, rename. Returns checksums."""
        if not self.complete():
            raise OutputError(f"internal: {self.path.name} finished with {len(self.crc)}/{len(self.tensors)} tensors")
        meta = {**self.meta, "int4pack.tensors": json.dumps(copy_checksums(results, self.crc, self.digest_kind),
                                                             sort_keys=True, separators=(",", ":"))}
        raw = _header_raw(self._planned, meta)
        if len(raw) > self.header_len:
            raise OutputError(f"internal: shard header grew past its reserved {self.header_len} bytes")
        digest = hashlib.sha256(raw)
        try:
            self._wait_io()
            # length, header, then the rest of the reserved slot in spaces: no joined copy of a header
            # that grows with the shard (and its padding, ~100 B per tensor)
            self._pwrite(memoryview(self.header_len.to_bytes(8, "little")), 0)
            self._pwrite(memoryview(raw), 8)
            off = 8 + len(raw)
            while off < 8 + self.header_len:
                pad = _SPACES[: 8 + self.header_len - off]
                digest.update(pad)
                self._pwrite(pad, off)
                off += len(pad)
            os.fsync(self._fh.fileno())
            self._fh.close()
            os.replace(self.tmp, self.path)
        except OSError as e:
            self.abort()
            raise _disk_error(self.path, e) from e
        return {"size": 8 + self.header_len + self.data_size,
                "header_sha256": digest.hexdigest(),
                "data_digest": _data_digest((self.crc[t.name] for t in self.tensors), self.digest_kind)}

    def _wait_io(self) -> None:
        """Every queued direct write done (raising the first failure), and the descriptor closed."""
        io, self._io = self._io, None
        if io is not None:
            io.shutdown(wait=True)
        fd, self._dfd, self._direct = self._dfd, None, False
        if fd is not None:
            os.close(fd)
        if self._io_error is not None:
            raise self._io_error

    def abort(self) -> None:
        self._io_error = self._io_error or OutputError(f"{self.tmp}: aborted")  # queued writes skipped
        try:
            self._wait_io()
        except BaseException:
            pass
        try:
            if hasattr(self, "_fh"):
                self._fh.close()
        except OSError:
            pass
        try:
            self.tmp.unlink()
        except OSError:
            pass


# kind -> (tag hashed first, checksum(data, crc) -> crc, copy_checksum(src, dst, crc) -> crc: the
# direct writer's staging copy). crc32c (hardware, in the extension) is written when the extension
# is loaded, zlib's crc32 without it; "crc32c:" prefixes its digests, and a bare hex digest
# (int4pack 0.1.0 before this change) is crc32
# kernels.py imports torch: imported on first use, not with this module (convert's plan imports it)
def _crc32c(data, crc: int = 0) -> int:
    from . import kernels

    return kernels.crc32c(data, crc)


def _crc32c_copy(src, dst, crc: int = 0) -> int:
    from . import kernels

    return kernels.crc32c_copy(src, dst, crc)


_CHECKSUMS = {"crc32": (b"int4pack-crc32-v1", zlib.crc32, _copy_crc32),
              "crc32c": (b"int4pack-crc32c-v1", _crc32c, _crc32c_copy)}


def tensor_crc(data, kind: str) -> int:
    """The CRC a shard of ``kind`` records for one tensor (a tensor, bytes or chunked TensorBytes)."""
    check = _CHECKSUMS[kind][1]
    crc = 0
    for piece in (data.chunks() if hasattr(data, "chunks") else (to_bytes(data),)):
        crc = check(piece, crc)
    return crc


def digest_kind(digest: str | None = None) -> str:
    """The checksum kind of a recorded data_digest; with none, the kind a new shard gets."""
    if digest is None:
        from . import kernels

        return "crc32c" if kernels.ext() is not None else "crc32"
    return "crc32c" if str(digest).startswith("crc32c:") else "crc32"


def copy_checksums(results: dict[str, dict], crcs: dict[str, int], kind: str) -> dict[str, dict]:
    """A shard's per-tensor header entries with each copied tensor's own CRC added (``{kind: hex}``):
    a copied tensor (a router, a norm) has no other record of its bytes in the shard, so one
    changed in place would pass a verify without the report (or with a resealed one)."""
    return {name: {**ent, kind: f"{crcs[name]:08x}"} if ent.get("path") == "copy" and name in crcs else ent
            for name, ent in results.items()}


def _data_digest(crcs, kind: str) -> str:
    """The shard's data checksum: sha256 over its tensors' CRCs in file order.

    A CRC runs at several GB/s (CRC-32C with SSE4.2 at ~13, zlib's CRC-32 at 2-6, sha256 at
    ~1.8) and is computed per tensor by the worker that wrote it; it catches any burst error up
    to 32 bits and any other change with probability 1 - 2**-32 per tensor, which is what resume
    and verify need (tamper-proofing is not a goal).
    """
    h = hashlib.sha256(_CHECKSUMS[kind][0])
    for c in crcs:
        h.update(int(c).to_bytes(4, "big"))
    return ("crc32c:" if kind == "crc32c" else "") + h.hexdigest()


def hash_shard(path: Path, like: str | None = None, per_tensor: dict | None = None) -> dict:
    """Re-checksum a finished shard the same way finish() recorded it (data_digest None if the
    header no longer parses, or the data ends early); ``like`` is the recorded digest, whose kind is
    used. ``per_tensor``, if given, receives each tensor's CRC by name."""
    return hash_shards([(path, like, per_tensor)])[0]


_HASH_PIECE = 8 << 20  # one read of hash_shards: a run of neighbouring tensors, or part of a large one


def hash_shards(shards: list[tuple[Path, str | None, dict | None]], workers: int = 1) -> list[dict]:
    """``hash_shard`` of each (path, like, per_tensor), the data read once, in reads of up to 8 MB
    (neighbouring tensors together, a large tensor in parts) spread over ``workers`` threads: a
    resume's check of what it keeps reads every kept byte, and one read at a time, per tensor, left
    the disk idle between small reads (2-core x86-64: 360 MB/s from one reader, 690 MB/s from four)."""
    outs, plans = [], []  # plans: (file, tensor names in file order, [(tensor index, begin, end)], kind)
    for path, like, _ in shards:
        kind = digest_kind(like)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        size = os.fstat(fd).st_size
        n = int.from_bytes(os.pread(fd, 8, 0), "little")
        header = os.pread(fd, min(n, max(0, size - 8)), 8)
        outs.append({"size": size, "header_sha256": hashlib.sha256(header).hexdigest(), "data_digest": None})
        try:
            hdr = json.loads(header)
            named = sorted((tuple(v["data_offsets"]), k) for k, v in hdr.items() if k != "__metadata__")
            spans = [(8 + n + int(a), 8 + n + int(b)) for (a, b), _ in named]
        except (ValueError, TypeError, KeyError, AttributeError):
            os.close(fd)
            plans.append(None)
            continue
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        plans.append((fd, [k for _, k in named], spans, kind))
    pieces = []  # (shard index, [(tensor index, begin, end)]): each read at once
    for si, plan in enumerate(plans):
        if plan is None:
            continue
        cur, cur_end, cur_bytes = [], None, 0
        for ti, (a, b) in enumerate(plan[2]):
            if cur and (a != cur_end or cur_bytes + b - a > _HASH_PIECE):
                pieces.append((si, cur))
                cur, cur_bytes = [], 0
            cur.append((ti, a, b))
            cur_end, cur_bytes = b, cur_bytes + b - a
        if cur:
            pieces.append((si, cur))
    crcs: list[list] = [[None] * len(p[1]) if p else [] for p in plans]
    short: set[int] = set()  # shards whose data ended early
    local = threading.local()

    def run(piece) -> None:
        si, ts = piece
        fd, _, _, kind = plans[si]
        check = _CHECKSUMS[kind][1]
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = memoryview(bytearray(_HASH_PIECE))
        lo, hi = ts[0][1], ts[-1][2]
        if hi - lo <= _HASH_PIECE:  # neighbours in one read
            got = 0
            while got < hi - lo:
                k = os.preadv(fd, [buf[got: hi - lo]], lo + got)
                if k <= 0:
                    short.add(si)
                    return
                got += k
            for ti, a, b in ts:
                crcs[si][ti] = check(buf[a - lo: b - lo], 0)
            return
        (ti, a, b), = ts  # a tensor larger than one read: in parts, in order
        crc, off = 0, a
        while off < b:
            k = os.preadv(fd, [buf[: min(len(buf), b - off)]], off)
            if k <= 0:
                short.add(si)
                return
            crc = check(buf[:k], crc)
            off += k
        crcs[si][ti] = crc

    try:
        if workers > 1 and len(pieces) > 1:
            with ThreadPoolExecutor(max_workers=min(workers, len(pieces)), thread_name_prefix="int4pack-hash") as pool:
                for f in [pool.submit(run, p) for p in pieces]:
                    f.result()
        else:
            for p in pieces:
                run(p)
    finally:
        for plan in plans:
            if plan is not None:
                os.close(plan[0])
    for si, plan in enumerate(plans):
        if plan is None or si in short:
            continue
        per_tensor = shards[si][2]
        if per_tensor is not None:
            per_tensor.update(zip(plan[1], crcs[si]))
        outs[si]["data_digest"] = _data_digest(crcs[si], plan[3])
    return outs


CHECKSUM_KEYS = ("size", "header_sha256", "data_digest")


def check_target(out: Path, source: Path, *, overwrite: bool) -> None:
    """Refuse an OUT that a run could not write or must not replace, changing nothing: what
    ``OutputDir.open`` checks first, and what ``convert --dry-run`` checks so that it says ok only to
    what the run accepts."""
    out = out.expanduser().absolute()
    _check_place(out, source)
    _check_existing(out, overwrite)
    _check_work(partial_folder(out))


def _check_place(out: Path, source: Path) -> None:
    if out.is_symlink() and not out.exists():  # the final rename would fail after the whole run
        raise OutputError(f"{out}: is a symlink to {os.readlink(out)}, which does not exist", path=str(out),
                          hint="Remove the link or pick another OUT.")
    src, outr = source.resolve(), out.resolve()
    if outr == src or src in outr.parents:
        raise OutputError(f"{out}: is inside the source folder {src}", path=str(out),
                          hint="The source is read-only to int4pack; write the output elsewhere.")
    if outr in src.parents:
        raise OutputError(f"{out}: contains the source folder {src}", path=str(out),
                          hint="Pick an OUT that does not contain the source.")
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out}: exists and is not a folder", path=str(out),
                          hint="Remove the file or pick another OUT.")


def _check_existing(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise OutputError(f"{out}: already exists", path=str(out),
                          hint="Pass --overwrite to replace it, or pick another OUT.")
    if out.exists() and any(out.iterdir()) and not (out / REPORT_NAME).is_file():
        # --overwrite replaces a previous int4pack output, never an arbitrary folder
        raise OutputError(f"{out}: is not empty and is not an int4pack output (no {REPORT_NAME})",
                          path=str(out), hint="Pick another OUT, or remove that folder yourself.")


def _check_work(work: Path) -> None:
    if work.is_symlink():
        raise OutputError(f"{work}: the work folder is a symlink (to {os.readlink(work)})", path=str(work),
                          hint="int4pack builds the output in a folder of its own; remove the link and run again.")
    if work.exists() and hasattr(os, "getuid") and work.stat().st_uid != os.getuid():
        raise OutputError(f"{work}: the work folder belongs to another user (uid {work.stat().st_uid})",
                          path=str(work), hint="Remove it, or write the output elsewhere.")
    if work.exists() and not _is_ours(work):
        raise OutputError(f"{work}: exists but is not an int4pack work folder", path=str(work),
                          hint="Remove it (it is not ours) and run again.")


@dataclass
class OutputDir:
    """The final folder, its hidden work folder, and the resume state inside it.

    A work folder is int4pack's when it holds ``MARKER`` (written atomically right after the folder
    is made, before anything else), or nothing but the files written before it (a run killed
    there), or a ``progress.json`` (int4pack 0.1.0). One run writes it at a time: ``LOCK`` in it is
    held with ``fcntl.flock`` for the whole run and names the running process."""

    final: Path
    work: Path
    fingerprint: str
    progress: dict
    lock_fd: int | None = None

    @classmethod
    def open(cls, out: Path, source: Path, fingerprint: str, *, overwrite: bool, resume: bool) -> "OutputDir":
        out = out.expanduser().absolute()
        _check_place(out, source)
        if out.is_dir() and (out / REPORT_NAME).is_file():
            _drop_work_files(out)  # left by a run stopped inside commit(), after its rename: the output is whole
        _check_existing(out, overwrite)
        try:  # missing parents are created, as mkdir -p would
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"{out.parent}: cannot create the output's parent folder: {e.strerror or e}",
                              path=str(out.parent), hint="Pick an OUT whose parent can be a folder.") from e
        work = partial_folder(out)
        _check_work(work)
        progress = {"fingerprint": fingerprint, "shards": {}, "jobs": {}}
        try:
            work.mkdir(parents=False, exist_ok=True)
        except OSError as e:
            raise _disk_error(work, e) from e
        lock_fd = _lock(work)  # before anything in it is read or removed: another run may own it
        try:
            old = None
            state = work / PROGRESS
            if state.is_file() and not state.is_symlink():
                try:
                    old = json.loads(state.read_text())
                except (OSError, ValueError):
                    old = None
            if resume and isinstance(old, dict) and old.get("fingerprint") == fingerprint:
                progress = old
            else:
                _clear(work)
            od = cls(out, work, fingerprint, progress, lock_fd)
            if not (work / MARKER).is_file():
                od.write_file(MARKER, (json.dumps({"int4pack_work_folder": 1, "output": out.name}) + "\n").encode())
            od.save_progress()
        except BaseException:
            os.close(lock_fd)
            raise
        return od

    def save_progress(self) -> None:
        # in pieces: its per-module results grow with the model and it is rewritten at every shard
        self.write_file(PROGRESS, json_pieces(self.progress))

    def trusted_shards(self, names: list[str] | None = None, workers: int = 1) -> set[str]:
        """Finished shards whose bytes still match their recorded checksums, each read once
        (``kept_crcs``: shard -> tensor -> CRC). Convert keeps them once their headers say what this
        run would write; the progress file's fingerprint has already tied them to the same source
        files (their identity and times), tool version and options. A folder entry that is a link is
        never kept."""
        ok = set()
        self.kept_crcs: dict[str, dict[str, int]] = {}
        shards = self.progress.get("shards")
        if not isinstance(shards, dict):
            shards = self.progress["shards"] = {}
        todo = []  # (name, path, recorded digest, per-tensor CRCs)
        for name, rec in shards.items():
            p = self.work / name
            if names is not None and name not in names or not isinstance(rec, dict) or p.is_symlink():
                continue
            if p.is_file() and p.stat().st_size == rec.get("size"):
                todo.append((name, p, rec.get("data_digest") if isinstance(rec.get("data_digest"), str) else None, {}))
        for (name, _, _, crcs), got in zip(todo, hash_shards([(p, d, c) for _, p, d, c in todo], workers)):
            if got == {k: shards[name].get(k) for k in CHECKSUM_KEYS}:
                ok.add(name)
                self.kept_crcs[name] = crcs
        # forget anything we could not verify, and stray temp files
        self.progress["shards"] = {k: {c: v[c] for c in CHECKSUM_KEYS} for k, v in shards.items() if k in ok}
        # the statistics recorded with the shards: those of a job whose outputs all lie in kept shards
        # are taken instead of running the job again (convert carries them into this run's record)
        jobs = self.progress.get("jobs")
        self.recorded_jobs = {m: st for m, st in jobs.items() if isinstance(st, dict)} if ok and isinstance(
            jobs, dict) else {}
        self.progress["jobs"] = {}
        for p in self.work.glob("*.tmp"):
            p.unlink(missing_ok=True)
        return ok

    def drop_shard(self, name: str) -> None:
        """Forget a kept shard that did not hold what the source gives (removed; the next --resume redoes it)."""
        self.progress.get("shards", {}).pop(name, None)
        (self.work / name).unlink(missing_ok=True)
        self.save_progress()

    def write_file(self, name: str, data: bytes | Iterable[str]) -> None:
        """Write ``name`` atomically: bytes, or text given in pieces (UTF-8)."""
        p = self.work / name
        tmp = p.with_name(p.name + ".tmp")
        try:
            if isinstance(data, (bytes, bytearray, memoryview)):
                tmp.write_bytes(data)
            else:
                with open(tmp, "w", encoding="utf-8") as fh:
                    for piece in data:
                        fh.write(piece)
            os.replace(tmp, p)
        except OSError as e:
            raise _disk_error(p, e) from e

    def copy_file(self, src: Path) -> None:
        try:
            shutil.copyfile(src, self.work / src.name)
        except OSError as e:
            raise _disk_error(self.work / src.name, e) from e

    def commit(self) -> None:
        """Swap the finished work folder into place (replacing OUT only when overwriting). The work
        files (progress, marker, lock) go once it is in place: a run stopped before that leaves a
        work folder the next run resumes, one stopped after it a whole OUT (open() tidies it)."""
        old = None
        try:
            if self.final.exists():
                old = self.final.parent / f".{self.final.name}.int4pack-old"
                if old.exists():
                    shutil.rmtree(old)
                os.replace(self.final, old)
            os.replace(self.work, self.final)
        except OSError as e:
            raise _disk_error(self.final, e) from e
        _drop_work_files(self.final)
        self.release()
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def release(self) -> None:
        """Let go of the work folder's lock (the process's exit does the same)."""
        fd, self.lock_fd = self.lock_fd, None
        if fd is not None:
            os.close(fd)


MARKER = "int4pack-work.json"  # written first in a work folder: it is ours
LOCK = "int4pack.lock"  # flock'ed by the run writing the folder; holds its process id
_WORK_FILES = (PROGRESS, MARKER, LOCK)
_BEFORE_MARKER = {LOCK, MARKER + ".tmp"}  # what a run writes in a new work folder before its marker


def _is_ours(work: Path) -> bool:
    """A work folder int4pack made: the marker, int4pack 0.1.0's progress file, or only what comes
    before the marker (a run killed between making the folder and writing it)."""
    if not work.is_dir():
        return False
    for name in (MARKER, PROGRESS):
        p = work / name
        if p.is_file() and not p.is_symlink():
            return True
    try:
        return all(e.name in _BEFORE_MARKER and e.is_file(follow_symlinks=False) for e in os.scandir(work))
    except OSError:
        return False


def _lock(work: Path) -> int:
    """Take the work folder's lock (a file in it, flock'ed) and write this process's id in it;
    refuse, naming the holder, while another run has it."""
    path = work / LOCK
    for _ in range(20):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            raise _disk_error(path, e) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return fd  # a file system without flock (some network mounts): the run goes on unlocked
            holder = _holder(fd)
            os.close(fd)
            raise OutputError(f"{work.parent / work.name[1:].removesuffix('.int4pack-partial')}: another int4pack "
                              f"run ({holder}) is writing this output in {work}", path=str(work),
                              hint="Wait for it to finish (or stop it), then run again.") from None
        try:  # the folder may have been renamed into OUT (or removed) while this run waited to lock it
            same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except OSError:
            same = False
        if not same:
            os.close(fd)
            work.mkdir(exist_ok=True)
            continue
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd
    raise OutputError(f"{work}: the work folder keeps changing under this run", path=str(work),
                      hint="Another process is using it; wait for it, then run again.")


def _holder(fd: int) -> str:
    """'process N' as the lock file names its holder (it writes its id just after locking)."""
    for _ in range(50):
        pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if pid:
            return f"process {pid}"
        time.sleep(0.01)
    return "process id not yet written"


def _clear(work: Path) -> None:
    """Empty the work folder for a fresh run, keeping the lock this run holds in it."""
    for e in os.scandir(work):
        if e.name == LOCK:
            continue
        if e.is_dir(follow_symlinks=False):
            shutil.rmtree(e.path)
        else:
            os.unlink(e.path)


def _drop_work_files(folder: Path) -> None:
    """The work folder's own files, out of a committed output."""
    for name in _WORK_FILES:
        p = folder / name
        if p.is_file() or p.is_symlink():
            try:
                p.unlink()
            except OSError:
                pass
