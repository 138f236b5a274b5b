"""A Hugging Face checkpoint on disk: config, shard index and lazy tensor access.

Nothing here loads the model: headers are parsed (and checked) up front, tensors are
read one at a time through a read-only, copy-on-write mmap of their shard. The source
folder is never written to.

Long: header checks, source resolution and mapped reads guard one invariant together (a tensor is
read only within its shard's checked header, and its pages are released after use).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

from ._lazy import torch
from .errors import InputError

__all__ = [
    "DTYPES",
    "DTYPE_NAMES",
    "TensorInfo",
    "TensorBytes",
    "Checkpoint",
    "read_header",
    "resolve_source",
]

# safetensors dtype names -> (the torch dtype's name, bytes per element): plain names, so that the
# plan needs no torch (_lazy.py); DTYPES / DTYPE_NAMES (torch dtypes) are built on first use
_DTYPE_SPECS = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "U16": ("uint16", 2),
    "U32": ("uint32", 4),
    "U64": ("uint64", 8),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
}
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # not named by Python before 3.13


def _libc_madvise():
    try:
        import ctypes

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
        import ctypes

        head = ctypes.c_char.from_buffer(m)
        addr = ctypes.addressof(head)
        del head  # releases the buffer export at once: the mapping can still be closed
        return addr
    except (TypeError, ValueError, BufferError):
        return None
_FAULT_AROUND = 1 << 21  # a fault maps resident pages around it: up to a whole large folio (<= 2 MB)
ITEMSIZE = {k: size for k, (_, size) in _DTYPE_SPECS.items()}
_DTYPE_KEY = {k: k for k in _DTYPE_SPECS}  # the shared name string instead of one per tensor from JSON
# same-size dtypes numpy has, to read into a torch tensor through its numpy view
_NUMPY_VIEW = {"BF16": "int16", "F8_E4M3": "uint8", "F8_E5M2": "uint8"}
# the dtypes numpy reads as they are (``Checkpoint.array``)
NUMPY_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
                "U8": "u1", "U16": "<u2", "U32": "<u4", "U64": "<u8", "BOOL": "?"}


def torch_dtype(name: str):
    """The torch dtype of a safetensors dtype name (imports torch)."""
    return getattr(torch, _DTYPE_SPECS[name][0])


def __getattr__(name: str):
    """DTYPES (safetensors name -> torch dtype) and DTYPE_NAMES (the reverse), built on first use."""
    if name in ("DTYPES", "DTYPE_NAMES"):
        dtypes = {k: torch_dtype(k) for k in _DTYPE_SPECS}
        globals().update(DTYPES=dtypes, DTYPE_NAMES={v: k for k, v in dtypes.items()})
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit

# files that describe the source's quantisation and must not reach the output
SOURCE_QUANT_FILES = {"quantize_config.json", "quant_config.json", "recipe.yaml"}


@dataclass(frozen=True, slots=True)  # slots: one per source tensor, alive for the whole run
class TensorInfo:
    """Where one tensor lives; read from the shard header only."""

    name: str
    file: str  # shard file name, relative to the checkpoint folder
    dtype: str  # safetensors dtype name, e.g. "I32"
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the shard
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def read_header(path: Path) -> tuple[dict[str, dict], dict[str, str], int]:
    """Parse and check a safetensors header.

    Returns ``(tensors, metadata, data_start)``; raises InputError naming the file for a
    truncated file, a corrupt or oversized header, or offsets out of range.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise InputError(f"{path.name}: file is {size} bytes, too short for a safetensors header",
                                 path=str(path), hint="The shard is truncated; download it again.")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER or n + 8 > size:
                raise InputError(
                    f"{path.name}: header length {n} is larger than the file ({size} bytes) or than 100 MB",
                    path=str(path), hint="The shard is truncated or not a safetensors file; download it again.")
            blob = fh.read(n)
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})", path=str(path),
                         hint="Check that the file exists and is readable.") from e
    try:
        header = json.loads(blob)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, huge ints, deep nesting
        raise InputError(f"{path.name}: corrupt safetensors header ({type(e).__name__}: {str(e)[:200]})",
                         path=str(path), hint="The shard is damaged; download it again.") from None
    damaged = "The shard is damaged or not a safetensors file; download it again."
    if not isinstance(header, dict):
        raise InputError(f"{path.name}: safetensors header is not a JSON object", path=str(path), hint=damaged)
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise InputError(f"{path.name}: __metadata__ is not a JSON object", path=str(path), hint=damaged)
    data_start = 8 + n
    data_len = size - data_start
    spans = []
    for name, info in header.items():
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise InputError(f"{path.name}: tensor {name!r} has a malformed header entry",
                             path=str(path), tensor=name, hint=damaged)
        dt, shape, off = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dt, str) or dt not in _DTYPE_SPECS:
            raise InputError(f"{path.name}: tensor {name!r} has unknown dtype {dt!r}", path=str(path),
                             tensor=name, hint=damaged)
        if (not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape)
                or not isinstance(off, list) or len(off) != 2
                or not all(isinstance(o, int) for o in off)):
            raise InputError(f"{path.name}: tensor {name!r} has a malformed shape or offsets",
                             path=str(path), tensor=name, hint=damaged)
        numel = 1
        for s in shape:
            numel *= s
        b, e = off
        if not (0 <= b <= e <= data_len):
            raise InputError(
                f"{path.name}: tensor {name!r} offsets {off} fall outside the data ({data_len} bytes)",
                path=str(path), tensor=name, hint="The shard is truncated or corrupt; download it again.")
        if e - b != numel * ITEMSIZE[dt]:
            raise InputError(
                f"{path.name}: tensor {name!r} spans {e - b} bytes but {dt}{shape} needs {numel * ITEMSIZE[dt]}",
                path=str(path), tensor=name, hint="The shard is corrupt; download it again.")
        spans.append((b, e, name))
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise InputError(f"{path.name}: tensors {n0!r} and {n1!r} overlap", path=str(path), tensor=n1,
                             hint=damaged)
    return header, {str(k): str(v) for k, v in meta.items()}, data_start


