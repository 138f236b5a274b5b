"""``int4pack verify OUT [--against SRC]``: the CLI face of ``int4pack.verify``."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ..architectures import layer_index
from ..error_stats import short_number as _f
from ..errors import EXIT_VERIFY
from ._common import (
    DebugOpt, JsonOpt, QuietOpt, ThreadsOpt, VerboseOpt, error_boundary, examples, library, make_output,
    tensor_parallel_line)

__all__ = ["verify_cmd", "EXAMPLES"]

EXAMPLES = examples(
    ("Check a conversion against the source's own dequantised weights:",
     "int4pack verify ./out --against ./Qwen3-30B-A3B-GPTQ-Int4"),
    ("Check the structure, and the kernel against the int4 weights it holds:", "int4pack verify ./out"),
    ("Sample a large model: two layers, 16 experts each, 64 tokens:",
     "int4pack verify ./out --layers 0,24 --experts 16 --tokens 64"),
    ("Check only the structure and print JSON:", "int4pack verify ./out --structural-only --json"),
)


def verify_cmd(
    out: Annotated[str, typer.Argument(
        metavar="OUT", help="The converted (W4A8 compressed-tensors) checkpoint.", show_default=False)],
    against: Annotated[Optional[str], typer.Option(
        "--against", metavar="SRC", help="The source checkpoint it was converted from, for reference weights.")
    ] = None,
    tokens: Annotated[Optional[int], typer.Option(
        min=1, help="Hidden-state rows per MoE layer (by default enough for at least 2 per sampled expert, and "
                    "at least 32).")] = None,
    layers: Annotated[Optional[str], typer.Option(
        metavar="all|N|I,J", help="The MoE layers to run: all (the default), a count N for a seeded sample, or "
                                  "indices such as 0,12,47 (a single index as 12,).")] = None,
    experts: Annotated[Optional[int], typer.Option(
        min=1, help="How many experts per layer to sample (by default all).")] = None,
    seed: Annotated[int, typer.Option(help="The seed for the inputs and the sampling.")] = 0,
    structural_only: Annotated[bool, typer.Option(
        "--structural-only", help="Check the structure only; skip the numerical pass.")] = False,
    no_dense: Annotated[bool, typer.Option("--no-dense", help="Skip the dense W4A8 linears.")] = False,
    revision: Annotated[Optional[str], typer.Option(help="The hub revision: a branch, tag or commit.")] = None,
    threads: ThreadsOpt = None,
    processes: Annotated[Optional[bool], typer.Option(
        "--processes/--no-processes", help="Run the numerical pass on --threads worker processes, or on threads "
                                           "(by default processes from 4 threads and 4 MoE layers up).")] = None,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = 0,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Check a converted checkpoint: its structure, then its numbers.

    For each MoE layer the W4A8 kernel runs against float32 references on the converted weights
    and, with --against, on the source's weights, within a tolerance derived from the inputs.
    """
    o = make_output(json_out, verbose, quiet, debug)
    with error_boundary(o, lambda: "verify writes nothing; run it again to check from the start"):
        verify = library("verify")
        with o.verify_progress() as bar:
            report = verify(out, against, tokens=tokens, layers=layers, experts=experts, seed=seed,
                            threads=threads, structural_only=structural_only, dense=not no_dense,
                            revision=revision, raise_on_failure=False, progress=bar, processes=processes)
        _render(o, report)
        o.result(report)
        if not report["ok"]:
            o.err.print(f"[bold red]verify failed[/bold red]: {report['verdict']}")
            raise typer.Exit(EXIT_VERIFY)


def _layer_index(layer: str) -> str:
    """model.layers.12.mlp -> 12 (the table's first column stays narrow)."""
    i = layer_index(layer)
    return str(i) if i >= 0 else layer


