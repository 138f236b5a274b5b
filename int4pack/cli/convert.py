"""``int4pack convert SRC OUT``: the CLI face of ``int4pack.convert``.

Usage:
    int4pack convert ./Qwen3-30B-A3B-GPTQ-Int4 ./out
    int4pack convert Qwen/Qwen3-30B-A3B-GPTQ-Int4 ./out --group-size 128 --dry-run --json
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..convert import convert
from ..output import Output, human_bytes
from ._common import DebugOpt, JsonOpt, QuietOpt, ThreadsOpt, VerboseOpt, error_boundary, make_output

__all__ = ["convert_cmd", "EXAMPLES"]


class Dense(str, Enum):
    w4a8 = "w4a8"
    bf16 = "bf16"

EXAMPLES = """[bold]Examples[/bold]

  int4pack convert ./Qwen3-30B-A3B-GPTQ-Int4 ./out\n
  int4pack convert Qwen/Qwen3-30B-A3B-GPTQ-Int4 ./out            [dim]# hub repo id (huggingface_hub cache)[/dim]\n
  int4pack convert SRC OUT --group-size channel                   [dim]# fp32 channel scales[/dim]\n
  int4pack convert SRC OUT --dry-run --json                       [dim]# the plan, nothing written[/dim]\n
  int4pack convert SRC OUT --resume                               [dim]# continue an interrupted run[/dim]\n
  int4pack convert SRC OUT --prepack kleidiai                     [dim]# + KleidiAI blobs in OUT/kleidiai/[/dim]
"""


def convert_cmd(
    src: Annotated[str, typer.Argument(help="Source checkpoint: a local folder or a hub repo id (owner/name).")],
    out: Annotated[Path, typer.Argument(help="Output folder (must not exist unless --overwrite).")],
    group_size: Annotated[str, typer.Option(
        "--group-size", "-g",
        help="Target group: auto (keep the source's when valid), channel, or a multiple of 32 dividing K.")] = "auto",
    dense: Annotated[Dense, typer.Option(
        help="Non-expert int4 linears: w4a8 (vLLM's dense W4A8 path) or bf16 (dequantised).")] = Dense.w4a8,
    max_shard_size: Annotated[str, typer.Option(help="Largest output shard, e.g. 5GB, 500MB.")] = "5GB",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate and print the plan; write nothing.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUT if it exists.")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Keep the verified shards of an interrupted run.")] = False,
    revision: Annotated[Optional[str], typer.Option(help="Hub revision (branch, tag or commit).")] = None,
    prepack: Annotated[Optional[str], typer.Option(
        help="Also write KleidiAI-packed experts to OUT/kleidiai/ (value: kleidiai), so nothing is packed "
             "at load time.")] = None,
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = 0,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Convert an int4 MoE checkpoint (GPTQ, AWQ, compressed-tensors) to vLLM's W4A8 layout.

    Writes a compressed-tensors int-quantized W4A8 checkpoint that vLLM's Arm CPU backend loads as
    is, plus int4pack_report.json (per-module path and error, every source tensor's fate)."""
    o = make_output(json_out, verbose, quiet, debug)
    with error_boundary(o):
        with o.progress("converting") as bar:
            report = convert(src, out, group_size=group_size, dense=dense.value, max_shard_size=max_shard_size,
                             dry_run=dry_run, overwrite=overwrite, resume=resume, threads=threads,
                             revision=revision, prepack=prepack, progress=bar)
        _render(o, report)
        o.result(report)


def _render(o: Output, r: dict) -> None:
    p = r["plan"]
    fmt = p["format"]
    o.text(f"[bold]{r['source']}[/bold]: {fmt['format']} ({fmt['detail']}), model_type {p['model_type']}")
    for ev in fmt.get("evidence", []):
        o.text(f"  evidence: {ev}", level=0)
    for w in fmt.get("warnings", []):
        o.warning(w)
    exp = "/".join(map(str, p["experts_per_layer"]))
    o.text(f"  {p['moe_layers']} MoE layers x {exp} experts, {p['shared_experts']} with shared experts, "
           f"{p['routers']} routers")
    g = "channel (fp32 scales)" if p["group_size"] == -1 else f"{p['group_size']} (bf16 scales)"
    o.text(f"  target: W4A8, group {g}, dense linears as {p['dense']}")
    for w in r.get("serving", []):
        o.warning(w)
    paths = p["paths"]
    o.table("Plan", ["path", "count"], [[k, v] for k, v in sorted(paths.items())])
    o.text(f"  tensors: {p['tensors_in']} in -> {p['tensors_out']} out in {len(r['shards'])} shard(s); "
           f"{human_bytes(p['in_bytes'])} read -> {human_bytes(p['out_bytes'])} written")
    if r.get("prepack"):
        pp = r["prepack"]
        o.text(f"  prepacked {pp['tensors']} KleidiAI tensor(s) into kleidiai/ ({pp['packer']} packer, "
               f"layout {pp['layout']} v{pp['layout_version']})")
    if r.get("dry_run"):
        o.text("[dim]dry run: nothing written[/dim]")
        return
    mods = r.get("modules", {})
    worst = sorted(((float(v["rel_l2"]), k, v) for k, v in mods.items() if v.get("rel_l2") not in (None, "0")),
                   reverse=True)
    if worst:
        rows = [[k, v["path"], v["rel_l2"], v.get("baseline_rel_l2") or "-"] for _, k, v in worst[:5]]
        o.table("Largest weight errors (relative L2 vs the source's own dequantisation)",
                ["module", "path", "rel_l2", "plain RTN"], rows, level=0)
    o.table("Every module", ["module", "role", "path", "rel_l2", "plain RTN"],
            [[k, v.get("role", ""), v["path"], v.get("rel_l2") or "-", v.get("baseline_rel_l2") or "-"]
             for k, v in sorted(mods.items())], level=1)
    o.text(f"[green]wrote[/green] {r['output']} in {r['seconds']:.1f} s")
