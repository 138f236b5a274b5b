"""convert's lossless batch: runs of lossless linear jobs converted, packed and checksummed in one
C++ call each (csrc/convert_kernels/batch.cpp), written with one write per span of the shard.

Per module, the per-job path (convert.run_job, blobs.job_packer, ShardFile.write) runs ~1.6 ms of
Python under the GIL (reading the record, the job's wrapper, packing, provenance, writing), so
more workers did not make convert faster (docs/performance.md). Here the C++ reads each module's
packed words, scales, zero points and g_idx in place from the mapped source shard, runs the
lossless job, writes the output tensors (the default format's int8 weight and scales, or the
KleidiAI blob) at their places in one buffer laid out in the shard's file order, and returns the
CRC-32C the writer records and the zlib CRC-32s of the blob's provenance; Python keeps the
statistics and header entries, a few dicts per module.

A batch holds consecutive jobs of one output shard and one source shard whose path the plan
predicts lossless, without bias, whose reader can say where their data lies (``in_place``). A
module the C++ does not take as given (zero points other than 8, a g_idx not arange(K) / group,
misaligned words) or whose job it refuses runs the per-job path inside the batch: it is
converted (or refused, with the same message) exactly as without batches. The outputs are the
same bytes, statistics and provenance either way (tests/test_batch.py). ``INT4PACK_BATCH=0``
turns batches off.

Requant batches (``Batch.kind == "requant"``) do the same for GPTQ, AWQ and compressed-tensors
(packed zero points) modules with zero
points whose path the plan predicts requant: ``requant_batch`` in the C++ runs requant_job on
each, as w4a8.requant_job does, and hands back what the per-job path would decide otherwise (zero
points all 8: lossless there; close calls: torch decides them there; a v1 F nibble, which the
reader notes; a g_idx that is not trivial; a refusal). Their stats are requant_job's info dict.
Float sources go the same way (``reader.float_in_place``: bf16/f16/f32 weights, or e4m3 with block
scales, E2M1 pairs with E8M0/E4M3 block scales and NVFP4's global scale, as the float, FP8 and FP4
readers read them; ``reader.mlx_in_place``: MLX affine words, scales and biases;
``reader.gguf_in_place``: GGUF blocks of the types gguf_checkpoint.GGUF_TYPES names):
requant_batch decodes them to float32 as the readers do, a row at a time inside the job, and runs
the float search of w4a8.requantize (GGUF Q4_0: the codes and zero points the reader gives, and
their search); a NaN byte or a bad scale is handed back, and the reader words the refusal.
"""

from __future__ import annotations

import os

from .error_stats import module_stats
from .errors import OutputError
from .groups import block, normalize_group, scale_dtype
from .plan import Job
from .records import Packing
from .output_folder.buffer_pool import BufferPool
from .output_folder.writer import PAGE, check_scale_bytes, to_bytes

# kernels, kleidiai and numpy: imported when the work starts, not with convert (none imports torch)
# (a dry run plans without them)

__all__ = ["ENABLED", "BATCH_BYTES", "units", "reserve_buffers", "run_batch", "buffer_positions", "FIELDS", "KINDS"]

ENABLED = os.environ.get("INT4PACK_BATCH", "1").strip() not in ("0", "false", "no", "off")
# a module's output bytes at most: a module up to this size goes as a batch of its own, so that
# the dense linears of a 30B-A3B model (8.4 MB int8 q_proj in the default format) need no torch
MODULE_BYTES = 16 << 20
# output bytes a batch of several modules gathers at most: small, as each batch in flight holds its
# buffer and its source bytes mapped (16 workers with 16 MB batches of FP8 reached 0.8 GB)
BATCH_BYTES = 4 << 20
BUFFERS = 8  # batch buffers at least: computing, or queued behind the disk (~136 MB of address space)
QUEUED = 4  # buffers beyond one per worker: written batches queued behind the disk
BATCH_MODULES = 64
KINDS = ("lossless", "requant")  # the predicted paths a batch runs (one kind per batch)
FIELDS = 24  # int64 per module in the descriptor (convert_kernels.h, BatchField)
_SCALE_TYPES = {"F32": 0, "F16": 1, "BF16": 2}
# float sources (convert_kernels.h, FloatSource, MiniScaleType): the weight's kind, its block scales' type
_FLOAT_WEIGHTS = {"BF16": 10, "F16": 11, "F32": 12, "F8_E4M3": 13, "U8": 14, "I8": 14}  # U8/I8: E2M1 pairs
_BLOCK_SCALES = {"F32": 0, "F16": 1, "BF16": 2, "F8_E8M0": 3, "U8": 3, "F8_E4M3": 4}
_DECODED, _MLX, _GGUF = 10, 15, 16  # the first FloatSource layout; MLX affine words, GGUF blocks
_GGUF_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14,
               "IQ4_NL": 20, "IQ4_XS": 23, "MXFP4": 39}  # ggml's type numbers (GgufType)
