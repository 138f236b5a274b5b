"""Where convert builds its output: the hidden partial folder beside OUT. No torch here: the CLI names
the folder when a run is interrupted, possibly while torch is still being imported."""

from __future__ import annotations

from pathlib import Path

__all__ = ["partial_folder", "folder_bytes"]


def partial_folder(out: Path) -> Path:
    """The hidden folder a run builds OUT in (kept on interrupt, for --resume)."""
    out = Path(out).expanduser().absolute()
    return out.parent / f".{out.name}.int4pack-partial"


def folder_bytes(folder: Path) -> int:
    """Bytes of the files in a folder (0 if it is gone)."""
    try:
        return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
    except OSError:
        return 0
