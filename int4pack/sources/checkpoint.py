"""A Hugging Face checkpoint on disk: config, shard index and lazy tensor access.

Nothing here loads the model: headers are parsed (and checked) up front (safetensors_header.py),
tensors are read one at a time through a read-only, copy-on-write mmap of their shard. The source
folder (found by source_folder.py) is never written to.

Long: the mappings, the positional reads and the size checks that keep a shrinking shard from
killing the process (SIGBUS) share one per-shard state (descriptors, maps, header ends); split,
each part would reach into the others. A shard cut while a C++ kernel is inside its mapped bytes
is caught by the library's guard (csrc/fault_guard.h); ``faults_named`` words it as the same
truncated-shard error.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref
from contextlib import contextmanager
from pathlib import Path

from . import safetensors_header
from .._lazy import gc_paused, torch
from ..errors import InputError, SourceBytesVanished
from ..families import resolve_type
# the header's names that the planner and convert take from here
from .safetensors_header import (DTYPE_KEY, ITEMSIZE, NUMPY_DTYPES, NUMPY_VIEW, TensorInfo, read_header,
                                 torch_dtype)
from .source_folder import link_roots, load_json, not_a_file, resolve_source

__all__ = [
    "DTYPES",
    "DTYPE_NAMES",
    "TensorInfo",
    "TensorBytes",
    "Checkpoint",
    "read_header",
    "resolve_source",
]


def __getattr__(name: str):
    """DTYPES and DTYPE_NAMES, as safetensors_header builds them on first use."""
    if name in ("DTYPES", "DTYPE_NAMES"):
        return getattr(safetensors_header, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # not named by Python before 3.13


def _libc_madvise():
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        return fn
    except (OSError, AttributeError, TypeError):
        return None


# madvise through ctypes, which lets go of the GIL for the call: mmap.madvise holds it while the
# kernel maps or drops a tensor's pages (~0.1 ms each), and convert's workers queued behind it
_MADVISE = _libc_madvise()


def _map_address(m: mmap.mmap) -> int | None:
    """The address of a (writable, copy-on-write) mapping's first byte, or None."""
    try:
        head = ctypes.c_char.from_buffer(m)
        addr = ctypes.addressof(head)
        del head  # releases the buffer export at once: the mapping can still be closed
        return addr
    except (TypeError, ValueError, BufferError):
        return None


_FAULT_AROUND = 1 << 21  # a fault maps resident pages around it: up to a whole large folio (<= 2 MB)

# files that describe the source's quantisation and must not reach the output (vLLM reads hf_quant_config.json)
SOURCE_QUANT_FILES = {"quantize_config.json", "quant_config.json", "quantization_config.json", "recipe.yaml", "hf_quant_config.json"}


# float dtype -> (unsigned view, exponent mask): a value is NaN or infinite when all its exponent bits are set
_EXPONENT = {"BF16": ("uint16", 0x7F80), "F16": ("uint16", 0x7C00), "F32": ("uint32", 0x7F800000),
             "F64": ("uint64", 0x7FF0000000000000)}


