"""``int4pack inspect PATH [TENSOR]``: the CLI face of ``int4pack.inspect``.

Usage:
    int4pack inspect ./Qwen3-30B-A3B-GPTQ-Int4
    int4pack inspect ./out model.layers.0.mlp.experts.0.gate_proj --json
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ..inspect import inspect
from ..output import human_bytes
from ._common import DebugOpt, JsonOpt, QuietOpt, VerboseOpt, error_boundary, make_output

__all__ = ["inspect_cmd", "EXAMPLES"]

EXAMPLES = """[bold]Examples[/bold]

  int4pack inspect ./Qwen3-30B-A3B-GPTQ-Int4                          [dim]# format, MoE, per-module path[/dim]\n
  int4pack inspect ./out                                               [dim]# KleidiAI path or fallback[/dim]\n
  int4pack inspect SRC model.layers.0.mlp.experts.0.gate_proj.qweight  [dim]# nibble layout dump[/dim]\n
  int4pack inspect ./out model.layers.0.mlp.experts.w13_packed         [dim]# prepacked block structure[/dim]
"""


def inspect_cmd(
    path: Annotated[str, typer.Argument(help="A checkpoint folder or hub repo id (source or output).")],
    tensor: Annotated[Optional[str], typer.Argument(help="A tensor or module name to dump.")] = None,
    revision: Annotated[Optional[str], typer.Option(help="Hub revision.")] = None,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = 0,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Show a checkpoint's format, MoE structure and what convert will do with every int4 tensor;
    or, with TENSOR, its bit layout."""
    o = make_output(json_out, verbose, quiet, debug)
    with error_boundary(o):
        r = inspect(path, tensor, revision=revision)
        if tensor is None:
            _summary(o, r)
        else:
            _dump(o, r)
        o.result(r)


def _summary(o, r: dict) -> None:
    f = r["format"]
    o.text(f"[bold]{r['path']}[/bold]: {f.get('format')} ({f.get('detail')}), model_type {r['model_type']}, "
           f"{r['tensor_count']} tensors in {r['shards']} shard(s), {human_bytes(r['bytes'])}")
    for ev in f.get("evidence", []):
        o.text(f"  evidence: {ev}")
    for w in f.get("warnings", []):
        o.warning(w)
    moe = r["moe"]
    if "error" in moe:
        o.text(f"  MoE: [red]{moe['error']}[/red]")
    else:
        exp = sorted({m["experts"] for m in moe["layers"]})
        shared = sum(1 for m in moe["layers"] if m["shared"])
        o.text(f"  MoE: {len(moe['layers'])} layers x {'/'.join(map(str, exp))} experts, {shared} with shared "
               f"experts, {len(moe['routers'])} routers; roles {moe['roles']}")
    p = r["plan"]
    if p["ok"]:
        g = "channel (fp32 scales)" if p["group_size"] == -1 else f"group {p['group_size']} (bf16 scales)"
        o.text(f"  convert plan: target {g}; paths {p['paths']}")
    else:
        o.text(f"  convert plan: [red]refused[/red]: {p['refused']}")
        if p.get("hint"):
            o.text(f"  hint: {p['hint']}")
    for w in r.get("serving", []):
        o.warning(w)
    ks = r["kleidiai_summary"]
    o.text(f"  KleidiAI ({'this checkpoint' if r['is_w4a8_output'] else 'after convert'}): {ks['kleidiai']} "
           f"module(s) take the KleidiAI path, {ks['fallback']} fall back to torch's float32 reference")
    mods = r["modules"]
    act = sum(1 for m in mods.values() if m["act_order"])
    asym = sum(1 for m in mods.values() if not m["sym"])
    o.text(f"  {len(mods)} int4 modules: {asym} asymmetric, {act} with act-order (g_idx)")
    # one row per distinct (role, shape, path, kleidiai): a 30B model has ~18k modules
    groups: dict[tuple, list] = {}
    for name, m in mods.items():
        key = (m["role"], m["format"], f"{m['n']}x{m['k']}", m["group_size"], "sym" if m["sym"] else "asym",
               "yes" if m["act_order"] else "-", m["scale_dtype"], m["path"] or "-",
               "yes" if m["kleidiai"] else m["kleidiai_reason"])
        groups.setdefault(key, []).append(name)
    rows = [[*k[:8], len(v), k[8]] + ([v[0]] if o.verbosity >= 1 else [])
            for k, v in sorted(groups.items(), key=lambda kv: kv[1][0])]
    o.table("Quantised modules", ["role", "fmt", "NxK", "group", "sym", "act-ord", "scale", "path", "count",
                                  "KleidiAI"] + (["example"] if o.verbosity >= 1 else []), rows)
    for k, v in groups.items():
        if k[8] != "yes":
            o.text(f"  [yellow]fallback[/yellow] {v[0]} (+{len(v) - 1}): {k[8]}")
    if o.verbosity >= 1:
        o.table("Tensors", ["name", "dtype", "shape", "bytes", "file"],
                [[t["name"], t["dtype"], t["shape"], human_bytes(t["bytes"]), t["file"]] for t in r["tensors"]])
    else:
        o.text(f"  ({r['tensor_count']} tensors: -v lists them, --json gives everything)")
    for b in r.get("prepacked", []):
        o.text(f"  prepacked: {b['file']}: {b.get('name')} {b.get('dtype')}{b.get('shape')} {b.get('error', '')}")


def _dump(o, r: dict) -> None:
    o.text(f"[bold]{r['tensor']}[/bold] {r.get('dtype', '')}{r.get('shape')} in {r.get('file')}")
    if "tile" in r:  # prepacked blob
        o.text(f"  {r['layout']}, N={r['n']} K={r['k']} group {r['group_size']}; tiles {r['tile']}")
        o.table("First 8-row block", ["part", "offset", "bytes"],
                [[p["part"], p["offset"], p["bytes"]] for p in r["first_block"]])
        o.text(f"  row sums (block 0): {r['row_sums_block0']}")
        o.text(f"  bias (block 0): {r['bias_block0']}")
        o.table("Decoded q (rows 0.., k 0..7)", [f"k{i}" for i in range(len(r['window']['q'][0]))], r["window"]["q"])
        return
    if "format" in r:
        o.text(f"  {r['format']}: N={r['n']} K={r['k']} group {r['group_size']}, "
               f"{'sym' if r['sym'] else 'asym'}, act-order {r['act_order']}")
    o.text(f"  layout: {r.get('layout')}")
    if r.get("nibbles"):
        o.table("Nibble order of the first words", ["word", "hex", "nibble", "bits", "byte", "half", "n", "k",
                                                    "raw", "zero", "q"],
                [[e["word"], e["word_hex"], e["nibble"], e["bits"], e["byte"], e["half"], e["n"], e["k"], e["raw"],
                  e["zero"], e["q"]] for e in r["nibbles"]])
    w = r.get("window")
    if isinstance(w, dict):
        o.table(f"Decoded int4 q ({w['rows']}, {w['cols']}; groups {w['group_of_k']})",
                [f"k{i}" for i in range(len(w["q"][0]))], w["q"])
        o.table("Scales of that window", [f"k{i}" for i in range(len(w["scales"][0]))],
                [[f"{v:.4g}" for v in row] for row in w["scales"]])
    elif w is not None:
        o.table("Values", [str(i) for i in range(len(w[0]))], [[f"{v:.4g}" for v in row] for row in w])
