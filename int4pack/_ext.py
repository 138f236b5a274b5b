"""Builds and loads the C++ hot loops in ``int4pack/csrc/`` (torch extensions, compiled on first use).

The sources ship inside the package (sdist and wheel) and compile at first use with
torch.utils.cpp_extension and ninja from PyPI, against the torch that is installed then. So
the install stays a plain ``pip install``: nothing asks for torch at build time, build
isolation cannot pull a second torch, and a wheel built on one torch keeps working when the
environment (e.g. vLLM's) brings another. Each folder ``csrc/<name>/`` is one extension, its
``*.cpp`` compiled together with its ``*.h``; a build is cached per source hash, torch and
Python version under ``$INT4PACK_CACHE`` (default ``~/.cache/int4pack``).

``load(name)`` returns the module, or None when ``INT4PACK_NO_EXT=1`` or the build fails; the
callers then use their pure-torch twins. A failed build warns once per process
(``SlowPathWarning``), and ``build_error(name)`` says why.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading
import warnings
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None

__all__ = ["load", "build_error", "csrc_dir", "SlowPathWarning"]

_lock = threading.Lock()
_loaded: dict[str, object] = {}
_errors: dict[str, str] = {}
_warned = False


class SlowPathWarning(RuntimeWarning):
    """The C++ kernels could not be built: int4pack runs, several times slower."""


def csrc_dir() -> Path:
    """The C++ sources, shipped inside the package."""
    return Path(__file__).resolve().parent / "csrc"


def _cache_root() -> Path:
    root = os.environ.get("INT4PACK_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "int4pack"


def build_error(name: str) -> str | None:
    return _errors.get(name)


def load(name: str, *, required: bool = False):
    """The compiled extension ``csrc/<name>/``, or None."""
    if os.environ.get("INT4PACK_NO_EXT", "") not in {"", "0"} and not required:
        _errors.setdefault(name, "disabled by INT4PACK_NO_EXT")
        return None
    with _lock:
        if name in _loaded:
            return _loaded[name]
        if name in _errors and not required:
            return None
        try:
            mod = _build(name, csrc_dir() / name)
        except Exception as e:  # a compiler problem must not break the pure-torch paths
            _errors[name] = f"{type(e).__name__}: {e}"
            if required:
                raise
            _warn_slow(name, _errors[name])
            return None
        _loaded[name] = mod
        return mod


def _warn_slow(name: str, error: str) -> None:
    """Say once per process that the kernels are missing, and what that costs."""
    global _warned
    if _warned:
        return
    _warned = True
    first_line = error.strip().splitlines()[0] if error.strip() else error
    warnings.warn(
        f"int4pack: the C++ kernels ({name}) could not be built: {first_line[:300]}. int4pack falls back "
        "to its pure-torch code, which gives the same bytes but runs several times slower. Install a C++ "
        "compiler (e.g. g++) with OpenMP, or set INT4PACK_EXT_VERBOSE=1 to see the build; set "
        "INT4PACK_NO_EXT=1 to choose the slow paths without this warning.",
        SlowPathWarning, stacklevel=3)


def _build(name: str, folder: Path):
    """Build (or import the cached build of) the extension whose sources are ``folder/*.cpp``."""
    import torch

    sources = sorted(folder.glob("*.cpp"))
    if not sources:
        raise FileNotFoundError(f"no C++ sources in {folder}")
    flags = ["-O3", "-std=c++17", "-fopenmp", "-DNDEBUG"]
    h = hashlib.sha256()
    for p in [*sources, *sorted(folder.glob("*.h"))]:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(torch.__version__.encode())
    h.update(sys.version.encode())
    h.update(" ".join(flags).encode())
    tag = h.hexdigest()[:16]
    mod_name = f"int4pack_{name}_{tag}"
    build_dir = _cache_root() / "ext" / f"{name}-{tag}"
    built = build_dir / ".int4pack.built"  # written once this build loaded
    if built.is_file():
        # the tag names the sources, flags, torch and Python: import the library directly (going
        # through cpp_extension.load, which imports setuptools and runs ninja to find nothing to
        # do, cost 0.2-0.6 s of every run)
        mod = _import_built(mod_name, build_dir)
        if mod is not None:
            return mod
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    # ninja from PyPI lives beside the interpreter; make sure torch finds it
    bindir = str(Path(sys.executable).parent)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    # torch's FileBaton ("lock" in the build folder) is a plain file: a process killed while holding
    # it (SIGKILL, OOM) leaves it behind and every later load waits on it forever. An flock is
    # released by the kernel when its holder dies, so under it any "lock" file is stale.
    with open(build_dir / ".int4pack.flock", "w") as flk:
        if fcntl is not None:
            fcntl.flock(flk, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
        mod = cpp_extension.load(
            name=mod_name,
            sources=[str(p) for p in sources],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(folder)],
            build_directory=str(build_dir),
            verbose=os.environ.get("INT4PACK_EXT_VERBOSE", "") not in {"", "0"},
        )
        tmp = built.with_name(built.name + f".{os.getpid()}")
        tmp.write_text(getattr(mod, "__file__", "") + "\n")
        os.replace(tmp, built)
        return mod


def _import_built(mod_name: str, build_dir: Path):
    """The library a finished build left in build_dir, or None (missing or unloadable: rebuild)."""
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    so = build_dir / f"{mod_name}.so"
    if not so.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(mod_name, so)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except (ImportError, OSError):
        return None
    sys.modules[mod_name] = mod
    return mod
