"""The plan's record in the work folder: what the end of a run takes from the plan, written once a
run has planned, so that ``--resume`` need not read the source's headers and plan it again.

Planning reads every safetensors header of the source, some of its small tensors (GPTQ's g_idx,
zero points) and its configs; on a 48-layer model that is most of a resume after the last shard.
The record holds the plan's results instead: each job's output tensors (name, dtype, shape) and
modules, the work folder's fingerprint and shard names, the report's plan part, the output's
config, the shards' header metadata, the names vLLM loads, and what became of every source tensor.
A resume uses it only when

- the record was written for the same int4pack version, options, SRC and OUT as spelt, and the
  same source folder; and
- every entry of the source folder is as it was before that run planned: the same names, and for
  each its device, inode, size, mode, mtime and ctime (following a link, whose target is
  recorded too; the kernel sets the ctime on every write and no call sets it back), and the
  SHA-256 of a safetensors file's header bytes and of a JSON file's bytes (what the plan reads).

Anything else (a file edited, touched, added, removed or replaced, another option) and the
source is planned again. With every shard kept, the record alone gives the rest of the run; with
shards left to write, the jobs need the source: it is planned again too (convert.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

from .._version import __version__
from ..plan import Job, OutTensor, Plan
from .workdir import PLAN_RECORD, OutputDir, partial_folder

__all__ = ["plan_key", "source_identity", "save", "load", "record_plan", "complete"]

RECORD_VERSION = 1  # the record's own layout
# what convert's _facts gives (the packed format's layout records besides)
FACTS = {"report", "config", "meta", "options", "fingerprint", "rename", "accounted", "family_type", "group_size",
         "dense", "extra_files"}
_HASHED_JSON = 64 << 20  # a JSON file of the source larger than this is not a config: its identity alone


def plan_key(**options) -> dict:
    """What the record was written for: the tool, its options, SRC and OUT as spelt (the report
    names them). Values must be JSON's own (str, int, bool, None): compared with what was read back."""
    return {"record": RECORD_VERSION, "int4pack": __version__, **options}


def _header_digest(fd: int, size: int) -> str | None:
    """SHA-256 of a safetensors file's length word and header bytes (what the plan parses)."""
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        return None
    n = min(int.from_bytes(head, "little"), max(size - 8, 0))
    h = hashlib.sha256(head)
    off = 8
    while off < 8 + n:
        chunk = os.pread(fd, min(8 + n - off, 16 << 20), off)
        if not chunk:
            break
        h.update(chunk)
        off += len(chunk)
    return h.hexdigest()


def _file_digest(fd: int) -> str:
    h = hashlib.sha256()
    while chunk := os.read(fd, 16 << 20):
        h.update(chunk)
    return h.hexdigest()


def source_identity(folder: Path) -> list | None:
    """Each entry of the source folder as it is now (see the module docstring), in name order; None
    where that cannot be told (not a folder, an entry that cannot be read, a dangling link)."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except (OSError, NotADirectoryError):
        return None
    out = []
    for e in entries:
        try:
            link = os.readlink(e.path) if e.is_symlink() else None
            fd = os.open(e.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))  # a FIFO never blocks it
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            digest = None
            if stat.S_ISREG(st.st_mode):
                if e.name.endswith(".safetensors"):
                    digest = _header_digest(fd, st.st_size)
                elif e.name.endswith(".json") and st.st_size <= _HASHED_JSON:
                    digest = _file_digest(fd)
        except OSError:
            return None
        finally:
            os.close(fd)
        out.append([e.name, link, st.st_dev, st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                    digest])
    return out


def _job_row(j: Job) -> list:
    return [j.kind, j.source, j.group_size, j.in_bytes, [[t.name, t.dtype, t.shape] for t in j.outputs], j.paths]


def save(od: OutputDir, key: dict, identity: list | None, facts: dict, plan: Plan) -> None:
    """Write the record of ``plan`` (and ``facts``, convert's results of it) into the work folder.
    Nothing is written where the source's identity could not be taken."""
    if identity is None:
        return
    try:
        jobs = json.dumps([_job_row(j) for j in plan.jobs])  # one call of the C encoder
        head = [json.dumps(key), json.dumps(identity), json.dumps(facts)]
    except (TypeError, ValueError):  # a value JSON cannot hold: no record, and a resume plans the source
        return

    def pieces():
        yield '{"key": ' + head[0]
        yield ', "source": ' + head[1]
        yield ', "facts": ' + head[2]
        yield ', "jobs": '
        yield jobs
        yield "}\n"

    od.write_file(PLAN_RECORD, pieces())


def load(out: Path, key: dict, identity: list | None) -> dict | None:
    """The record in OUT's work folder if it was written for ``key`` and a source whose identity was
    ``identity``; else None (then the source is planned)."""
    if identity is None:
        return None
    path = partial_folder(Path(out)) / PLAN_RECORD
    try:
        if path.parent.is_symlink():
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as fh:  # closes fd
            rec = json.loads(fh.read())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(rec, dict) or rec.get("key") != key or rec.get("source") != identity:
        return None
    if not isinstance(rec.get("facts"), dict) or not FACTS <= rec["facts"].keys() or not isinstance(rec.get("jobs"), list):
        return None
    return rec


def record_plan(rec: dict) -> Plan:
    """The plan a record stands for, as far as keeping shards needs it: each job's kind, output
    tensors and modules (no source specs and no reader: it computes nothing)."""
    jobs = [Job(kind, [OutTensor(n, d, tuple(s)) for n, d, s in outs], source=src, paths=paths, in_bytes=nb,
                group_size=g) for kind, src, g, nb, outs, paths in rec["jobs"]]
    f = rec["facts"]
    return Plan(f["report"]["plan"]["source"], None, None, f["group_size"], f["dense"], jobs, f["accounted"],
                f["options"])


def complete(plan: Plan, od: OutputDir, names: list[str], trusted: set[str]) -> bool:
    """Whether a recorded plan is all this run needs: every shard kept and every job's statistics
    recorded with them (so that no job runs)."""
    if trusted != set(names):
        return False
    return all(m in od.recorded_jobs for j in plan.jobs for m in j.paths)