def _load_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror or e})", path=str(path),
                         hint="Check that the file exists, is a regular file and is readable.") from e
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, huge ints, deep nesting
        raise InputError(f"{path.name}: invalid JSON ({type(e).__name__}: {str(e)[:200]})", path=str(path),
                         hint="Fix or re-download the file.") from None
    if not isinstance(data, dict):
        raise InputError(f"{path.name}: expected a JSON object, got {type(data).__name__}", path=str(path),
                         hint="Fix or re-download the file.")
    return data


def _link_roots(folder: Path) -> list[Path]:
    """Where a checkpoint's symlinks may lead: the folder itself and, for a hub cache snapshot
    (``models--owner--name/snapshots/REV``), that repo's ``blobs/``."""
    real = Path(os.path.realpath(folder))
    roots = [real]
    for f in {Path(os.path.abspath(folder)), real}:
        if f.parent.name == "snapshots" and f.parent.parent.name.startswith(("models--", "datasets--")):
            roots.append(Path(os.path.realpath(f.parent.parent / "blobs")))
    return roots


def _not_a_file(path: Path) -> str | None:
    """Why ``path`` cannot be read as a file (missing, a directory, a broken link), or None."""
    if path.is_file():
        return None
    if path.is_symlink() and not path.exists():
        return f"is a broken symlink (to {os.readlink(path)})"
    if path.is_dir():
        return "is a directory, not a file"
    if path.exists():
        return "is not a regular file"
    return "is missing"


