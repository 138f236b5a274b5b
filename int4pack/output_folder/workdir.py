"""The output folder: the hidden work folder beside OUT that a run builds it in (its marker, lock and
progress file, kept on interrupt for --resume), the checks before it is made, its small files
written in pieces, and the swap into place. No torch here: the CLI names the folder when a run is
interrupted, possibly while torch is still being imported."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .checksums import CHECKSUM_KEYS, data_digest, digest_kind, hash_shards
from ..errors import OutputError

__all__ = ["partial_folder", "folder_bytes", "check_space", "check_target", "OutputDir", "disk_error",
           "json_pieces", "report_pieces", "index_pieces", "PROGRESS", "PLAN_RECORD", "REPORT_NAME", "MARKER", "LOCK"]

PROGRESS = "progress.json"
PLAN_RECORD = "int4pack-plan.json"  # the plan's record, for --resume (plan_record.py)
REPORT_NAME = "int4pack_report.json"  # what marks a folder as an int4pack output


def partial_folder(out: Path) -> Path:
    """The hidden folder a run builds OUT in (kept on interrupt, for --resume)."""
    out = Path(out).expanduser().absolute()
    return out.parent / f".{out.name}.int4pack-partial"


def folder_bytes(folder: Path) -> int:
    """Bytes of the files in a folder (0 if it is gone)."""
    try:
        return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
    except OSError:
        return 0


SPACE_MARGIN = 1 << 20  # config and extra small files
SPACE_PER_TENSOR = 1000  # its shard header entry, index line and report entry: a few hundred bytes


def check_space(work: Path, parent: Path, need: int, tensors: int, *, fresh: bool) -> None:
    """Refuse before writing when the output's file system has less free space than the plan writes."""
    try:
        free = shutil.disk_usage(work).free
    except OSError:
        return  # no figure to check against: the writes themselves report a full disk
    want = need + SPACE_MARGIN + SPACE_PER_TENSOR * tensors
    if free >= want:
        return
    if fresh:  # only the progress file is in it: leave nothing behind
        shutil.rmtree(work, ignore_errors=True)
    from ..output import human_bytes  # rich's: a run that has the space needs none

    raise OutputError(f"{parent}: not enough free space: the output needs {human_bytes(want)} ({want} "
                      f"bytes: {need} planned, the rest for headers, index and report), {human_bytes(free)} "
                      f"({free} bytes) free", path=str(parent),
                      hint="Free some space or pick an OUT on another disk (--max-shard-size does not change "
                           "the total).")


def disk_error(path: Path, e: OSError) -> OutputError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return OutputError(f"{path}: no space left on the device", path=str(path),
                           hint="Free some space (or pick another OUT) and re-run with --resume; "
                                "finished shards are kept.")
    return OutputError(f"{path}: cannot write ({e.strerror or e})", path=str(path),
                       hint="Check permissions and free space, then re-run with --resume.")


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


_REPORT_ENCODER = json.JSONEncoder(sort_keys=True, separators=(", ", ": "))  # json.dumps would make one per call


