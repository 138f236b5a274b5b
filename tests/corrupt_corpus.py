#!/usr/bin/env python3
"""Corrupted int4pack outputs, made by code from real conversions of the fixtures.

Every case is a copy of a converted checkpoint (packed ``--serve-format kleidiai`` or the default
compressed-tensors output) with one thing wrong, and most are *consistent* forgeries: after the
edit, the shard checksums in int4pack_report.json are recomputed (``reseal``), and where a blob
was replaced its provenance CRCs and the layout record's ``blob_checks`` are rewritten to match,
so only a comparison with the source (or the bytes convert wrote) can tell.

    from corrupt_corpus import build
    cases = build(dest, sources)   # -> {name: Case}; sources: {"packed": Path, "plain": Path, ...}

``Case.folder`` is the damaged checkpoint, ``Case.plugin`` True for the same-size corruptions the
vLLM plugin must refuse at load (tests/vllm/trust_check.py runs those under QEMU).
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = ["Case", "build", "reseal", "edit_tensors", "edit_config", "repack", "bump", "one_int"]

L0 = "model.layers.0.mlp.experts"
L1 = "model.layers.1.mlp.experts"
SUF = "weight_packed"


@dataclass
class Case:
    name: str
    what: str
    folder: Path
    base: str  # the source key it was derived from (build's ``sources``)
    plugin: bool = False  # a same-size corruption the plugin refuses at load


def _crc(t: torch.Tensor) -> str:
    return f"{zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy()):08x}"


def edit_tensors(folder: Path, edit) -> None:
    """edit(tensors, meta) -> True to rewrite a shard (tensors and header metadata as dicts)."""
    idx_path = folder / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text()) if idx_path.is_file() else None
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            meta, tensors = dict(fh.metadata() or {}), {k: fh.get_tensor(k) for k in fh.keys()}
        if edit(tensors, meta):
            save_file(tensors, str(f), metadata=meta)
            if idx is not None:
                idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if v != f.name or k in tensors}
                idx["weight_map"].update(dict.fromkeys(tensors, f.name))
    if idx is not None:
        idx_path.write_text(json.dumps(idx))


def edit_config(folder: Path, edit) -> None:
    p = folder / "config.json"
    cfg = json.loads(p.read_text())
    edit(cfg)
    p.write_text(json.dumps(cfg, indent=2))


def edit_report(folder: Path, edit) -> None:
    p = folder / "int4pack_report.json"
    rep = json.loads(p.read_text())
    edit(rep)
    p.write_text(json.dumps(rep))


def reseal(folder: Path) -> None:
    """Recompute every shard checksum int4pack_report.json records: what a forger can always do."""
    from int4pack.output_folder.writer import hash_shard

    def fix(rep):
        for shard, rec in rep["shards"].items():
            got = hash_shard(folder / shard, rec.get("data_digest"))
            rec.update(got)

    edit_report(folder, fix)


def _provenance(meta: dict) -> dict:
    return json.loads(meta["int4pack.tensors"])


def _set_prov(meta: dict, ents: dict) -> None:
    meta["int4pack.tensors"] = json.dumps(ents, sort_keys=True, separators=(",", ":"))


def _sync_checks(folder: Path) -> None:
    """Rewrite the layout record's blob_checks from the blobs as they now are (a consistent forgery)."""
    from int4pack import serve_spec
    from int4pack import blobs

    prov = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            ents = json.loads((fh.metadata() or {}).get("int4pack.tensors", "{}"))
            for k in fh.keys():
                if k.endswith(f".{SUF}") and isinstance(ents.get(k, {}).get("packed"), dict):
                    p = dict(ents[k]["packed"])
                    p["crc32"] = _crc(fh.get_tensor(k))
                    prov[k[: -len(SUF) - 1]] = p

    def fix(cfg):
        cfg["quantization_config"]["kleidiai"][serve_spec.BLOB_CHECKS] = blobs.blob_checks(prov)

    edit_config(folder, fix)


def _swap(a: str, b: str, with_provenance: bool):
    def edit(t, meta):
        if a not in t or b not in t:
            return False
        t[a], t[b] = t[b].clone(), t[a].clone()
        if with_provenance and "int4pack.tensors" in meta:
            ents = _provenance(meta)
            if a in ents and b in ents:
                ents[a], ents[b] = ents[b], ents[a]
                _set_prov(meta, ents)
        return True
    return edit


def _copy(folder: Path, base: Path, name: str) -> Path:
    dst = folder / name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(base, dst)
    return dst


