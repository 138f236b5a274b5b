"""verify's two passes over one opened output, side by side: one view of the output
(W4A8Output), its module checks watching the numerical pass's reads (module_checks.py); the shard
scan reads every byte the numerical pass does not, on threads of its own, while the numbers run;
then the structural pass checks everything (structure.py), and the report says what ran and what
was found. A layer the structural pass flags is reported as not run, whatever its numbers were.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..architectures import layer_index
from ..errors import InputError
from ..serve_spec import KLEIDIAI, PLAIN, tensor_parallel_size
from .layer_selection import missing, select_layers
from .module_checks import ModuleChecks, Problems
from .numerical import draw, numerical, planned
from .processes import start as start_workers
from .processes import use_processes
from .report import kernel_info, trust_notes
from .shard_scan import scan, shard_kinds
from .source import Source, recorded_dense
from .structure import check_structure, read_report
from .threads import shutting, timed
from .w4a8_output import W4A8Output

__all__ = ["Asked", "problem", "run_passes"]


@dataclass
class Asked:
    """What verify was asked (its arguments; ``sel``: ``layers`` parsed)."""

    out: object
    against: object
    revision: str | None
    layers: object
    sel: int | list[int] | None
    experts: int | None
    tokens: int | None
    seed: int
    structural_only: bool
    dense: bool
    dense_tokens: int
    processes: bool | None
    progress: object


def problem(e: InputError, where: str = "config") -> dict:
    """A checkpoint error that leaves nothing to check, as one structural problem (with its hint)."""
    return {"where": e.tensor or where, "message": str(e), **({"hint": e.hint} if e.hint else {})}


def _unreadable(report: dict, e: InputError) -> None:
    report.update(ok=False, layers=[], dense=[], structural={"ok": False, "problems": [problem(e)]})


def run_passes(ckpt, asked: Asked, report: dict, clock, pool, workers: int) -> None:
    """Both passes over the opened output ``ckpt`` (a ``Tapped`` checkpoint), on ``pool``'s
    ``workers`` threads, into ``report``; where a checkpoint value leaves nothing to check (a config
    that is not W4A8...), the report says so with "ok" false."""
    n_hidden = ckpt.text_config.get("num_hidden_layers")
    if isinstance(asked.sel, list) and isinstance(n_hidden, int):  # before the structural pass: it reads every byte
        missing(asked.layers, asked.sel, set(range(n_hidden)), f"num_hidden_layers {n_hidden}, layers", asked.out)
    asked.progress.phase("structure")
    try:
        output = W4A8Output(ckpt)
    except InputError as e:
        _unreadable(report, e)
        return
    checks = ModuleChecks(output)
    moe_prefixes = sorted(output.layers, key=lambda p: (layer_index(p), p))
    chosen, dense_mods, gen = _chosen(output, asked, moe_prefixes)
    conv_report = read_report(ckpt, Problems())
    ckpt.kinds = shard_kinds(ckpt, conv_report)  # the numerical pass's reads checksum what they read
    draws = None if asked.structural_only else draw(output, chosen, dense_mods, asked.experts, asked.tokens,
                                                    asked.dense_tokens, gen, clock)
    got = _side_by_side(checks, asked, report, clock, pool, workers, chosen, dense_mods, draws, conv_report)
    if got is not None:
        _say(report, output, asked, moe_prefixes, chosen, dense_mods, *got)


def _chosen(output: W4A8Output, asked: Asked, moe_prefixes: list[str]) -> tuple[list[str], list[str], torch.Generator]:
    """The MoE layers and dense modules the numerical pass runs, and the generator its draws come
    from (the seeded sample of layers drawn first)."""
    dense_mods = [m for m in output.modules if output.roles[m] != "expert"] if asked.dense else []
    if isinstance(asked.sel, list):  # every index must name something verify can run
        have = {layer_index(p) for p in moe_prefixes} | {layer_index(m) for m in dense_mods}
        missing(asked.layers, asked.sel, have - {-1},
                "layers with MoE experts" + (" or dense W4A8 linears" if asked.dense else ""), asked.out)
    gen = torch.Generator().manual_seed(asked.seed)
    chosen = select_layers(moe_prefixes, asked.sel, gen)
    if asked.sel is not None:
        idx = {layer_index(p) for p in chosen} if isinstance(asked.sel, int) else set(asked.sel)
        dense_mods = [m for m in dense_mods if layer_index(m) in idx]
    return chosen, dense_mods, gen


def _side_by_side(checks: ModuleChecks, asked: Asked, report: dict, clock, pool, workers: int, chosen: list[str],
                  dense_mods: list[str], draws, conv_report) -> tuple | None:
    """The numerical pass (on worker processes or the pool's threads) while the shard scan reads the
    rest on threads of its own (it waits on the disk), then the structural pass: (numbers, problems,
    counts, convert's report, scan seconds, check seconds), or None where the structural pass found
    nothing it could check (the report then says why)."""
    output, ckpt, progress = checks.output, checks.output.ckpt, asked.progress
    skip = planned(output, draws) | set(ckpt.taps)
    n_procs = min(workers, len(chosen) + len(dense_mods)) \
        if draws is not None and use_processes(asked.processes, workers, len(chosen)) else 0
    report["workers"] = {"kind": "processes" if n_procs else "threads", "count": n_procs or workers}
    src = Source(asked.against, asked.revision, recorded_dense(ckpt)) \
        if asked.against is not None and draws is not None else None
    try:  # the worker processes fork here, before this verify starts any thread
        procs = start_workers(checks, n_procs, src) if n_procs else None
    except BaseException:
        if src is not None:
            src.close()
        raise
    if n_procs and procs is None:  # they could not start: threads
        report["workers"] = {"kind": "threads", "count": workers, "processes": "could not start"}
    spool = ThreadPoolExecutor(max_workers=max(1, workers // 2), thread_name_prefix="int4pack-scan") \
        if workers > 1 else None
    with shutting(spool), ThreadPoolExecutor(max_workers=1) as bg:
        scan_f = bg.submit(timed, scan, ckpt, conv_report, spool, skip) if spool is not None else None
        numbers = None
        try:
            if draws is not None:
                progress.start(len(chosen), sum(min(len(output.layers[p]), asked.experts or len(output.layers[p]))
                                                for p in chosen), len(dense_mods))
                try:
                    numbers = numerical(output, chosen, dense_mods, src, conv_report, draws, clock, progress, pool,
                                        procs)
                except BaseException:
                    progress.stop()
                    raise
        finally:
            for held in (procs, src):
                if held is not None:
                    held.close()
            if procs is not None:
                report["workers"]["peak_rss_mb"] = procs.peak_rss_mb()
        # the structural pass says where it is: the scan's last reads, then layer after layer
        progress.phase("structure: reading the rest")
        try:
            scanned, scan_s = scan_f.result() if scan_f is not None else timed(scan, ckpt, conv_report, pool, skip)
            (problems, counts, conv_report), st_s = timed(check_structure, checks, spool or pool, scanned,
                                                          progress.phase)
        except InputError as e:
            _unreadable(report, e)
            return None
        finally:
            progress.stop()
    return numbers, problems, counts, conv_report, scan_s, st_s


def _say(report: dict, output: W4A8Output, asked: Asked, moe_prefixes: list[str], chosen: list[str],
         dense_mods: list[str], numbers, problems, counts: dict, conv_report, scan_s: float, st_s: float) -> None:
    """The report's structural part, its notes, and the numerical results of what the structural
    pass found and did not flag (a flagged layer: not run); "checked" says exactly what ran."""
    packed = output.packed
    report["structural"] = {"ok": not problems, "problems": problems.items, "counts": counts,
                            # the scan of what the numerical pass did not read, then the checks
                            "seconds": round(scan_s + st_s, 3), "scan_seconds": round(scan_s, 3),
                            "check_seconds": round(st_s, 3), "serve_format": KLEIDIAI if packed else PLAIN,
                            "tensor_parallel_size": tensor_parallel_size(packed.record) if packed else None}
    report["layers"], report["dense"] = [], []
    report["kernel"] = kernel_info()
    report["trust"] = trust_notes(output, counts, conv_report, asked.against is not None and not asked.structural_only)
    bad = {p["where"] for p in problems.items}
    # a config-wide problem (scheme, group, layout record) leaves no layer whose numbers can be trusted
    everywhere = any(w == "config" or w.startswith("config ") for w in bad)

    def flagged(name: str) -> bool:
        return everywhere or any(w == name or w.startswith(name + ".") for w in bad)

    chosen = [p for p in chosen if p in output.layers]  # what the structural pass found
    dense_mods = [m for m in dense_mods if m in output.roles and not flagged(m)]
    sel, experts, notes = asked.sel, asked.experts, []
    if isinstance(sel, int) and sel > len(moe_prefixes):  # a sample larger than the model checks all of it: say so
        notes.append(f"--layers {sel}: the model has {len(moe_prefixes)} MoE layer(s); all are checked")
    most = max((len(v) for v in output.layers.values()), default=0)
    if experts is not None and experts > most:
        notes.append(f"--experts {experts}: the MoE layers have {most} experts; all are checked")
    report["checked"] = {"layers": None if sel is None else (sel if isinstance(sel, list) else f"sample of {sel}"),
                         "numerical": not asked.structural_only, "moe_layers": [], "experts": 0, "dense": [],
                         "notes": notes}
    if asked.structural_only:
        return
    if numbers["copies"] is not None:
        report["copies"] = numbers["copies"]
    not_run = ["structural problems (see above): not run"]
    report["layers"] = [numbers["layers"][p] if not flagged(p) else {
        "layer": p, "kind": "moe", "ok": False, "skipped": True, "problems": list(not_run)} for p in chosen]
    report["dense"] = [numbers["dense"][m] for m in dense_mods]
    ran = [r for r in report["layers"] if not r.get("skipped")]
    report["checked"].update(moe_layers=[layer_index(r["layer"]) for r in ran],
                             experts=sum(r["experts_checked"] for r in ran),
                             experts_by_layer={r["layer"]: r["experts_sampled"] for r in ran},
                             dense=[d["module"] for d in report["dense"] if not d.get("skipped")])
