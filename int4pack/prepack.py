"""KleidiAI-ready prepacked experts beside a converted checkpoint (``convert --prepack kleidiai``).

Layout, in ``OUT/kleidiai/``:
- ``layer-<L>.safetensors`` per decoder layer (``other.safetensors`` for modules outside layers):
  ``<experts prefix>.w13_packed`` uint8 [E, bytes] (gate rows then up rows, packed as one
  [2I, H] matrix, as vLLM concatenates them), ``<experts prefix>.w2_packed`` uint8 [E, bytes],
  and ``<module>.weight_packed`` uint8 [bytes] for every other W4A8 linear.
- Header metadata: layout name/version, nr/kr/sr, group size, scale dtype, packer, torch versions;
  ``manifest.json`` repeats it with per tensor N, K, experts, bytes per matrix, bias, file.

The blobs are packed from the W4A8 tensors just written (so they match them by construction),
by torch's native packer where its KleidiAI path is really taken, else by the portable packer
(byte-identical to torch's, proven under QEMU). ``load_prepacked`` refuses any blob whose size
or metadata does not match what the running torch expects.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from . import kleidiai
from .checkpoint import Checkpoint, read_header
from .errors import InputError
from .plan import OutTensor, Plan
from .writer import ShardFile

__all__ = ["FOLDER", "MANIFEST", "prepack_kleidiai", "load_prepacked"]

FOLDER = "kleidiai"
MANIFEST = "manifest.json"
# torch releases whose native KleidiAI packer the portable packer was proven against (QEMU lane)
VERIFIED_TORCH = ("2.9.1", "2.10.0")
_EXPERT_CHUNK = 16  # experts packed per step: bounds memory to a few experts' int8 weights
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def _file_for(name: str) -> str:
    m = _LAYER.search(name)
    return f"layer-{int(m.group(1)):05d}.safetensors" if m else "other.safetensors"


def _global_meta(group_size: int | None, packer: str) -> dict[str, str]:
    meta = {
        "format": "int4pack-kleidiai",
        "layout": kleidiai.LAYOUT_NAME,
        "layout_version": str(kleidiai.LAYOUT_VERSION),
        "nr": str(kleidiai.NR),
        "kr": str(kleidiai.KR),
        "sr": str(kleidiai.SR),
        "group_size": str(group_size),
        "scale_dtype": "float32" if group_size == -1 else "bfloat16",
        "packer": packer,
        "torch_version": torch.__version__.split("+")[0],
        "matches_native_torch": ",".join(VERIFIED_TORCH),
    }
    if group_size is None:  # modules of several schemes: each tensor's own entry holds its group
        del meta["group_size"], meta["scale_dtype"]
    return meta


def _units(plan: Plan, ckpt: Checkpoint, rename: dict[str, str]) -> list[dict]:
    """What to pack: one entry per stacked expert tensor or dense module, in a fixed order.

    Names are the written checkpoint's (``rename``: source -> output tensor names)."""
    def out(module: str) -> str:
        return rename.get(f"{module}.weight", f"{module}.weight")[: -len(".weight")]

    units = []
    experts = set()
    for lay in plan.layout.moe_layers:
        ids = sorted(lay.experts)
        gates = [out(lay.experts[e]["gate"]) for e in ids]
        ups = [out(lay.experts[e]["up"]) for e in ids]
        downs = [out(lay.experts[e]["down"]) for e in ids]
        experts.update(lay.experts[e][r] for e in ids for r in ("gate", "up", "down"))
        i_, h = ckpt.tensors[f"{gates[0]}.weight"].shape
        prefix = gates[0].rsplit(".", 2)[0]  # <...>.experts
        g = plan.groups[lay.experts[ids[0]]["gate"]]  # one scheme per MoE layer
        units.append({"name": f"{prefix}.w13_packed", "rows": [gates, ups], "n": 2 * i_, "k": h, "g": g})
        units.append({"name": f"{prefix}.w2_packed", "rows": [downs], "n": h, "k": i_, "g": g})
    for j in plan.jobs:
        if j.kind in ("linear", "fold"):
            for s in j.specs:
                if s.name not in experts:
                    units.append({"name": f"{out(s.name)}.weight_packed", "rows": [[out(s.name)]],
                                  "n": s.n, "k": s.k, "g": plan.groups[s.name]})
    return units


def _load_rows(ckpt: Checkpoint, rows: list[list[str]], idx: slice, g: int):
    """Stack experts idx of each row list along N: (q [e, N, K] int8, scales, bias or None)."""
    qs, ss, bs = [], [], []
    for part in rows:
        mods = part[idx]
        qs.append(torch.stack([ckpt.get(f"{m}.weight") for m in mods]))
        ss.append(torch.stack([ckpt.get(f"{m}.weight_scale") for m in mods]))
        has = [f"{m}.bias" in ckpt for m in mods]
        if any(has):
            bs.append(torch.stack([ckpt.get(f"{m}.bias").float() if h else
                                   torch.zeros(ckpt.tensors[f"{m}.weight"].shape[0]) for m, h in zip(mods, has)]))
        else:
            bs.append(None)
    bias = None if all(b is None for b in bs) else torch.cat(
        [b if b is not None else torch.zeros(q.shape[:2]) for b, q in zip(bs, qs)], dim=1)
    return torch.cat(qs, dim=1), torch.cat(ss, dim=1), bias


