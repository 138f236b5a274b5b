"""verify's one read of every output byte. The numerical pass reads its tensors through a
``Tapped`` checkpoint, which checksums each one (of the kind its shard records) and takes each
int8 tensor's range on the way; the shard scan reads the rest, in parts of ~256 MB on the pool's
threads, while the numerical pass runs; what neither read (a layer that could not run) is read
after it. Then the shard checksums are checked against convert's report. The bytes checked are
the bytes computed on, and the output is read from the disk once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .. import _ext
from ..sources.checkpoint import Checkpoint
from ..output_folder.checksums import CHECKSUMS as _CHECKSUMS, data_digest as _data_digest, digest_kind, hash_shard, tensor_crc

__all__ = ["Tapped", "shard_kinds", "scan", "finish_scan", "check_hashes", "check_copy_checksums", "in_order"]

_PART_BYTES = 256 << 20  # one task of the shard scan
_READ_BYTES = 16 << 20


class Tapped(Checkpoint):
    """A Checkpoint whose whole-tensor reads (``get``) also record each tensor's checksum, of the
    kind ``kinds`` names for its shard (a shard not named is not recorded), and an int8 tensor's
    (min, max): ``taps`` {(shard, name): (crc, range or None)}, what ``finish_scan`` takes instead
    of reading the tensor again."""

    def __init__(self, folder):
        super().__init__(folder)
        self.kinds: dict[str, str] = {}
        self.taps: dict[tuple[str, str], tuple[int, tuple[int, int] | None]] = {}

    def get(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        x = super().get(name, out)
        info = self.tensors[name]
        kind = self.kinds.get(info.file)
        if kind is not None:
            flat = x.reshape(-1)
            crc = _CHECKSUMS[kind][1](flat.view(torch.uint8).numpy() if flat.numel() else b"", 0)
            self.taps[(info.file, name)] = (crc, _range(flat) if info.dtype == "I8" and flat.numel() else None)
        return x

    def prefetch(self, names) -> None:
        """Ask the kernel to start reading these tensors (one span per shard): the next expert's
        bytes come in while this one computes."""
        spans: dict[str, tuple[int, int]] = {}
        for n in names:
            i = self.tensors.get(n)
            if i is not None and i.end > i.begin:
                lo, hi = spans.get(i.file, (i.begin, i.end))
                spans[i.file] = (min(lo, i.begin), max(hi, i.end))
        for shard, (lo, hi) in spans.items():
            try:
                os.posix_fadvise(self._fd(shard), lo, hi - lo, os.POSIX_FADV_WILLNEED)
            except (OSError, AttributeError):  # a hint only (no posix_fadvise on this platform)
                return


def _range(q: torch.Tensor) -> tuple[int, int]:
    vk = _ext.load("verify_kernels")
    return vk.int8_range(q) if vk is not None else (int(q.min()), int(q.max()))


def shard_kinds(ckpt: Checkpoint, report: dict | None) -> dict[str, str]:
    """Each shard's checksum kind: the one convert's report records for it, else a new shard's."""
    recs = (report or {}).get("shards")
    recs = recs if isinstance(recs, dict) else {}
    out = {}
    for shard in {info.file for info in ckpt.tensors.values()}:
        rec = recs.get(shard)
        got = rec.get("data_digest") if isinstance(rec, dict) and isinstance(rec.get("data_digest"), str) else None
        # without a report, the kind the shard's own copied-tensor checksums name (one read serves both)
        out[shard] = digest_kind(got) if got is not None else next(
            (k for _, k, _ in _copy_checksums(ckpt, shard)), None) or digest_kind(None)
    return out


