#!/usr/bin/env python3
"""Build a corpus of malformed int4pack inputs from the real fixtures and small synthetic data.

Nothing here is a hand-edited binary: every case is derived by code from a copy of a real
fixture (``tests/fixtures``) or from a tiny synthetic checkpoint written with safetensors, so
the corpus is rebuilt fresh by the tests (into ``tmp_path``) and never committed.

Usage:
    python tests/make_bad_inputs.py DEST [--fixtures PATH]

    from make_bad_inputs import build_corpus
    cases = build_corpus(dest, fixtures)       # -> list[Case]; also writes DEST/cases.json

Each case is one ``int4pack convert SRC OUT ARGS`` call that must fail cleanly: ``exit`` is the
expected exit code, ``mention`` lists names (file, tensor, option or repo id) one of which the
error line must contain. ``env`` holds extra environment variables (``{DEST}`` is replaced by the
corpus folder). ``setup`` marks the cases a test has to stage itself:

- ``"tmpfs"``: OUT is on a file system too small for the output (disk full). The test mounts a
  small tmpfs at ``DEST/<case>/full`` when it can (root in this sandbox), else it injects
  ``OSError(ENOSPC)`` through a size-limited shard writer.

Cases with ``ok=True`` are inputs that look suspicious but are legitimate and must convert
(e.g. a zero scale on a group whose codes all sit at the zero point).

Unreadable files: the tests run as root, where ``chmod 000`` does not stop reads, so
"unreadable" is simulated by a directory where a file is expected and by a broken symlink;
the ``chmod 000`` case is only added when the builder does not run as root.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = ["Case", "build_corpus", "load_cases", "tree_hash", "DEFAULT_FIXTURES"]

DEFAULT_FIXTURES = Path(__file__).resolve().parent / "fixtures"
INDEX = "model.safetensors.index.json"


@dataclass
class Case:
    name: str
    what: str  # one line: what is wrong
    src: str  # folder relative to DEST, or a hub repo id when hub=True
    out: str  # OUT relative to DEST
    exit: int  # expected exit code
    mention: list[str]  # the error line names one of these
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    hub: bool = False
    setup: str | None = None
    ok: bool = False  # a legitimate input that must convert

    def src_path(self, dest: Path) -> str:
        return self.src if self.hub else str(dest / self.src)

    def out_path(self, dest: Path) -> Path:
        return dest / self.out

    def cli_args(self, dest: Path) -> list[str]:
        return ["convert", self.src_path(dest), str(self.out_path(dest)), *self.args]

    def environ(self, dest: Path) -> dict[str, str]:
        return {k: v.replace("{DEST}", str(dest)) for k, v in self.env.items()}


def tree_hash(path: Path) -> str:
    """sha256 over every entry below ``path`` (relative names, kinds, link targets, bytes)."""
    h = hashlib.sha256()
    path = Path(path)
    if not os.path.lexists(path):
        return "absent"
    if path.is_file() and not path.is_symlink():
        return "file:" + hashlib.sha256(path.read_bytes()).hexdigest()
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files + [d for d in dirs if os.path.islink(os.path.join(root, d))]):
            p = Path(root) / name
            rel = str(p.relative_to(path))
            if p.is_symlink():
                h.update(f"L|{rel}|{os.readlink(p)}\n".encode())
            else:
                h.update(f"F|{rel}|{p.stat().st_size}\n".encode())
                with open(p, "rb") as fh:
                    for chunk in iter(lambda: fh.read(1 << 22), b""):
                        h.update(chunk)
        for d in dirs:
            h.update(f"D|{Path(root, d).relative_to(path)}\n".encode())
    return h.hexdigest()


# --------------------------------------------------------------------------- file helpers

def _copy_fixture(fixtures: Path, name: str, dst: Path) -> Path:
    """A writable copy (the fixtures are read-only; copytree would copy their modes)."""
    src = fixtures / name
    if not src.is_dir():
        raise FileNotFoundError(f"fixture {name} not found under {fixtures}")
    dst.mkdir(parents=True)
    for p in sorted(src.iterdir()):
        if p.is_file():
            shutil.copyfile(p, dst / p.name)
    return dst


def _read_raw(path: Path) -> tuple[dict, bytes]:
    """(header dict incl. __metadata__, data bytes) of a safetensors file, parsed by hand."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def _write_raw(path: Path, header: dict | bytes, data: bytes, length: int | None = None) -> None:
    hb = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * ((-len(hb)) % 8)
    n = len(hb) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + hb + data)


def _edit_header(path: Path, fn: Callable[[dict], None]) -> None:
    header, data = _read_raw(path)
    fn(header)
    _write_raw(path, header, data)