def _pack_unit(ckpt: Checkpoint, unit: dict, g: int, count: int, native: bool, out: torch.Tensor) -> bool:
    """Fill ``out`` [count, bytes] for one unit; returns whether a bias was packed."""
    has_bias = False
    for e0 in range(0, count, _EXPERT_CHUNK):
        sl = slice(e0, min(count, e0 + _EXPERT_CHUNK))
        q, s, b = _load_rows(ckpt, unit["rows"], sl, g)
        has_bias |= b is not None
        gk = unit["k"] if g == -1 else g
        if native:
            for i in range(q.shape[0]):
                blob, _ = kleidiai.pack(q[i], s[i], None if b is None else b[i], gk, packer="native")
                out[e0 + i] = blob
        else:
            kleidiai.pack_experts(q, s, b, gk, out=out[sl])
    return has_bias


def prepack_kleidiai(folder: Path, plan: Plan, rename: dict[str, str] | None = None) -> dict:
    """Pack every W4A8 tensor of the checkpoint being written in ``folder``; returns the manifest."""
    native = kleidiai.native_kleidiai_available()
    packer = "native" if native else "portable"
    g_all = plan.group_size  # None when modules differ: then each tensor's entry says
    dest = folder / FOLDER
    dest.mkdir(exist_ok=True)
    tensors: dict[str, dict] = {}
    with Checkpoint(folder) as ckpt:
        units = _units(plan, ckpt, rename or {})
        by_file: dict[str, list[dict]] = {}
        for u in units:
            by_file.setdefault(_file_for(u["name"]), []).append(u)
        for fname, us in sorted(by_file.items()):
            outs = []
            for u in us:
                count = len(u["rows"][0])
                g = u["g"]
                size = kleidiai.packed_size(u["n"], u["k"], u["k"] if g == -1 else g)
                shape = (count, size) if u["name"].endswith(("w13_packed", "w2_packed")) else (size,)
                outs.append(OutTensor(u["name"], "U8", shape))
            shard = ShardFile(dest / fname, outs, _global_meta(g_all, packer))
            results = {}
            for u, ot in zip(us, outs):
                count = len(u["rows"][0])
                g = u["g"]
                buf = torch.empty((count, ot.shape[-1]), dtype=torch.uint8)
                has_bias = _pack_unit(ckpt, u, g, count, native, buf)
                shard.write(u["name"], buf.reshape(ot.shape))
                entry = {"file": fname, "n": u["n"], "k": u["k"], "bytes": ot.shape[-1],
                         "experts": count if len(ot.shape) == 2 else None, "has_bias": has_bias,
                         "group_size": g}
                results[u["name"]] = entry
                tensors[u["name"]] = entry
            shard.finish(results)
    manifest = {**_global_meta(g_all, packer), "tensors": dict(sorted(tensors.items()))}
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def load_prepacked(out: str | Path, name: str) -> list[torch.Tensor]:
    """The per-expert (or single) tensors of one prepacked blob, ready for ``_dyn_quant_matmul_4bit``.

    Refuses a layout, version or size the running code does not expect. On a host without
    torch's KleidiAI path the blobs are decoded and repacked into torch's reference format,
    so the same call works (slowly) everywhere.
    """
    dest = Path(out) / FOLDER
    try:
        manifest = json.loads((dest / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"{dest / MANIFEST}: cannot read the prepack manifest ({e})", path=str(dest),
                         hint="Re-run convert with --prepack kleidiai.") from e
    want = {"layout": kleidiai.LAYOUT_NAME, "layout_version": str(kleidiai.LAYOUT_VERSION),
            "nr": str(kleidiai.NR), "kr": str(kleidiai.KR), "sr": str(kleidiai.SR)}
    for key, val in want.items():
        if str(manifest.get(key)) != val:
            raise InputError(f"{dest / MANIFEST}: {key}={manifest.get(key)!r}, this int4pack reads {val!r}",
                             path=str(dest), hint="Re-run convert with this int4pack version.")
    ent = manifest.get("tensors", {}).get(name)
    if ent is None:
        raise InputError(f"{name}: not in the prepack manifest", tensor=name, path=str(dest))
    g = int(ent["group_size"])
    gk = ent["k"] if g == -1 else g
    path = dest / ent["file"]
    header, _, start = read_header(path)
    info = header.get(name)
    if info is None or info["dtype"] != "U8":
        raise InputError(f"{name}: missing from {ent['file']} or not uint8", tensor=name, path=str(path))
    b, e = info["data_offsets"]
    count = ent.get("experts") or 1
    if e - b != count * ent["bytes"] or ent["bytes"] != kleidiai.packed_size(ent["n"], ent["k"], gk):
        raise InputError(f"{name}: {e - b} bytes, expected {count} x {kleidiai.packed_size(ent['n'], ent['k'], gk)}"
                         f" for N={ent['n']} K={ent['k']} group {g}", tensor=name, path=str(path),
                         hint="The blob is truncated or from another layout; re-run convert --prepack kleidiai.")
    with open(path, "rb") as fh:
        fh.seek(start + b)
        data = torch.frombuffer(bytearray(fh.read(e - b)), dtype=torch.uint8)
    rows = data.view(-1, ent["bytes"]) if ent.get("experts") else data.view(1, -1)
    return [kleidiai.load_for_matmul(r.contiguous(), ent["n"], ent["k"], gk, ent["has_bias"]) for r in rows]
