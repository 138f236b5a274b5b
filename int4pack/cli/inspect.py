"""``int4pack inspect PATH [TENSOR]``: the CLI face of ``int4pack.inspect``."""

from __future__ import annotations

from collections import Counter
from typing import Annotated, Optional

import typer
from rich.markup import escape

from ..groups import is_channel
from ..output import human_bytes
from ._common import (
    DebugOpt, JsonOpt, QuietOpt, VerboseOpt, error_boundary, examples, library, make_output, tensor_parallel_line)

__all__ = ["inspect_cmd", "EXAMPLES"]

EXAMPLES = examples(
    ("Show a source's format, its MoE structure and what convert does with it:",
     "int4pack inspect ./Qwen3-30B-A3B-GPTQ-Int4"),
    ("Show which modules of a converted checkpoint take the KleidiAI path:", "int4pack inspect ./out"),
    ("Show how one tensor's nibbles are laid out:",
     "int4pack inspect SRC model.layers.0.mlp.experts.0.gate_proj.qweight"),
    ("Show the block structure of a KleidiAI blob (convert --serve-format kleidiai):",
     "int4pack inspect ./out model.layers.0.mlp.experts.0.up_proj"),
)


def inspect_cmd(
    path: Annotated[str, typer.Argument(
        metavar="PATH", help="A checkpoint folder or hub repo id, a source or a converted one.", show_default=False)],
    tensor: Annotated[Optional[str], typer.Argument(
        metavar="[TENSOR]", help="A tensor or module name whose layout to show.", show_default=False)] = None,
    revision: Annotated[Optional[str], typer.Option(help="The hub revision: a branch, tag or commit.")] = None,
    json_out: JsonOpt = False,
    verbose: VerboseOpt = 0,
    quiet: QuietOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Show a checkpoint's format, its MoE structure and what convert will do with every int4 tensor.

    With TENSOR, show that tensor's bit layout and the first values it decodes to.
    """
    o = make_output(json_out, verbose, quiet, debug)
    with error_boundary(o):
        inspect = library("inspect")
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
    src = r.get("converted_from")
    if isinstance(src, dict):
        o.text(f"  converted by int4pack from: {src.get('format')} ({src.get('detail')})")
        errs = [(float(m["rel_l2"]), float(m["baseline_rel_l2"] or 0), n) for n, m in r["modules"].items()
                if m.get("rel_l2") not in (None, "0") and m.get("baseline_rel_l2") is not None]
        if errs:
            worst = max(errs)
            o.text(f"  weight error against the source (its report): mean rel_l2 {sum(e[0] for e in errs) / len(errs):.4g}, "
                   f"plain RTN {sum(e[1] for e in errs) / len(errs):.4g}; worst {worst[2]} {worst[0]:.4g} (RTN {worst[1]:.4g})")
    moe = r["moe"]
    if "error" in moe:
        o.text(f"  MoE: [red]{escape(moe['error'])}[/red]")
        if moe.get("hint"):
            o.text(f"  hint: {escape(moe['hint'])}")
    else:
        exp = sorted({m["experts"] for m in moe["layers"]})
        shared = sum(1 for m in moe["layers"] if m["shared"])
        if moe.get("family"):
            rt = moe.get("routing") or {}
            how = rt.get("kind", "?") + f", {rt.get('scoring')}" + (" + score bias" if rt.get("bias") else "") \
                + (f", groups {rt['n_group']}/top {rt['topk_group']}" if rt.get("n_group") else "") \
                + (f", top-{rt['top_k']}" if rt.get("top_k") else "") + (", renormalised" if rt.get("renormalize") else "") \
                + (", per-expert scale" if rt.get("per_expert_scale") else "") \
                + (", ids from the token-id hash table" if rt.get("hash_routed") else "") \
                + (f", logits soft-capped at {rt['softcap']:g}" if rt.get("softcap") else "") \
                + (f", x{rt['scale']:g}" if rt.get("scale") not in (None, 1.0) else "") \
                + (f"; activation {(rt.get('activation') or {}).get('name')}" if rt.get("activation") else "")
            o.text(f"  family: {moe['family']} ({escape(moe.get('expert_naming') or '')}); routing {how}")
            for g in rt.get("by_layer") or []:
                o.text(f"    layers {','.join(map(str, g['layers']))}: {escape(g['routing'])}; {escape(g['activation'])}")
        if moe["layers"]:
            o.text(f"  MoE: {len(moe['layers'])} layers x {'/'.join(map(str, exp))} experts, {shared} with shared "
                   f"experts, {len(moe['routers'])} routers; {_counts(moe['roles']) or 'no quantised linears'}")
        else:
            o.text(f"  MoE: no quantised expert found ({len(moe['routers'])} routers)")
        for why, n in (moe.get("kept") or {}).items():
            o.text(f"  kept as is: {n} tensor(s), {why}")
        if moe.get("float_only"):
            o.text(f"  dequantised to bfloat16 (vLLM builds them unquantised): {len(moe['float_only'])} linear(s), "
                   f"e.g. {moe['float_only'][0]}")
        if moe.get("renamed_for_vllm"):
            o.text("  convert writes the expert and router names vLLM loads for this family")
    p = r["plan"]
    made = r.get("made_by")
    if made:
        o.text(f"  made by: int4pack {made['int4pack_version']} from {escape(str(made['source']))}"
               + f", written {made['written']}")
    if made and not p["ok"]:  # int4pack's own output that is no convert source: verify is its check
        o.text("  a converted output: `int4pack verify PATH --against SOURCE` checks it")
    elif p["ok"]:
        g = ", ".join(f"{s['scheme']} x {s['modules']}" for s in p["schemes"])
        o.text(f"  convert plan: target {g} module(s); paths {_counts(p['paths'])}")
    else:
        o.text(f"  convert plan: [red]refused[/red]: {p['refused']}")
        if p.get("hint"):
            o.text(f"  hint: {p['hint']}")
    full = o.verbosity >= 1  # the vLLM detail (the exception and where vLLM raises it) under -v
    for w in r.get("serving", []) if full else r.get("serving_notes", []) + r.get("model_notes", []):
        o.warning(w)
    ks = r["kleidiai_summary"]
    o.text(f"  KleidiAI ({'this checkpoint' if r['is_w4a8_output'] else 'after convert'}): {ks['kleidiai']} "
           f"module(s) take the KleidiAI path, {ks['fallback']} fall back to torch's float32 reference")
    mods = r["modules"]
    act = sum(1 for m in mods.values() if m["act_order"])
    # here: --help must not import the readers (numpy)
    from ..formats import value_kind
    from ..formats.float_source import VALUES

    def values(m: dict) -> str | None:  # what a module holds when it is not int4 values
        return value_kind(m["format"], m.get("bits", 4))

    other = Counter(values(m) for m in mods.values() if values(m))
    asym = sum(1 for m in mods.values() if not m["sym"] and not values(m))
    what = (f"{', '.join(f'{n} {k}' for k, n in sorted(other.items()))} (not int4 values, requantised by "
            "convert), " if other else "")
    o.text(f"  {len(mods)} {'quantised' if other else 'int4'} modules: {what}{asym} int4 asymmetric, {act} with "
           "act-order (g_idx)")
    # one row per distinct (role, shape, path, kleidiai): a 30B model has ~18k modules
    groups: dict[tuple, list] = {}
    for name, m in mods.items():
        sym = VALUES[m["format"]][0] if m["format"] in VALUES else values(m) or ("sym" if m["sym"] else "asym")
        key = (m["role"], m["format"], f"{m['n']}x{m['k']}", _groups(m), sym,
               "yes" if m["act_order"] else "-", m["scale_dtype"], m["path"] or "-",
               "yes" if m["kleidiai"] else m["kleidiai_reason"])
        groups.setdefault(key, []).append(name)
    ordered = sorted(groups.items(), key=lambda kv: kv[1][0])
    rows = [[*k[:8], len(v), "yes" if k[8] == "yes" else "no"] for k, v in ordered]
    o.table("Quantised modules", ["role", "format", "NxK", "group", "sym", "g_idx", "scale", "path", "count",
                                  "KleidiAI"], rows)
    for k, v in ordered:
        if k[8] != "yes":
            o.text(f"  [yellow]fallback[/yellow] {v[0]} (+{len(v) - 1}): {k[8]}")
        elif o.verbosity >= 1:
            o.text(f"  {k[0]} {k[2]} ({k[7]}): {v[0]} (+{len(v) - 1})")
    o.table("Every quantised module", ["module", "role", "NxK", "group", "path", "KleidiAI"],
            [[name, m["role"] or "-", f"{m['n']}x{m['k']}", _groups(m), m["path"] or "-",
              "yes" if m["kleidiai"] else "no"] for name, m in sorted(mods.items())], level=2)
    if o.verbosity >= 1:
        by_file: dict[str, list] = {}
        for t in r["tensors"]:
            by_file.setdefault(t["file"], []).append(t)
        for file, ts in sorted(by_file.items()):
            o.table(f"Tensors in {file}", ["name", "dtype", "shape", "bytes"],
                    [[t["name"], t["dtype"], t["shape"], human_bytes(t["bytes"])] for t in ts])
    else:
        o.text(f"  ({r['tensor_count']} tensors: -v lists them, -vv every module too, --json gives everything)")
    if "error" in moe:  # what a bug report about an unknown layout needs (-v lists every tensor)
        o.table("Tensor names (layer and expert numbers folded to N)", ["pattern", "count"],
                [[t["pattern"], t["count"]] for t in r.get("tensor_names", [])])
    sv = r.get("serve_format")
    if sv:
        o.text(f"  serve format: {sv['blobs']} KleidiAI blobs ({human_bytes(sv['blob_bytes'])}), layout {sv.get('layout')} "
               f"v{sv.get('layout_version')}, nr/kr/sr {sv.get('nr')}/{sv.get('kr')}/{sv.get('sr')}, group "
               f"{sv.get('group_size')} ({sv.get('scale_dtype')} scales); served by int4pack's vLLM plugin")
        tp = tensor_parallel_line(sv.get("tensor_parallel_size"))
        if tp:
            o.text(tp)


def _counts(counts: dict) -> str:
    """{'expert': 24, 'attention': 8} as people read it: '24 expert, 8 attention'."""
    return ", ".join(f"{n} {what}" for what, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _groups(m: dict) -> str:
    """The source's group and, before convert, the target group it gets: '32->ch' (ch: channel)."""
    def name(g):
        if not isinstance(g, int) or not isinstance(m.get("k"), int):
            return "?"  # unreadable (a packed blob without usable provenance: see kleidiai_reason)
        return "ch" if is_channel(g) or g >= m["k"] else str(g)
    g = m.get("target_group_size")
    return name(m["group_size"]) + ("" if g is None else f"->{name(g)}")


def _floats(xs: list) -> str:
    return "[" + ", ".join(f"{v:.4g}" for v in xs) + "]"


def _dump(o, r: dict) -> None:
    o.text(f"[bold]{r['tensor']}[/bold] {r.get('dtype', '')}{r.get('shape')} in {r.get('file')}")
    if "tile" in r:  # a KleidiAI blob
        o.text(f"  {r['layout']}, N={r['n']} K={r['k']} group {r['group_size']}; tiles {r['tile']}")
        o.table("First 8-row block", ["part", "offset", "bytes"],
                [[p["part"], p["offset"], p["bytes"]] for p in r["first_block"]])
        o.text(f"  row sums (block 0): {_floats(r['row_sums_block0'])}")
        if r["bias_block0"]:
            o.text(f"  bias (block 0): {_floats(r['bias_block0'])}")
        else:
            o.text("  bias: none (the module has none; the blob's bias part holds zeros)")
        o.table("Decoded q (rows 0.., k 0..7)", [f"k{i}" for i in range(len(r['window']['q'][0]))], r["window"]["q"])
        sc = r["window"]["scales"]
        grouped = r["layout"].startswith("group")
        o.table(f"Decoded scales (rows 0.., {'first groups' if grouped else 'one per row'})",
                [f"g{i}" for i in range(len(sc[0]))] if grouped else ["scale"],
                [[f"{v:.4g}" for v in row[: None if grouped else 1]] for row in sc])
        pv = r.get("provenance") or {}
        o.text("  provenance (shard header): " + ", ".join(f"{k} {v}" for k, v in sorted(pv.items())))
        return
    if "format" in r:
        o.text(f"  {r['format']}: N={r['n']} K={r['k']} group {r['group_size']}, "
               f"{'sym' if r['sym'] else 'asym'}, act-order {r['act_order']}")
    o.text(f"  layout: {escape(str(r.get('layout')))}")
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
