"""int4pack/__init__.py: importing the package leaves the interpreter's GC as it found it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _gc_after_import(before: str) -> str:
    code = f"import gc\n{before}\nimport int4pack\nprint(gc.isenabled(), gc.get_freeze_count())"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    return res.stdout.strip()


def test_import_restores_the_gc_state():
    # the import pauses the cyclic GC for its own imports only, and freezes nothing (the CLI does)
    assert _gc_after_import("") == "True 0"
    assert _gc_after_import("gc.disable()") == "False 0"