def _render(o, r: dict) -> None:
    st = r["structural"]
    c = st.get("counts", {})
    o.text(f"[bold]{r['output']}[/bold]" + (f" against [bold]{r['against']}[/bold]" if r.get("against") else
                                          " (no --against: weights checked against themselves)"))
    o.text(f"  structure: {c.get('moe_layers', 0)} MoE layers, {c.get('experts', 0)} experts, "
           f"{c.get('modules', 0)} W4A8 modules, {c.get('blobs', 0)} KleidiAI blobs checked: "
           + ("[green]ok[/green]" if st["ok"] else f"[red]{len(st['problems'])} problem(s)[/red]"))
    tp = tensor_parallel_line(st.get("tensor_parallel_size"))
    if tp:
        o.text(tp)
    for n in r.get("checked", {}).get("notes", []):
        o.text(f"  note: {n}")
    for p in st["problems"][:20]:
        o.text(f"  [red]x[/red] {p['where']}: {p['message']}")
        if p.get("hint"):
            o.text(f"    hint: {p['hint']}")
    cp = r.get("copies")
    if cp is not None:
        o.text(f"  copied tensors: {cp['checked']} compared byte for byte with the source: "
               + ("[green]ok[/green]" if cp["ok"] else f"[red]{len(cp['problems'])} problem(s)[/red]"))
        for p in cp["problems"][:20]:
            o.text(f"  [red]x[/red] {p['where']}: {p['message']}")
    for note in r.get("trust", []):
        o.text(f"  [dim]note:[/dim] {note}")
    if "kernel" in r:
        w = r.get("workers") or {}
        on = f"; on {w['count']} {w['kind']}" if w else ""
        o.text(f"  kernel: {r['kernel']['matmul']}, MoE op {r['kernel']['moe_op']}{on}", level=1)
    rows = []
    for L in r.get("layers", []):
        if L.get("skipped"):
            rows.append([_layer_index(L["layer"]), "-", "-", "-", "-", "-", "-", "[red]skipped[/red]"])
            continue
        rows.append([_layer_index(L["layer"]), f"{L['experts_checked']}/{L['experts']}", L["tokens"],
                     _f(L["rel_l2"]), _f(L["max_abs"]), f"{_f(L['act_rel'])} ({_f(L['act_pred'])})",
                     f"{_f(L.get('weight_rel'))} ({_f(L.get('weight_pred'))})" if "weight_rel" in L else "-",
                     ("[green]ok[/green] " if L["ok"] else "[red]FAIL[/red] ") + _f(L["tolerance"])])
    if rows:
        o.table("MoE layers: kernel against the float32 reference (predicted in parentheses)",
                ["layer", "experts", "tokens", "rel_l2", "max_abs", "act. int8", "weights", "tol"], rows)
    dense = r.get("dense", [])
    if dense:
        bad = [d for d in dense if not d["ok"]]
        ran = [d for d in dense if "rel_l2" in d]  # a linear that could not run has no figures
        worst = max(ran, key=lambda d: d["rel_l2"] / max(d["tolerance"], 1e-30), default=None)
        o.text(f"  dense W4A8 linears: {len(dense) - len(bad)}/{len(dense)} ok" + (
            f"; closest to its tolerance {worst['module']} rel_l2 {_f(worst['rel_l2'])} "
            f"(tol {_f(worst['tolerance'])})" if worst else ""))
        if o.verbosity >= 1:
            o.table("Dense linears", ["module", "rel_l2", "act (pred)", "tol", "ok"],
                    [[d["module"], _f(d.get("rel_l2")), f"{_f(d.get('act_rel'))} ({_f(d.get('act_pred'))})",
                      _f(d.get("tolerance")), d["ok"]] for d in dense])
    for L in r.get("layers", []) + dense:
        for p in L.get("problems", []):
            o.text(f"  [red]x[/red] {L.get('layer') or L.get('module')}: {p}")
    tm = r.get("timing", {})
    o.text(f"  time {tm.get('total', 0):.1f} s (kernel {tm.get('kernel', 0):.1f} s, reference "
           f"{tm.get('reference', 0):.1f} s, prediction {tm.get('prediction', 0):.1f} s)", level=1)
    colour = "green" if r["ok"] else "red"
    o.text(f"[bold {colour}]{r['verdict']}[/bold {colour}]")
