"""The plugin's checks and loaders that need torch only (tested without vLLM).

``runtime_problem``: can this process run the recorded blobs? torch's packer must write KleidiAI
blobs here (it silently writes its float32 reference format on x86 or an Arm CPU without dotprod,
and the packed size is how torch's matmul tells them apart), and byte for byte the recorded layout.

vLLM holds one packed parameter per fused module: ``[E, bytes]`` for the experts (gate blob, up
blob of each expert in one row), ``[bytes]`` for a dense linear (q, k, v or gate, up one after the
other). The checkpoint has one blob per part; the loaders put each at its offset (the parts'
blobs joined are the fused matrix's blob: serve_format.py) and remember what they filled, so a
blob the checkpoint lacks is an error after loading, not uninitialised memory.

Tensor parallelism (docs/serve-format.md): a column parallel part (q/k/v, gate/up, an expert's
gate/up) is stored whole and each rank copies its own byte range (its rows are whole 8-row blocks);
a row parallel matrix (o_proj, down_proj, an expert's down) is stored ``[tp, bytes]`` by
``convert --tensor-parallel`` and each rank copies its own row. No rank keeps another's bytes.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .. import kleidiai
from ..serve_format import QUANT_METHOD, record_problems, tensor_parallel_size

__all__ = ["runtime_problem", "check_runtime", "check_tensor_parallel", "column_shards", "split_problem",
           "ExpertBlobs", "DenseBlobs"]

_HINT = ("Serve the default output of `int4pack convert` (compressed-tensors W4A8: vLLM packs it at load), "
         "or run on an Arm CPU with dotprod and a torch build with KleidiAI.")


def _probe(group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(19)
    n, k = 13, 64  # 13 rows: the padding of the last 8-row block is part of the layout too
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    s = torch.rand(n, 1 if group_size == k else k // group_size, generator=gen) * 0.01 + 0.001
    return q, (s if group_size == k else s.to(torch.bfloat16)), torch.randn(n, generator=gen)


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

    def __init__(self, experts: int, hidden: int, inter: int, group_size: int, tp: int = 1, rank: int = 0):
        """``inter``: this rank's intermediate size; ``tp``, ``rank``: the tensor parallel split (w13
        along N: a byte range of each whole gate/up blob; w2 along K: row ``rank`` of its [tp, bytes])."""
        self.experts, self.tp, self.rank = experts, tp, rank
        if inter % kleidiai.NR:
            raise ValueError(split_problem("the experts' gate/up", inter, max(tp, 2)) if tp > 1 else
                             f"{QUANT_METHOD}: intermediate size {inter} is not a multiple of {kleidiai.NR}")
        self.half = kleidiai.packed_size(inter, hidden, hidden if group_size == -1 else group_size)
        self.w2 = kleidiai.packed_size(hidden, inter, inter if group_size == -1 else group_size)
        self.loaded: set[tuple[int, str]] = set()

    def empty(self, which: str) -> torch.Tensor:
        return torch.empty(self.experts, 2 * self.half if which == "w13" else self.w2, dtype=torch.uint8)

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
                src = _check_blob(loaded_weight, (self.tp, self.w2), what)[self.rank]
            row.copy_(src)
        else:
            whole = _check_blob(loaded_weight, (self.half * self.tp,), what)
            dst = row[: self.half] if shard_id == "w1" else row[self.half:]
            dst.copy_(whole[self.rank * self.half:(self.rank + 1) * self.half])
        self.loaded.add((e, shard_id))
        return True if return_success else None

    def missing(self) -> list[str]:
        return [f"expert {e} {s}" for e in range(self.experts) for s in ("w1", "w3", "w2") if (e, s) not in self.loaded]


class DenseBlobs:
    """Shape and loader of a dense W4A8 linear's packed parameter, fused parts one after the other."""

    _QKV = {"q": 0, "k": 1, "v": 2}

    def __init__(self, out_sizes: list[int], k: int, group_size: int, shards: list[tuple[int, int]] | None = None,
                 k_split: tuple[int, int] | None = None, name: str = "a dense layer"):
        """``out_sizes``, ``k``: this rank's rows per part and its K. ``shards``: per part (the whole
        part's rows in the checkpoint, this rank's first row) for a column parallel split;
        ``k_split``: (tp, rank) for a row parallel one (the checkpoint's [tp, bytes], row rank)."""
        block = k if group_size == -1 else group_size
        if len(out_sizes) > 1 and any(n % kleidiai.NR for n in out_sizes):
            raise ValueError(f"{QUANT_METHOD}: fused parts {out_sizes} are not multiples of {kleidiai.NR} rows")
        sizes = [kleidiai.packed_size(n, k, block) for n in out_sizes]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        self.shards = shards or [(n, 0) for n in out_sizes]
        self.whole = [kleidiai.packed_size(full, k, block) for full, _ in self.shards]
        self.out_sizes, self.k_split, self.name = list(out_sizes), k_split, name
        self.loaded: set[int] = set()

    def empty(self) -> torch.Tensor:
        return torch.empty(self.offsets[-1], dtype=torch.uint8)

    def load(self, param, loaded_weight, loaded_shard_id=None, *_args, **_kw):
        """vLLM's linear weight_loader signature: (param, tensor[, shard id]); no id = the whole blob."""
        if loaded_shard_id is None:
            parts = range(len(self.offsets) - 1)
        else:
            i = self._QKV.get(loaded_shard_id, loaded_shard_id)
            parts = range(int(i), int(i) + 1)
        lo, hi = self.offsets[parts[0]], self.offsets[parts[-1] + 1]
        what = self.name if loaded_shard_id is None else f"{self.name} part {loaded_shard_id}"
        if self.k_split is not None:  # row parallel: one part, this rank's row of [tp, bytes]
            tp, rank = self.k_split
            param.data[lo:hi].copy_(_check_blob(loaded_weight, (tp, hi - lo), what)[rank])
        elif len(parts) == 1 and self.shards[parts[0]] != (self.out_sizes[parts[0]], 0):  # column parallel
            i = parts[0]
            whole = _check_blob(loaded_weight, (self.whole[i],), what)
            start = self.shards[i][1]
            param.data[lo:hi].copy_(_rows(whole, start, self.out_sizes[i], self.shards[i][0]))
        else:
            param.data[lo:hi].copy_(_check_blob(loaded_weight, (hi - lo,), what))
        self.loaded.update(parts)

    def missing(self) -> list[int]:
        return [i for i in range(len(self.offsets) - 1) if i not in self.loaded]
