"""int4pack: int4 MoE checkpoints -> the W4A8 layout Arm CPUs run fast (KleidiAI, vLLM CPU).

``int4pack.convert``, ``int4pack.verify`` and ``int4pack.inspect`` are functions that mirror the
CLI commands. They load on first use: importing the package (and so ``int4pack --help``) does
not import torch.
"""

import importlib
import sys
import types

from ._version import __version__
from .errors import Int4packError

__all__ = ["__version__", "convert", "verify", "inspect", "Int4packError"]

_FUNCTIONS = ("convert", "verify", "inspect")  # each the function of the module of its name


class _Package(types.ModuleType):
    def __setattr__(self, name, value):
        # importing int4pack.convert binds the module to the package's name "convert": the
        # function keeps that name, as the CLI mirror promises
        if name in _FUNCTIONS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


def __getattr__(name):
    if name in _FUNCTIONS:
        from ._lazy import gc_paused

        with gc_paused():  # verify's imports torch: ~10^6 objects the GC would rescan on the way
            function = getattr(importlib.import_module(f".{name}", __name__), name)
        types.ModuleType.__setattr__(sys.modules[__name__], name, function)
        return function
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


sys.modules[__name__].__class__ = _Package