def _index(folder: Path) -> dict:
    return json.loads((folder / INDEX).read_text())


def _shard_of(folder: Path, tensor: str) -> Path:
    if (folder / INDEX).is_file():
        return folder / _index(folder)["weight_map"][tensor]
    return folder / "model.safetensors"


def _load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    with safe_open(str(path), framework="pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}, fh.metadata()


def _edit_tensors(folder: Path, shard: Path, fn: Callable[[dict], None]) -> None:
    tensors, meta = _load(shard)
    fn(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(shard), metadata=meta)


def _set_tensor(folder: Path, name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    def edit(ts: dict) -> None:
        ts[name] = fn(ts[name].clone())
    _edit_tensors(folder, _shard_of(folder, name), edit)


def _drop_tensors(folder: Path, names: list[str]) -> None:
    by_shard: dict[Path, list[str]] = {}
    for n in names:
        by_shard.setdefault(_shard_of(folder, n), []).append(n)
    for shard, ns in by_shard.items():
        _edit_tensors(folder, shard, lambda ts, ns=ns: [ts.pop(n) for n in ns])
    if (folder / INDEX).is_file():
        idx = _index(folder)
        for n in names:
            idx["weight_map"].pop(n)
        (folder / INDEX).write_text(json.dumps(idx, indent=2))


def _edit_json(path: Path, fn: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data, indent=2))


def _qcfg(fn: Callable[[dict], None]) -> Callable[[dict], None]:
    return lambda cfg: fn(cfg["quantization_config"])


# --------------------------------------------------------------------------- synthetic checkpoints

def _gptq_linear(prefix: str, n: int, k: int, group: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A symmetric GPTQ v1 linear: qweight [K/8, N], qzeros 0x77777777, fp16 scales, trivial g_idx."""
    groups = -(-k // group)
    return {
        f"{prefix}.qweight": torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=gen, dtype=torch.int64)
        .to(torch.int32),
        f"{prefix}.qzeros": torch.full((groups, n // 8), 0x77777777, dtype=torch.int32),
        f"{prefix}.scales": (torch.rand(groups, n, generator=gen) * 0.01 + 0.001).to(torch.float16),
        f"{prefix}.g_idx": (torch.arange(k) // group).to(torch.int32),
    }


def _synthetic_gptq(folder: Path, *, group: int, hidden: int = 128, inter: int = 64, experts: int = 2,
                    model_type: str = "qwen3_moe", extra: dict | None = None, fused: bool = False) -> Path:
    """A one-layer Qwen3-MoE-named GPTQ checkpoint (or a granitemoe-style fused one)."""
    gen = torch.Generator().manual_seed(1234)
    t: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(64, hidden, generator=gen).to(torch.bfloat16),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "lm_head.weight": torch.randn(64, hidden, generator=gen).to(torch.bfloat16),
    }
    lp = "model.layers.0"
    t.update(_gptq_linear(f"{lp}.self_attn.q_proj", hidden, hidden, group, gen))
    if fused:  # granitemoe: experts fused into 3-D input_linear / output_linear, not quantisable by GPTQ
        t[f"{lp}.block_sparse_moe.input_linear.weight"] = torch.randn(experts, 2 * inter, hidden,
                                                                      generator=gen).to(torch.bfloat16)
        t[f"{lp}.block_sparse_moe.output_linear.weight"] = torch.randn(experts, hidden, inter,
                                                                       generator=gen).to(torch.bfloat16)
        t[f"{lp}.block_sparse_moe.router.layer.weight"] = torch.randn(experts, hidden,
                                                                      generator=gen).to(torch.bfloat16)
    else:
        t[f"{lp}.mlp.gate.weight"] = torch.randn(experts, hidden, generator=gen).to(torch.bfloat16)
        for e in range(experts):
            for proj, (n, k) in {"gate_proj": (inter, hidden), "up_proj": (inter, hidden),
                                 "down_proj": (hidden, inter)}.items():
                t.update(_gptq_linear(f"{lp}.mlp.experts.{e}.{proj}", n, k, group, gen))
    folder.mkdir(parents=True)
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = {"model_type": model_type, "architectures": ["SyntheticForCausalLM"], "hidden_size": hidden,
           "moe_intermediate_size": inter, "num_experts": experts, "num_local_experts": experts,
           "num_hidden_layers": 1, "quantization_config": {"quant_method": "gptq", "bits": 4,
                                                           "group_size": group, "desc_act": False,
                                                           "sym": True, "checkpoint_format": "gptq"}}
    cfg.update(extra or {})
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def _synthetic_ct_fused(folder: Path, experts: int = 4, hidden: int = 128, inter: int = 64) -> Path:
    """A llama4-style compressed-tensors checkpoint whose experts are fused 3-D packed tensors."""
    gen = torch.Generator().manual_seed(99)
    lp = "language_model.model.layers.0.feed_forward"

    def packed(*shape):
        return torch.randint(-2**31, 2**31 - 1, shape, generator=gen, dtype=torch.int64).to(torch.int32)

    t = {
        f"{lp}.router.weight": torch.randn(experts, hidden, generator=gen).to(torch.bfloat16),
        f"{lp}.experts.gate_up_proj.weight_packed": packed(experts, 2 * inter, hidden // 8),
        f"{lp}.experts.gate_up_proj.weight_scale": torch.rand(experts, 2 * inter, hidden // 32).to(torch.bfloat16),
        f"{lp}.experts.down_proj.weight_packed": packed(experts, hidden, inter // 8),
        f"{lp}.experts.down_proj.weight_scale": torch.rand(experts, hidden, inter // 32).to(torch.bfloat16),
        "language_model.model.embed_tokens.weight": torch.randn(64, hidden, generator=gen).to(torch.bfloat16),
    }
    folder.mkdir(parents=True)
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"],
           "text_config": {"model_type": "llama4_text", "num_local_experts": experts, "hidden_size": hidden},
           "quantization_config": {
               "quant_method": "compressed-tensors", "format": "pack-quantized", "version": "0.20.0",
               "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized",
                                             "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                         "strategy": "group", "group_size": 32}}}}}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def _hub_cache(cache: Path, repo: str, source: Path, skip: set[str]) -> None:
    """A Hugging Face cache entry (models--owner--name, blobs + snapshot symlinks + refs/main) made
    from ``source``, leaving out the files in ``skip`` (a partial download: their blobs are only
    ``.incomplete`` fragments)."""
    rev = hashlib.sha1(repo.encode()).hexdigest()
    base = cache / ("models--" + repo.replace("/", "--"))
    snap = base / "snapshots" / rev
    (base / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(rev)
    for p in sorted(source.iterdir()):
        data = p.read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        if p.name in skip:
            (base / "blobs" / (blob + ".incomplete")).write_bytes(data[: len(data) // 3])
            continue
        (base / "blobs" / blob).write_bytes(data)
        (snap / p.name).symlink_to(Path("..", "..", "blobs", blob))


# --------------------------------------------------------------------------- the corpus

_GPTQ = "gptq_q3_sym"
_S1, _S2, _S3 = (f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3))
_M = "model.layers.0.mlp.experts.1.up_proj"  # a GPTQ expert linear in shard 2 (K=256, N=128, group 32)


def build_corpus(dest: str | os.PathLike, fixtures: str | os.PathLike = DEFAULT_FIXTURES) -> list[Case]:
    """Write every case under ``dest`` (which must not exist or be empty) and ``dest/cases.json``."""
    dest, fixtures = Path(dest), Path(fixtures)
    dest.mkdir(parents=True, exist_ok=True)
    if any(dest.iterdir()):
        raise FileExistsError(f"{dest} is not empty")
    cases: list[Case] = []

    def case(name: str, what: str, *, base: str | None = _GPTQ, exit: int = 3, mention=(), args=(),
             out: str | None = None, **kw) -> Path:
        """Register a case; returns its source folder (a fresh copy of ``base``, or an empty path)."""
        folder = dest / name / "src"
        if base is not None:
            _copy_fixture(fixtures, base, folder)
        else:
            (dest / name).mkdir(parents=True)
        cases.append(Case(name=name, what=what, src=f"{name}/src", out=out or f"{name}/out", exit=exit,
                          mention=list(mention), args=list(args), **kw))
        return folder

    # ---- safetensors shards and headers ------------------------------------------------
    f = case("truncated_shard", "last shard cut in half", mention=[_S3])
    with open(f / _S3, "r+b") as fh:
        fh.truncate((f / _S3).stat().st_size // 2)

    f = case("shard_4_bytes", "shard shorter than the 8-byte header length", mention=[_S3])
    with open(f / _S3, "r+b") as fh:
        fh.truncate(4)

    f = case("empty_shard", "zero-byte shard", mention=[_S1])
    (f / _S1).write_bytes(b"")

    f = case("header_corrupt_json", "header bytes overwritten with garbage", mention=[_S2])
    blob = bytearray((f / _S2).read_bytes())
    blob[8:24] = b"\xff\xfe{{{{not json!!"
    (f / _S2).write_bytes(bytes(blob))

    f = case("header_oversized", "header length field 2**40 (safetensors caps headers at 100 MB)", mention=[_S3])
    with open(f / _S3, "r+b") as fh:
        fh.write(struct.pack("<Q", 2**40))

    f = case("header_length_past_eof", "header length field larger than the file", mention=[_S1])
    with open(f / _S1, "r+b") as fh:
        fh.write(struct.pack("<Q", (f / _S1).stat().st_size))

    f = case("header_not_object", "header is a JSON list", mention=[_S1])
    _, data = _read_raw(f / _S1)
    _write_raw(f / _S1, b"[1, 2, 3]", data)

    f = case("header_offsets_out_of_range", "a tensor's data_offsets end past the end of the file",
             mention=[f"{_M}.scales"])
    _edit_header(f / _S2, lambda h: h[f"{_M}.scales"].__setitem__(
        "data_offsets", [h[f"{_M}.scales"]["data_offsets"][0], 10**9]))

    f = case("header_offsets_negative", "a tensor's data_offsets are negative", mention=[f"{_M}.qweight"])
    _edit_header(f / _S2, lambda h: h[f"{_M}.qweight"].__setitem__("data_offsets", [-64, 0]))

    def overlap(h: dict) -> None:
        a, b = h[f"{_M}.qweight"], h[f"{_M}.qzeros"]
        size = b["data_offsets"][1] - b["data_offsets"][0]
        b["data_offsets"] = [a["data_offsets"][0], a["data_offsets"][0] + size]
    f = case("header_offsets_overlap", "two tensors share bytes", mention=[f"{_M}.qweight", f"{_M}.qzeros"])
    _edit_header(f / _S2, overlap)

    f = case("header_shape_bytes_mismatch", "shape says more bytes than the offsets span", mention=[f"{_M}.scales"])
    _edit_header(f / _S2, lambda h: h[f"{_M}.scales"].__setitem__("shape", [9, 128]))

    f = case("header_unknown_dtype", "dtype 'I4' is not a safetensors dtype", mention=[f"{_M}.qweight"])
    _edit_header(f / _S2, lambda h: h[f"{_M}.qweight"].__setitem__("dtype", "I4"))

    f = case("header_entry_malformed", "a tensor entry without 'shape'", mention=[f"{_M}.qzeros"])
    _edit_header(f / _S2, lambda h: h[f"{_M}.qzeros"].pop("shape"))

    # ---- index -------------------------------------------------------------------------------
    f = case("shard_missing", "a shard listed in the index is absent", mention=[_S3])
    (f / _S3).unlink()

    f = case("index_invalid_json", "index file cut mid-JSON", mention=[INDEX])
    (f / INDEX).write_text((f / INDEX).read_text()[:200])

    f = case("index_no_weight_map", "index without weight_map", mention=[INDEX])
    (f / INDEX).write_text(json.dumps({"metadata": {"total_size": 1}}))

    f = case("index_wrong_shard", "index puts a tensor in a shard that does not hold it",
             mention=[f"{_M}.scales"])
    _edit_json(f / INDEX, lambda d: d["weight_map"].__setitem__(f"{_M}.scales", _S1))

    f = case("index_stale", "a shard holds a tensor the index does not list", mention=[f"{_M}.g_idx"])
    _edit_json(f / INDEX, lambda d: d["weight_map"].pop(f"{_M}.g_idx"))

    f = case("index_path_escape", "index names a shard outside the checkpoint folder (../)",
             mention=["../"])
    _edit_json(f / INDEX, lambda d: d["weight_map"].__setitem__(f"{_M}.scales", "../escape.safetensors"))
    shutil.copyfile(f / _S1, f.parent / "escape.safetensors")

    f = case("tensor_in_two_shards", "the same tensor stored in two shards", mention=[f"{_M}.scales"])
    dup, _ = _load(f / _S2)
    _edit_tensors(f, f / _S3, lambda ts: ts.__setitem__(f"{_M}.scales", dup[f"{_M}.scales"]))

    # ---- folder / config ----------------------------------------------------------------------
    f = case("config_missing", "no config.json", mention=["config.json"])
    (f / "config.json").unlink()

    f = case("config_invalid_json", "config.json cut mid-JSON", mention=["config.json"])
    (f / "config.json").write_text((f / "config.json").read_text()[:300])

    f = case("config_not_object", "config.json is a JSON list", mention=["config.json"])
    (f / "config.json").write_text("[]")

    f = case("config_not_utf8", "config.json is binary garbage", mention=["config.json"])
    (f / "config.json").write_bytes(b"\xff\xfe\x00garbage\x80\x81")

    f = case("config_text_config_not_object", "text_config is a string", mention=["config.json"], exit=3)
    _edit_json(f / "config.json", lambda c: c.__setitem__("text_config", "qwen3"))

    f = case("unreadable_config_is_dir", "config.json is a directory (unreadable as a file)",
             mention=["config.json"])
    (f / "config.json").unlink()
    (f / "config.json").mkdir()

    f = case("unreadable_shard_is_dir", "a shard path is a directory (unreadable as a file)", mention=[_S3])
    (f / _S3).unlink()
    (f / _S3).mkdir()

    f = case("unreadable_shard_broken_symlink", "a shard is a dangling symlink", mention=[_S3])
    (f / _S3).unlink()
    (f / _S3).symlink_to(f.parent / "nowhere.safetensors")

    f = case("unreadable_index_is_dir", "the index path is a directory", mention=[INDEX])
    (f / INDEX).unlink()
    (f / INDEX).mkdir()

    if os.geteuid() != 0:  # root reads through chmod 000, so the case only exists for other users
        f = case("unreadable_shard_chmod000", "a shard with mode 000", mention=[_S2])
        os.chmod(f / _S2, 0)

    f = case("no_safetensors", "only pytorch_model.bin", base=None, mention=["safetensors"])
    f.mkdir()
    (f / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    (f / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not really a zip")

    f = case("empty_folder", "an empty folder", base=None, mention=["config.json"])
    f.mkdir()

    f = case("source_is_file", "SRC is a file, not a folder", base=None, mention=["src"])
    f.write_text("{}")

    case("source_missing", "SRC does not exist and is no repo id", base=None, mention=["src"])

    # ---- quantised tensors ----------------------------------------------------------------------
    f = case("qweight_without_scales", "a GPTQ qweight without its scales", mention=[f"{_M}.scales"])
    _drop_tensors(f, [f"{_M}.scales"])

    f = case("qweight_without_qzeros", "a GPTQ qweight without its qzeros", mention=[f"{_M}.qzeros"])
    _drop_tensors(f, [f"{_M}.qzeros"])

    f = case("scales_without_qweight", "scales/qzeros left behind without a qweight", mention=[f"{_M}.qweight"])
    _drop_tensors(f, [f"{_M}.qweight"])

    f = case("scales_shape_mismatch", "scales has one group too few", mention=[f"{_M}.scales"])
    _set_tensor(f, f"{_M}.scales", lambda t: t[:-1])

    f = case("qzeros_shape_mismatch", "qzeros has an extra column", mention=[f"{_M}.qzeros"])
    _set_tensor(f, f"{_M}.qzeros", lambda t: torch.cat([t, t[:, :1]], 1))

    f = case("qweight_3d", "qweight with 3 dims", mention=[f"{_M}.qweight"])
    _set_tensor(f, f"{_M}.qweight", lambda t: t.reshape(1, *t.shape))

    f = case("qweight_wrong_dtype", "qweight stored as float32", mention=[f"{_M}.qweight"])
    _set_tensor(f, f"{_M}.qweight", lambda t: t.float())

    f = case("g_idx_shape_mismatch", "g_idx shorter than K", base="gptq_q3_descact", mention=[f"{_M}.g_idx"])
    _set_tensor(f, f"{_M}.g_idx", lambda t: t[:-8])

    f = case("g_idx_out_of_range", "g_idx names group 99 of 8", base="gptq_q3_descact", mention=[f"{_M}.g_idx"])
    _set_tensor(f, f"{_M}.g_idx", lambda t: t.index_fill_(0, torch.tensor([5]), 99))

    f = case("g_idx_negative", "g_idx holds -1", base="gptq_q3_descact", mention=[f"{_M}.g_idx"])
    _set_tensor(f, f"{_M}.g_idx", lambda t: t.index_fill_(0, torch.tensor([0]), -1))

    f = case("scales_nan", "one GPTQ scale is NaN", mention=[f"{_M}.scales"])
    _set_tensor(f, f"{_M}.scales", lambda t: t.index_put_((torch.tensor([2]), torch.tensor([7])),
                                                          torch.tensor(float("nan"), dtype=t.dtype)))

    f = case("scales_inf", "one GPTQ scale is +Inf", mention=[f"{_M}.scales"])
    _set_tensor(f, f"{_M}.scales", lambda t: t.index_put_((torch.tensor([0]), torch.tensor([0])),
                                                          torch.tensor(float("inf"), dtype=t.dtype)))

    f = case("scales_negative", "one GPTQ scale is negative (no producer writes that)", mention=[f"{_M}.scales"])
    _set_tensor(f, f"{_M}.scales", lambda t: t.index_put_((torch.tensor([3]), torch.tensor([5])),
                                                          -t[3, 5]))

    f = case("scales_zero_with_codes", "a zero scale on a group whose codes are not all at the zero point",
             mention=[f"{_M}.scales"])
    _set_tensor(f, f"{_M}.scales", lambda t: t.index_put_((torch.tensor([1]), torch.tensor([9])),
                                                          torch.tensor(0.0, dtype=t.dtype)))

    f = case("scales_zero_all_zero_group", "a zero scale on a group whose codes all equal the zero point "
             "(a pruned group: dequantises to 0 either way) is legitimate", exit=0, ok=True)
    # group 1 of column 9: K rows 32..63 -> packed rows 4..7; symmetric v1 zero point is 8
    _set_tensor(f, f"{_M}.qweight", lambda t: t.index_put_((torch.arange(4, 8), torch.tensor([9])),
                                                           torch.tensor(0x88888888 - 2**32, dtype=torch.int32)))
    _set_tensor(f, f"{_M}.scales", lambda t: t.index_put_((torch.tensor([1]), torch.tensor([9])),
                                                          torch.tensor(0.0, dtype=t.dtype)))

    f = case("awq_scales_nan", "one AWQ scale is NaN", base="awq_q3", mention=[f"{_M}.scales"])
    _set_tensor(f, f"{_M}.scales", lambda t: t.index_put_((torch.tensor([0]), torch.tensor([3])),
                                                          torch.tensor(float("nan"), dtype=t.dtype)))

    ctm = "model.layers.1.mlp.experts.2.down_proj"
    f = case("ct_weight_scale_inf", "one compressed-tensors weight_scale is -Inf", base="ct_qwen3moe_w4a16",
             mention=[f"{ctm}.weight_scale"])
    _set_tensor(f, f"{ctm}.weight_scale", lambda t: t.index_put_((torch.tensor([4]), torch.tensor([1])),
                                                                 torch.tensor(float("-inf"), dtype=t.dtype)))

    f = case("ct_int_values_out_of_range", "an int-quantized weight holds 100 (not int4)",
             base="ct_qwen3moe_w4a8_int_g32", mention=[f"{ctm}.weight"])
    _set_tensor(f, f"{ctm}.weight", lambda t: t.index_fill_(1, torch.tensor([3]), 100))

    f = case("ct_asym_without_zero_point", "asymmetric compressed-tensors module without weight_zero_point",
             base="ct_qwen3moe_w4a16_asym_g32", mention=[f"{ctm}.weight_zero_point", ctm])
    _drop_tensors(f, [f"{ctm}.weight_zero_point"])

    f = case("ct_weight_shape_mismatch", "weight_shape disagrees with weight_packed", base="ct_qwen3moe_w4a16",
             mention=[f"{ctm}.weight_packed", f"{ctm}.weight_shape"])
    _set_tensor(f, f"{ctm}.weight_shape", lambda t: t * 2)

    f = case("config_num_experts_huge", "config claims 10**12 experts (must not loop over them)",
             mention=["model.layers.0.mlp.experts"])
    _edit_json(f / "config.json", lambda c: c.__setitem__("num_experts", 10**12))

    f = case("expert_missing", "every tensor of one expert removed", mention=["model.layers.1.mlp.experts"])
    gone = "model.layers.1.mlp.experts.3"
    _drop_tensors(f, [n for n in _index(f)["weight_map"] if n.startswith(gone + ".")])

    # ---- configs the tool refuses --------------------------------------------------------------
    for bits in (2, 3, 8):
        f = case(f"gptq_bits_{bits}", f"GPTQ config says bits={bits}", exit=4, mention=["model.layers", "config.json"])
        _edit_json(f / "config.json", _qcfg(lambda q, b=bits: q.__setitem__("bits", b)))

    f = case("awq_bits_3", "AWQ config says bits=3", base="awq_q3", exit=4, mention=["model.layers", "config.json"])
    _edit_json(f / "config.json", _qcfg(lambda q: q.__setitem__("bits", 3)))

    f = case("ct_num_bits_8", "compressed-tensors config group num_bits 8", base="ct_qwen3moe_w4a16", exit=4,
             mention=["group_0", "config.json"])
    _edit_json(f / "config.json", _qcfg(lambda q: q["config_groups"]["group_0"]["weights"].__setitem__("num_bits", 8)))

    f = case("bits_not_a_number", "bits: 'four'", exit=3, mention=["config.json"])
    _edit_json(f / "config.json", _qcfg(lambda q: q.__setitem__("bits", "four")))

    f = case("unknown_quant_method", "quant_method 'hqq'", exit=4, mention=["config.json"])
    _edit_json(f / "config.json", _qcfg(lambda q: q.__setitem__("quant_method", "hqq")))

    f = case("float_unknown_family", "a float checkpoint of a model type that is not an MoE family",
             base="dense_qwen3moe", exit=4, mention=["llama", "config.json"])
    _edit_json(f / "config.json", lambda c: c.__setitem__("model_type", "llama"))

    f = case("gptq_marlin", "GPTQ checkpoint_format marlin", exit=4, mention=["config.json"])
    _edit_json(f / "config.json", _qcfg(lambda q: q.update(checkpoint_format="marlin", format="marlin")))

    f = case("gptq_is_marlin_format", "GPTQ is_marlin_format: true", exit=4, mention=["config.json"])
    _edit_json(f / "config.json", _qcfg(lambda q: q.update(is_marlin_format=True)))

    f = case("gptq_pack_dtype_int16", "GPTQ pack_dtype int16", exit=4, mention=["config.json"])
    _edit_json(f / "config.json", _qcfg(lambda q: q.update(pack_dtype="int16")))

    f = case("gptq_dynamic_bad_regex", "GPTQ dynamic rule with an invalid regex", exit=3, mention=["config.json"])
    _edit_json(f / "config.json", _qcfg(lambda q: q.update(dynamic={"+:model.layers.(0": {"bits": 4}})))

    f = case("gptq_dynamic_not_object", "GPTQ dynamic is a list", exit=3, mention=["config.json"])
    _edit_json(f / "config.json", _qcfg(lambda q: q.update(dynamic=["model.layers.0"])))

    f = case("awq_gemv", "AWQ version gemv", base="awq_q3", exit=4, mention=["config.json"])
    _edit_json(f / "config.json", _qcfg(lambda q: q.update(version="gemv")))

    f = case("awq_marlin", "AWQ version marlin", base="awq_q3", exit=4, mention=["config.json"])
    _edit_json(f / "config.json", _qcfg(lambda q: q.update(version="marlin")))

    def marlin24(q: dict) -> None:
        q["format"] = "marlin-24"
        q["config_groups"]["group_0"]["format"] = "marlin-24"
    f = case("ct_marlin_24", "compressed-tensors format marlin-24", base="ct_qwen3moe_w4a16", exit=4,
             mention=["config.json"])
    _edit_json(f / "config.json", _qcfg(marlin24))

    f = case("ct_group_size_not_a_number", "compressed-tensors group_size 'abc'", base="ct_qwen3moe_w4a16", exit=3,
             mention=["config.json"])
    _edit_json(f / "config.json", _qcfg(lambda q: q["config_groups"]["group_0"]["weights"].__setitem__(
        "group_size", "abc")))

    f = case("ct_weights_not_object", "compressed-tensors weights is a list", base="ct_qwen3moe_w4a16", exit=3,
             mention=["config.json"])
    _edit_json(f / "config.json", _qcfg(lambda q: q["config_groups"]["group_0"].__setitem__("weights", [4])))

    # ---- fused experts -------------------------------------------------------------------------
    f = case("fused_granitemoe", "granitemoe: 3-D fused input_linear/output_linear experts", base=None, exit=4,
             mention=["input_linear", "granitemoe"])
    _synthetic_gptq(f, group=32, model_type="granitemoe", fused=True)

    f = case("fused_llama4_ct", "llama4: fused 3-D gate_up_proj/down_proj packed experts", base=None, exit=4,
             mention=["gate_up_proj", "down_proj"])
    _synthetic_ct_fused(f)

    # ---- group sizes -----------------------------------------------------------------------------
    case("group_size_48", "--group-size 48 is not a multiple of 32", exit=2, args=["--group-size", "48"],
         mention=["--group-size 48"])
    case("group_size_0", "--group-size 0", exit=2, args=["--group-size", "0"], mention=["--group-size 0"])
    case("group_size_word", "--group-size big", exit=2, args=["--group-size", "big"], mention=["--group-size"])
    case("group_size_not_dividing_k", "--group-size 96 --strict-group-size: 96 does not divide K=256", exit=4,
         args=["--group-size", "96", "--strict-group-size"], mention=["--group-size 96"])
    case("group_size_not_dividing_k_substituted", "--group-size 96 does not divide K=256: those modules get "
         "a group they can run, with a warning", exit=0, ok=True, args=["--group-size", "96"])

    f = case("source_group_not_dividing_k_kept", "source group 96 (does not divide K=128) kept with --group-size 96 "
             "--strict-group-size", base=None, exit=4, args=["--group-size", "96", "--strict-group-size"],
             mention=["--group-size 96"])
    _synthetic_gptq(f, group=96)

    f = case("source_group_not_dividing_k", "source GPTQ group 96 with K=128: valid GPTQ (last group partial); "
             "auto picks a valid target group and requantises", base=None, exit=0, ok=True)
    _synthetic_gptq(f, group=96)

    case("max_shard_size_bad", "--max-shard-size 5XB", exit=2, args=["--max-shard-size", "5XB"],
         mention=["--max-shard-size"])

    # ---- output folder -------------------------------------------------------------------------
    case("out_exists", "OUT exists", exit=5, mention=["out"])
    (dest / "out_exists" / "out").mkdir()
    (dest / "out_exists" / "out" / "keep.txt").write_text("user data\n")

    case("out_is_file", "OUT is a file", exit=5, mention=["out"])
    (dest / "out_is_file" / "out").write_text("user data\n")

    case("out_is_file_overwrite", "OUT is a file, with --overwrite", exit=5, args=["--overwrite"], mention=["out"])
    (dest / "out_is_file_overwrite" / "out").write_text("user data\n")

    case("out_inside_source", "OUT inside SRC", exit=5, out="out_inside_source/src/converted",
         mention=["converted"])

    case("out_contains_source", "OUT is SRC's parent, with --overwrite", exit=5, out="out_contains_source",
         args=["--overwrite"], mention=["out_contains_source"])

    case("out_parent_is_file", "OUT's parent is a file (a missing parent would be created)", exit=5,
         out="out_parent_is_file/file/out", mention=["file"])
    (dest / "out_parent_is_file" / "file").write_text("user data\n")

    case("out_foreign_work_folder", "the hidden work folder exists but is not int4pack's", exit=5,
         mention=[".out.int4pack-partial"])
    (dest / "out_foreign_work_folder" / ".out.int4pack-partial").mkdir()
    (dest / "out_foreign_work_folder" / ".out.int4pack-partial" / "notes.txt").write_text("not ours\n")

    case("disk_full", "OUT on a file system with 400 KB free", exit=5, out="disk_full/full/out",
         mention=["full/"], setup="tmpfs")
    (dest / "disk_full" / "full").mkdir()

    # ---- hub ids ---------------------------------------------------------------------------------
    offline = {"HF_HUB_OFFLINE": "1", "HF_HOME": "{DEST}/hub_offline_no_cache/hf",
               "HF_HUB_CACHE": "{DEST}/hub_offline_no_cache/hf/hub"}
    (dest / "hub_offline_no_cache" / "hf" / "hub").mkdir(parents=True)
    cases.append(Case("hub_offline_no_cache", "a repo id, HF_HUB_OFFLINE=1 and an empty cache",
                      src="int4pack-test/not-cached", out="hub_offline_no_cache/out", exit=3,
                      mention=["int4pack-test/not-cached"], env=offline, hub=True))

    partial = {"HF_HUB_OFFLINE": "1", "HF_HOME": "{DEST}/hub_partial_cache/hf",
               "HF_HUB_CACHE": "{DEST}/hub_partial_cache/hf/hub"}
    _hub_cache(dest / "hub_partial_cache" / "hf" / "hub", "int4pack-test/partial", fixtures / _GPTQ, {_S2})
    cases.append(Case("hub_partial_cache", "a cached snapshot with config and index but a shard never finished",
                      src="int4pack-test/partial", out="hub_partial_cache/out", exit=3,
                      mention=[_S2], env=partial, hub=True))

    cases.append(Case("hub_bad_id", "neither a folder nor an owner/name id", src="owner/name/extra",
                      out="hub_bad_id/out", exit=3, mention=["owner/name/extra"], hub=True,
                      env={"HF_HUB_OFFLINE": "1"}))
    (dest / "hub_bad_id").mkdir()

    (dest / "cases.json").write_text(json.dumps([asdict(c) for c in cases], indent=2) + "\n")
    return cases


def load_cases(dest: str | os.PathLike) -> list[Case]:
    return [Case(**d) for d in json.loads((Path(dest) / "cases.json").read_text())]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dest", type=Path, help="empty or missing folder to build the corpus in")
    ap.add_argument("--fixtures", type=Path, default=DEFAULT_FIXTURES, help="the real fixtures folder")
    a = ap.parse_args(argv)
    cases = build_corpus(a.dest, a.fixtures)
    bad = [c for c in cases if not c.ok]
    for c in cases:
        print(f"{'ok ' if c.ok else 'bad'} {c.name:36s} exit {c.exit}  {c.what}")
    print(f"{len(bad)} malformed input(s) and {len(cases) - len(bad)} legitimate edge case(s) in {a.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
