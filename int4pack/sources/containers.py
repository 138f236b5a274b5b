"""Which container class opens a source: safetensors (Checkpoint), GGUF (gguf_checkpoint.py) or
MLX (mlx_checkpoint.py, safetensors whose quantised embeddings and routers are read as BF16)."""

from __future__ import annotations

import os
from pathlib import Path

from .checkpoint import Checkpoint

__all__ = ["open_checkpoint"]


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """The checkpoint at ``path`` (a folder, or a .gguf file) in the container class its files need."""
    p = Path(path)
    from .gguf_checkpoint import GGUFCheckpoint, is_gguf

    if is_gguf(p):
        return GGUFCheckpoint(p)
    from .mlx_checkpoint import MLXCheckpoint, is_mlx_folder

    if is_mlx_folder(p):
        return MLXCheckpoint(p)
    return Checkpoint(p)
