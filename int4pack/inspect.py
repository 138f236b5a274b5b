"""``inspect``: what a checkpoint is and what convert will do with it, from headers (plus the few
small tensors the verdicts need); and a layout dump of one tensor.

The summary reuses the readers' format verdict (GPTQ v1/v2 evidence included), the MoE discovery
and ``make_plan``'s per-module path prediction. For W4A8 outputs it says, per module, whether
``_dyn_quant_pack_4bit_weight`` takes the KleidiAI path or silently falls back, by the same rules
as torch's gate (docs/kleidiai.md §1.3). For the packed serving format (blobs.py) it shows the
recorded KleidiAI layout and each blob's shape, and dumps a blob's block structure.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

import torch

from . import blobs, kleidiai
from .serving import expert_layout
from .architectures import classify, discover, name_summary, vllm_module
from .sources.checkpoint import Checkpoint, resolve_source
from .sources.containers import open_checkpoint
from .errors import InputError, Int4packError, UsageError
from .families import family
from .families import family_warnings, unloadable_releases
from .groups import channel_group, groupwise_problem, is_channel, is_channelwise, scale_st_dtype
from .nibbles import AWQ_ORDER
from .serve_spec import PLAIN_MODULES, QUANT_METHOD, SUFFIX, read_record, record_problems
from .serving.vllm_compat import routing_warnings, serving_notes, serving_warnings
from .output_folder.writer import REPORT_NAME

__all__ = ["inspect", "kleidiai_gate", "nibble_map"]

_MAIN_SUFFIXES = ("qweight", "weight_packed", "weight")


def kleidiai_gate(k: int, group_size: int, scale_dtype: str) -> tuple[bool, str]:
    """Will torch's packer take KleidiAI for this [N, K] int4 matrix (on an Arm host with dotprod)?"""
    if is_channelwise(k, group_size):
        if scale_dtype != "F32":
            return False, f"channelwise needs float32 scales, got {scale_dtype}: silent float32 fallback"
        return True, "channelwise qsi4cxp (fp32 scales)"
    why = groupwise_problem(group_size, k)
    if why:
        return False, f"{why}: fallback/refused"
    if scale_dtype != "BF16":
        return False, f"groupwise needs bfloat16 scales, got {scale_dtype}: silent float32 fallback"
    return True, f"groupwise qsi4c32p, group {group_size} (bf16 scales)"


def _tensor_rows(ckpt: Checkpoint) -> list[dict]:
    return [{"name": n, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes, "file": t.file}
            for n, t in sorted(ckpt.tensors.items())]


def _head(ckpt: Checkpoint, label: str) -> dict:
    return {"path": label, "folder": str(ckpt.folder), "model_type": ckpt.model_type,
            "family_type": ckpt.family_type,
            # names with layer/expert numbers folded to N: what a bug report about a layout needs
            "tensor_names": [{"pattern": p, "count": c} for p, c in name_summary(ckpt.tensors)],
            "architectures": ckpt.config.get("architectures"), "shards": len(ckpt.shards),
            "tensor_count": len(ckpt.tensors), "bytes": sum(t.nbytes for t in ckpt.tensors.values()),
            "made_by": _made_by(ckpt)}


def _made_by(ckpt: Checkpoint) -> dict | None:
    """Which int4pack made this output and from which source (its report), and when the report was
    written (its modification time: the file itself holds no date, so that a conversion's bytes are
    the same on every run), or None for a folder int4pack did not write."""
    path = ckpt.folder / REPORT_NAME
    try:
        rep = json.loads(path.read_text())
        written = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    except (OSError, ValueError):
        return None
    if not isinstance(rep, dict) or "int4pack_version" not in rep:
        return None
    return {"int4pack_version": rep.get("int4pack_version"), "source": rep.get("source"), "written": written}


