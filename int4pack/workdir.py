"""Where convert builds its output: the hidden partial folder beside OUT. No torch here: the CLI names
the folder when a run is interrupted, possibly while torch is still being imported."""

from __future__ import annotations

import shutil
from pathlib import Path

from .errors import OutputError
from .output import human_bytes

__all__ = ["partial_folder", "folder_bytes", "check_space"]


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


SPACE_MARGIN = 1 << 20  # config and extra small files
SPACE_PER_TENSOR = 1000  # its shard header entry, index line and report entry: a few hundred bytes


def check_space(work: Path, parent: Path, need: int, tensors: int, *, fresh: bool) -> None:
    """Refuse before writing when the output's file system has less free space than the plan writes."""
    try:
        free = shutil.disk_usage(work).free
    except OSError:
        return  # no figure to check against: the writes themselves report a full disk
    want = need + SPACE_MARGIN + SPACE_PER_TENSOR * tensors
    if free >= want:
        return
    if fresh:  # only the progress file is in it: leave nothing behind
        shutil.rmtree(work, ignore_errors=True)
    raise OutputError(f"{parent}: not enough free space: the output needs {human_bytes(want)} ({want} "
                      f"bytes: {need} planned, the rest for headers, index and report), {human_bytes(free)} "
                      f"({free} bytes) free", path=str(parent),
                      hint="Free some space or pick an OUT on another disk (--max-shard-size does not change "
                           "the total).")