def _copy_checksums(ckpt: Checkpoint, shard: str) -> list[tuple[str, str, str]]:
    """(tensor, checksum kind, hex) of each copied tensor whose CRC the shard's header records."""
    try:
        ents = json.loads((ckpt.shard_metadata.get(shard) or {}).get("int4pack.tensors") or "{}")
    except ValueError:
        return []  # a packed shard's provenance problem, named by its blob checks
    out = []
    for name, ent in ents.items() if isinstance(ents, dict) else ():
        if isinstance(ent, dict) and ent.get("path") == "copy":
            kind = next((k for k in _CHECKSUMS if isinstance(ent.get(k), str)), None)
            if kind is not None:
                out.append((name, kind, ent[kind]))
    return out


def check_copy_checksums(ckpt: Checkpoint, problems, scanned: dict) -> None:
    """Each copied tensor's bytes (as the scan read them) against the CRC its shard header records:
    a router or norm changed in place is found without the report, and through a resealed one."""
    for shard, (_, _, kind) in scanned["layout"].items():
        for name, ck, want in _copy_checksums(ckpt, shard):
            info = ckpt.tensors.get(name)
            if info is None or info.file != shard:
                continue  # a tensor the index does not put here: the layout checks name it
            got = scanned["crcs"].get((shard, name)) if ck == kind else None
            if got is None:  # read in another kind (or not at all): read it again, of the header's kind
                got = tensor_crc(bytes(ckpt.read_bytes(name)), ck)
            if f"{got:08x}" != want:
                problems.add(name, f"bytes differ from the checksum its shard header records ({ck} {want}, "
                                   f"read {got:08x}): this copied tensor was changed after convert")


def _shard_layout(path: Path) -> tuple[int, list[tuple[tuple[int, int], str, str]]] | None:
    """(data base, [((begin, end), name, dtype)] in file order) from a shard's header, as hash_shard
    reads it; None when the header does not parse."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        n = int.from_bytes(fh.read(8), "little")
        header = fh.read(min(n, max(0, size - 8)))
    try:
        hdr = json.loads(header)
        named = sorted((tuple(v["data_offsets"]), k, v.get("dtype")) for k, v in hdr.items() if k != "__metadata__")
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return 8 + n, named


def _scan_part(path: Path, base: int, part: list, kind: str) -> list[tuple[int, tuple[int, int] | None]] | None:
    """Each tensor's CRC (of the kind the shard records) and, for int8 ones, its (min, max): one
    read of their bytes. None when the file ends early."""
    check = _CHECKSUMS[kind][1]
    buf = bytearray(_READ_BYTES)
    out = []
    with open(path, "rb") as fh:
        for (a, b), _, dtype in part:
            crc, off, lo, hi = 0, a, None, None
            while off < b:
                k = os.preadv(fh.fileno(), [memoryview(buf)[: min(len(buf), b - off)]], base + off)
                if k <= 0:
                    return None
                piece = memoryview(buf)[:k]
                crc = check(piece, crc)
                if dtype == "I8":
                    pl, ph = _range(torch.frombuffer(piece, dtype=torch.int8))
                    lo, hi = (pl, ph) if lo is None else (min(lo, pl), max(hi, ph))
                off += k
            out.append((crc, None if lo is None else (lo, hi)))
    return out


def scan(ckpt: Checkpoint, report: dict | None, pool, skip=frozenset()) -> dict:
    """Every shard's tensors but the (shard, name) pairs in ``skip`` read once, in parts of ~256 MB on
    the pool's threads: {"layout": {shard: (path, (base, [((begin, end), name, dtype)]) or None,
    kind)}, "crcs": {(shard, name): crc}, "ranges": {int8 name: (min, max)}, "short": shards that
    ended early}."""
    kinds = getattr(ckpt, "kinds", None) or shard_kinds(ckpt, report)  # a Tapped's: set by verify already
    jobs, layout = [], {}
    for shard in sorted(kinds):
        path = ckpt.folder / shard
        lay = _shard_layout(path) if path.is_file() else None
        layout[shard] = (path, lay, kinds[shard])
        if lay is not None:
            jobs += _parts(shard, path, lay[0], [ent for ent in lay[1] if (shard, ent[1]) not in skip], kinds[shard])
    out = {"layout": layout, "crcs": {}, "ranges": {}, "short": set()}
    _run(pool, jobs, out)
    return out


def _parts(shard: str, path: Path, base: int, named: list, kind: str) -> list[tuple]:
    """The scan's tasks: runs of tensors of ~256 MB, in file order."""
    jobs, part, size = [], [], 0
    for ent in named + [None]:
        if ent is None or (part and size + ent[0][1] - ent[0][0] > _PART_BYTES):
            if part:
                jobs.append((shard, path, base, part, kind))
            part, size = [], 0
        if ent is not None:
            part.append(ent)
            size += ent[0][1] - ent[0][0]
    return jobs