def _moe(ckpt: Checkpoint, linears: list[str], split=frozenset()) -> tuple[dict, dict]:
    """(the MoE structure for the summary, module -> role); ``split``: fused tensors the reader splits."""
    try:
        lay = discover(ckpt.family_type, ckpt.text_config, sorted(linears),
                       sorted(t for t in ckpt.tensors if t not in split))
    except Int4packError as e:
        return {"error": str(e), "hint": e.hint}, {}
    fam = family(ckpt.family_type)
    return ({"family": lay.family, "model_types": list(fam.model_types) if fam else [],
             "expert_naming": ckpt.expert_layout or (fam.experts if fam else None), "routing": lay.routing, "kept": lay.kept,
             "float_only": sorted(m for m, r in lay.roles.items() if r == "float_only"),
             "renamed_for_vllm": bool(fam and fam.renames),
             "layers": [{"prefix": m.prefix, "experts": m.num_experts, "router": m.router,
                         "shared": sorted(m.shared.values()), "shared_gate": m.shared_gate} for m in lay.moe_layers],
             "routers": lay.routers, "roles": lay.counts()}, lay.roles)


def _packed_summary(ckpt: Checkpoint, label: str, rec: dict) -> dict:
    """The summary of a packed serving checkpoint: its recorded layout and one row per blob."""
    pw = blobs.PackedWeights(ckpt, rec)
    out = _head(ckpt, label)
    out["format"] = {"format": QUANT_METHOD, "detail": f"KleidiAI-packed W4A8, {rec.get('layout')} "
                     f"v{rec.get('layout_version')}, nr/kr/sr {rec.get('nr')}/{rec.get('kr')}/{rec.get('sr')}",
                     "evidence": [], "warnings": record_problems(rec)}
    out["quantization_config"] = ckpt.quant_config
    out["serve_format"] = {**rec, "blobs": len(pw.modules),
                           "blob_bytes": sum(ckpt.tensors[f"{m}.{SUFFIX}"].nbytes for m in pw.modules)}
    out["moe"], roles = _moe(ckpt, pw.modules)
    out["plan"] = {"ok": False, "refused": f"a packed serving checkpoint ({QUANT_METHOD}) is not a convert source",
                   "hint": "Convert the original int4 checkpoint instead.", "exit_code": 4}
    mods = {}
    for m in pw.modules:
        try:
            n, k = pw.shape(m)
        except InputError as e:
            mods[m] = {"role": roles.get(m) or classify(m)[0], "format": "kleidiai", "n": None, "k": None,
                       "group_size": None, "sym": True, "act_order": False, "scale_dtype": None, "path": None,
                       "kleidiai": False, "kleidiai_reason": str(e)}
            continue
        g = pw.group(m)
        chan = is_channel(g)
        mods[m] = {"role": roles.get(m) or classify(m)[0], "format": "kleidiai", "n": n, "k": k, "group_size": g,
                   "sym": True, "act_order": False, "scale_dtype": scale_st_dtype(g),
                   "bias": bool(pw.prov[f"{m}.{SUFFIX}"].get("bias")), "path": "packed",
                   "bytes": ckpt.tensors[f"{m}.{SUFFIX}"].nbytes, "kleidiai": True,
                   "kleidiai_reason": "packed " + ("channelwise qsi4cxp (fp32 scales)" if chan else
                                                   f"groupwise qsi4c32p, group {g} (bf16 scales)")}
    mods.update(_plain_rows(ckpt, rec, roles))
    out["modules"] = dict(sorted(mods.items()))
    out["tensors"] = _tensor_rows(ckpt)
    out["is_w4a8_output"] = True
    gs = {m["group_size"] for m in mods.values() if m["group_size"] is not None}
    skip = unloadable_releases(ckpt.family_type)
    out["model_warnings"] = (routing_warnings(ckpt.family_type, ckpt.text_config, packed=True)
                             + family_warnings(ckpt.family_type, ckpt.text_config, packed=True))
    out["model_notes"] = (routing_warnings(ckpt.family_type, ckpt.text_config, packed=True, short=True)
                          + family_warnings(ckpt.family_type, ckpt.text_config, packed=True))  # as the terminal shows them
    out["serving"] = serving_warnings(gs, skip) + out["model_warnings"]
    out["serving_notes"] = serving_notes(gs, skip)  # the same, one short line per release
    out["kleidiai_summary"] = {"kleidiai": sum(1 for m in mods.values() if m["kleidiai"]),
                               "fallback": sum(1 for m in mods.values() if not m["kleidiai"])}
    return out


