"""Where a checkpoint comes from: a local folder as is, or a hub repo id fetched (or found in the
cache) through huggingface_hub and checked complete; the folder's JSON files and links, checked."""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path

from ..errors import InputError

__all__ = ["resolve_source", "load_json", "link_roots", "not_a_file"]


def load_json(path: Path) -> dict:
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


def link_roots(folder: Path) -> list[Path]:
    """Where a checkpoint's symlinks may lead: the folder itself and, for a hub cache snapshot
    (``models--owner--name/snapshots/REV``), that repo's ``blobs/``."""
    real = Path(os.path.realpath(folder))
    roots = [real]
    for f in {Path(os.path.abspath(folder)), real}:
        if f.parent.name == "snapshots" and f.parent.parent.name.startswith(("models--", "datasets--")):
            roots.append(Path(os.path.realpath(f.parent.parent / "blobs")))
    return roots


def not_a_file(path: Path) -> str | None:
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
        if p.is_file() and p.suffix == ".gguf":  # a GGUF model is a file (gguf_checkpoint.py)
            return p.resolve()
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
    if len(parts) == 2 and Path(parts[0]).expanduser().is_dir():  # a local folder's child, misspelt
        raise InputError(f"{s}: no such folder ({parts[0]} has no {parts[1]!r})", path=s,
                         hint=f"Check the path (ls {parts[0]}); a hub repo id is read only when no local "
                              f"folder {parts[0]} exists.")
    if (s.count("/") != 1 or s.startswith((".", "/", "~")) or any(c in s for c in " \\:")
            or any(not x or x in (".", "..") or ".." in x or "--" in x or x[0] in ".-" or x[-1] in ".-"
                   for x in parts)):
        raise InputError(f"{s}: no such folder, and not a hub repo id (owner/name)", path=s,
                         hint="Check the path, or pass a repo id such as Qwen/Qwen3-30B-A3B-GPTQ-Int4.")
    try:  # only for a repo id: a local folder needs neither the hub client nor its imports
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
        offline = _offline()
        why = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
        raise InputError(f"{s}: not in the local Hugging Face cache and {why}", path=s,
                         hint=f"Download it first (hf download {s})"
                              + (" or unset HF_HUB_OFFLINE." if offline else ", where the hub can be reached.")) from e
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


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes", "on"}


def _did_you_mean(p: Path) -> str | None:
    """The existing folder closest to a path that does not exist, if one is close: the deepest
    existing ancestor's sub-folder nearest to the first missing part, then the rest as given."""
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
        why = not_a_file(folder / name) if Path(name).name == name else None
        if why:
            raise InputError(
                f"{repo}: the cached snapshot {folder.name[:12]} is a partial download: {name} {why}",
                path=str(folder / name),
                hint=f"Finish the download (hf download {repo}; it needs the network"
                     + (", so unset HF_HUB_OFFLINE" if _offline() else "") + "), then run again.")