def _run(pool, jobs: list, out: dict) -> None:
    done = in_order(pool, lambda shard, path, base, part, kind: _scan_part(path, base, part, kind), jobs)
    for (shard, _, _, part, _), res in zip(jobs, done):
        if res is None:
            out["short"].add(shard)
            continue
        for ((_, name, _), (crc, rng)) in zip(part, res):
            out["crcs"][(shard, name)] = crc
            if rng is not None:
                out["ranges"][name] = rng


def finish_scan(ckpt: Checkpoint, pool, scanned: dict, taps: dict) -> tuple[dict, dict]:
    """(shard -> (size, data digest of the kind its report entry records, or None)), (int8 tensor ->
    (min, max)): the scan's tensors, the tapped ones (``Tapped.taps``), and the rest read now."""
    for key, (crc, rng) in taps.items():
        if key not in scanned["crcs"]:
            scanned["crcs"][key] = crc
            if rng is not None:
                scanned["ranges"][key[1]] = rng
    jobs = []
    for shard, (path, lay, kind) in scanned["layout"].items():
        if lay is not None and shard not in scanned["short"]:
            jobs += _parts(shard, path, lay[0], [ent for ent in lay[1] if (shard, ent[1]) not in scanned["crcs"]],
                           kind)
    _run(pool, jobs, scanned)
    digests = {}
    for shard, (path, lay, kind) in scanned["layout"].items():
        size = path.stat().st_size if path.is_file() else None
        ok = lay is not None and shard not in scanned["short"]
        digests[shard] = (size, _data_digest([scanned["crcs"][(shard, name)] for _, name, _ in lay[1]], kind)
                                if ok else None)
    return digests, scanned["ranges"]


def check_hashes(ckpt: Checkpoint, problems, report: dict | None, digests: dict) -> None:
    """Shard checksums recorded by convert against the ones the scan computed."""
    if report is None:
        return
    shards = report.get("shards")
    if not isinstance(shards, dict):
        problems.add("int4pack_report.json", "no shards record: the shard checksums cannot be checked")
        shards = {}
    for shard, rec in shards.items():
        if not isinstance(rec, dict) or "data_digest" not in rec:
            continue
        path = ckpt.folder / shard
        if not isinstance(shard, str) or Path(shard).name != shard or shard in (".", ".."):
            problems.add("int4pack_report.json", f"shards names {shard!r}, not a file of this folder")
            continue
        if not path.is_file():
            problems.add(shard, "listed in int4pack_report.json but missing")
            continue
        if not isinstance(rec.get("data_digest"), str):
            problems.add(shard, f"int4pack_report.json: shards.{shard}.data_digest is {rec['data_digest']!r}, "
                                "not a checksum")
            continue
        size, digest = digests.get(shard) or (None, None)
        if size is None:  # a shard no tensor of the index names: read on its own
            got = hash_shard(path, rec["data_digest"])
            size, digest = got["size"], got["data_digest"]
        if digest != rec["data_digest"] or size != rec.get("size", size):
            problems.add(shard, "tensor bytes differ from what convert wrote (data checksum mismatch with "
                                "int4pack_report.json): the shard was modified or corrupted")


def in_order(pool, fn, items: list) -> list:
    if pool is None:
        return [fn(*it) for it in items]
    return [f.result() for f in [pool.submit(fn, *it) for it in items]]
