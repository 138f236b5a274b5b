"""``verify``: prove a converted W4A8 checkpoint is complete and computes what its source computes.

The structural pass (structure.py) runs first and always; this module runs the numerical
pass on what it found and renders one report.

Numerical pass, per MoE layer: unit-RMS random hidden states times the layer's input norm weight,
routed by the layer's own router (every sampled expert is guaranteed tokens), run through the W4A8
MoE op (``moe.moe_forward``) and through float32 references on the converted weights and (with
``against``) on the source checkpoint's own dequantised weights. The error splits into

* activation quantisation: kernel vs float on the converted weights. Its expected size is derived
  from the inputs (per-row int8 step^2/12, propagated through the layer: ``moe.predicted_noise``);
  the measured error must stay below ``K_ACT`` times that;
* weight requantisation: float on converted vs float on source weights. Each module's weight
  error must equal convert's own measurement in the report (or, without a report, stay below the
  path's bound: bf16 scale rounding 2^-8 for lossless/fold, plain absmax RTN for requant), and each
  expert's output error must stay below ``K_WEIGHT`` times the error those budgets predict.

Dense W4A8 linears get the same with ``_dyn_quant_matmul_4bit`` on a few random rows.

The pass's parts, each a module of this package: the random inputs (random_inputs), the MoE and
dense checks (moe_layer, dense_linear), the source side (source), the tolerances (tolerance), the
layer selection (layer_selection), the threads (threads) and the report (report).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from . import matmul
from ..sources.checkpoint import resolve_source
from ..errors import InputError, UsageError
from ..serve_spec import KLEIDIAI, PLAIN, tensor_parallel_size
from .dense_linear import check_linear
from .random_inputs import dense_input, moe_inputs
from .layer_selection import missing, parse_layers, select_layers
from .moe_layer import check_layer
from .threads import Clock, PerThread, parallel, shutting, timed, torch_threads
from .report import finish, kernel_info, trust_notes
from .source import Source, check_copies, recorded_dense
from .shard_scan import Tapped, scan, shard_kinds
from ..architectures import layer_index
from .module_checks import ModuleChecks, Problems
from .structure import check_structure, read_report
from .w4a8_output import W4A8Output
from .tolerance import K_ACT, K_WEIGHT, LOSSLESS_BOUND, REL_MARGIN
from .processes import Workers, guarded, use_processes
from .processes import start as start_workers

__all__ = ["verify", "K_ACT", "K_WEIGHT", "LOSSLESS_BOUND", "REL_MARGIN"]


class NullProgress:
    """verify's progress protocol: the CLI passes a rich implementation (output.VerifyProgress)."""

    def phase(self, what: str) -> None: ...

    def start(self, layers: int, experts: int, dense: int) -> None: ...

    def advance(self, *, layers: int = 0, experts: int = 0, dense: int = 0, what: str = "") -> None: ...

    def stop(self) -> None: ...


def _problem(e: InputError, where: str = "config") -> dict:
    """A checkpoint error that leaves nothing to check, as one structural problem (with its hint)."""
    return {"where": e.tensor or where, "message": str(e), **({"hint": e.hint} if e.hint else {})}


