"""The C++ hot loops of ``int4pack/csrc/``: one plain library, built when int4pack is installed.

``pip install`` compiles the sources (no torch or Python headers) into ``_kernels-<machine>.so``
beside this file (setup.py, ``_build.py``), in seconds with the machine's C++ compiler; a prebuilt
wheel carries it. Nothing is compiled at run time. ``load(name)`` gives the kernels ``name``
(``"convert_kernels"`` or ``"kleidiai_pack"``, one library) as methods on tensors
(``_native.py``), or None when ``INT4PACK_NO_EXT=1`` or the library is missing or unusable; the
callers then use their pure-torch twins (the same bytes, about 22x slower to convert). A missing
library is reported once per process, in one line that says what to do (``SlowPathWarning``),
and ``build_error(name)`` says why.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

from . import _build

__all__ = ["load", "build_error", "csrc_dir", "library_path", "SlowPathWarning", "NAMES"]

NAMES = ("convert_kernels", "kleidiai_pack", "verify_kernels")

_lock = threading.Lock()
_loaded: dict[str, object] = {}
_error: str | None = None
_warned = False


class SlowPathWarning(RuntimeWarning):
    """The C++ kernels are missing: int4pack runs its pure-torch paths, about 22x slower."""


def csrc_dir() -> Path:
    """The C++ sources (in a source checkout and the sdist)."""
    return _build.CSRC


def library_path() -> Path:
    """Where the built library lives: beside this file."""
    return _build.HERE / _build.library_name()


def disabled() -> bool:
    return os.environ.get("INT4PACK_NO_EXT", "") not in {"", "0"}


def build_error(name: str = "convert_kernels") -> str | None:
    """Why ``load`` gave None (None when it did not, or was not asked yet)."""
    if disabled():
        return "disabled by INT4PACK_NO_EXT"
    return _error


def load(name: str):
    """The kernels ``name`` (a ``_native`` object), or None (then the pure-torch twins run)."""
    global _error
    if name not in NAMES:
        raise ValueError(f"no C++ kernels named {name!r} (known: {', '.join(NAMES)})")
    if disabled():
        return None
    if name in _loaded:
        return _loaded[name]
    if _error is not None:
        return None
    with _lock:
        if name in _loaded or _error is not None:
            return _loaded.get(name)
        try:
            # here: they import torch and numpy, which a plan-only run does without
            from . import _native, _native_verify

            lib = _native.open_library(library_path())
        except (OSError, RuntimeError, AttributeError) as e:
            _error = _why(e)
            _warn_slow(_error)
            return None
        _loaded["convert_kernels"] = _native.ConvertKernels(lib)
        _loaded["kleidiai_pack"] = _native.KleidiaiPack(lib)
        _loaded["verify_kernels"] = _native_verify.VerifyKernels(lib)
        return _loaded[name]


def _why(e: Exception) -> str:
    """One line: what is wrong and what to do."""
    path = library_path()
    rebuild = ("reinstall int4pack (pip install --force-reinstall --no-deps --no-cache-dir int4pack; from a source "
               "checkout: pip install -e . or python -m int4pack._build)")
    if not path.exists():
        if _build.find_compiler() is None:
            return (f"no C++ compiler was found, so int4pack's C++ kernels were not built ({path.name} is missing): "
                    f"{_build.INSTALL_HINT}, then {rebuild}")
        return f"int4pack's C++ kernels were not built when it was installed ({path} is missing): {rebuild}"
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"int4pack's C++ kernels at {path} cannot be used ({first[:300]}): {rebuild}"


def _warn_slow(error: str) -> None:
    """Say once per process that the kernels are missing, what that costs and what to do: one line."""
    global _warned
    if _warned:
        return
    _warned = True
    # warn_explicit with no source file to quote: the warning prints as one line
    warnings.warn_explicit(
        f"{error}. Running the pure-torch paths meanwhile: the same bytes, about 22x slower to convert "
        "(INT4PACK_NO_EXT=1 chooses them without this warning).",
        SlowPathWarning, filename="int4pack", lineno=0, module="int4pack")