def resolve_source(src: str | os.PathLike, *, revision: str | None = None) -> Path:
    """A local folder as is; otherwise a hub repo id, fetched through huggingface_hub.

    Respects HF_HUB_OFFLINE: with it set (or no network), only the local cache is used and a
    missing or partial cache gives a clear InputError.
    """
    p = Path(src).expanduser()
    if p.exists():
        if not p.is_dir():
            raise InputError(f"{p}: not a folder", path=str(p),
                             hint="Pass the checkpoint folder (the one holding config.json).")
        return p.resolve()
    s = str(src)
    near = _did_you_mean(p)
    if near is not None:  # a local path with a typo, not a hub repo id that happens to have one slash
        raise InputError(f"{s}: no such folder; did you mean {near}?", path=s,
                         hint=f"Pass {near} if that is the checkpoint.")
    parts = s.split("/")
    if (s.count("/") != 1 or s.startswith((".", "/", "~")) or any(c in s for c in " \\:")
            or any(not x or x in (".", "..") or ".." in x or "--" in x or x[0] in ".-" or x[-1] in ".-"
                   for x in parts)):
        raise InputError(f"{s}: no such folder, and not a hub repo id (owner/name)", path=s,
                         hint="Check the path, or pass a repo id such as Qwen/Qwen3-30B-A3B-GPTQ-Int4.")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError as e:  # pragma: no cover - a dependency
        raise InputError("huggingface_hub is needed to read a hub repo id") from e
    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py"]
    try:
        local = snapshot_download(s, revision=revision, allow_patterns=patterns)
    except LocalEntryNotFoundError as e:
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes", "on"}
        why = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
        raise InputError(f"{s}: not in the local Hugging Face cache and {why}", path=s,
                         hint="Download it first (hf download " + s + ") or unset HF_HUB_OFFLINE.") from e
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError) as e:
        raise InputError(f"{s}: {type(e).__name__}: {str(e).splitlines()[0]}", path=s,
                         hint="Check the repo id and revision, and log in (hf auth login) for gated repos.") from e
    except OSError as e:
        raise InputError(f"{s}: download failed ({e})", path=s,
                         hint="Check the network and disk space, then run again.") from e
    except ValueError as e:  # huggingface_hub's HFValidationError: not a repo id it accepts
        raise InputError(f"{s}: not a valid hub repo id ({str(e).splitlines()[0][:200]})", path=s,
                         hint="Check the path, or pass a repo id such as Qwen/Qwen3-30B-A3B-GPTQ-Int4.") from e
    _check_snapshot(s, Path(local))
    return Path(local)


def _did_you_mean(p: Path) -> str | None:
    """The existing folder closest to a path that does not exist, if one is close: the deepest
    existing ancestor's sub-folder nearest to the first missing part, then the rest as given."""
    import difflib

    parts = p.parts
    for i in range(len(parts) - 1, -1 if not p.is_absolute() else 0, -1):
        base = Path(*parts[:i])  # Path() is the current folder
        if not base.is_dir():
            continue
        try:
            names = [c.name for c in base.iterdir() if c.is_dir()]
        except OSError:
            return None
        for name in difflib.get_close_matches(parts[i], names, n=3, cutoff=0.75):
            cand = base.joinpath(name, *parts[i + 1:])
            if cand.is_dir():
                return str(cand)
        return None
    return None


def _check_snapshot(repo: str, folder: Path) -> None:
    """A cached snapshot (offline mode returns whatever is there) must hold config.json and every
    shard its index names; otherwise say it is a partial download rather than a broken model."""
    wanted = ["config.json"]
    try:
        wmap = json.loads((folder / "model.safetensors.index.json").read_text()).get("weight_map")
        wanted += sorted({v for v in wmap.values() if isinstance(v, str)})
    except (OSError, ValueError, AttributeError):
        pass  # no index (single shard) or a broken one: Checkpoint reports it
    for name in wanted:
        why = _not_a_file(folder / name) if Path(name).name == name else None
        if why:
            raise InputError(
                f"{repo}: the cached snapshot {folder.name[:12]} is a partial download: {name} {why}",
                path=str(folder / name),
                hint=f"Finish the download (hf download {repo}; it needs the network, so unset HF_HUB_OFFLINE), "
                     "then run again.")


