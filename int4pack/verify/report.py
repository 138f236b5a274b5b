"""verify's report: the notes on what its checks trust, the kernel it ran, the timing and the
verdict; a failed check raises VerifyFailed carrying the report."""

from __future__ import annotations

import time

from . import matmul
from ..error_stats import short_number as _fmt
from ..errors import VerifyFailed
from ..serve_spec import BLOB_CHECKS
from .threads import Clock
from .w4a8_output import W4A8Output

__all__ = ["trust_notes", "kernel_info", "finish"]


def trust_notes(output: W4A8Output, counts: dict, conv_report: dict | None, against: bool) -> list[str]:
    """Which checks rest on figures the checkpoint records about itself (a forger can edit those)."""
    notes = []
    if not against:
        notes.append("weights were checked against themselves, not against a source: pass --against SRC to "
                     "compare every module and copied tensor with the checkpoint it came from")
        if conv_report is not None:
            notes.append("shard checksums are compared with int4pack_report.json, which the checkpoint carries: "
                         "they detect damage, not a consistent forgery")
    else:
        notes.append("error budgets come from the source (the report's figures only tighten them); copied "
                     "tensors are compared byte for byte with the source")
    if conv_report is None:
        notes.append("no int4pack_report.json: shard checksums could not be checked")
    if output.packed:
        notes.append("each blob is checked against the provenance in its own shard header (CRCs of the values "
                     "it was packed from) and repacked byte for byte")
        if BLOB_CHECKS not in output.packed.record:
            notes.append(f"the layout record has no {BLOB_CHECKS} (written by an older int4pack, or deleted): the "
                         "vLLM plugin refuses it unless INT4PACK_ALLOW_UNCHECKED_BLOBS=1; convert again to have "
                         "its blobs checked at load")
    return notes


def kernel_info() -> dict:
    return matmul.info()


def finish(report: dict, t0: float, clock: Clock, raise_on_failure: bool) -> dict:
    report["timing"] = {k: round(v, 4) for k, v in clock.s.items()}
    report["timing"]["total"] = round(time.perf_counter() - t0, 4)
    fails = [r for r in report.get("layers", []) + report.get("dense", []) if not r.get("ok")]
    st = report.get("structural", {})
    n_l = len(report.get("layers", []))
    worst = max((r.get("rel_l2") or 0 for r in report.get("layers", [])), default=None)
    if report.get("ok") and not report.get("checked", {}).get("numerical", True):
        report["verdict"] = "PASS: structure ok (numerical pass not run: structural only)"
    elif report.get("ok"):
        report["verdict"] = (f"PASS: structure ok, {n_l} MoE layer(s) and {len(report.get('dense', []))} dense "
                             "linear(s) within tolerance" + (f" (worst layer rel_l2 {_fmt(worst)})" if n_l else ""))
    else:
        parts = []
        if report.get("nothing_checked"):
            parts.append("nothing was checked (no MoE layer and no dense W4A8 linear selected)")
        if not st.get("ok", False):
            parts.append(f"{len(st.get('problems', []))} structural problem(s)")
        if not report.get("copies", {}).get("ok", True):
            first = report["copies"]["problems"][0] if report["copies"]["problems"] else {}
            parts.append(first["message"] if first.get("where") == "source" else
                         f"{len(report['copies']['problems'])} tensor(s) not as copied from the source")
        if fails:
            names = [r.get("layer") or r.get("module") for r in fails]
            parts.append(f"{len(fails)} layer(s)/linear(s) out of tolerance ({', '.join(names[:3])}"
                         f"{' ...' if len(names) > 3 else ''})")
        report["verdict"] = "FAIL: " + "; ".join(parts)
    if not report.get("ok") and raise_on_failure:
        first = next((p for p in st.get("problems", []) + report.get("copies", {}).get("problems", [])), None)
        detail = f"{first['where']}: {first['message']}" if first else next(
            (f"{r.get('layer') or r.get('module')}: {r['problems'][0]}" for r in fails if r.get("problems")), "")
        hint = ("Re-run convert (the output is damaged or differs from its source), or see --json for every "
                "per-layer figure.")
        if report.get("nothing_checked") and not detail:
            hint = "Select layers that hold MoE experts or dense W4A8 linears (without --no-dense for the latter)."
        err = VerifyFailed(f"{report['verdict']}." + (f" First: {detail}" if detail else ""), hint=hint)
        err.report = report
        raise err
    return report