def _plain_rows(ckpt: Checkpoint, rec: dict, roles: dict) -> dict:
    """The rows of a packed checkpoint's modules kept as plain W4A8 (the record's plain_modules,
    named by vLLM module): KleidiAI could not pack them, vLLM packs their int8 weights at load."""
    why = rec.get(PLAIN_MODULES) if isinstance(rec.get(PLAIN_MODULES), dict) else {}
    rows = {}
    for name in sorted(ckpt.tensors):
        if not name.endswith(".weight_scale"):
            continue
        m = name[: -len(".weight_scale")]
        w, sc = ckpt.tensors.get(f"{m}.weight"), ckpt.tensors[name]
        if w is None or len(w.shape) != 2 or len(sc.shape) != 2:
            continue
        n, k = w.shape
        chan = sc.dtype == "F32" and sc.shape[1] == 1
        reason = why.get(vllm_module(m, ckpt.family_type))
        rows[m] = {"role": roles.get(m) or classify(m)[0], "format": "int-quantized", "n": n, "k": k,
                   "group_size": -1 if chan else k // max(1, sc.shape[1]), "sym": True, "act_order": False,
                   "scale_dtype": sc.dtype, "bias": f"{m}.bias" in ckpt.tensors, "path": "plain",
                   "bytes": w.nbytes + sc.nbytes, "kleidiai": False,
                   "kleidiai_reason": (f"plain W4A8, packed by vLLM at load: {reason}" if reason else
                                       f"plain W4A8 without a reason in quantization_config.kleidiai."
                                       f"{PLAIN_MODULES}: the int4pack-kleidiai plugin expects a blob for it")}
    return rows


def _summary(ckpt: Checkpoint, label: str) -> dict:
    from .formats import open_reader
    from .plan import make_plan

    rec = read_record(ckpt.quant_config)
    if rec is not None:
        return _packed_summary(ckpt, label, rec)
    out = _head(ckpt, label)
    specs: dict = {}
    try:
        reader = open_reader(ckpt)
        out["format"] = reader.verdict().to_dict()
        # an output in a model class's own per-expert layout (gpt-oss): its modules as int4pack names them
        specs = expert_layout.output_specs(ckpt) if reader.name != "mxfp4" else {}
        if specs:
            out["format"]["detail"] += ", experts per expert as gpt-oss's vLLM loader takes them (transposed, " \
                                       "gate then up in gate_up_proj)"
        specs = specs or reader.linears()
    except Int4packError as e:
        out["format"] = {"format": "none" if ckpt.quant_config is None else "unknown", "detail": str(e),
                         "evidence": [], "warnings": []}
    out["quantization_config"] = ckpt.quant_config
    split = reader.split_tensors() if specs and hasattr(reader, "split_tensors") else frozenset()
    out["moe"], roles = _moe(ckpt, list(specs), split)
    try:
        if out["format"].get("detail", "").endswith("gate then up in gate_up_proj)"):
            raise InputError("a W4A8 output in gpt-oss's per-expert layout is not a convert source",
                             hint="Convert the original MXFP4 checkpoint; int4pack verify checks this one.")
        plan = make_plan(ckpt, source_label=label)
        paths = {m: p for j in plan.jobs for m, p in j.paths.items()}
        out["plan"] = {"ok": True, "group_size": plan.group_size, "paths": plan.path_counts(),
                       "scale_dtype": None if plan.group_size is None else scale_st_dtype(plan.group_size),
                       "schemes": plan.summary()["schemes"]}
    except Int4packError as e:
        paths, plan = {}, None
        out["plan"] = {"ok": False, "refused": str(e), "hint": e.hint, "exit_code": e.exit_code}
    is_output = out["format"].get("ct_format") == "int-quantized"
    mods = {}
    for name, s in sorted(specs.items()):
        rec = {"role": roles.get(name), "format": s.fmt, "n": s.n, "k": s.k, "bits": s.bits, "group_size": s.group_size,
               "sym": s.sym, "act_order": s.act_order, "scale_dtype": s.scale_dtype, "bias": s.has_bias,
               # int4pack's own output that is no convert source: no path to predict, nothing refused
               "path": paths.get(name, "refused" if out["plan"].get("refused") and not out["made_by"] else None)}
        if s.refused:
            rec["refused"] = s.refused
        if is_output:
            ok, why = kleidiai_gate(s.k, s.group_size, s.scale_dtype)
        elif plan is not None and name in plan.groups:
            g = rec["target_group_size"] = plan.groups[name]
            ok, why = kleidiai_gate(s.k, g, scale_st_dtype(g))
            why = "after convert: " + why
        elif plan is not None:
            ok, why = None, f"after convert: {rec['path']} (not W4A8)"
        else:
            ok, why = None, "no plan"
        rec["kleidiai"] = ok
        rec["kleidiai_reason"] = why
        mods[name] = rec
    out["modules"] = mods
    out["tensors"] = _tensor_rows(ckpt)
    out["is_w4a8_output"] = is_output
    g_out = ({channel_group(m["k"], m["group_size"]) for m in mods.values()} if is_output
             else set(plan.schemes()) if plan else set())
    # measured vLLM releases that fail on this output (or the output convert writes by default)
    skip = unloadable_releases(ckpt.family_type)
    # the model class or its routing: printed in full, whatever the dtype
    out["model_warnings"] = (routing_warnings(ckpt.family_type, ckpt.text_config, packed=False)
                             + family_warnings(ckpt.family_type, ckpt.text_config))
    out["model_notes"] = (routing_warnings(ckpt.family_type, ckpt.text_config, packed=False, short=True)
                          + family_warnings(ckpt.family_type, ckpt.text_config))  # as the terminal shows them
    out["serving"] = serving_warnings(g_out, skip) + out["model_warnings"]
    out["serving_notes"] = serving_notes(g_out, skip)
    counts = {"kleidiai": sum(1 for m in mods.values() if m["kleidiai"]),
              "fallback": sum(1 for m in mods.values() if m["kleidiai"] is False)}
    out["kleidiai_summary"] = counts
    return out


