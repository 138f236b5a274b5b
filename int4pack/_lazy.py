"""torch, imported on first use.

``import torch`` alone takes ~3 s on a 2-core x86-64 host, more than the whole plan of a small
model. The modules that the CLI's start, ``--help`` and convert's plan run through (checkpoint,
formats, plan, serving, ...) name ``torch`` through this stand-in instead, so the plan is printed
before torch is imported, and torch is imported when the work starts (``load_torch``), if it
needs it: a convert whose modules all go through the C++ batches (batch.py) never does.
Only names looked up at run time may go through it: a module-level ``torch.float32`` would
import torch with the module. Once torch is imported, every int4pack module's ``torch`` global is
bound to torch itself, so the work pays nothing for the stand-in (~1 us per attribute otherwise).
"""

from __future__ import annotations

import gc
import sys
from contextlib import contextmanager

__all__ = ["torch", "load_torch", "torch_loaded", "freeze_after_import", "gc_paused", "gc_frozen"]

_state = {"freeze": False, "bound": False}


def freeze_after_import() -> None:
    """The process is the CLI's own: what torch's import creates lives as long as the process, so
    it is frozen out of the cyclic GC's scans (``gc.freeze``) once imported."""
    _state["freeze"] = True


@contextmanager
def gc_paused():
    """The cyclic GC off while a burst of long-lived, acyclic objects is made (an import, a plan's
    tens of thousands of records): each full collection on the way would rescan all of them, about
    a tenth of a 48-layer plan's time. Restored as it was, however the block ends."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextmanager
def gc_frozen():
    """What exists now (torch's ~10^6 objects, the caller's) left out of the cyclic GC's scans while
    the block runs (``gc.freeze``), and handed back after it: a full collection on the way then scans
    only what the block made (~0.3 s each on a 2-core x86-64 host otherwise). Nothing where the GC is
    off or something is frozen already (the CLI freezes what its imports made)."""
    mine = gc.isenabled() and gc.get_freeze_count() == 0
    if mine:
        gc.freeze()
    try:
        yield
    finally:
        if mine:
            gc.unfreeze()


def torch_loaded() -> bool:
    return "torch" in sys.modules


def load_torch():
    """Import torch (once) and return it. torch's import creates ~10^6 objects that the cyclic GC
    would rescan while it runs, so the GC pauses for the import."""
    mod = sys.modules.get("torch")
    if mod is not None and not getattr(getattr(mod, "__spec__", None), "_initializing", False):
        if not _state["bound"]:  # imported by the caller first (a script, the plugin): bind it once
            _bind(mod)
        return mod
    with gc_paused():
        import torch as mod
    if _state["freeze"]:
        gc.freeze()
    _bind(mod)
    return mod


def _bind(mod) -> None:
    """Replace the stand-in by torch in every loaded int4pack module (and here, for later imports)."""
    globals()["torch"] = mod
    _state["bound"] = True
    for name, module in list(sys.modules.items()):
        if (name == "int4pack" or name.startswith("int4pack.")) and isinstance(
                getattr(module, "__dict__", {}).get("torch"), _Torch):
            module.torch = mod


class _Torch:
    """Attribute access on this object imports torch and reads the attribute from it (nothing is
    cached here, so a test's monkeypatch of a torch function is seen)."""

    __slots__ = ()

    def __getattr__(self, name: str):
        return getattr(load_torch(), name)

    def __repr__(self) -> str:
        return f"<torch, {'imported' if torch_loaded() else 'imported on first use'}>"


torch = _Torch()
