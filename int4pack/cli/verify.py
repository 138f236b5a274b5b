"""``int4pack verify OUT [--against SRC]``: the CLI face of ``int4pack.verify``.

Usage:
    int4pack verify ./out --against ./Qwen3-30B-A3B-GPTQ-Int4
    int4pack verify ./out --layers 0,12 --experts 16 --tokens 64 --json
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ..errors import EXIT_VERIFY
from ..verify import verify
from ._common import DebugOpt, JsonOpt, QuietOpt, ThreadsOpt, VerboseOpt, error_boundary, make_output

__all__ = ["verify_cmd", "EXAMPLES"]

EXAMPLES = """[bold]Examples[/bold]

  int4pack verify ./out --against ./Qwen3-30B-A3B-GPTQ-Int4     [dim]# vs the source's own dequantisation[/dim]\n
  int4pack verify ./out                                          [dim]# structure + kernel vs int4 weights[/dim]\n
  int4pack verify ./out --layers 0,24 --experts 16 --tokens 64   [dim]# sample a big model[/dim]\n
  int4pack verify ./out --structural-only --json
"""


def _f(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def verify_cmd(
    out: Annotated[str, typer.Argument(help="The converted (W4A8 compressed-tensors) checkpoint.")],
    against: Annotated[Optional[str], typer.Option(
        "--against", help="The source checkpoint it was converted from (reference weights).")] = None,
    tokens: Annotated[Optional[int], typer.Option(
        min=1, help="Hidden-state rows per MoE layer (default: enough for >= 2 per sampled expert, >= 32).")] = None,
    layers: Annotated[Optional[str], typer.Option(
        help="MoE layers: all (default), a count N (seeded sample), or indices 0,12,47 (one index: 12,).")
    ] = None,
    experts: Annotated[Optional[int], typer.Option(min=1, help="Experts per layer to sample (default: all).")] = None,
    seed: Annotated[int, typer.Option(help="Seed for inputs and sampling.")] = 0,
    structural_only: Annotated[bool, typer.Option("--structural-only", help="Skip the numerical pass.")] = False,
    no_dense: Annotated[bool, typer.Option("--no-dense", help="Skip the dense W4A8 linears.")] = False,
    revision: Annotated[Optional[str], typer.Option(help="Hub revision (for hub ids).")] = None,
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = 0,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Check a converted checkpoint: structure, then per MoE layer the W4A8 kernel against float32
    references (converted and, with --against, source weights), with a derived tolerance."""
    o = make_output(json_out, verbose, quiet, debug)
    with error_boundary(o):
        lay = None
        if layers and layers != "all":
            lay = layers if "," in layers else int(layers) if layers.isdigit() else layers
        report = verify(out, against, tokens=tokens, layers=lay, experts=experts, seed=seed, threads=threads,
                        structural_only=structural_only, dense=not no_dense, revision=revision,
                        raise_on_failure=False)
        _render(o, report)
        o.result(report)
        if not report["ok"]:
            o.err.print(f"[bold red]verify failed[/bold red]: {report['verdict']}")
            raise typer.Exit(EXIT_VERIFY)


def _render(o, r: dict) -> None:
    st = r["structural"]
    c = st.get("counts", {})
    o.text(f"[bold]{r['output']}[/bold]" + (f" against [bold]{r['against']}[/bold]" if r.get("against") else
                                          " (no --against: weights checked against themselves)"))
    o.text(f"  structure: {c.get('moe_layers', 0)} MoE layers, {c.get('experts', 0)} experts, "
           f"{c.get('modules', 0)} W4A8 modules, {c.get('blobs', 0)} KleidiAI blobs checked: "
           + ("[green]ok[/green]" if st["ok"] else f"[red]{len(st['problems'])} problem(s)[/red]"))
    for p in st["problems"][:20]:
        o.text(f"  [red]x[/red] {p['where']}: {p['message']}")
    if "kernel" in r:
        o.text(f"  kernel: {r['kernel']['matmul']}, MoE op {r['kernel']['moe_op']}", level=1)
    rows = []
    for L in r.get("layers", []):
        if L.get("skipped"):
            rows.append([L["layer"], "-", "-", "-", "-", "-", "-", "-", "[red]skipped[/red]"])
            continue
        rows.append([L["layer"], f"{L['experts_checked']}/{L['experts']}", L["tokens"], _f(L["rel_l2"]),
                     _f(L["max_abs"]), f"{L['cosine']:.5f}", f"{_f(L['act_rel'])} ({_f(L['act_pred'])})",
                     f"{_f(L.get('weight_rel'))} ({_f(L.get('weight_pred'))})" if "weight_rel" in L else "-",
                     ("[green]ok[/green] " if L["ok"] else "[red]FAIL[/red] ") + _f(L["tolerance"])])
    if rows:
        o.table("MoE layers: kernel vs float32 reference (predicted in parentheses)",
                ["layer", "experts", "tokens", "rel_l2", "max_abs", "cosine", "act. int8", "weights", "tol"], rows)
    dense = r.get("dense", [])
    if dense:
        bad = [d for d in dense if not d["ok"]]
        worst = max(dense, key=lambda d: d["rel_l2"] / max(d["tolerance"], 1e-30))
        o.text(f"  dense W4A8 linears: {len(dense) - len(bad)}/{len(dense)} ok; closest to its tolerance "
               f"{worst['module']} rel_l2 {_f(worst['rel_l2'])} (tol {_f(worst['tolerance'])})")
        if o.verbosity >= 1:
            o.table("Dense linears", ["module", "rel_l2", "act (pred)", "tol", "ok"],
                    [[d["module"], _f(d["rel_l2"]), f"{_f(d['act_rel'])} ({_f(d['act_pred'])})",
                      _f(d["tolerance"]), d["ok"]] for d in dense])
    for L in r.get("layers", []) + dense:
        for p in L.get("problems", []):
            o.text(f"  [red]x[/red] {L.get('layer') or L.get('module')}: {p}")
    tm = r.get("timing", {})
    o.text(f"  time {tm.get('total', 0):.1f} s (kernel {tm.get('kernel', 0):.1f} s, reference "
           f"{tm.get('reference', 0):.1f} s, prediction {tm.get('prediction', 0):.1f} s)", level=1)
    colour = "green" if r["ok"] else "red"
    o.text(f"[bold {colour}]{r['verdict']}[/bold {colour}]")