# --------------------------------------------------------------------------------- tensor dump


def nibble_map(fmt: str, shape: tuple[int, ...], words: int = 2) -> list[dict]:
    """Which logical (n, k) each nibble of the first ``words`` 32-bit words holds, by format.

    gptq qweight [K/8, N]: word [r, c] nibble i -> k = 8r + i, n = c (packed along K);
    awq qweight [K, N/8]: word [r, c] nibble i -> k = r, n = 8c + AWQ_ORDER[i] (along N, interleaved);
    ct weight_packed [N, K/8]: word [r, c] nibble i -> n = r, k = 8c + i (along K).
    """
    cols = shape[1]
    out = []
    for w in range(words):
        r, c = divmod(w, cols)
        if r >= shape[0]:
            break
        for i in range(8):
            if fmt == "gptq":
                n, k = c, 8 * r + i
            elif fmt == "awq":
                n, k = 8 * c + AWQ_ORDER[i], r
            else:
                n, k = r, 8 * c + i
            out.append({"word": [r, c], "nibble": i, "bits": f"{4 * i}..{4 * i + 3}", "byte": 4 * w + i // 2,
                        "half": "low" if i % 2 == 0 else "high", "n": n, "k": k})
    return out


def _module_and_key(ckpt: Checkpoint, tensor: str) -> tuple[str, str]:
    if tensor in ckpt.tensors:
        mod, _, leaf = tensor.rpartition(".")
        return mod, leaf
    for suf in _MAIN_SUFFIXES:
        if f"{tensor}.{suf}" in ckpt.tensors:
            return tensor, suf
    near = [n for n in ckpt.tensors if tensor in n][:5]
    if not near:  # a typo: the names closest in spelling
        import difflib

        near = difflib.get_close_matches(tensor, list(ckpt.tensors), n=3, cutoff=0.8)
    # the argument names something the checkpoint lacks: a usage error, as verify --layers 7 on 2 layers
    raise UsageError(f"tensor {tensor!r} not found in {ckpt.folder}", tensor=tensor,
                     hint=("Close matches: " + ", ".join(near)) if near else "List the tensors with inspect PATH -v.")


def _window(t: torch.Tensor, rows: int = 8, cols: int = 8) -> list[list]:
    return t[:rows, :cols].tolist()


