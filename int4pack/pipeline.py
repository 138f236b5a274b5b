"""Convert's pipeline: the jobs in a bounded pool, their results taken in plan order, each shard
closed by a finisher thread once all its tensors are in; and, on --resume, what the kept shards
stand in for. The I/O is the shard file's (writer.py) and the output folder's (workdir.py).

Each worker writes its own tensors at their planned offsets. The main thread takes results in plan
order (per-tensor header entries, stats, progress) and the finisher closes each shard (header,
fsync, rename, progress.json), so neither the serial bookkeeping nor an fsync holds the workers up.
"""

from __future__ import annotations

import ctypes
import json
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import batch
from ._lazy import load_torch
from .sources.checkpoint import Checkpoint, read_header
from .output_folder.checksums import copy_checksums, digest_kind, tensor_crc
from .errors import InputError, OutputError
from .plan import Job, OutTensor, Plan
from .serve_spec import PROVENANCE_BYTES, SUFFIX
from .output_folder.workdir import OutputDir
from .output_folder.writer import ShardFile, check_scale_tensors

__all__ = ["FLUSH_BYTES", "Kept", "Pipeline", "header_entry"]

FLUSH_BYTES = 256 << 20  # write-back step of an open shard


def _load_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (AttributeError, OSError, TypeError):
        return None


_MALLOC_TRIM = _load_trim()