def verify(out, against=None, *, tokens: int | None = None, layers=None, experts: int | None = None,
           seed: int = 0, threads: int | None = None, structural_only: bool = False, dense: bool = True,
           dense_tokens: int = 8, revision: str | None = None, raise_on_failure: bool = True,
           progress: NullProgress | None = None, processes: bool | None = None) -> dict:
    """Check a converted W4A8 checkpoint; returns the report, raises VerifyFailed when it fails.

    ``layers``: None/"all", a count (seeded sample) or layer indices ("0,3" or [0, 3]); an index the
    model does not have is a UsageError, and a run that checks nothing fails;
    ``experts``: per-layer sample size (default all); ``tokens``: rows per MoE layer (default enough
    for every sampled expert to get >= 2 slots, at least 32). The VerifyFailed carries ``.report``;
    the report's ``checked`` lists exactly what the numerical pass ran. ``processes``: run the
    numerical pass on ``threads`` worker processes (True) or threads (False); None: processes from
    4 workers and 4 MoE layers up (processes.py). The report's ``workers`` says which ran.
    """
    t0 = time.perf_counter()
    progress = progress or NullProgress()
    sel = parse_layers(layers)
    if experts is not None and experts < 1:
        raise UsageError(f"--experts {experts}: must be at least 1")
    if tokens is not None and tokens < 1:
        raise UsageError(f"--tokens {tokens}: must be at least 1")
    matmul.setting()  # a bad INT4PACK_VERIFY_MATMUL is a usage error before any work
    folder = resolve_source(out, revision=revision)
    if not (Path(folder) / "config.json").is_file():
        raise InputError(f"{folder}: no config.json", path=str(folder))
    report: dict = {"output": str(out), "against": None if against is None else str(against), "seed": seed,
                    "threads": threads or torch.get_num_threads(), "tolerance": {
                        "k_act": K_ACT, "k_weight": K_WEIGHT, "lossless_bound": LOSSLESS_BOUND,
                        "rule": "act_rel <= k_act * predicted int8 noise; module weight rel_l2 <= budget "
                                "(report, or 2^-8 lossless / absmax RTN requant); expert output error <= "
                                "k_weight * predicted from budgets; layer rel_l2 <= hypot of both"}}
    clock = Clock()
    try:
        ckpt = Tapped(folder)
    except InputError as e:
        report.update(ok=False, structural={"ok": False, "problems": [_problem(e, "checkpoint")]},
                      layers=[], dense=[])
        return finish(report, t0, clock, raise_on_failure)
    workers = max(1, int(threads or torch.get_num_threads()))
    # one expert (module, shard) per thread, each single-threaded in torch: nothing nests
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="int4pack-verify") if workers > 1 else None
    with torch_threads(1), ckpt, shutting(pool):
        n_hidden = ckpt.text_config.get("num_hidden_layers")
        if isinstance(sel, list) and isinstance(n_hidden, int):  # before the structural pass: it reads every byte
            missing(layers, sel, set(range(n_hidden)), f"num_hidden_layers {n_hidden}, layers", out)
        progress.phase("structure")
        try:
            # one view of the checkpoint for both passes, its module checks watching the numerical
            # pass's reads: the numbers are computed while the structural pass reads every byte, and
            # a layer the structural pass flags is reported as not run, whatever its numbers were
            output = W4A8Output(ckpt)
            checks = ModuleChecks(output)
        except InputError as e:  # a checkpoint value that leaves nothing to check (a config not W4A8...)
            report.update(ok=False, layers=[], dense=[], structural={"ok": False, "problems": [_problem(e)]})
            return finish(report, t0, clock, raise_on_failure)
        moe_prefixes = sorted(output.layers, key=lambda p: (layer_index(p), p))
        dense_mods = [m for m in output.modules if output.roles[m] != "expert"] if dense else []
        if isinstance(sel, list):  # every index must name something verify can run
            have = {layer_index(p) for p in moe_prefixes} | {layer_index(m) for m in dense_mods}
            missing(layers, sel, have - {-1}, "layers with MoE experts" + (" or dense W4A8 linears" if dense else ""),
                     out)
        gen = torch.Generator().manual_seed(seed)
        chosen = select_layers(moe_prefixes, sel, gen)
        if sel is not None:
            idx = {layer_index(p) for p in chosen} if isinstance(sel, int) else set(sel)
            dense_mods = [m for m in dense_mods if layer_index(m) in idx]
        conv_report = read_report(ckpt, Problems())
        ckpt.kinds = shard_kinds(ckpt, conv_report)  # the numerical pass's reads checksum what they read
        draws = None if structural_only else _draw(output, chosen, dense_mods, experts, tokens, dense_tokens, gen, clock)
        # the shard scan reads what the numerical pass will not, on threads of its own (it waits on
        # the disk), while the numbers run on the pool
        skip = _planned(output, draws) | set(ckpt.taps)
        n_procs = min(workers, len(chosen) + len(dense_mods)) \
            if draws is not None and use_processes(processes, workers, len(chosen)) else 0
        report["workers"] = {"kind": "processes" if n_procs else "threads", "count": n_procs or workers}
        src = Source(against, revision, recorded_dense(ckpt)) if against is not None and draws is not None else None
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
                    progress.start(len(chosen), sum(min(len(output.layers[p]), experts or len(output.layers[p]))
                                                    for p in chosen), len(dense_mods))
                    try:
                        numbers = _numerical(output, chosen, dense_mods, src, conv_report, draws, clock, progress, pool,
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
                scanned, scan_s = scan_f.result() if scan_f is not None else timed(scan, ckpt, conv_report, pool,
                                                                                   skip)
                (problems, counts, conv_report), st_s = timed(check_structure, checks, spool or pool, scanned,
                                                              progress.phase)
            except InputError as e:
                report.update(ok=False, layers=[], dense=[], structural={"ok": False, "problems": [_problem(e)]})
                return finish(report, t0, clock, raise_on_failure)
            finally:
                progress.stop()
        report["structural"] = {"ok": not problems, "problems": problems.items, "counts": counts,
                                # the scan of what the numerical pass did not read, then the checks
                                "seconds": round(scan_s + st_s, 3), "scan_seconds": round(scan_s, 3),
                                "check_seconds": round(st_s, 3),
                                "serve_format": KLEIDIAI if output.packed else PLAIN,
                                "tensor_parallel_size": tensor_parallel_size(output.packed.record) if output.packed else None}
        report["layers"], report["dense"] = [], []
        report["kernel"] = kernel_info()
        report["trust"] = trust_notes(output, counts, conv_report, against is not None and not structural_only)
        bad = {p["where"] for p in problems.items}
        # a config-wide problem (scheme, group, layout record) leaves no layer whose numbers can be trusted
        everywhere = any(w == "config" or w.startswith("config ") for w in bad)

        def flagged(name: str) -> bool:
            return everywhere or any(w == name or w.startswith(name + ".") for w in bad)

        chosen = [p for p in chosen if p in output.layers]  # what the structural pass found
        dense_mods = [m for m in dense_mods if m in output.roles and not flagged(m)]
        notes = []  # a sample larger than the model checks all of it: say so rather than drop it silently
        if isinstance(sel, int) and sel > len(moe_prefixes):
            notes.append(f"--layers {sel}: the model has {len(moe_prefixes)} MoE layer(s); all are checked")
        most = max((len(v) for v in output.layers.values()), default=0)
        if experts is not None and experts > most:
            notes.append(f"--experts {experts}: the MoE layers have {most} experts; all are checked")
        report["checked"] = {"layers": None if sel is None else (sel if isinstance(sel, list) else f"sample of {sel}"),
                             "numerical": not structural_only, "moe_layers": [], "experts": 0, "dense": [],
                             "notes": notes}
        if not structural_only:
            if numbers["copies"] is not None:
                report["copies"] = numbers["copies"]
            for p in chosen:
                report["layers"].append(numbers["layers"][p] if not flagged(p) else {
                    "layer": p, "kind": "moe", "ok": False, "skipped": True,
                    "problems": ["structural problems (see above): not run"]})
            report["dense"] = [numbers["dense"][m] for m in dense_mods]
            ran = [r for r in report["layers"] if not r.get("skipped")]
            report["checked"].update(
                moe_layers=[layer_index(r["layer"]) for r in ran],
                experts=sum(r["experts_checked"] for r in ran),
                experts_by_layer={r["layer"]: r["experts_sampled"] for r in ran},
                dense=[d["module"] for d in report["dense"] if not d.get("skipped")])
    report["ok"] = (report["structural"]["ok"] and all(r["ok"] for r in report["layers"] + report["dense"])
                    and report.get("copies", {}).get("ok", True))
    if not structural_only and not report["layers"] and not report["dense"]:
        report["ok"] = False  # a pass must mean something was checked
        report["nothing_checked"] = True
    return finish(report, t0, clock, raise_on_failure)


def _draw(output: W4A8Output, chosen: list[str], dense_mods: list[str], experts, tokens, dense_tokens: int, gen,
          clock) -> tuple[dict, dict]:
    """Every random draw of the numerical pass, in the order one layer after the other makes them:
    ({prefix: moe_inputs}, {module: rows}); a layer or module that cannot even be read gets its
    failed result instead."""
    layer_in: dict = {}
    for p in chosen:
        r = guarded(p, "moe", lambda: layer_in.__setitem__(p, moe_inputs(output, p, experts, tokens, gen, clock)))
        if r is not None:
            layer_in[p] = r  # could not even be read: reported as such
    dense_in: dict = {}
    for m in dense_mods:
        r = guarded(m, "dense", lambda: dense_in.__setitem__(m, dense_input(output, m, dense_tokens, gen)))
        if r is not None:
            dense_in[m] = r
    return layer_in, dense_in


def _planned(output: W4A8Output, draws) -> set[tuple[str, str]]:
    """The (shard, tensor) pairs the numerical pass reads: the shard scan leaves them to it."""
    if draws is None:
        return set()
    layer_in, dense_in = draws
    mods = [m for p, ins in layer_in.items() for e in ins.get("sampled", ()) for m in output.layers[p][e].values()]
    mods += [m for m, x in dense_in.items() if not isinstance(x, dict)]
    tensors = output.ckpt.tensors
    return {(tensors[n].file, n) for m in mods for n in output.read_names(m) if n in tensors}


def _numerical(output: W4A8Output, chosen: list[str], dense_mods: list[str], src: Source | None, conv_report, draws,
               clock, progress, pool, procs: Workers | None) -> dict:
    """Every chosen MoE layer and dense module through the kernel and the references:
    {"layers": {prefix: result}, "dense": {module: result}, "copies": the copied tensors' check};
    on the worker processes ``procs`` (processes.py), else on the pool's threads."""
    copies = check_copies(output, src, clock) if src is not None else None
    layer_in, dense_in = draws

    def dense_one(m):
        x = dense_in[m]
        if isinstance(x, dict):
            return x
        return guarded(m, "dense", lambda: check_linear(output, m, src, conv_report, x, clock))

    work = PerThread(dict)  # each thread's expert buffers, from one layer to the next

    def layer_one(p):
        ins = layer_in[p]
        if "res" not in ins:
            return ins
        progress.advance(what=p)
        return guarded(p, "moe", lambda: check_layer(
            output, p, src, conv_report, ins, clock, tick=lambda: progress.advance(experts=1), pool=pool, work=work))

    out: dict = {"layers": {}, "dense": {}, "copies": copies}
    if procs:
        def done(kind: str, name: str, r: dict) -> None:
            if kind == "moe":
                out["layers"][name] = r
                progress.advance(layers=1, experts=len(layer_in[name]["sampled"]), what=name)
            else:
                out["dense"][name] = r
                progress.advance(dense=1, what=name)

        procs.run({p: ins for p, ins in layer_in.items() if "res" in ins},
                  {m: x for m, x in dense_in.items() if not isinstance(x, dict)}, clock, done,
                  lambda kind, name: layer_one(name) if kind == "moe" else dense_one(name))
        out["layers"] = {p: out["layers"].get(p, layer_in[p]) for p in chosen}  # (a draw that failed)
        out["dense"] = {m: out["dense"].get(m, dense_in[m]) for m in dense_mods}
        return out
    # the dense modules queue on the pool first; two layers at a time feed it their experts,
    # so that one layer's own serial steps (routing, sums) overlap the other's experts
    dense_f = [pool.submit(dense_one, m) for m in dense_mods] if pool is not None else None
    layers_pool = ThreadPoolExecutor(max_workers=2) if pool is not None and len(chosen) > 1 else None
    with shutting(layers_pool):
        for p, r in zip(chosen, parallel(layers_pool, layer_one, [(p,) for p in chosen])):
            out["layers"][p] = r
            progress.advance(layers=1)
    for i, m in enumerate(dense_mods):
        progress.advance(what=m)
        out["dense"][m] = dense_one(m) if dense_f is None else dense_f[i].result()
        progress.advance(dense=1)
    return out