# the int4 layouts whose words the dump maps nibble by nibble (nibble_map), by LinearSpec.fmt; another
# format's module is shown as its reader unpacks it, so a new reader needs no line here
_NIBBLE_MAPS = {"gptq": "gptq", "awq": "awq", "ct-pack": "ct", "ct-int": "ct-int"}


def _dump(ckpt: Checkpoint, tensor: str, rows: int, cols: int, quantised: bool = True) -> dict:
    """``quantised`` False: the checkpoint has no int4 reader (the packed serving format)."""
    from .formats import open_reader

    mod, leaf = _module_and_key(ckpt, tensor)
    info = ckpt.tensors[f"{mod}.{leaf}"]
    out: dict = {"tensor": info.name, "dtype": info.dtype, "shape": list(info.shape), "bytes": info.nbytes,
                 "file": info.file, "module": mod}
    reader = open_reader(ckpt) if quantised else None
    spec = reader.linears().get(mod) if reader else None
    if spec is None:
        t = ckpt.get(info.name)
        out["layout"] = "plain (not a quantised module)"
        out["window"] = _window(t.float().reshape(t.shape[0], -1) if t.dim() > 1 else t.float().reshape(1, -1),
                                rows, cols)
        return out
    ql = reader.read(spec)
    if ql.dense is not None:  # a module read as its float values (8-bit, float, not int4): no nibbles to map
        out.update(format=spec.fmt, n=spec.n, k=spec.k, bits=spec.bits, layout=f"{spec.bits}-bit source read as its "
                   "float values (requantised or kept in bf16 by convert)", window=_window(ql.dense, rows, cols))
        return out
    fmt = _NIBBLE_MAPS.get(spec.fmt)
    out.update(format=spec.fmt, n=spec.n, k=spec.k, group_size=spec.group_size, sym=spec.sym,
               act_order=spec.act_order)
    codes = ql.codes
    z = ql.zeros
    if fmt is None:  # a format whose words this dump does not map: its codes as its reader unpacks them
        out["layout"] = f"{spec.fmt}: the int4 codes as its reader unpacks them (no word map drawn for it)"
    elif leaf in ("qweight", "weight_packed") and info.dtype == "I32":
        words = ckpt.get(info.name)
        nm = nibble_map(fmt, tuple(info.shape))
        for ent in nm:
            r, c = ent["word"]
            u = (int(words[r, c]) & 0xFFFFFFFF) >> (4 * ent["nibble"]) & 0xF
            ent["raw"] = u
            ent["word_hex"] = f"0x{int(words[r, c]) & 0xFFFFFFFF:08x}"
            gi = int(ql.group_index()[ent["k"]])
            zp = 8 if z is None else int(z[ent["n"], gi])
            ent["q"] = u - zp
            ent["zero"] = zp
        out["layout"] = {"gptq": "int32 [K/8, N], packed along K: nibble i of word [r, n] is k = 8r + i",
                         "awq": "int32 [K, N/8], packed along N with AWQ order [0,2,4,6,1,3,5,7]: nibble i of "
                                "word [k, j] is n = 8j + order[i]",
                         "ct": "int32 [N, K/8], packed along K: nibble i of word [n, j] is k = 8j + i"}[fmt]
        out["nibbles"] = nm
    elif info.dtype == "I8":
        out["layout"] = "int8 [N, K], one int4 value in [-8, 7] per byte (compressed-tensors int-quantized)"
    gi = ql.group_index()
    zz = 8 if z is None else z.to(torch.int16)[:rows][:, gi[:cols]]
    q = codes[:rows, :cols].to(torch.int16) - zz
    out["window"] = {"rows": f"n 0..{min(rows, spec.n) - 1}", "cols": f"k 0..{min(cols, spec.k) - 1}",
                     "q": q.tolist(),
                     "group_of_k": gi[:cols].tolist(),
                     "scales": ql.scales.float()[:rows][:, gi[:cols]].tolist(),
                     "zeros": None if z is None else z[:rows][:, gi[:cols]].tolist()}
    return out