class TensorBytes:
    """One tensor's bytes, read in chunks when written (a copied embedding never sits in memory)."""

    CHUNK = 1 << 24

    def __init__(self, ckpt: "Checkpoint", name: str, nbytes: int):
        self.ckpt, self.name, self.nbytes = ckpt, name, nbytes

    def chunks(self):
        buf = bytearray(min(self.CHUNK, self.nbytes))
        mv = memoryview(buf)
        for off in range(0, self.nbytes, self.CHUNK):
            n = min(self.CHUNK, self.nbytes - off)
            self.ckpt.read_into(self.name, mv[:n], off)
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

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        cfg_path = self.folder / "config.json"
        self._roots = _link_roots(self.folder)
        try:
            entries = sorted(os.scandir(self.folder), key=lambda e: e.name)
        except OSError:
            entries = []
        for ent in entries:  # up front: nothing is read or written before a bad link is refused
            if ent.is_symlink() and not ent.name.startswith("."):
                self.check_link(Path(ent.path))
        if not cfg_path.is_file():
            why = _not_a_file(cfg_path)
            raise InputError(f"{self.folder}: no config.json" if why == "is missing" else f"{cfg_path}: {why}",
                             path=str(cfg_path),
                             hint="Pass a Hugging Face model folder (config.json + *.safetensors).")
        self.config: dict = _load_json(cfg_path)
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
            self.tensors[name] = TensorInfo(name, shard, _DTYPE_KEY[info["dtype"]],
                                            shapes.setdefault(shape, shape), start + b, start + e)

    def _start_io(self) -> None:
        """The mappings and descriptors of the lazy reads."""
        self._maps: dict[str, mmap.mmap] = {}
        self._addrs: dict[str, int | None] = {}  # each mapping's address, for madvise without the GIL
        # one read-only descriptor per shard for the positional reads: an open and close per
        # small tensor (scales, zeros, g_idx: three a module) was a third of a GPTQ module's read
        self._fds: dict[str, int] = {}
        self._fds_lock = threading.Lock()
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
                return _load_json(p)
        return None

    def _load_index(self) -> None:
        idx = self.folder / "model.safetensors.index.json"
        self.check_link(idx)
        if os.path.lexists(idx) and not idx.is_file():
            raise InputError(f"{idx}: {_not_a_file(idx)}", path=str(idx),
                             hint="Re-download the index file (or remove it for a single-shard checkpoint).")
        if idx.is_file():
            self.index_path = idx
            data = _load_json(idx)
            wmap = data.get("weight_map")
            if not isinstance(wmap, dict) or not wmap:
                raise InputError(f"{idx.name}: has no weight_map", path=str(idx),
                                 hint="Re-download the index file.")
            plain: set[str] = set()  # shard names already checked (a Path per tensor was ~10% of the plan)
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
                why = _not_a_file(sp)
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
        if m is None:
            path = self.folder / shard
            try:
                with open(path, "rb") as fh:
                    # ACCESS_COPY: private copy-on-write pages, so writes can never reach the file
                    m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
            except (OSError, ValueError) as e:
                raise InputError(f"{shard}: cannot map the file ({e})", path=str(path)) from e
            self._maps[shard] = m
            self._addrs[shard] = _map_address(m)
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
            import ctypes

            raise OSError(ctypes.get_errno(), "madvise failed")

    def raw(self, name: str) -> memoryview:
        """The tensor's bytes, zero-copy."""
        t = self.info(name)
        m = self._map(t.file)
        if t.end > len(m):
            raise InputError(f"{t.file}: truncated while reading {name!r}", path=str(self.folder / t.file),
                             tensor=name, hint="The shard changed or is truncated; download it again.")
        return memoryview(m)[t.begin:t.end]

    def get(self, name: str) -> torch.Tensor:
        """The tensor, read into memory of its own (pread: no mapped pages stay counted in RSS)."""
        t = self.info(name)
        out = torch.empty(t.shape, dtype=torch_dtype(t.dtype))
        if t.end > t.begin:
            # read through a numpy view of the same itemsize (numpy has no bf16/fp8): no dtype views after
            same_size = _NUMPY_VIEW.get(t.dtype)
            self._read(t, (out.view(getattr(torch, same_size)) if same_size else out).numpy(), 0, t.nbytes)
        return out

    def array(self, name: str):
        """The tensor as a numpy array in memory of its own, without torch (the plan's small reads).
        Raises InputError for a dtype numpy does not have (bf16, fp8)."""
        import numpy as np

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
        Falls back to ``get`` (a copy) where the data is not aligned for its dtype.
        """
        t = self.info(name)
        dt = torch_dtype(t.dtype)
        if t.numel == 0 or t.begin % ITEMSIZE[t.dtype]:
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
        t = self.tensors.get(name)
        m = self._maps.get(t.file) if t is not None else None
        if m is None or t.end <= t.begin:
            return
        # whole 2 MB blocks: a fault (a populate too) maps the resident pages around it, up to a
        # large folio (512 KB here), so a neighbour read after this tensor was released mapped
        # its pages back and they stayed (the RSS grew with the model). A neighbour still in use
        # just maps its pages again on its next touch (the mapping is never written)
        lo = t.begin - t.begin % _FAULT_AROUND
        hi = min(len(m), -(-t.end // _FAULT_AROUND) * _FAULT_AROUND)
        try:
            self._madvise(t.file, lo, hi - lo, mmap.MADV_DONTNEED)
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
        from .families import resolve_type

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