# descriptor columns (BatchField)
(_LAYOUT, _WORDS, _D0, _D1, _N, _K, _SCALES, _STYPE, _KN, _GS, _ZEROS, _ZBYTES, _ZBYTE, _GIDX, _GITEM,
 _GGROUP, _SRCG, _G, _BF16, _OUTQ, _OUTS, _OUTBLOB, _BLOBBYTES) = range(23)
_CRC_A, _CRC_B, _ZLIB_Q, _ZLIB_S, _ZLIB_BLOB, _KEPT_INTS = 4, 5, 6, 7, 8, 9  # result columns (BatchResult)


def _source(reader, job: Job, packed: bool) -> tuple | None:
    """(kind, source shard, the module's descriptor row, its tensors' byte ranges there, None) of a job
    the batch takes, or None. A module whose tensors lie in several source files is staged: its
    source is None, its row points into a buffer of its own, and the last item lists the tensors to
    read into it at those offsets."""
    if job.kind != "linear" or len(job.specs) != 1:
        return None
    spec = job.specs[0]
    n, k, g = spec.n, spec.k, job.group_size
    kind = job.paths.get(spec.name)
    if kind not in KINDS or g is None or (g != -1 and (g <= 0 or g >= k or k % g)):
        return None
    if kind == "requant":
        for decoded in (_float_row, _mlx_row, _gguf_row):
            got = decoded(reader, job, spec, g, packed)
            if got is not None:
                return got
    where = reader.in_place(spec) if hasattr(reader, "in_place") else None
    if where is None:
        return None
    layout, words, scales, kn, zeros, zbyte, gidx = where
    stype = _SCALE_TYPES.get(scales.dtype)
    files = {words.file, scales.file} | {t.file for t in (zeros, gidx) if t is not None}
    if stype is None or words.dtype != "I32" or len(words.shape) != 2 or \
            scales.numel != n * spec.groups or (gidx is not None and tuple(gidx.shape) != (k,)):
        return None
    if kind == "lossless" and layout not in (Packing.GPTQ, Packing.CT):
        return None
    if kind == "requant" and not _requant_source(layout, words, zeros, n, k, spec):
        return None
    if not _outputs_fit(job, n, k, g, packed):
        return None
    parts = [t for t in (words, scales, zeros, gidx) if t is not None]
    at, staged = _places(parts, files)
    gb = block(k, g)
    row = [layout, at[id(words)], words.shape[0], words.shape[1], n, k, at[id(scales)], stype, int(kn),
           spec.groups, -1 if zeros is None else at[id(zeros)], 0 if zeros is None else zeros.nbytes, zbyte,
           -1 if gidx is None else at[id(gidx)], 0 if gidx is None else (8 if gidx.dtype == "I64" else 4),
           spec.group_size, block(k, spec.group_size), gb, int(scale_dtype(g) == "bfloat16"), -1, -1, -1, 0, 0]
    return _answer(kind, row, parts, staged)


