"""int4pack/__init__.py: a light import, and convert/verify/inspect as the functions the CLI mirrors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str) -> str:
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.strip()


def test_import_is_light_and_leaves_the_gc_alone():
    code = ("import gc, sys\ngc.disable()\nimport int4pack\n"
            "print('torch' in sys.modules, gc.isenabled(), gc.get_freeze_count())")
    assert _run(code) == "False False 0"


def test_functions_keep_their_names_whatever_imports_their_modules():
    # the modules of the same names loaded first (as the CLI and inspect do), then the functions asked for
    code = ("import int4pack.convert, int4pack.verify\nfrom int4pack.inspect import inspect as f\nimport int4pack\n"
            "kinds = [type(getattr(int4pack, n)).__name__ for n in ('convert', 'verify', 'inspect')]\n"
            "print(*kinds, f is int4pack.inspect, int4pack.__version__)")
    out = _run(code).split()
    assert out[:4] == ["function", "function", "function", "True"]
    assert out[4] == _run("from int4pack._version import __version__; print(__version__)")
    code = "import int4pack as p\nprint(p.convert.__module__, p.verify.__module__, p.inspect.__module__)"
    assert _run(code) == "int4pack.convert int4pack.verify int4pack.inspect"


def test_torch_is_imported_on_first_use_then_bound_in_every_module():
    """The plan's modules name torch through _lazy's stand-in: importing them imports no torch; the
    first attribute read does, and from then on each module's ``torch`` is torch itself."""
    code = ("import importlib, sys\n"
            "mods = [importlib.import_module(m) for m in ('int4pack.convert', 'int4pack.sources.checkpoint', "
            "'int4pack.formats.gptq', 'int4pack.output_folder.writer', 'int4pack.blobs', 'int4pack.serve_spec', 'int4pack.routing')]\n"
            "before = 'torch' in sys.modules\n"
            "dt = mods[1].torch.bfloat16\n"
            "import torch\n"
            "print(before, dt is torch.bfloat16, all(m.torch is torch for m in mods))")
    assert _run(code) == "False True True"