def _entry_encoder():
    """_REPORT_ENCODER.encode for the report's many entries, its C encoder made once: encode() makes
    one per value, half the cost of a module's entry (a 48-layer model has ~18,000). Taken only where
    it gives encode()'s bytes for a probe of every kind of value; else encode() itself."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return _REPORT_ENCODER.encode
    try:
        c = make(None, _REPORT_ENCODER.default, json.encoder.encode_basestring_ascii, None, ": ", ", ", True,
                 False, True)
        probe = {"b": [1, -2.5e-07, None, True, float("nan")], "a": {"\u00e9\n": "x\"y", "z": 0.1}, "c": "0.00172"}
        if "".join(c(probe, 0)) != _REPORT_ENCODER.encode(probe) or "".join(c("s", 0)) != '"s"':
            return _REPORT_ENCODER.encode
    except (TypeError, ValueError):
        return _REPORT_ENCODER.encode
    return lambda value: "".join(c(value, 0))


_ENCODE_ENTRY = _entry_encoder()


def report_pieces(obj, level: int = 0, depth: int = 2):
    """The report as JSON, one line per entry down to ``depth`` (one line per module), compact below;
    in pieces, so a large report is written without a copy of it in memory, each line by the C encoder."""
    if isinstance(obj, dict) and obj and level < depth:
        pad = "  " * (level + 1)
        if level + 1 == depth:  # the last level (one line per module or tensor): its lines joined at once
            enc, q = _ENCODE_ENTRY, json.encoder.encode_basestring_ascii  # q: encode()'s own for a str
            yield "{\n" + ",\n".join([f"{pad}{q(str(k))}: {q(v) if type(v) is str else enc(v)}"
                                       for k, v in sorted(obj.items())])
        else:
            sep = "{\n"
            for k, v in sorted(obj.items()):
                yield f"{sep}{pad}{json.dumps(str(k))}: "
                yield from report_pieces(v, level + 1, depth)
                sep = ",\n"
        yield "\n" + "  " * level + "}"
    else:
        yield _REPORT_ENCODER.encode(obj)


def index_pieces(total_size: int, weight_map: dict[str, str]):
    """json.dumps({"metadata": ..., "weight_map": sorted}, indent=2) + newline, in pieces."""
    yield f'{{\n  "metadata": {{\n    "total_size": {int(total_size)}\n  }},\n  "weight_map": {{'
    sep = "\n"
    q = json.encoder.encode_basestring_ascii  # what json.dumps does with a str, without its call per name
    for name in sorted(weight_map):
        yield f"{sep}    {q(name)}: {q(weight_map[name])}"
        sep = ",\n"
    yield "\n  }\n}\n" if weight_map else "}\n}\n"


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
            raise disk_error(work, e) from e
        lock_fd = _lock(work)  # before anything in it is read or removed: another run may own it
        try:
            old = None
            state = work / PROGRESS
            if state.is_file() and not state.is_symlink():
                try:
                    old = json.loads(state.read_text())
                except (OSError, ValueError):
                    old = None
            taken = resume and isinstance(old, dict) and old.get("fingerprint") == fingerprint
            if taken:
                progress = old
            else:
                _clear(work)
            od = cls(out, work, fingerprint, progress, lock_fd)
            if not (work / MARKER).is_file():
                od.write_file(MARKER, (json.dumps({"int4pack_work_folder": 1, "output": out.name}) + "\n").encode())
            if not taken:  # a progress file taken up is on disk as it is (rewriting it is most of a resume's write)
                od.save_progress()
        except BaseException:
            os.close(lock_fd)
            raise
        return od

    def save_progress(self) -> None:
        # in pieces: its per-module results grow with the model and it is rewritten at every shard
        self.write_file(PROGRESS, json_pieces(self.progress))

    def record_shard(self, name: str, checksums: dict, crcs: list[int]) -> None:
        """A finished shard into the progress file: its checksums, each tensor's CRC in file order and
        the file's identity as it was closed (what lets a resume keep it without reading it again)."""
        st = os.stat(self.work / name, follow_symlinks=False)
        self.progress["shards"][name] = {**checksums, RECORD_CRCS: list(crcs), RECORD_WRITTEN: _identity(st)}

    def trusted_shards(self, names: list[str] | None = None, workers: int = 1, *, check_kept: bool = False) -> set[str]:
        """Finished shards whose bytes still match their recorded checksums (``kept_crcs``: shard ->
        tensor -> CRC). A shard unchanged since it was closed (``_unchanged``: same file, size, mtime
        and ctime, its header as recorded) is kept on those records (``kept_unread``); any other, or
        every one with ``check_kept``, is read once against them. Convert keeps them once their
        headers say what this run would write; the progress file's fingerprint has already tied them
        to the same source files (their identity and times), tool version and options. A folder entry
        that is a link is never kept."""
        ok = set()
        self.kept_crcs: dict[str, dict[str, int]] = {}
        self.kept_unread: set[str] = set()
        self.kept_meta: dict[str, dict[str, str]] = {}  # an unread kept shard's header metadata, parsed once
        shards = self.progress.get("shards")
        if not isinstance(shards, dict):
            shards = self.progress["shards"] = {}
        todo = []  # (name, path, recorded digest, per-tensor CRCs)
        for name, rec in shards.items():
            p = self.work / name
            if names is not None and name not in names or not isinstance(rec, dict) or p.is_symlink():
                continue
            same = None if check_kept else _unchanged(p, rec)
            if same is not None:
                ok.add(name)
                self.kept_unread.add(name)
                self.kept_crcs[name], self.kept_meta[name] = same
            elif p.is_file() and p.stat().st_size == rec.get("size"):
                todo.append((name, p, rec.get("data_digest") if isinstance(rec.get("data_digest"), str) else None, {}))
        kept = {}
        for (name, p, _, crcs), got in zip(todo, hash_shards([(p, d, c) for _, p, d, c in todo], workers)):
            if got == {k: shards[name].get(k) for k in CHECKSUM_KEYS}:
                ok.add(name)
                self.kept_crcs[name] = crcs
                # read and found whole: recorded as it is now, so the next resume need not read it
                kept[name] = {**got, RECORD_CRCS: list(crcs.values()),
                              RECORD_WRITTEN: _identity(os.stat(p, follow_symlinks=False))}
        # forget anything we could not verify, and stray temp files
        self.progress["shards"] = {k: kept.get(k) or {c: v[c] for c in _RECORD_KEYS if c in v}
                                   for k, v in shards.items() if k in ok}
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
            raise disk_error(p, e) from e

    def copy_file(self, src: Path) -> None:
        try:
            shutil.copyfile(src, self.work / src.name)
        except OSError as e:
            raise disk_error(self.work / src.name, e) from e

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
            raise disk_error(self.final, e) from e
        _drop_work_files(self.final)
        self.release()
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def release(self) -> None:
        """Let go of the work folder's lock (the process's exit does the same)."""
        fd, self.lock_fd = self.lock_fd, None
        if fd is not None:
            os.close(fd)