def _trim_heap() -> None:
    """Hand freed heap pages back to the OS (glibc, ~1 ms). An arena keeps what its thread freed (only
    a free top above M_TRIM_THRESHOLD goes back: 32 MB once a 16 MB copy buffer was freed), so the
    workers' arenas crept up as they fragmented, and a shard close's header and JSON stayed in the
    finisher's arena. Called every FLUSH_BYTES and at each shard close; jobs then refault a few
    of those pages (~5 more minor faults per job)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _flush_and_trim(f: ShardFile) -> None:  # finisher thread
    f.flush()
    _trim_heap()


def header_entry(job: Job, name: str, job_stats: dict) -> dict | None:
    """A tensor's entry among its shard's per-tensor results (the header's ``int4pack.tensors``)."""
    if job.kind == "copy":
        return {"path": "copy"}
    mod, leaf = name.rsplit(".", 1) if "." in name else (name, "")
    if leaf in ("weight", SUFFIX) and mod in job_stats:
        return {k: v for k, v in job_stats[mod].items() if k in ("path", "rel_l2", "max_abs", "packed")}
    return None


def _header_problem(path: Path, meta: dict[str, str], results: dict, got: dict[str, str] | None = None) -> str | None:
    """How a kept shard's header metadata (``got``, where its header was already parsed) differs from
    what this run would write, or None."""
    if got is None:
        try:
            _, got, _ = read_header(path)
        except InputError as e:
            return str(e)
    want = {**meta, "int4pack.tensors": json.dumps(results, sort_keys=True, separators=(",", ":"))}
    if got != want:
        key = next(k for k in sorted(set(got) | set(want)) if got.get(k) != want.get(k))
        return f"header metadata {key!r} differs"
    return None


class Kept:
    """The shards a resume keeps (``OutputDir.trusted_shards``: their bytes match their records).

    A job whose outputs all lie in kept shards does not run: its statistics are the ones recorded
    with those shards, and the kept headers are checked against them (``check``). A job writing
    into a kept shard and another runs, and its tensors in the kept one are compared with the
    kept bytes (``compare``)."""

    def __init__(self, od: OutputDir, shards: set[str]) -> None:
        self.od, self.shards = od, shards
        self.kind = {n: digest_kind(od.progress["shards"][n].get("data_digest")) for n in shards}
        self.recorded = od.recorded_jobs if shards else {}  # set by od.trusted_shards, which gave ``shards``
        self.results: dict[str, dict] = {}  # kept shard -> its per-tensor header entries, as this run has them
        self.mismatched: dict[str, str] = {}  # kept shard -> the first tensor that differs

    def recorded_stats(self, job: Job, shard_of: dict[str, str]) -> dict | None:
        """The job's statistics if it need not run (every output kept, every module recorded), else None."""
        if not all(shard_of[t.name] in self.shards for t in job.outputs) or any(m not in self.recorded for m in job.paths):
            return None
        return {m: self.recorded[m] for m in job.paths}

    def compare(self, shard: str, name: str, data) -> None:
        if tensor_crc(data, self.kind[shard]) != self.od.kept_crcs[shard].get(name):
            self.mismatched.setdefault(shard, name)

    def check(self, meta: dict[str, str]) -> None:
        """Refuse (and remove) a kept shard whose tensors or header are not what this run gives."""
        od = self.od
        for shard in sorted(self.shards):
            why = (f"tensor {self.mismatched[shard]} differs" if shard in self.mismatched else
                   _header_problem(od.work / shard, meta, copy_checksums(
                       self.results.get(shard, {}), od.kept_crcs[shard], self.kind[shard]),
                                   getattr(od, "kept_meta", {}).get(shard)))
            if why:
                od.drop_shard(shard)
                raise OutputError(f"{od.work / shard}: kept from an interrupted run, but it does not hold what the "
                                  f"source gives ({why}); it was removed", path=str(od.work / shard),
                                  hint="Run the same command again (with --resume) to write it anew.")


class Pipeline:
    """One run's jobs through the pool into the shards not kept. ``compute(job, ckpt, reader, plan)``
    gives a job's ([(name, tensor)], stats) (convert.run_job); ``rename`` maps plan names to the
    names written; ``pack`` turns a job's tensors into blobs (blobs.job_packer); the modules
    ``rotary`` names go per job (the packer reorders their rows, the batches would not)."""

    def __init__(self, plan: Plan, ckpt: Checkpoint, od: OutputDir, shards, names, *, workers: int, progress,
                 compute, meta: dict[str, str], kept: Kept, rename: dict | None = None, pack=None, rotary=None):
        self.plan, self.ckpt, self.od, self.workers, self.progress = plan, ckpt, od, workers, progress
        self.compute, self.meta, self.kept, self.pack, self.rotary = compute, meta, kept, pack, rotary
        self.rename = rename = rename or {}
        self.shard_of = {t.name: n for n, s in zip(names, shards) for t in s}
        self.total = (sum(t.nbytes for s in shards for t in s), len(self.shard_of),
                      sum(t.nbytes for n, s in zip(names, shards) if n in kept.shards for t in s))
        # the plan's own OutTensors where the name is kept (a copy of each would live for the whole run)
        self.planned = {n: [OutTensor(rename[t.name], t.dtype, t.shape) if t.name in rename else t for t in s]
                        for n, s in zip(names, shards) if n not in kept.shards}
        self.left = {n: len(ts) for n, ts in self.planned.items()}  # tensors not yet consumed, per shard
        self.unflushed = dict.fromkeys(self.planned, 0)  # bytes consumed since the shard's last flush
        self.files: dict[str, ShardFile] = {}
        self._files_lock = threading.Lock()
        self.stats: dict[str, dict] = {}
        self.shard_results: dict[str, dict] = {}  # shard -> per-tensor results for its header
        self.pending_stats: dict[str, dict] = {}  # stats of jobs not yet fully on disk
        self.closing: list = []  # the finisher's futures, oldest first

    # ------------------------------------------------------------------ the workers

    def shard_file(self, shard: str) -> ShardFile:
        with self._files_lock:
            f = self.files.get(shard)
            if f is None:
                f = self.files[shard] = ShardFile(self.od.work / shard, self.planned[shard], self.meta,
                                                  PROVENANCE_BYTES if self.pack is not None else 0)
            return f

    def per_job(self, job: Job) -> tuple[list, dict]:
        tensors, job_stats = self.compute(job, self.ckpt, self.plan.reader, self.plan)
        if self.pack is not None:
            check_scale_tensors(tensors)  # the writer's scale check, before the scales go into blobs
            tensors = self.pack(job, tensors, job_stats)
        return tensors, job_stats

    def work_batch(self, b: batch.Batch) -> list[tuple[dict, set]]:
        from . import kernels

        with kernels.threads_here(1), self.ckpt.faults_named():
            return batch.run_batch(b, self.ckpt, self.plan, self.shard_file, self.rename, self.pack is not None,
                                   self.per_job)

    def work(self, job: Job) -> tuple[dict, set]:
        from . import kernels

        # one job per worker, each single-threaded: nothing nests
        with kernels.threads_here(1), self.ckpt.faults_named():
            tensors, job_stats = self.per_job(job)
        written = set()
        for name, data in tensors:
            shard = self.shard_of.get(name)
            if shard is None:
                raise OutputError(f"internal: job produced {name!r}, which is not planned", tensor=name)
            out = self.rename.get(name, name)
            if shard not in self.kept.shards:
                self.shard_file(shard).write(out, data)
                written.add(name)
            else:
                self.kept.compare(shard, out, data)
        return job_stats, written

    # ------------------------------------------------------------------ the main thread, in plan order

    def take_kept(self, job: Job, job_stats: dict) -> None:
        """A job that does not run: its recorded statistics and its kept tensors' header entries."""
        self.stats.update(job_stats)
        for t in job.outputs:
            ent = header_entry(job, t.name, job_stats)
            if ent is not None:
                self.kept.results.setdefault(self.shard_of[t.name], {})[self.rename.get(t.name, t.name)] = ent

    def consume(self, job: Job, job_stats: dict, written: set) -> None:
        kept = self.kept.shards
        want = {t.name for t in job.outputs if self.shard_of[t.name] not in kept}
        if written != want:
            raise OutputError(f"internal: job for {job.outputs[0].name} wrote {sorted(written ^ want)[:3]} "
                              "other than planned")
        self.stats.update(job_stats)
        self.pending_stats.update(job_stats)
        for t in job.outputs:
            shard = self.shard_of[t.name]
            res = self.kept.results if shard in kept else self.shard_results
            ent = header_entry(job, t.name, job_stats)
            if ent is not None:
                res.setdefault(shard, {})[self.rename.get(t.name, t.name)] = ent
            if shard not in kept:
                self._advance(shard, t.nbytes)

    def _advance(self, shard: str, nbytes: int) -> None:
        self.progress.advance(nbytes, 1)
        self.left[shard] -= 1
        self.unflushed[shard] += nbytes
        if self.unflushed[shard] >= FLUSH_BYTES and self.left[shard]:
            # write back while the workers compute: a 5 GB shard's single fsync at the end
            # would otherwise hold the run up for seconds (the page cache lets it all pile up)
            self.closing.append(self.finisher.submit(_flush_and_trim, self.files[shard]))
            self.unflushed[shard] = 0
        if self.left[shard] == 0:
            self.closing.append(self.finisher.submit(self._close_shard, shard, self.shard_results.pop(shard, {}),
                                                     dict(self.pending_stats)))
            self.pending_stats.clear()

    def _close_shard(self, shard: str, results: dict, job_stats: dict) -> None:  # finisher thread only
        od = self.od
        f = self.files[shard]
        od.record_shard(shard, f.finish(results), [f.crc[t.name] for t in f.tensors])  # file order
        od.progress["jobs"].update(job_stats)  # kept for --resume
        od.save_progress()
        _trim_heap()

    def _take(self, unit, fut) -> None:
        for j, got in (zip(unit.jobs, fut.result()) if isinstance(unit, batch.Batch) else [(unit, fut.result())]):
            self.consume(j, *got)

    def _units(self, todo: list[Job]) -> list:
        """The jobs to run, runs of lossless or requant linear jobs as one batch each (batch.py: one C++
        call each)."""
        rotary = self.rotary
        alone = (lambda job: any(rotary(sp.name) for sp in job.specs)) if rotary is not None else None
        units = list(batch.units(todo, self.plan.reader, self.shard_of, self.kept.shards, self.pack is not None, alone))
        if any(not isinstance(u, batch.Batch) and u.kind != "copy" for u in units):  # a per-job module
            load_torch()  # the work needs it: imported here, once, not in a worker (_lazy.py)
        return units

    # ------------------------------------------------------------------ the run

    def run(self) -> dict:
        """Every job computed or taken from the kept shards; returns per-module stats."""
        todo = []
        for job in self.plan.jobs:
            recorded = self.kept.recorded_stats(job, self.shard_of)
            if recorded is None:
                todo.append(job)
            else:
                self.take_kept(job, recorded)
        self.od.progress["jobs"].update(self.stats)  # recorded again with the next shard this run finishes
        self.progress.start(*self.total)
        batch.reserve_buffers(self.workers)
        pool = ThreadPoolExecutor(max_workers=self.workers)
        self.finisher = ThreadPoolExecutor(max_workers=1)
        try:
            window: deque = deque()
            for unit in self._units(todo):
                window.append((unit, pool.submit(self.work_batch if isinstance(unit, batch.Batch) else self.work, unit)))
                if len(window) >= 2 * self.workers:
                    self._take(*window.popleft())
                while self.closing and self.closing[0].done():
                    self.closing.pop(0).result()  # a failed close (disk full) stops the run here
            while window:
                self._take(*window.popleft())
            for fut in self.closing:
                fut.result()
            self.kept.check(self.meta)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            self.finisher.shutdown(wait=True, cancel_futures=True)
            for f in self.files.values():
                if not f.path.exists():
                    f.abort()
            raise
        finally:
            pool.shutdown(wait=True)
            self.finisher.shutdown(wait=True)
            self.progress.stop()
        return self.stats
