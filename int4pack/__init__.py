"""int4pack: int4 MoE checkpoints -> the W4A8 layout Arm CPUs run fast (KleidiAI, vLLM CPU)."""

from ._version import __version__
from .errors import Int4packError

# the function shadows its module on purpose: int4pack.convert(src, out, ...) mirrors the CLI
from .convert import convert  # noqa: E402
from .verify import verify  # noqa: E402
from .inspect import inspect  # noqa: E402

__all__ = ["__version__", "convert", "Int4packError"]
__all__ += ["verify", "inspect"]
