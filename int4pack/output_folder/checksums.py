"""The checksums of convert's output: each tensor's CRC (CRC-32C with the C++ library, zlib's
CRC-32 without), a shard's data digest over them, and the re-read of a finished shard that --resume
and verify compare with what was recorded. No torch at import: kernels.py (which imports it) is
loaded on first use."""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import queue
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .._lazy import torch

__all__ = ["CHECKSUMS", "CHECKSUM_KEYS", "to_bytes", "tensor_crc", "digest_kind", "copy_checksums", "data_digest",
           "hash_shard", "hash_shards"]

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


def _copy_crc32(src: memoryview, dst: memoryview, crc: int) -> int:
    dst[: len(src)] = src
    return zlib.crc32(dst[: len(src)], crc)


# kind -> (tag hashed first, checksum(data, crc) -> crc, copy_checksum(src, dst, crc) -> crc: the
# direct writer's staging copy). crc32c (hardware, in the extension) is written when the extension
# is loaded, zlib's crc32 without it; "crc32c:" prefixes its digests, and a bare hex digest
# (int4pack 0.1.0 before this change) is crc32
# kernels.py imports torch: imported on first use, not with this module (convert's plan imports it)
def _crc32c(data, crc: int = 0) -> int:
    from .. import kernels

    return kernels.crc32c(data, crc)


def _crc32c_copy(src, dst, crc: int = 0) -> int:
    from .. import kernels

    return kernels.crc32c_copy(src, dst, crc)


CHECKSUMS = {"crc32": (b"int4pack-crc32-v1", zlib.crc32, _copy_crc32),
              "crc32c": (b"int4pack-crc32c-v1", _crc32c, _crc32c_copy)}


def tensor_crc(data, kind: str) -> int:
    """The CRC a shard of ``kind`` records for one tensor (a tensor, bytes or chunked TensorBytes)."""
    check = CHECKSUMS[kind][1]
    crc = 0
    for piece in (data.chunks() if hasattr(data, "chunks") else (to_bytes(data),)):
        crc = check(piece, crc)
    return crc


def digest_kind(digest: str | None = None) -> str:
    """The checksum kind of a recorded data_digest; with none, the kind a new shard gets."""
    if digest is None:
        from .. import kernels

        return "crc32c" if kernels.ext() is not None else "crc32"
    return "crc32c" if str(digest).startswith("crc32c:") else "crc32"


def copy_checksums(results: dict[str, dict], crcs: dict[str, int], kind: str) -> dict[str, dict]:
    """A shard's per-tensor header entries with each copied tensor's own CRC added (``{kind: hex}``):
    a copied tensor (a router, a norm) has no other record of its bytes in the shard, so one
    changed in place would pass a verify without the report (or with a resealed one)."""
    return {name: {**ent, kind: f"{crcs[name]:08x}"} if ent.get("path") == "copy" and name in crcs else ent
            for name, ent in results.items()}


def data_digest(crcs, kind: str) -> str:
    """The shard's data checksum: sha256 over its tensors' CRCs in file order.

    A CRC runs at several GB/s (CRC-32C with SSE4.2 at ~13, zlib's CRC-32 at 2-6, sha256 at
    ~1.8) and is computed per tensor by the worker that wrote it; it catches any burst error up
    to 32 bits and any other change with probability 1 - 2**-32 per tensor, which is what resume
    and verify need (tamper-proofing is not a goal).
    """
    h = hashlib.sha256(CHECKSUMS[kind][0])
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
    # anonymous mappings, one per thread in use, unmapped at the end: heap buffers of this size
    # raised glibc's mmap threshold and stayed in the arenas, in the RSS of the jobs that follow
    spare: queue.SimpleQueue = queue.SimpleQueue()
    made: list[mmap.mmap] = []

    def run(piece) -> None:
        try:
            m = spare.get_nowait()
        except queue.Empty:
            m = mmap.mmap(-1, _HASH_PIECE)
            made.append(m)
        try:
            with memoryview(m) as buf:
                _hash_piece(piece, buf)
        finally:
            spare.put(m)

    def _hash_piece(piece, buf: memoryview) -> None:
        si, ts = piece
        fd, _, _, kind = plans[si]
        check = CHECKSUMS[kind][1]
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
        for m in made:
            m.close()
    for si, plan in enumerate(plans):
        if plan is None or si in short:
            continue
        per_tensor = shards[si][2]
        if per_tensor is not None:
            per_tensor.update(zip(plan[1], crcs[si]))
        outs[si]["data_digest"] = data_digest(crcs[si], plan[3])
    return outs


CHECKSUM_KEYS = ("size", "header_sha256", "data_digest")
