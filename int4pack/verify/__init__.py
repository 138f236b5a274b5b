"""``verify``: prove a converted W4A8 checkpoint is complete and computes what its source computes.

``verify`` opens the output and runs its two passes side by side on one view of it (passes.py):
the structural pass (structure.py) always, and the numerical pass (numerical.py) on what the
structural pass finds; one report says what ran and what was found (report.py).

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

The numerical pass's parts, each a module of this package: the random inputs (random_inputs), the
MoE and dense checks (moe_layer, expert_check, dense_linear), the matmul (matmul), the source side
(source, exact_ints), the tolerances (tolerance), the layer selection (layer_selection), the threads
and worker processes (threads, processes).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .._lazy import gc_frozen
from ..errors import InputError, UsageError
from ..sources.checkpoint import resolve_source
from . import matmul
from .layer_selection import parse_layers
from .passes import Asked, problem, run_passes
from .report import finish
from .shard_scan import Tapped
from .threads import Clock, shutting, torch_threads
from .tolerance import K_ACT, K_WEIGHT, LOSSLESS_BOUND, REL_MARGIN

__all__ = ["verify", "NullProgress", "K_ACT", "K_WEIGHT", "LOSSLESS_BOUND", "REL_MARGIN"]


class NullProgress:
    """verify's progress protocol: the CLI passes a rich implementation (output.VerifyProgress)."""

    def phase(self, what: str) -> None: ...

    def start(self, layers: int, experts: int, dense: int) -> None: ...

    def advance(self, *, layers: int = 0, experts: int = 0, dense: int = 0, what: str = "") -> None: ...

    def stop(self) -> None: ...


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
        report.update(ok=False, structural={"ok": False, "problems": [problem(e, "checkpoint")]},
                      layers=[], dense=[])
        return finish(report, t0, clock, raise_on_failure)
    asked = Asked(out, against, revision, layers, sel, experts, tokens, seed, structural_only, dense, dense_tokens,
                  processes, progress or NullProgress())
    workers = max(1, int(threads or torch.get_num_threads()))
    # one expert (module, shard) per thread, each single-threaded in torch: nothing nests
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="int4pack-verify") if workers > 1 else None
    with torch_threads(1), gc_frozen(), ckpt, shutting(pool):
        run_passes(ckpt, asked, report, clock, pool, workers)
    if "ok" in report:  # the checkpoint left nothing to check: the report says why
        return finish(report, t0, clock, raise_on_failure)
    report["ok"] = (report["structural"]["ok"] and all(r["ok"] for r in report["layers"] + report["dense"])
                    and report.get("copies", {}).get("ok", True))
    if not structural_only and not report["layers"] and not report["dense"]:
        report["ok"] = False  # a pass must mean something was checked
        report["nothing_checked"] = True
    return finish(report, t0, clock, raise_on_failure)