RECORD_CRCS = "crcs"  # a shard's progress record: each tensor's CRC, in file order
RECORD_WRITTEN = "written"  # and the file as it was closed: device, inode, size, mtime and ctime (ns)
_RECORD_KEYS = (*CHECKSUM_KEYS, RECORD_CRCS, RECORD_WRITTEN)


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _unchanged(path: Path, rec: dict) -> tuple[dict[str, int], dict[str, str]] | None:
    """The per-tensor CRCs and the header metadata of a kept shard not written since it was closed, or
    None where that cannot be shown (then its bytes are read). Unchanged: the same device, inode, size, mtime and ctime as
    recorded at its close (the kernel sets the ctime on every write, and no call sets it back: an
    edit with its mtime put back still shows), its header re-read against its recorded checksum,
    and the recorded CRCs giving the recorded data digest. A file copied elsewhere (a new inode) or
    rewritten in place is read."""
    written, crcs = rec.get(RECORD_WRITTEN), rec.get(RECORD_CRCS)
    if not isinstance(written, list) or not isinstance(crcs, list) or not all(type(c) is int for c in crcs):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        n = int.from_bytes(os.pread(fd, 8, 0), "little")
        if _identity(st) != written or not 0 < n <= st.st_size - 8:
            return None
        header = os.pread(fd, n, 8)
    except OSError:
        return None
    finally:
        os.close(fd)
    if hashlib.sha256(header).hexdigest() != rec.get("header_sha256"):
        return None
    try:
        hdr = json.loads(header)
        meta = hdr.pop("__metadata__", None) or {}
        order = [k for _, k in sorted((tuple(v["data_offsets"]), k) for k, v in hdr.items())]
    except (ValueError, TypeError, KeyError, AttributeError, IndexError):
        return None
    if len(order) != len(crcs) or data_digest(crcs, digest_kind(rec.get("data_digest"))) != rec.get("data_digest"):
        return None
    if not isinstance(meta, dict):
        return None
    return dict(zip(order, crcs)), {str(k): str(v) for k, v in meta.items()}


MARKER = "int4pack-work.json"  # written first in a work folder: it is ours
LOCK = "int4pack.lock"  # flock'ed by the run writing the folder; holds its process id
_WORK_FILES = (PLAN_RECORD, PROGRESS, MARKER, LOCK)
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
            raise disk_error(path, e) from e
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