def _packed_cases(dest: Path, base: Path, channel: Path | None) -> list[Case]:
    cases = []

    def case(name, what, fn, plugin=False, seal=True, sync=False, on="packed"):
        f = _copy(dest, base if on == "packed" else channel, f"packed_{name}")
        fn(f)
        if sync:
            _sync_checks(f)
        if seal:
            reseal(f)
        cases.append(Case(f"packed_{name}", what, f, on, plugin))

    gate0, up0, down0 = (f"{L0}.0.{p}.{SUF}" for p in ("gate_proj", "up_proj", "down_proj"))

    def flip(f):
        def edit(t, meta):
            if gate0 not in t:
                return False
            b = t[gate0].clone()
            b[5] ^= 0x01
            t[gate0] = b
            return True
        edit_tensors(f, edit)

    case("flip_byte", "one bit of an expert blob flipped", flip, plugin=True)
    case("swap_experts", "experts 0 and 1 swapped (blobs only)",
         lambda f: edit_tensors(f, _swap(gate0, f"{L0}.1.gate_proj.{SUF}", False)), plugin=True)
    case("swap_experts_consistent", "experts 0 and 1 swapped with their provenance and blob checks",
         lambda f: edit_tensors(f, _swap(gate0, f"{L0}.1.gate_proj.{SUF}", True)), sync=True)
    case("gate_up_swap", "an expert's gate and up blobs swapped with their provenance",
         lambda f: edit_tensors(f, _swap(gate0, up0, True)), plugin=True)
    case("other_layer", "a blob of layer 1 in layer 0, provenance and blob checks rewritten",
         lambda f: _other_layer(f), sync=True)
    if channel is not None:
        case("k2g_as_channel", "a group-32 blob (K = 2 x 32) in place of a channelwise one of the same size",
             lambda f: _graft(f, base, down0, provenance=False), plugin=True, on="packed_channel")
        case("k2g_as_channel_consistent", "the same, its provenance and blob checks rewritten to match",
             lambda f: _graft(f, base, down0, provenance=True), sync=True, on="packed_channel")
    for field, value in (("n", None), ("n", "64"), ("n", 1.5), ("k", -3), ("group_size", 96), ("bias", "no"),
                         ("crc32_q", 7)):
        case(f"prov_{field}_{str(value).replace('.', '_')}", f"provenance field {field} set to {value!r}",
             lambda f, field=field, value=value: _edit_prov(f, gate0, field, value))
    case("prov_missing", "a blob's provenance entry removed", lambda f: _edit_prov(f, gate0, None, None))
    case("prov_not_json", "a shard's provenance header not JSON", lambda f: _prov_garbage(f))
    case("prov_group_doubled", "every provenance group doubled", lambda f: _prov_all(f, "group_size", 2))
    case("config_group_doubled", "the config group size doubled", lambda f: edit_config(f, _double_group), seal=False)
    case("config_channel", "the config scheme made channelwise (same blob size for K = 2g)",
         lambda f: edit_config(f, _to_channel), seal=False)
    for field, value in (("group_size", 64), ("group_size", "32"), ("scale_dtype", "float32"),
                         ("layout_version", 99), ("nr", 4)):
        case(f"record_{field}_{value}", f"layout record {field} set to {value!r}",
             lambda f, field=field, value=value: edit_config(
                 f, lambda c: c["quantization_config"]["kleidiai"].__setitem__(field, value)), seal=False)
    case("record_checks_edited", "one recorded blob CRC changed", lambda f: edit_config(f, _edit_check), seal=False)
    case("record_checks_garbage", "the blob_checks record not an object",
         lambda f: edit_config(f, lambda c: c["quantization_config"]["kleidiai"].__setitem__("blob_checks", 5)),
         seal=False)
    case("forged_report", "an expert's values changed, blob repacked with matching provenance and checks, its "
         "rel_l2 in the report raised", lambda f: _forge_packed(f, gate0), sync=True)
    return cases


def _graft(f: Path, other: Path, name: str, provenance: bool) -> None:
    with safe_open(str(next(p for p in sorted(other.glob("*.safetensors")) if _holds(p, name))), "pt") as fh:
        blob, ent = fh.get_tensor(name), json.loads(fh.metadata()["int4pack.tensors"])[name]

    def edit(t, meta):
        if name not in t:
            return False
        assert t[name].shape == blob.shape, "the grafted blob must have the same size"
        t[name] = blob.clone()
        if provenance:
            ents = _provenance(meta)
            ents[name] = {**ents[name], "packed": {**ent["packed"], "group_size": -1}}
            _set_prov(meta, ents)
        return True

    edit_tensors(f, edit)


def _holds(p: Path, name: str) -> bool:
    with safe_open(str(p), "pt") as fh:
        return name in fh.keys()


