"""``convert``: source checkpoint -> compressed-tensors W4A8 checkpoint (and a JSON report).

Flow: resolve source -> validate and plan everything -> lay out shards -> compute jobs in a
bounded thread pool and stream their tensors to disk in plan order -> index, config, extra
files, report -> atomic rename.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import ExitStack
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING

from . import _ext, blobs
from .serving import expert_layout
from ._lazy import torch
from ._version import __version__
from .architectures import vllm_output_names
from .sources.checkpoint import Checkpoint, resolve_source
from .sources.containers import open_checkpoint
from .error_stats import module_stats
from .errors import RefusedError, UsageError
from .families import family
from .groups import scale_dtype
from .pipeline import Kept, Pipeline
from .plan import Job, Plan, make_plan, parse_size
from .records import QuantLinear
from .serve_spec import BLOB_CHECKS, KLEIDIAI, PLAIN_MODULES, SUFFIX, parse_format, serve_config
from .serving.target_config import output_config
from .serving.vllm_compat import serving_report
from .output_folder.workdir import (REPORT_NAME, OutputDir, check_space, check_target, folder_bytes, index_pieces,
                      partial_folder, report_pieces)
from .workers import job_workers
from .output_folder import plan_record
from .output_folder.checksums import CHECKSUM_KEYS
from .output_folder.writer import assign_shards, shard_names

if TYPE_CHECKING:  # w4a8 and kernels import torch: the work imports them, the plan does not
    from .formats import Reader
    from .w4a8 import W4A8Linear

__all__ = ["convert", "run_job", "REPORT_NAME", "NullProgress"]

HASH_READERS = 4  # threads reading kept shards at least (2-core x86-64: 360 MB/s from one, 690 from four)


class NullProgress:
    """The progress protocol: the CLI passes a rich implementation."""

    def start(self, total_bytes: int, total_tensors: int, skipped_bytes: int = 0) -> None: ...

    def advance(self, nbytes: int, ntensors: int) -> None: ...

    def stop(self) -> None: ...


def _w_stats(w: W4A8Linear, role: str) -> dict:
    return module_stats(w.path, role, w.group_size, w.error or {})


def run_job(job: Job, ckpt: Checkpoint, reader: Reader, plan: Plan) -> tuple[list, dict]:
    """Compute one job: ([(out name, tensor or bytes)] in plan order, {module: stats})."""
    if job.kind == "copy":
        return [(job.source, ckpt.slice(job.source))], {}  # streamed by the writer in chunks
    from .w4a8 import check_scales, fold_act_order, to_w4a8  # torch's: a copy needs none
    roles = plan.layout.roles
    if job.kind == "linear":
        spec = job.specs[0]
        try:
            # the codes may stay packed (and mapped): the one-pass kernels read the words
            ws = [to_w4a8(reader.read(spec, unpack=False), job.group_size)]
        finally:
            for key in spec.keys:
                ckpt.release(key)  # unmap the packed words read in place; RSS stays bounded
        return _outputs(ws, roles)
    if job.kind == "experts":  # one expert in its model's own layout (expert_layout.py)
        ws = [to_w4a8(reader.read(s), job.group_size) for s in job.specs]
        out = expert_layout.tensors(job.specs[0].name.rsplit(".", 1)[0], *ws)
        return out, {w.name: _w_stats(w, roles[w.name]) for w in ws}
    qls: list[QuantLinear] = [reader.read(s) for s in job.specs]
    for ql in qls:
        check_scales(ql)
    if job.kind == "dequant":
        ql = qls[0]
        out = [(f"{ql.spec.name}.weight", ql.dequantize().to(torch.bfloat16))]
        if ql.bias is not None:
            out.append((f"{ql.spec.name}.bias", ql.bias))
        return out, {ql.spec.name: {"path": "dequant", "role": roles[ql.spec.name]}}
    return _outputs(list(fold_act_order(qls[0], qls[1], qls[2], job.group_size)), roles)


def _outputs(ws: list[W4A8Linear], roles: dict) -> tuple[list, dict]:
    out, stats = [], {}
    for w in ws:
        out.append((f"{w.name}.weight", w.q))
        out.append((f"{w.name}.weight_scale", w.scales))
        if w.bias is not None:
            out.append((f"{w.name}.bias", w.bias))
        stats[w.name] = _w_stats(w, roles[w.name])
    return out, stats


def _out_config(plan: Plan, ckpt: Checkpoint) -> dict:
    dequant = [s.name for j in plan.jobs if j.kind == "dequant" for s in j.specs]
    return output_config(ckpt.config, ckpt.family_type, ckpt.tensors, plan.quantized_modules(), dequant,
                         plan.group_size, plan.groups)


def _kernels_used() -> str:
    """Which code computed the jobs: the C++ kernels, or their pure-torch twins and why."""
    from . import kernels

    if kernels.ext() is not None:
        return "c++"
    return f"pure torch ({_ext.build_error('convert_kernels')})"


def _base_meta(plan: Plan) -> dict[str, str]:
    g = plan.group_size
    target = {"scheme": "W4A8", "group_size": g, "dense": plan.dense,
              "scale_dtype": scale_dtype(g)}
    if g is None:  # per module: the config's groups and the report say which
        target.update(scale_dtype="per module", group_sizes=sorted(plan.schemes()))
    return {
        "format": "pt",
        "int4pack.version": __version__,
        "int4pack.source_format": json.dumps(plan.verdict.to_dict(), sort_keys=True),
        "int4pack.target": json.dumps(target, sort_keys=True),
    }


def convert(
    src: str | Path,
    out: str | Path,
    *,
    group_size: int | str | None = "auto",
    dense: str | None = None,
    max_shard_size: int | str = "5GB",
    dry_run: bool = False,
    overwrite: bool = False,
    resume: bool = False,
    check_kept: bool = False,
    threads: int | None = None,
    revision: str | None = None,
    serve_format: str = "compressed-tensors",
    progress: NullProgress | None = None,
    strict_group_size: bool = False,
    tensor_parallel: int = 1,
    on_plan=None,
) -> dict:
    """Convert an int4 MoE checkpoint to a vLLM-loadable compressed-tensors W4A8 checkpoint, or with
    ``serve_format="kleidiai"`` to the packed serving format (blobs.py).

    Returns the report (also written to ``OUT/int4pack_report.json``). With ``dry_run`` nothing is
    written and the report holds the plan. Raises Int4packError subclasses on bad input.
    ``group_size`` is a model-wide request: modules that cannot run it take the group they can
    (the report's ``plan.group_substitutions``), unless ``strict_group_size`` refuses instead.
    ``tensor_parallel`` > 1 (packed format only) stores the row parallel modules split along K for
    that many vLLM tensor parallel ranks (blobs.py).
    ``on_plan(report)`` is called once the source is validated and planned (and, with ``resume``, once
    the kept shards are known: ``report["resume"]``), before any long work.
    With ``resume``, a finished shard unchanged since it was closed (same file, size, mtime and ctime)
    is kept on its records and its header; ``check_kept`` reads every kept byte against its
    checksums instead (a disk you do not trust). A resume that keeps every shard takes the plan
    from the record the interrupted run wrote (output_folder/plan_record.py: ``resume.plan_reused``)
    where every source file is as it was then; any other plans the source again.
    """
    t0 = time.perf_counter()
    progress = progress or NullProgress()
    if threads is not None and threads < 1:
        raise UsageError(f"--threads {threads}: must be at least 1")
    packed = parse_format(serve_format) == KLEIDIAI
    if tensor_parallel != 1 and not packed:
        raise UsageError(f"--tensor-parallel {tensor_parallel} applies to --serve-format kleidiai only "
                         "(vLLM splits the default format itself at load, for any tensor_parallel_size)")
    if tensor_parallel < 1:
        raise UsageError(f"--tensor-parallel {tensor_parallel}: must be at least 1")
    if check_kept and not resume:
        raise UsageError("--check-kept applies with --resume only (it says how the kept shards are checked)")
    max_bytes = parse_size(max_shard_size)
    folder = resolve_source(src, revision=revision)
    key = plan_record.plan_key(src=str(src), out=str(out), folder=str(folder), revision=revision,
                               group_size=str(group_size), dense=dense, strict_group_size=strict_group_size,
                               serve_format=KLEIDIAI if packed else "compressed-tensors",
                               tensor_parallel=tensor_parallel, max_bytes=max_bytes)
    # taken before the plan reads the source: a file changed while it plans is not the one recorded
    identity = None if dry_run else plan_record.source_identity(folder)
    record = plan_record.load(Path(out), key, identity) if resume else None
    planning = dict(src=src, group_size=group_size, dense=dense, strict_group_size=strict_group_size,
                    packed=packed, tensor_parallel=tensor_parallel, max_bytes=max_bytes)
    with ExitStack() as held:
        if record is None:
            ckpt, plan, report, shards, names = _plan_source(held, folder, out, **planning)
            if dry_run:  # refuse what the run would refuse: the output folder, the free space
                check_target(Path(out), folder, overwrite=overwrite)
                extra = sum((ckpt.folder / n).stat().st_size for n in ckpt.extra_files())
                where = next(p for p in Path(out).expanduser().absolute().parents if p.is_dir())
                check_space(where, where, sum(t.nbytes for t in plan.outputs) + extra, len(plan.outputs), fresh=False)
                report["dry_run"] = True
                report["output"] = str(out)
                report["modules"] = {m: {"path": p, "role": plan.layout.roles.get(m), "group_size": j.group_size}
                                     for j in plan.jobs for m, p in j.paths.items()}
                report["seconds"] = round(time.perf_counter() - t0, 3)
                if on_plan is not None:
                    on_plan(report)
                return report
            facts = _facts(plan, ckpt, report, packed, max_bytes)
        else:  # the source is as the record's run planned it: its plan, without reading the source
            ckpt, plan, facts = None, plan_record.record_plan(record), record["facts"]
            shards = assign_shards(plan.outputs, max_bytes)
            names = shard_names(len(shards))
        t_plan = time.perf_counter() - t0
        had_partial = partial_folder(Path(out)).is_dir()
        # what a run without --resume replaces: said, not deleted silently
        dropped = folder_bytes(partial_folder(Path(out))) if had_partial and not resume else None
        od = OutputDir.open(Path(out), folder, facts["fingerprint"], overwrite=overwrite, resume=resume)
        held.callback(lambda: od.release())  # the work folder's lock, however the run ends
        # a kept shard's bytes read once where it is not shown unchanged (or with check_kept), several
        # reads in flight whatever the cores (the disk is the limit)
        readers = max(HASH_READERS, job_workers(threads))
        trusted = od.trusted_shards(names, readers, check_kept=check_kept)
        if ckpt is None and not plan_record.complete(plan, od, names, trusted):
            # shards are left to write, and their jobs read the source: planned after all
            ckpt, plan, planned, shards, names = _plan_source(held, folder, out, **planning)
            facts = _facts(plan, ckpt, planned, packed, max_bytes)
            if facts["fingerprint"] != od.fingerprint:  # not the recorded plan: nothing of its folder is kept
                od.release()
                od = OutputDir.open(Path(out), folder, facts["fingerprint"], overwrite=overwrite, resume=resume)
                trusted = od.trusted_shards(names, readers, check_kept=check_kept)
                record = None
        if record is None and not hasattr(ckpt, "generated_files"):  # a GGUF's: planned on every run
            plan_record.save(od, key, identity, facts, plan)
        report = facts["report"]
        sizes = {n: sum(t.nbytes for t in s) for n, s in zip(names, shards)}
        if resume:
            report["resume"] = {"partial": str(od.work), "found": had_partial, "shards": len(names),
                                "kept_shards": sorted(trusted), "kept_bytes": sum(sizes[n] for n in trusted),
                                "kept_unread": sorted(od.kept_unread), "plan_reused": ckpt is None}
        elif dropped is not None:
            report["replaced_partial"] = {"partial": str(od.work), "bytes": dropped}
        extra = sum(os.stat(p).st_size for p in facts["extra_files"])
        check_space(od.work, od.final.parent, sum(v for n, v in sizes.items() if n not in trusted) + extra, len(plan.outputs),
                     fresh=not trusted)
        if on_plan is not None:
            on_plan(report)
        rename = facts["rename"]
        rotary = pack = None
        if ckpt is not None and packed:  # a recorded plan runs no job
            rotary = _rotary(ckpt)
            pack = blobs.job_packer(tensor_parallel, rotary, set(plan.options.get(PLAIN_MODULES, {})))
        stats = _write_shards(plan, ckpt, od, shards, names, threads, progress, rename, pack, trusted, rotary,
                              meta=facts["meta"])
        weight_map = {rename.get(t.name, t.name): n for n, s in zip(names, shards) for t in s}
        if rename:
            report["renamed_for_vllm"] = {"count": len(rename), "example": min(rename.items())}
        # written in pieces: the index and the report grow with the model, and the end of a run
        # (with the plan still alive) is where the peak RSS was
        od.write_file("model.safetensors.index.json",
                      index_pieces(sum(t.nbytes for t in plan.outputs), weight_map))
        del weight_map
        cfg = facts["config"]
        if packed:
            provs = {rename.get(f"{m}.{SUFFIX}", f"{m}.{SUFFIX}")[: -len(SUFFIX) - 1]: st["packed"]
                     for m, st in stats.items() if isinstance(st.get("packed"), dict)}
            cfg["quantization_config"] = serve_config(
                cfg["quantization_config"], facts["group_size"], blobs.blob_checks(provs, facts["family_type"]),
                tensor_parallel, facts["plain_record"], facts["moe_layers"])
            report["serve_format"] = {"format": KLEIDIAI, **{k: v for k, v in cfg["quantization_config"][
                "kleidiai"].items() if k != BLOB_CHECKS}}
        od.write_file("config.json", (json.dumps(cfg, indent=2) + "\n").encode())
        for p in facts["extra_files"]:
            od.copy_file(Path(p))
        for name, data in getattr(ckpt, "generated_files", dict)().items():  # a GGUF's tokenizer
            od.write_file(name, data)
        report["kernels"] = _kernels_used()
        report["workers"] = job_workers(threads)
        report["modules"] = dict(sorted(stats.items()))
        report["tensors"] = facts["accounted"]
        report["shards"] = {n: {**report["shards"][n], **{k: od.progress["shards"][n][k] for k in CHECKSUM_KEYS}}
                            for n in names}
        # the file records the conversion, not this run: no path of OUT, nothing that --resume changes
        kept = {k: v for k, v in report.items() if k not in _RUN_ONLY}
        od.write_file(REPORT_NAME, chain(report_pieces(kept), ("\n",)))
        od.commit()
    report["output"] = str(Path(out))
    report["seconds"] = round(time.perf_counter() - t0, 3)
    report["seconds_plan"] = round(t_plan, 3)
    return report


def _plan_source(held: ExitStack, folder: Path, out, *, src, group_size, dense, strict_group_size, packed: bool,
                 tensor_parallel: int, max_bytes: int) -> tuple:
    """The source opened (held until the run ends), checked and planned: (checkpoint, plan, the
    report's plan part, shards, shard names)."""
    ckpt = held.enter_context(open_checkpoint(folder))
    plan = make_plan(ckpt, group_size=group_size, dense=dense, source_label=str(src),
                     strict_group_size=strict_group_size)
    if packed and any(j.kind == "experts" for j in plan.jobs):
        raise RefusedError(f"--serve-format {KLEIDIAI}: the {plan.layout.family} experts are written in "
                           "their model class's own layout, which int4pack's vLLM plugin does not load",
                           hint="Convert to the default compressed-tensors format.")
    if packed:
        plan = blobs.packed_plan(plan, tensor_parallel, ckpt.family_type)
    shards = assign_shards(plan.outputs, max_bytes)
    names = shard_names(len(shards))
    report = {
        "int4pack_version": __version__,
        "source": str(src),
        "plan": plan.summary(),
        "shards": {n: {"tensors": len(s), "bytes": sum(t.nbytes for t in s)} for n, s in zip(names, shards)},
        **serving_report(ckpt.family_type, ckpt.text_config, str(out), plan.schemes(), packed,
                         own_layout=any(j.kind == "experts" for j in plan.jobs), tensor_parallel=tensor_parallel),
    }
    if packed:
        report["serve_format_planned"] = KLEIDIAI
        report["plan"][PLAIN_MODULES] = plan.options.get(PLAIN_MODULES, {})  # the modules KleidiAI cannot pack
    return ckpt, plan, report, shards, names


def _facts(plan: Plan, ckpt: Checkpoint, report: dict, packed: bool, max_bytes: int) -> dict:
    """What the rest of the run takes from the plan (and what the plan's record holds): the same
    whether it was just planned or read back from a record, so the output is the same bytes."""
    rename = vllm_output_names(ckpt.family_type, [t.name for t in plan.outputs])  # names vLLM loads
    small = {"report": report, "config": _out_config(plan, ckpt), "meta": _base_meta(plan), "options": plan.options}
    if packed:
        small["plain_record"] = blobs.plain_record(plan.options.get(PLAIN_MODULES, {}), ckpt.family_type, rename)
        small["moe_layers"] = blobs.moe_layers_record(plan, ckpt.family_type, ckpt.text_config, rename)
    facts = json.loads(json.dumps(small))  # as a record gives them back: JSON's lists, string keys
    facts.update(fingerprint=work_fingerprint(plan, ckpt, max_bytes, bool(rename)), rename=rename,
                 accounted=plan.accounted, family_type=ckpt.family_type, group_size=plan.group_size,
                 dense=plan.dense, extra_files=[str(ckpt.folder / n) for n in ckpt.extra_files()])
    return facts


def work_fingerprint(plan: Plan, ckpt: Checkpoint, max_bytes: int, renamed: bool) -> str:
    """What a work folder's progress file must record for --resume to keep any of its shards: the
    plan's fingerprint (tool version, options, every source tensor's place, each source file's size
    and mtime), the shard size, and each source file's inode and ctime. Kept shards' jobs do not run
    again, so an edit that keeps a file's size and mtime (``touch -r``, ``cp -p`` over it) must still
    show: the kernel sets the ctime on every write, and no call sets it back."""
    fp = plan.fingerprint(ckpt) + ("|vllm-names" if renamed else "")
    for shard in ckpt.shards:
        st = (ckpt.folder / shard).stat()
        fp += f"|{shard}:{st.st_dev}:{st.st_ino}:{st.st_ctime_ns}"
    return fp + f"|{max_bytes}"


_RUN_ONLY = ("next", "next_command", "next_notes", "routing_notes", "resume", "replaced_partial", "serve_format_planned", "workers")  # in the returned report, not in the file


def _rotary(ckpt: Checkpoint):
    """module -> the heads whose rows the family's vLLM class reorders on load (families: qk_rotary),
    or None where it reorders none."""
    fam = family(ckpt.family_type or "")
    if fam is None or not fam.qk_rotary:
        return None
    tc = ckpt.text_config
    return lambda module: fam.rotary_heads(module, tc)


def _write_shards(plan: Plan, ckpt: Checkpoint | None, od: OutputDir, shards, names, threads, progress,
                  rename: dict[str, str] | None, pack, trusted: set[str], rotary, *, meta: dict[str, str]) -> dict:
    """Every job computed (or, on --resume, taken from the ``trusted`` kept shards) and written;
    per-module stats (pipeline.py)."""
    return Pipeline(plan, ckpt, od, shards, names, workers=job_workers(threads), progress=progress, compute=run_job,
                    meta=meta, kept=Kept(od, trusted), rename=rename, pack=pack, rotary=rotary).run()