def _dump_blob(pw: blobs.PackedWeights, m: str, rows: int) -> dict:
    """Block structure of a KleidiAI blob of the packed serving format, decoded with kleidiai.unpack."""
    name = f"{m}.{SUFFIX}"
    info = pw.ckpt.tensors[name]
    n, k = pw.shape(m)
    g = pw.block(m)
    blob = pw.blob(m)
    q, s, bias = pw.decode(m, blob, check=False)
    per_block = blob.numel() // (-(-n // kleidiai.NR))
    raw = blob[:per_block]
    chan = kleidiai.is_channelwise(k, g)
    if chan:
        dlen = -(-k // 32) * 32 // 2 * 8
        parts = [("data", 0, dlen), ("row sums int32 x16", dlen, 32), ("scales fp32 /16", dlen + 32, 32),
                 ("bias fp32", dlen + 64, 32)]
        sums = raw[dlen:dlen + 32].contiguous().view(torch.int32).tolist()
    else:
        nb = k // g
        dl = g // 2 * 8
        parts = [(f"quant block {b}: data", b * (dl + 16), dl) for b in range(min(nb, 3))]
        parts += [(f"quant block {b}: 8 bf16 scales", b * (dl + 16) + dl, 16) for b in range(min(nb, 3))]
        off = nb * (dl + 16)
        parts += [("row sums fp32 (sum q*scale)", off, 32), ("bias fp32", off + 32, 32)]
        sums = raw[off:off + 32].contiguous().view(torch.float32).tolist()
    return {"tensor": name, "dtype": info.dtype, "file": info.file, "shape": list(info.shape), "n": n, "k": k,
            "group_size": pw.group(m), "layout": "channelwise qsi4cxp" if chan else "groupwise qsi4c32p",
            "provenance": pw.prov[name],
            "tile": {"nr": kleidiai.NR, "kr": kleidiai.KR, "sr": kleidiai.SR, "rows_per_block": kleidiai.NR,
                     "blocks": -(-n // kleidiai.NR), "bytes_per_block": per_block},
            "first_block": [{"part": p, "offset": o, "bytes": b} for p, o, b in sorted(parts, key=lambda x: x[1])],
            "first_bytes_hex": raw[:16].tolist(),
            "row_sums_block0": sums, "bias_block0": [] if bias is None else bias[:8].tolist(),
            "window": {"q": q[:rows, :8].tolist(), "scales": s.float()[:rows, :2].tolist()}}


def _with_conversion(ckpt: Checkpoint, out: dict) -> dict:
    """An int4pack output: the source format its shards record (``converted_from``: e.g. "quantised from
    float, data-free") and, where its report is beside it, each module's error against the source and
    plain RTN's (``rel_l2``, ``baseline_rel_l2``)."""
    import json

    from .output_folder.writer import REPORT_NAME

    meta = next((m for m in ckpt.shard_metadata.values() if "int4pack.source_format" in (m or {})), None)
    if meta is None:
        return out
    try:
        out["converted_from"] = json.loads(meta["int4pack.source_format"])
        report = ckpt.folder / REPORT_NAME
        errors = json.loads(report.read_text()).get("modules", {}) if report.is_file() else {}
    except (ValueError, OSError, AttributeError):
        return out  # a damaged record: inspect shows the rest; verify checks the output
    for m, rec in out.get("modules", {}).items():
        e = errors.get(m) if isinstance(errors, dict) else None
        if isinstance(e, dict) and e.get("rel_l2") is not None:
            rec["rel_l2"], rec["baseline_rel_l2"] = e.get("rel_l2"), e.get("baseline_rel_l2")
    return out


def inspect(path, tensor: str | None = None, *, revision: str | None = None, rows: int = 8, cols: int = 8) -> dict:
    """Summary of a checkpoint (``tensor`` None) or a layout dump of one tensor / module."""
    folder = resolve_source(path, revision=revision)
    with open_checkpoint(folder) as ckpt:
        if tensor is None:
            return _with_conversion(ckpt, _summary(ckpt, str(path)))
        rec = read_record(ckpt.quant_config)
        if rec is not None:
            m = tensor[: -len(SUFFIX) - 1] if tensor.endswith(f".{SUFFIX}") else tensor
            if f"{m}.{SUFFIX}" in ckpt.tensors:
                return _dump_blob(blobs.PackedWeights(ckpt, rec), m, rows)
            return _dump(ckpt, tensor, rows, cols, quantised=False)
        return _dump(ckpt, tensor, rows, cols)