def _other_layer(f: Path) -> None:
    a = f"{L0}.0.gate_proj.{SUF}"
    b = f"{L1}.0.gate_proj.{SUF}"
    src = {}

    def grab(t, meta):
        if b in t:
            src["blob"] = t[b].clone()
            src["prov"] = _provenance(meta).get(b)
        return False

    edit_tensors(f, grab)

    def put(t, meta):
        if a not in t:
            return False
        t[a] = src["blob"]
        ents = _provenance(meta)
        ents[a] = src["prov"]
        _set_prov(meta, ents)
        return True

    edit_tensors(f, put)


def _edit_prov(f: Path, name: str, field, value) -> None:
    def edit(t, meta):
        if name not in t:
            return False
        ents = _provenance(meta)
        if field is None:
            ents[name].pop("packed")
        elif value is None:
            ents[name]["packed"].pop(field)
        else:
            ents[name]["packed"][field] = value
        _set_prov(meta, ents)
        return True
    edit_tensors(f, edit)


def _prov_all(f: Path, field: str, factor: int) -> None:
    def edit(t, meta):
        ents = _provenance(meta)
        for e in ents.values():
            if isinstance(e.get("packed"), dict):
                e["packed"][field] = e["packed"][field] * factor
        _set_prov(meta, ents)
        return True
    edit_tensors(f, edit)


def _prov_garbage(f: Path) -> None:
    def edit(t, meta):
        meta["int4pack.tensors"] = "{not json"
        return True
    edit_tensors(f, edit)


def _double_group(cfg: dict) -> None:
    for g in cfg["quantization_config"]["config_groups"].values():
        if g["weights"].get("group_size"):
            g["weights"]["group_size"] *= 2


def _to_channel(cfg: dict) -> None:
    for g in cfg["quantization_config"]["config_groups"].values():
        g["weights"].update(strategy="channel", group_size=None)


def _edit_check(cfg: dict) -> None:
    ent = cfg["quantization_config"]["kleidiai"]["blob_checks"]["modules"][L0]
    c = ent["crc32"][0][0]
    ent["crc32"][0][0] = f"{int(c, 16) ^ 1:08x}"


def repack(name: str, change):
    """An edit_tensors editor: blob ``name``'s int4 values replaced by ``change(q)`` and repacked,
    with honest provenance (a consistent forgery; _sync_checks then rewrites the blob checks)."""
    from int4pack import kleidiai
    from int4pack import serve_spec

    def edit(t, meta):
        if name not in t:
            return False
        ents = _provenance(meta)
        p = ents[name]["packed"]
        n, k, g = p["n"], p["k"], p["group_size"]
        block = k if g in (-1, k) else g
        q, s, b = kleidiai.unpack(t[name], n, k, block, bool(p.get("bias")), check=False)
        q = change(q.clone()).contiguous()
        t[name] = kleidiai.pack_portable(q, s, b, block, threads=1)
        ents[name]["packed"] = {**serve_spec.provenance(q, s, b, g, t[name])}
        _set_prov(meta, ents)
        return True
    return edit


def bump(q: torch.Tensor, at: int = 37) -> torch.Tensor:
    """One int4 value moved by one step (staying in [-8, 7]), in place."""
    flat = q.view(-1)
    flat[at] = flat[at] + 1 if int(flat[at]) < 7 else flat[at] - 1
    return q


def one_int(name: str, packed: bool):
    """An edit_tensors editor: one int4 value of ``name`` (a blob, or a plain int8 weight) moved by one step."""
    if packed:
        return repack(name, bump)
    return lambda t, meta: name in t and bump(t[name]) is not None


def _forge_packed(f: Path, name: str) -> None:
    """Replace an expert's int4 values by others (a 72 % error), repacked with honest provenance."""
    edit_tensors(f, repack(name, lambda q: torch.roll(q, 1, dims=1)))  # the right values in the wrong places
    edit_report(f, lambda r: r["modules"][name[: -len(SUF) - 1]].__setitem__("rel_l2", "0.9"))