def _outputs_fit(job: Job, n: int, k: int, g: int, packed: bool) -> bool:
    """Whether the job's planned outputs are what the batch writes: the blob, or the int8 weight and scales."""
    from . import kleidiai

    gb = block(k, g)
    outs = job.outputs
    if packed:
        return len(outs) == 1 and outs[0].shape == (kleidiai.packed_size(n, k, gb),)
    return len(outs) == 2 and outs[0].nbytes == n * k and \
        outs[1].nbytes == n * (k // gb) * (4 if scale_dtype(g) == "float32" else 2)


def _places(parts: list, files: set) -> tuple[dict, list | None]:
    """Each tensor's offset in the mapped source shard, or (tensors in several files: staged) at a
    64-byte boundary of the module's own buffer, with the staging list."""
    at = {id(t): t.begin for t in parts}
    staged = None
    if len(files) > 1:
        staged, end = [], 0
        for t in parts:
            staged.append((t, end))
            at[id(t)], end = end, end + -(-t.nbytes // 64) * 64
    return at, staged


def _answer(kind: str, row: list, parts: list, staged: list | None) -> tuple:
    if staged is not None:
        return kind, None, row, [], staged
    return kind, parts[0].file, row, [(t.begin, t.end) for t in parts], None


def _decoded_row(job: Job, spec, g: int, packed: bool, layout: int, parts: list, fields: dict) -> tuple | None:
    """_source's answer for a module whose values requant_batch decodes (FloatSource): the descriptor
    row of its weight ``parts[0]`` with ``fields`` (column -> value, or a tensor of ``parts``: its
    offset); None where its outputs are not what the batch writes."""
    from . import kernels

    if not kernels.ext().requant_ok or not _outputs_fit(job, spec.n, spec.k, g, packed):
        return None
    at, staged = _places(parts, {t.file for t in parts})
    row = [0] * FIELDS
    row[_LAYOUT], row[_WORDS], row[_D0], row[_D1], row[_N], row[_K] = layout, at[id(parts[0])], spec.n, spec.k, \
        spec.n, spec.k
    row[_SCALES] = row[_ZEROS] = row[_GIDX] = -1
    row[_G], row[_BF16] = block(spec.k, g), int(scale_dtype(g) == "bfloat16")
    row[_OUTQ], row[_OUTS], row[_OUTBLOB] = -1, -1, -1
    for col, v in fields.items():
        row[col] = at[id(v)] if any(v is t for t in parts) else v
    return _answer("requant", row, parts, staged)


def _float_row(reader, job: Job, spec, g: int, packed: bool) -> tuple | None:
    """A module of a float source (bf16/f16/f32 weights, or e4m3 / E2M1 times block scales:
    ``reader.float_in_place``), which requant_batch decodes as the reader does."""
    import numpy as np

    where = reader.float_in_place(spec) if hasattr(reader, "float_in_place") else None
    if where is None:
        return None
    weight, scales, bn, bk, glob = where
    layout = _FLOAT_WEIGHTS.get(weight.dtype)
    if layout is None or (scales is None) != (weight.dtype in ("BF16", "F16", "F32")):
        return None
    if scales is None:
        return _decoded_row(job, spec, g, packed, layout, [weight], {})
    stype = _BLOCK_SCALES.get(scales.dtype)
    if stype is None:
        return None
    fields = {_SCALES: scales, _STYPE: stype, _GS: -(-spec.k // bk), _GGROUP: bn, _SRCG: bk}
    if glob is not None:  # NVFP4's global scale: how it applies, and its float32 bits
        fields[_ZBYTE], fields[_ZBYTES] = glob[0], int(np.float32(glob[1]).view(np.uint32))
    return _decoded_row(job, spec, g, packed, layout, [weight, scales], fields)


def _mlx_row(reader, job: Job, spec, g: int, packed: bool) -> tuple | None:
    """A module of an MLX affine source (``reader.mlx_in_place``: its words, scales and biases, bits
    and group), which requant_batch decodes as mlx_checkpoint.dequantize does."""
    where = reader.mlx_in_place(spec) if hasattr(reader, "mlx_in_place") else None
    if where is None:
        return None
    words, scales, biases, bits, group = where
    stype = _SCALE_TYPES.get(scales.dtype)
    if stype is None or biases.dtype != scales.dtype or words.dtype != "U32":
        return None
    return _decoded_row(job, spec, g, packed, _MLX, [words, scales, biases],
                        {_SCALES: scales, _STYPE: stype, _ZEROS: biases, _ZBYTE: bits, _SRCG: group,
                         _GS: spec.k // group})


def _gguf_row(reader, job: Job, spec, g: int, packed: bool) -> tuple | None:
    """A module of a GGUF source (``reader.gguf_in_place``: its block bytes [N, bytes per row] and ggml
    type), which requant_batch decodes as gguf.quants.dequantize does (Q4_0: into the codes and
    zero points the reader gives)."""
    where = reader.gguf_in_place(spec) if hasattr(reader, "gguf_in_place") else None
    if where is None:
        return None
    blocks, qtype = where
    number = _GGUF_TYPES.get(qtype)
    if number is None or blocks.dtype != "U8" or len(blocks.shape) != 2:
        return None
    return _decoded_row(job, spec, g, packed, _GGUF, [blocks], {_STYPE: number, _D1: blocks.shape[1]})


def _requant_source(layout, words, zeros, n: int, k: int, spec) -> bool:
    """Whether requant_batch reads this module as the per-job path's reader does: GPTQ, AWQ or
    compressed-tensors words of the spec's shape, with their packed zero points, whole source groups."""
    from . import kernels

    if not kernels.ext().requant_ok or zeros is None or zeros.dtype != "I32" or \
            spec.groups * block(k, spec.group_size) != k:
        return False
    if layout == Packing.GPTQ:
        shape, zw = (k // 8, n), -(-n // 8)
        if k % 8:
            return False
    elif layout == Packing.AWQ:
        shape, zw = (k, n // 8), n // 8
        if n % 8:
            return False
    elif layout == Packing.CT:
        shape, zw = (n, -(-k // 8)), -(-n // 8)
        if tuple(zeros.shape) != (zw, spec.groups):
            return False
    else:
        return False
    return tuple(words.shape) == shape and zeros.nbytes == spec.groups * zw * 4


class Batch:
    """Consecutive jobs run in one C++ call: their descriptor rows and where their source lies."""

    __slots__ = ("jobs", "rows", "shard", "source", "spans", "out_bytes", "kind", "staged")

    def __init__(self, shard: str, source: str | None, kind: str = "lossless", staged: list | None = None):
        self.jobs: list[Job] = []
        self.rows: list[list[int]] = []
        self.shard, self.source, self.kind = shard, source, kind
        self.spans: list[tuple[int, int]] = []  # the source tensors' byte ranges
        self.out_bytes = 0
        # one module whose tensors lie in several source files: (tensor, offset) in a buffer of its own
        self.staged = staged

    def extents(self, gap: int = 1 << 18) -> list[tuple[int, int]]:
        """The source ranges to map, merged where less than ``gap`` apart: a shard may keep each
        kind of tensor (words, scales, zeros) in a region of its own, so one range could span it."""
        out: list[list[int]] = []
        for lo, hi in sorted(self.spans):
            if out and lo - out[-1][1] < gap:
                out[-1][1] = max(out[-1][1], hi)
            else:
                out.append([lo, hi])
        return [(lo, hi) for lo, hi in out]


def units(jobs: list[Job], reader, shard_of: dict[str, str], trusted: set[str], packed: bool, alone=None):
    """The jobs in plan order, runs of batchable ones gathered into Batches (a run of one too: a
    dense linear between copies, which then needs no torch). Nothing is batched without the C++
    library or with INT4PACK_BATCH=0; ``alone(job)``: true for a job that must go per job."""
    from . import kernels

    if not ENABLED or kernels.ext() is None:
        yield from jobs
        return
    cur: Batch | None = None

    def flush():
        nonlocal cur
        done, cur = cur, None
        if done is None:
            return
        yield done

    for job in jobs:
        got = None if alone is not None and alone(job) else _source(reader, job, packed)
        shard = shard_of.get(job.outputs[0].name)
        nbytes = sum(t.nbytes for t in job.outputs)
        if got is None or shard in trusted or nbytes > MODULE_BYTES or \
                any(shard_of.get(t.name) != shard for t in job.outputs):
            yield from flush()
            yield job
            continue
        kind, source, row, spans, staged = got
        if staged is not None:  # a batch of its own, read into a buffer of its own
            yield from flush()
            one = Batch(shard, None, kind, staged)
            one.jobs.append(job)
            one.rows.append(row)
            one.out_bytes = nbytes
            yield one
            continue
        if cur is not None and (cur.shard != shard or cur.source != source or cur.kind != kind
                                or len(cur.jobs) >= BATCH_MODULES or cur.out_bytes + nbytes > BATCH_BYTES):
            yield from flush()
        if cur is None:
            cur = Batch(shard, source, kind)
        cur.jobs.append(job)
        cur.rows.append(row)
        cur.spans.extend(spans)
        cur.out_bytes += nbytes
    yield from flush()


# a batch's output, in file order; room for a page's shift at each of its outputs (run_batch)
_buffers = BufferPool(BUFFERS, MODULE_BYTES + 2 * BATCH_MODULES * PAGE)


def reserve_buffers(workers: int) -> None:
    """A buffer for every worker and QUEUED more: a batch takes its buffer before it computes, so
    with fewer the other workers wait while cores sit idle (16 workers sharing 8 buffers kept 6.5
    of a 16-core host's vCPUs busy on an FP8 source)."""
    _buffers.resize(max(BUFFERS, workers + QUEUED))


def _stats(error_stats, tot: list[float], role, g: int) -> dict:
    """convert._w_stats of a lossless W4A8Linear (w4a8.lossless_job's error dict); ``error_stats``:
    scale_search.ErrorStats (imported once per batch: an import statement per module cost ~50 µs)."""
    st = error_stats()
    st.dd, st.ww, st.vv, st.wv, st.max_abs = tot
    e = st.result()
    return module_stats("lossless", role, g, {**e, "baseline_rel_l2": None, "exact_ints": True})


def _requant_stats(kernels, tot: list[float], zero_groups: int, role, g: int) -> dict:
    """convert._w_stats of a requantised W4A8Linear (w4a8.requant_job's info dict)."""
    info = kernels.requant_info(True, tot, zero_groups)
    info["exact_ints"] = False
    return module_stats("requant", role, g, info)


def buffer_positions(places: list[tuple[int, int]]) -> list[int]:
    """Positions in a page-aligned buffer for tensors at (data offset, bytes) in file order: next to
    each other as in the file, each run of neighbours as far into a page as its first offset, so
    that the writer sends their whole pages directly (ShardFile.write_batch)."""
    pos, end, out = 0, None, []
    for begin, nbytes in places:
        if begin != end:
            pos += (begin - pos) % PAGE
        out.append(pos)
        pos, end = pos + nbytes, begin + nbytes
    return out


def run_batch(b: Batch, ckpt, plan, shard_file, rename: dict, packed: bool, per_job) -> list[tuple[dict, set]]:
    """Convert a Batch and write its tensors; returns each job's (stats, written names) as convert's
    per-job ``work`` does. ``per_job(job)`` gives a job's (tensors, stats) by the per-job path (for
    a module the C++ hands back)."""
    f = shard_file(b.shard)
    places = []  # the buffer in file order (buffer_positions)
    for i, job in enumerate(b.jobs):
        for j, t in enumerate(job.outputs):
            out = rename.get(t.name, t.name)
            places.append((f.place(out)[1], out, t.nbytes, i, j))
    places.sort()
    pos = buffer_positions([(begin, nbytes) for begin, _, nbytes, _, _ in places])
    at = {(i, j): p for (_, _, _, i, j), p in zip(places, pos)}
    end = pos[-1] + places[-1][2] if places else 0
    if end > _buffers.nbytes:
        raise OutputError(f"internal: a batch of {end} bytes, more than {_buffers.nbytes}")
    buf = _buffers.take()
    try:
        answers, crcs = _run(b, ckpt, plan, rename, packed, per_job, at, buf)
    except BaseException:
        _buffers.give(buf)
        raise
    # the writer gives the buffer back once its bytes are written
    f.write_batch([(out, at[i, j], crcs[i, j]) for _, out, _, i, j in places], buf, _buffers.give)
    return answers


def _run(b: Batch, ckpt, plan, rename: dict, packed: bool, per_job, at: dict, buf: memoryview):
    """The C++ call and each job's stats and CRCs (its handed-back modules' bytes copied into ``buf``)."""
    import numpy as np

    from . import kernels
    from .error_stats import ErrorStats

    desc = np.array(b.rows, dtype=np.int64)
    for i, job in enumerate(b.jobs):
        if packed:
            desc[i, _OUTBLOB], desc[i, _BLOBBYTES] = at[i, 0], job.outputs[0].nbytes
        else:
            desc[i, _OUTQ], desc[i, _OUTS] = at[i, 0], at[i, 1]
    staged = None
    if b.staged is not None:
        staged = np.zeros(max(off + t.nbytes for t, off in b.staged), dtype=np.uint8)
        for t, off in b.staged:
            ckpt.read_into(t.name, memoryview(staged)[off:off + t.nbytes])
        addr, length, extents = staged.ctypes.data, staged.nbytes, []
    else:
        addr, length = ckpt.mapping(b.source)
        extents = b.extents()
    for lo, hi in extents:
        ckpt.populate(b.source, lo, hi)
    if packed:  # the scales go into blobs unseen by the writer's check: the source's, before the C++ reads them
        for job, row in zip(b.jobs, b.rows):
            if row[_LAYOUT] >= _DECODED:  # a decoded source's scales are the search's
                continue
            sc = plan.reader.in_place(job.specs[0])[2]
            # read (pread), not checked in the mapping: numpy on a page of a shard cut under it would end the process
            check_scale_bytes(sc.name, ckpt.read_bytes(sc.name), sc.dtype)
    requant = b.kind == "requant"
    try:
        if requant:
            coarse, fine = kernels.search_arrays(True)  # convert searches (to_w4a8's default); no torch
            res, tot, zgroups = kernels.ext().requant_batch(addr, length, desc, buf, coarse, fine,
                                                            kernels.kernel_threads())
            zgroups = zgroups.tolist()
        else:
            res, tot = kernels.ext().lossless_batch(addr, length, desc, buf, kernels.kernel_threads())
    finally:
        for lo, hi in extents:
            ckpt.release_range(b.source, lo, hi)
    res, tot = res.tolist(), tot.tolist()
    roles = plan.layout.roles
    crcs: dict[tuple[int, int], int] = {}
    answers = []
    for i, job in enumerate(b.jobs):
        r = res[i]
        name = job.specs[0].name
        if r[0]:  # handed back: the per-job path converts it (or raises its refusal)
            tensors, stats = per_job(job)
            for j, (tname, data) in enumerate(tensors):
                if tname != job.outputs[j].name:
                    raise OutputError(f"internal: the per-job path gave {tname}, planned {job.outputs[j].name}",
                                      tensor=tname)
                raw = to_bytes(data)
                if len(raw) != job.outputs[j].nbytes:
                    raise OutputError(f"internal: {tname} has {len(raw)} bytes, planned {job.outputs[j].nbytes}",
                                      tensor=tname)
                buf[at[i, j]: at[i, j] + len(raw)] = raw
                crcs[i, j] = kernels.crc32c(raw)
        else:
            g = job.group_size
            if requant and not r[_KEPT_INTS]:
                stats = {name: _requant_stats(kernels, tot[i], zgroups[i], roles[name],
                                              normalize_group(g, job.specs[0].k))}
            else:  # lossless (in a requant batch: a GGUF Q4_0 module whose ints it kept)
                stats = {name: _stats(ErrorStats, tot[i][:5], roles[name], normalize_group(g, job.specs[0].k))}
            if packed:
                spec = job.specs[0]
                stats[name]["packed"] = {"n": spec.n, "k": spec.k, "group_size": g, "bias": False,
                                         "crc32_q": f"{r[_ZLIB_Q]:08x}", "crc32_scales": f"{r[_ZLIB_S]:08x}",
                                         "crc32_bias": None, "crc32": f"{r[_ZLIB_BLOB]:08x}"}
                crcs[i, 0] = r[_CRC_A]
            else:
                crcs[i, 0], crcs[i, 1] = r[_CRC_A], r[_CRC_B]
        answers.append((stats, {t.name for t in job.outputs}))
    return answers, crcs