class TensorBytes:
    """One tensor's bytes, read in chunks when written (a copied embedding never sits in memory).
    A float tensor's chunks are checked for NaN and infinity on the way: a copied router or norm
    holding one would make every output of the model NaN, so it is named here, at convert."""

    CHUNK = 1 << 24

    def __init__(self, ckpt: "Checkpoint", name: str, nbytes: int):
        self.ckpt, self.name, self.nbytes = ckpt, name, nbytes

    def chunks(self):
        import numpy as np  # here: a Checkpoint opened for its config and headers needs no numpy

        buf = bytearray(min(self.CHUNK, self.nbytes))
        mv = memoryview(buf)
        exp = _EXPONENT.get(self.ckpt.tensors[self.name].dtype)
        if exp is not None:
            view, mask = np.dtype(exp[0]), exp[1]
            bits = np.empty(len(buf) // view.itemsize, dtype=view)
        for off in range(0, self.nbytes, self.CHUNK):
            n = min(self.CHUNK, self.nbytes - off)
            self.ckpt.read_into(self.name, mv[:n], off)
            if exp is not None:
                x = np.frombuffer(mv[:n], dtype=view)
                np.bitwise_and(x, mask, out=bits[: x.size])
                hit = np.flatnonzero(bits[: x.size] == mask)
                if hit.size:
                    t = self.ckpt.tensors[self.name]
                    raise InputError(f"tensor {self.name!r} ({t.file}) holds {hit.size} NaN or infinite value(s) "
                                     f"(the first at element {off // view.itemsize + int(hit[0])})",
                                     path=str(self.ckpt.folder / t.file), tensor=self.name,
                                     hint="The source is damaged (no model computes with NaN weights); "
                                          "download it again.")
            yield mv[:n]


def _close_fds(fds: dict[str, int]) -> None:
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


class Checkpoint:
    """Config, index and lazily read tensors of one checkpoint folder."""

    # how the container holds the experts where that is not the family's own layout (GGUF, MLX): inspect says so
    expert_layout: str | None = None

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        cfg_path = self.folder / "config.json"
        self._roots = link_roots(self.folder)
        try:
            entries = sorted(os.scandir(self.folder), key=lambda e: e.name)
        except OSError:
            entries = []
        for ent in entries:  # up front: nothing is read or written before a bad link is refused
            if ent.is_symlink() and not ent.name.startswith("."):
                self.check_link(Path(ent.path))
        if not cfg_path.is_file():
            why = not_a_file(cfg_path)
            raise InputError(f"{self.folder}: no config.json" if why == "is missing" else f"{cfg_path}: {why}",
                             path=str(cfg_path),
                             hint="Pass a Hugging Face model folder (config.json + *.safetensors).")
        self.config: dict = load_json(cfg_path)
        if "text_config" in self.config and not isinstance(self.config["text_config"], (dict, type(None))):
            raise InputError(f"{cfg_path}: text_config is a {type(self.config['text_config']).__name__}, "
                             "not an object", path=str(cfg_path), hint="Fix or re-download config.json.")
        self.quant_config_path: Path | None = None
        self.quant_config: dict | None = self._find_quant_config()
        self.tensors: dict[str, TensorInfo] = {}
        self.shard_metadata: dict[str, dict[str, str]] = {}
        self.index_path: Path | None = None
        self._load_index()
        self._start_io()

    def check_link(self, path: Path) -> None:
        """Refuse a file of the checkpoint that is a symlink resolving outside the model folder
        (or, for a hub snapshot, outside its repo's ``blobs/``): a source never reads or copies
        a file from elsewhere."""
        if not os.path.islink(path):
            return
        target = Path(os.path.realpath(path))
        if any(target == r or r in target.parents for r in self._roots):
            return
        raise InputError(f"{path}: a symlink to {target}, outside the model folder", path=str(path),
                         hint="Copy the file into the model folder (or remove the link); int4pack follows links "
                              "only inside the folder or, for a hub snapshot, into the repo's blobs/.")

    def _add_shard(self, shard: str) -> None:
        """Index one shard's tensors from its header."""
        sp = self.folder / shard
        self.check_link(sp)
        header, meta, start = read_header(sp)
        self.shard_metadata[shard] = meta
        shapes: dict[tuple, tuple] = {}  # one tuple per distinct shape: they repeat per expert
        for name, info in header.items():
            if name in self.tensors:
                raise InputError(
                    f"tensor {name!r} is stored twice: in {self.tensors[name].file} and {shard}",
                    path=str(sp), tensor=name, hint="The checkpoint is inconsistent; re-download it.")
            b, e = info["data_offsets"]
            shape = tuple(info["shape"])
            self.tensors[name] = TensorInfo(name, shard, DTYPE_KEY[info["dtype"]],
                                            shapes.setdefault(shape, shape), start + b, start + e)

    def _start_io(self) -> None:
        """The mappings and descriptors of the lazy reads."""
        self._maps: dict[str, mmap.mmap] = {}
        self._mapped: set[str] = set()  # tensors ever read through the mapping (raw, view): release's work
        self._addrs: dict[str, int | None] = {}  # each mapping's address, for madvise without the GIL
        # one read-only descriptor per shard for the positional reads: an open and close per
        # small tensor (scales, zeros, g_idx: three a module) would cost more than the read
        self._fds: dict[str, int] = {}
        self._ends: dict[str, int] = {}  # shard -> the end of its last tensor (_shard_end)
        self._fds_lock = threading.Lock()
        self._maps_lock = threading.Lock()
        weakref.finalize(self, _close_fds, self._fds)  # a Checkpoint dropped without close()

    # -- discovery -----------------------------------------------------------------
    def _find_quant_config(self) -> dict | None:
        c = self.config
        for q in (c.get("quantization_config"), (c.get("text_config") or {}).get("quantization_config"),
                  c.get("compression_config")):
            if isinstance(q, dict):
                self.quant_config_path = self.folder / "config.json"
                return q
        for side in ("quantize_config.json", "quant_config.json"):
            p = self.folder / side
            self.check_link(p)
            if p.is_file():
                self.quant_config_path = p
                return load_json(p)
        return None

    @gc_paused()  # one record per tensor, living as long as the checkpoint
    def _load_index(self) -> None:
        idx = self.folder / "model.safetensors.index.json"
        self.check_link(idx)
        if os.path.lexists(idx) and not idx.is_file():
            raise InputError(f"{idx}: {not_a_file(idx)}", path=str(idx),
                             hint="Re-download the index file (or remove it for a single-shard checkpoint).")
        if idx.is_file():
            self.index_path = idx
            data = load_json(idx)
            wmap = data.get("weight_map")
            if not isinstance(wmap, dict) or not wmap:
                raise InputError(f"{idx.name}: has no weight_map", path=str(idx),
                                 hint="Re-download the index file.")
            plain: set[str] = set()  # shard names already checked: one Path each, not one per tensor
            for name, shard in wmap.items():
                if isinstance(shard, str) and shard in plain:
                    continue
                # a plain file name in this folder: never a path that leaves it
                if not isinstance(shard, str) or not shard or Path(shard).name != shard or shard in (".", ".."):
                    raise InputError(f"{idx.name}: tensor {name!r} is mapped to {shard!r}, which is not a file "
                                     "name in the checkpoint folder", path=str(idx), tensor=name,
                                     hint="The index is corrupt; re-download it.")
                plain.add(shard)
            shards = sorted(plain)
        else:
            wmap = None
            shards = sorted(p.name for p in self.folder.glob("*.safetensors"))
            if not shards:
                others = sorted(p.name for p in self.folder.iterdir()
                                if p.suffix in {".bin", ".pt", ".pth", ".gguf"})
                hint = ("Only safetensors checkpoints are supported; convert the .bin files with "
                        "transformers' save_pretrained(safe_serialization=True)." if others else
                        "Pass a folder with *.safetensors shards.")
                raise InputError(f"{self.folder}: no *.safetensors files", path=str(self.folder), hint=hint)
        for shard in shards:
            sp = self.folder / shard
            if not sp.is_file():
                why = not_a_file(sp)
                where = "listed in model.safetensors.index.json but" if wmap is not None else "found, but it"
                raise InputError(f"{shard}: {where} {why}", path=str(sp),
                                 hint="The download is incomplete or damaged; fetch the shard again.")
            self._add_shard(shard)
        if wmap is not None:
            for name, shard in wmap.items():
                if name not in self.tensors:
                    raise InputError(f"tensor {name!r}: the index puts it in {shard}, which does not hold it",
                                     path=str(self.folder / shard), tensor=name,
                                     hint="The index and shards disagree; re-download the checkpoint.")
                if self.tensors[name].file != shard:
                    raise InputError(
                        f"tensor {name!r}: the index puts it in {shard} but it is in {self.tensors[name].file}",
                        path=str(self.folder / shard), tensor=name,
                        hint="The index and shards disagree; re-download the checkpoint.")
            extra = sorted(set(self.tensors) - set(wmap))
            if extra:
                raise InputError(f"tensor {extra[0]!r} (and {len(extra) - 1} more) is in a shard but not "
                                 "in model.safetensors.index.json", tensor=extra[0],
                                 hint="The index is stale; re-download the checkpoint.")

    # -- access ----------------------------------------------------------------------
    @property
    def shards(self) -> list[str]:
        return sorted({t.file for t in self.tensors.values()})

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise InputError(f"tensor {name!r} not found in {self.folder}", tensor=name) from None

    def _map(self, shard: str) -> mmap.mmap:
        m = self._maps.get(shard)
        if m is not None:
            return m
        # one mapping per shard, ever: two threads mapping it at once would replace the first map,
        # unmapping it under a reader still using its address (convert's batches read by address)
        with self._maps_lock:
            m = self._maps.get(shard)
            if m is None:
                path = self.folder / shard
                try:
                    with open(path, "rb") as fh:
                        # ACCESS_COPY: private copy-on-write pages, so writes can never reach the file
                        m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
                except (OSError, ValueError) as e:
                    raise InputError(f"{shard}: cannot map the file ({e})", path=str(path)) from e
                if len(m) < self._shard_end(shard):
                    size = len(m)
                    m.close()
                    raise self._truncated(shard, size, self._shard_end(shard))
                self._addrs[shard] = _map_address(m)
                self._maps[shard] = m
        return m

    def _madvise(self, shard: str, off: int, length: int, advice: int) -> None:
        """madvise on part of a shard's mapping without holding the GIL; raises OSError on failure."""
        m, addr = self._maps[shard], self._addrs.get(shard)
        if _MADVISE is None or addr is None:
            m.madvise(advice, off, length)
            return
        if off < 0 or length < 0 or off + length > len(m):
            raise ValueError("madvise range outside the mapping")
        if _MADVISE(addr + off, length, advice) != 0:
            raise OSError(ctypes.get_errno(), "madvise failed")

    def _check_size(self, shard: str, end: int, name: str | None = None) -> None:
        """Refuse to touch mapped bytes below ``end`` of a shard that no longer has them: a read of a
        mapped page past the end of a file that shrank kills the process with SIGBUS. One fstat
        (about a microsecond) before each mapped read."""
        try:
            size = os.fstat(self._fd(shard)).st_size
        except OSError as e:
            raise InputError(f"{shard}: cannot read ({e.strerror})", path=str(self.folder / shard)) from e
        if size < end:
            raise self._truncated(shard, size, end, name)

    def _truncated(self, shard: str, size: int, end: int, name: str | None = None) -> InputError:
        what = f" while reading {name!r}" if name else ""
        return InputError(f"{shard}: truncated{what}: the file is {size} bytes now, its header needs {end}",
                          path=str(self.folder / shard), tensor=name,
                          hint="The shard changed or shrank while int4pack read it (another process writing "
                               "it, or a full disk); download it again.")

    @contextmanager
    def faults_named(self):
        """C++ kernels run inside: source bytes that vanished under one (SourceBytesVanished, a shard
        cut while the kernel read its mapped pages) raise the error naming that shard instead."""
        try:
            yield
        except SourceBytesVanished as e:
            raise self.vanished(e) from e

    def vanished(self, e: SourceBytesVanished) -> Exception:
        """The error for mapped bytes that vanished under a kernel: the shard whose mapping holds the
        faulting address, as its size check words it (truncated), or, at its full size still,
        unreadable there (its storage failed); else the first mapped shard that is now shorter
        than its header says; else ``e`` itself (no mapping of this checkpoint lost bytes)."""
        hit = [s for s, a in list(self._addrs.items())
               if a is not None and s in self._maps and a <= e.address < a + len(self._maps[s])]
        for shard in hit or list(self._maps):
            try:
                self._check_size(shard, self._shard_end(shard))
            except InputError as err:
                return err
        if not hit:
            return e
        shard = hit[0]
        return InputError(f"{shard}: its bytes at offset {e.address - self._addrs[shard]} could not be read while "
                          "int4pack used them", path=str(self.folder / shard),
                          hint="The disk or file system holding the shard failed a read (see the system log), or "
                               "the file changed; check the storage and download the shard again.")

    def raw(self, name: str) -> memoryview:
        """The tensor's bytes, zero-copy."""
        t = self.info(name)
        m = self._map(t.file)
        self._mapped.add(name)
        self._check_size(t.file, t.end, name)
        if t.end > len(m):
            raise InputError(f"{t.file}: truncated while reading {name!r}", path=str(self.folder / t.file),
                             tensor=name, hint="The shard changed or is truncated; download it again.")
        return memoryview(m)[t.begin:t.end]

    def get(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor, read into memory of its own (pread: no mapped pages stay counted in RSS).
        ``out``: a contiguous tensor of its dtype and size to read into instead (a reused buffer),
        returned viewed in the tensor's shape; one that does not fit is left alone."""
        t = self.info(name)
        dt = torch_dtype(t.dtype)
        if out is not None and out.dtype == dt and out.numel() == t.numel and out.is_contiguous() \
                and out.device.type == "cpu":
            out = out.view(t.shape)
        else:
            out = torch.empty(t.shape, dtype=dt)
        if t.end > t.begin:
            # read through a numpy view of the same itemsize (numpy has no bf16/fp8): no dtype views after
            same_size = NUMPY_VIEW.get(t.dtype)
            self._read(t, (out.view(getattr(torch, same_size)) if same_size else out).numpy(), 0, t.nbytes)
        return out

    def array(self, name: str):
        """The tensor as a numpy array in memory of its own, without torch (the plan's small reads).
        Raises InputError for a dtype numpy does not have (bf16, fp8)."""
        import numpy as np  # here: a Checkpoint opened for its config and headers needs no numpy

        t = self.info(name)
        dt = NUMPY_DTYPES.get(t.dtype)
        if dt is None:
            raise InputError(f"tensor {name!r} is {t.dtype}, which numpy cannot read", tensor=name)
        return np.frombuffer(self.read_bytes(name), dtype=dt).reshape(t.shape)

    def read_bytes(self, name: str) -> bytearray:
        """The tensor's bytes in a buffer of their own: cheaper than ``get`` for a comparison or numpy."""
        t = self.info(name)
        buf = bytearray(t.nbytes)
        self._read(t, buf, 0, t.nbytes)
        return buf

    def view(self, name: str) -> torch.Tensor:
        """The tensor straight over the mapped file, no copy (for the large packed weights).

        Pair it with ``release(name)`` once done, which unmaps its pages again so RSS stays bounded
        by the tensors in flight. The mapping is private copy-on-write: nothing can reach the file.
        Falls back to ``get`` (a copy) where the data is not aligned for its dtype, and where the C++
        kernels are not there to read it: torch reading a page of a shard cut under it would end the
        process (SIGBUS), where the kernels' guard turns it into an error (``faults_named``).
        """
        from .. import _ext

        t = self.info(name)
        dt = torch_dtype(t.dtype)
        if t.numel == 0 or t.begin % ITEMSIZE[t.dtype] or _ext.load("convert_kernels") is None:
            return self.get(name)
        mv = self.raw(name)
        lo = t.begin - t.begin % mmap.PAGESIZE
        try:
            # map every page in one call (Linux 5.14+): a minor fault per 4 KB page cost more than the unpacking
            self._madvise(t.file, lo, t.end - lo, _MADV_POPULATE_READ)
        except (OSError, ValueError, AttributeError):
            try:
                self._madvise(t.file, lo, t.end - lo, mmap.MADV_WILLNEED)  # one readahead for the whole tensor
            except (OSError, ValueError, AttributeError):
                pass
        return torch.frombuffer(mv, dtype=dt).view(t.shape)

    def release(self, name: str) -> None:
        """Drop this process's pages of a tensor read with ``view`` (the page cache keeps them)."""
        if name not in self._mapped:  # read with pread only (a module's zeros, scales, g_idx): no pages here
            return  # (a neighbour's fault-around lies inside that neighbour's own 2 MB blocks)
        t = self.tensors.get(name)
        m = self._maps.get(t.file) if t is not None else None
        if m is None or t.end <= t.begin:
            return
        # whole 2 MB blocks: a fault (a populate too) maps the resident pages around it, up to a
        # large folio, so a neighbour read after this tensor is released would map its pages back
        # and they would stay (the RSS would grow with the model). A neighbour still in use just
        # maps its pages again on its next touch (the mapping is never written)
        lo = t.begin - t.begin % _FAULT_AROUND
        hi = min(len(m), -(-t.end // _FAULT_AROUND) * _FAULT_AROUND)
        try:
            self._madvise(t.file, lo, hi - lo, mmap.MADV_DONTNEED)
        except (OSError, ValueError, AttributeError):
            pass

    def mapping(self, shard: str) -> tuple[int | None, int]:
        """(address, length) of a shard's read-only mapping, for C++ that reads tensors in place
        (convert's lossless batch); the address is None where the mapping gives none."""
        m = self._map(shard)
        self._check_size(shard, self._shard_end(shard))
        return self._addrs.get(shard), len(m)

    def _shard_end(self, shard: str) -> int:
        """The end of the last tensor of a shard, as its header says."""
        if shard not in self._ends:
            self._ends[shard] = max((t.end for t in self.tensors.values() if t.file == shard), default=0)
        return self._ends[shard]

    def populate(self, shard: str, begin: int, end: int) -> None:
        """Map the pages of bytes [begin, end) of a shard in one call (what ``view`` does per tensor)."""
        self._check_size(shard, end)
        lo = begin - begin % mmap.PAGESIZE
        for advice in (_MADV_POPULATE_READ, mmap.MADV_WILLNEED):
            try:
                self._madvise(shard, lo, end - lo, advice)
                return
            except (OSError, ValueError, AttributeError):
                continue

    def release_range(self, shard: str, begin: int, end: int) -> None:
        """Drop this process's pages of bytes [begin, end) of a shard, in whole 2 MB blocks (see ``release``)."""
        m = self._maps.get(shard)
        if m is None or end <= begin:
            return
        lo = begin - begin % _FAULT_AROUND
        hi = min(len(m), -(-end // _FAULT_AROUND) * _FAULT_AROUND)
        try:
            self._madvise(shard, lo, hi - lo, mmap.MADV_DONTNEED)
        except (OSError, ValueError, AttributeError):
            pass

    def read_into(self, name: str, buf: memoryview, offset: int = 0) -> None:
        """Fill ``buf`` with the tensor's bytes from ``offset`` on (positional reads, thread-safe)."""
        t = self.info(name)
        want = memoryview(buf).nbytes
        if offset < 0 or offset + want > t.nbytes:
            raise ValueError(f"read of {want} bytes at {offset} outside {name!r} ({t.nbytes} bytes)")
        self._read(t, buf, offset, want)

    def _read(self, t: TensorInfo, buf, offset: int, want: int) -> None:
        """Fill the writable, contiguous ``buf`` (``want`` bytes) from ``offset`` bytes into tensor ``t``."""
        pos = t.begin + offset
        fd = self._fd(t.file)
        try:
            done = os.preadv(fd, [buf], pos)
            if done < want:  # a short read (signal, or the file shrank): go on from where it stopped
                mv = memoryview(buf).cast("B")
                while done < want:
                    k = os.preadv(fd, [mv[done:]], pos + done)
                    if k <= 0:
                        raise InputError(f"{t.file}: truncated while reading {t.name!r}",
                                         path=str(self.folder / t.file), tensor=t.name,
                                         hint="The shard changed or is truncated; download it again.")
                    done += k
        except OSError as e:
            raise InputError(f"{t.file}: cannot read ({e.strerror})", path=str(self.folder / t.file)) from e

    def _fd(self, shard: str) -> int:
        fd = self._fds.get(shard)
        if fd is None:
            path = self.folder / shard
            with self._fds_lock:
                fd = self._fds.get(shard)
                if fd is None:
                    try:
                        fd = self._fds[shard] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                    except OSError as e:
                        raise InputError(f"{shard}: cannot read ({e.strerror})", path=str(path)) from e
        return fd

    def slice(self, name: str) -> "TensorBytes":
        """The tensor's bytes left on disk, for streaming copies in bounded memory."""
        t = self.info(name)
        return TensorBytes(self, name, t.nbytes)

    def close(self) -> None:
        self._addrs.clear()  # first: no madvise may reach an address that is about to be unmapped
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:  # a tensor still references it; the GC will unmap it
                pass
        self._maps.clear()
        with self._fds_lock:
            _close_fds(self._fds)

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- config helpers --------------------------------------------------------------
    @property
    def text_config(self) -> dict:
        """The language model's config (multimodal wrappers nest it)."""
        tc = self.config.get("text_config")
        return tc if isinstance(tc, dict) else self.config

    @property
    def model_type(self) -> str:
        return str(self.text_config.get("model_type") or self.config.get("model_type") or "")

    @property
    def family_type(self) -> str:
        """The model type that names the family (a known wrapper's own type, else the text model's)."""
        return resolve_type(self.config)

    def extra_files(self) -> list[str]:
        """Files to copy to the output as they are (tokenizer, generation config, ...)."""
        skip = {"config.json", "model.safetensors.index.json"} | SOURCE_QUANT_FILES
        out = []
        for p in sorted(self.folder.iterdir()):
            if p.name not in skip and not p.name.startswith("."):
                self.check_link(p)
            if p.is_file() and p.name not in skip and p.suffix not in {".safetensors", ".bin", ".pt", ".pth"} \
                    and not p.name.startswith("."):
                out.append(p.name)
        return out