def _plain_cases(dest: Path, base: Path) -> list[Case]:
    cases = []

    def case(name, what, fn, seal=True):
        f = _copy(dest, base, f"plain_{name}")
        fn(f)
        if seal:
            reseal(f)
        cases.append(Case(f"plain_{name}", what, f, "plain"))

    w0 = f"{L0}.0.gate_proj.weight"

    def flip(f):
        def edit(t, meta):
            if w0 not in t:
                return False
            w = t[w0].clone()
            w[0, 0] = 7 if int(w[0, 0]) != 7 else -8
            t[w0] = w
            return True
        edit_tensors(f, edit)

    case("flip_value", "one int4 value changed", flip)
    case("swap_experts", "experts 0 and 1 swapped (weights and scales)", lambda f: edit_tensors(f, _swap_pair(
        f"{L0}.0.gate_proj", f"{L0}.1.gate_proj")))
    case("gate_up_swap", "gate and up of an expert swapped", lambda f: edit_tensors(f, _swap_pair(
        f"{L0}.0.gate_proj", f"{L0}.0.up_proj")))
    case("other_layer", "an expert of layer 1 in layer 0", lambda f: _plain_other_layer(f))
    case("config_group_doubled", "the config group size doubled", lambda f: edit_config(f, _double_group), seal=False)
    case("forged_report", "an expert's values rolled, its rel_l2 in the report raised",
         lambda f: _forge_plain(f, f"{L0}.0.gate_proj"))
    case("scale_dtype", "an expert's scales stored as float32", lambda f: edit_tensors(f, _retype(
        f"{L0}.0.gate_proj.weight_scale", torch.float32)))
    case("planted_tensor", "a tensor the source does not have", lambda f: edit_tensors(f, _plant))
    return cases


def _swap_pair(a: str, b: str):
    def edit(t, meta):
        done = False
        for leaf in ("weight", "weight_scale"):
            x, y = f"{a}.{leaf}", f"{b}.{leaf}"
            if x in t and y in t:
                t[x], t[y] = t[y].clone(), t[x].clone()
                done = True
        return done
    return edit


def _plain_other_layer(f: Path) -> None:
    a, b = f"{L0}.0.gate_proj", f"{L1}.0.gate_proj"
    got = {}

    def grab(t, meta):
        for leaf in ("weight", "weight_scale"):
            if f"{b}.{leaf}" in t:
                got[leaf] = t[f"{b}.{leaf}"].clone()
        return False

    edit_tensors(f, grab)

    def put(t, meta):
        done = False
        for leaf in ("weight", "weight_scale"):
            if f"{a}.{leaf}" in t:
                t[f"{a}.{leaf}"] = got[leaf]
                done = True
        return done

    edit_tensors(f, put)


def _forge_plain(f: Path, m: str) -> None:
    def edit(t, meta):
        if f"{m}.weight" not in t:
            return False
        t[f"{m}.weight"] = torch.roll(t[f"{m}.weight"], 1, dims=1).contiguous()
        return True

    edit_tensors(f, edit)
    edit_report(f, lambda r: r["modules"][m].__setitem__("rel_l2", "0.9"))


def _retype(name: str, dtype):
    def edit(t, meta):
        if name not in t:
            return False
        t[name] = t[name].to(dtype)
        return True
    return edit


def _plant(t, meta):
    if "model.norm.weight" not in t:
        return False
    t["model.layers.0.mlp.extra.weight"] = torch.ones(4)
    return True


def _copied_cases(dest: Path, base: Path, kind: str) -> list[Case]:
    """Copied tensors negated, shard checksums recomputed."""
    cases = []
    for what, name in (("router", "model.layers.0.mlp.gate.weight"), ("norm", "model.layers.0.input_layernorm.weight"),
                       ("embedding", "model.embed_tokens.weight"), ("lm_head", "lm_head.weight"),
                       ("final_norm", "model.norm.weight")):
        f = _copy(dest, base, f"{kind}_negated_{what}")

        def edit(t, meta, name=name):
            if name not in t:
                return False
            t[name] = (-t[name].float()).to(t[name].dtype)
            return True

        edit_tensors(f, edit)
        reseal(f)
        cases.append(Case(f"{kind}_negated_{what}", f"{name} negated, shard checksum recomputed", f, kind))
    return cases


def _symlink_cases(dest: Path, base: Path, kind: str) -> list[Case]:
    f = _copy(dest, base, f"{kind}_shard_symlink_outside")
    outside = dest / f"{kind}_outside"
    outside.mkdir(exist_ok=True)
    shard = sorted(f.glob("*.safetensors"))[0]
    shutil.move(shard, outside / shard.name)
    os.symlink(outside / shard.name, shard)
    return [Case(f"{kind}_shard_symlink_outside", "a shard that is a symlink to a file outside the folder", f, kind)]


def build(dest: Path, sources: dict[str, Path]) -> dict[str, Case]:
    """sources: "packed" (a packed conversion at a group g), "plain" (the default output of the same
    source), optionally "packed_channel" (a channelwise packed conversion of a source of the same
    shapes, where some module has K = 2g: the K = 2g cases)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    cases = _packed_cases(dest, sources["packed"], sources.get("packed_channel"))
    cases += _plain_cases(dest, sources["plain"])
    for kind in ("packed", "plain"):
        cases += _copied_cases(dest, sources[kind], kind)
        cases += _symlink_cases(dest, sources[kind], kind)
    return {c.name: c for c in cases}
