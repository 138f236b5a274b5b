"""Streaming safetensors shards: the shard file.

Every output tensor's dtype and shape is known from the plan, so each shard's header (and
so every tensor's offset) is fixed before any data is computed: tensors are streamed to
disk one at a time and memory stays bounded by the tensors in flight. Per-tensor results
(path, error) go into a reserved, space-padded slot of the header when the shard is
finished, which keeps offsets unchanged. A shard is written as ``<name>.tmp`` and renamed when
complete. Its checksums are checksums.py's; the folder it is written in, workdir.py's.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .._lazy import torch, torch_loaded
from .buffer_pool import BufferPool
from .checksums import CHECKSUMS, copy_checksums, data_digest, digest_kind, to_bytes
from ..errors import InputError, OutputError
from ..groups import MAX_SCALE
from ..plan import OutTensor
from .workdir import disk_error

# names callers found here before they got homes of their own (checksums.py, workdir.py)
from .checksums import CHECKSUM_KEYS, hash_shard, hash_shards, tensor_crc  # noqa: F401
from .workdir import LOCK, MARKER, PROGRESS, REPORT_NAME, OutputDir, check_target, partial_folder  # noqa: F401

__all__ = ["assign_shards", "shard_names", "ShardFile", "PAGE", "check_scale_bytes",
           "check_scale_tensors"]

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


_stages = BufferPool(_STAGES, _STAGE_BYTES)  # direct writes of single tensors


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
            from ..sources.checkpoint import DTYPE_NAMES

            check_scale_bytes(name, to_bytes(data), DTYPE_NAMES.get(data.dtype))


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
            raise disk_error(self.tmp, e) from e

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
            from ..sources.checkpoint import DTYPE_NAMES
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
        check = CHECKSUMS[self.digest_kind][1]
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
            raise disk_error(self.tmp, e) from e
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
            raise disk_error(self.tmp, e) from e
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
        copy = CHECKSUMS[self.digest_kind][2]
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
            raise disk_error(self.tmp, e) from e

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
            raise disk_error(self.path, e) from e
        return {"size": 8 + self.header_len + self.data_size,
                "header_sha256": digest.hexdigest(),
                "data_digest": data_digest((self.crc[t.name] for t in self.tensors), self.digest_kind)}

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


