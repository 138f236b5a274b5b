"""int4pack: int4 MoE checkpoints -> the W4A8 layout Arm CPUs run fast (KleidiAI, vLLM CPU)."""

import gc as _gc

# torch's import makes ~10^6 long-lived objects, and the cyclic GC rescanned them over and over
# while it ran (~0.3 s of a 1.6 s start); paused for the imports only, and left as it was found
_gc_was_enabled = _gc.isenabled()
_gc.disable()
try:
    from ._version import __version__
    from .errors import Int4packError

    # the function shadows its module on purpose: int4pack.convert(src, out, ...) mirrors the CLI
    from .convert import convert
    from .verify import verify
    from .inspect import inspect
finally:
    if _gc_was_enabled:
        _gc.enable()

__all__ = ["__version__", "convert", "Int4packError"]
__all__ += ["verify", "inspect"]
