"""Counts of the package's shape: run ``python tests/house_counts.py`` from the repository root.

- import circles and arrows back up (from tests/test_imports.py's walk: module level and deferred);
- the vLLM plugin's import closure: int4pack modules that ``register()`` plus loading a packed
  checkpoint import, measured in a fresh interpreter (sys.modules), and the modules it reaches
  in the source graph;
- Python files in int4pack/ over 500 lines, and those without a reason in their docstring
  (a docstring line starting "Long:");
- places that turn a group size of -1 into K (``k if g == -1 else g`` and the like);
- tracked files holding an absolute path of a machine (a recorded path of a run: under /work/,
  /home/, or a quoted /tmp/... inside a results file);
- definitions of ``FIXTURES`` under tests/;
- the top-level modules of int4pack/ (the .py files directly under it, and its packages), the
  product files over 600 lines, the verify package's functions over 80 lines, and the product
  files that write a vLLM release number;
- one MoE layer's trip through verify's checks (``layer_trip``): on a lossless source (the exact
  path), a requantised one, and without a source.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_imports import cycles, graph, reach  # noqa: E402

# a vLLM release number as written in prose or code: 0.19.1, 0.32, 0.33.0, the 055e47c snapshot
RELEASE_NUMBER = re.compile(r"\b0\.(19|32|33)(\.\d+)?\b|\b055e47c\b")
MINUS_ONE = re.compile(r"\w+ if [\w.]+ == -1 else [\w.]*\b(g|gs|k|group_size)\b|-1 means (K|channel)|[\w.]+ if [\w.]+ != -1 else \w+")
MACHINE = re.compile(r"/work/|/home/\w|\"/tmp/")


def _floors(edges: dict[str, set[str]]) -> dict[str, int]:
    floor: dict[str, int] = {}

    def f(m, path=()):
        if m in floor:
            return floor[m]
        if m in path:
            return 0
        floor[m] = 1 + max((f(d, path + (m,)) for d in edges[m]), default=-1)
        return floor[m]

    for m in edges:
        f(m)
    return floor


PLUGIN_RUN = r"""
import json, sys
from int4pack import vllm_plugin
vllm_plugin.register()
after_register = sorted(m for m in sys.modules if m.startswith("int4pack"))
from int4pack.vllm_plugin import _layout
print(json.dumps({"register": after_register,
                  "load": sorted(m for m in sys.modules if m.startswith("int4pack"))}))
"""


def _is_verify(path: str) -> bool:
    """Whether a source file is verify's: a module of int4pack/verify/ (or, before the package, an
    int4pack/verify*.py)."""
    p, pkg = Path(path), ROOT / "int4pack"
    return p.parent == pkg / "verify" or (p.parent == pkg and p.name.startswith("verify"))


def trip(stops: list[str]) -> tuple[int, int]:
    """(stays, returns) of the modules a trip passes through: a stay is a run of one module, a
    return a stay in a module the trip was in before."""
    runs = [m for i, m in enumerate(stops) if i == 0 or stops[i - 1] != m]
    return len(runs), sum(m in runs[:i] for i, m in enumerate(runs))


def layer_trip(out, against=None) -> list[str]:
    """The verify modules one MoE layer's numerical check passes through, in the order their
    functions are first called: ``int4pack.verify`` on layer 0 of the output ``out`` (with the
    source ``against``), one sampled expert, one thread, traced (``sys.setprofile``) while
    ``check_layer`` runs. A function is a stop at its first call only; lambdas and comprehensions
    belong to the function they are in; what runs outside verify (torch, moe.py, the C++ bindings)
    belongs to the verify module that called it."""
    import importlib

    import int4pack

    importlib.import_module("int4pack.verify")
    real = next(m.check_layer for n, m in sorted(sys.modules.items()) if n.startswith("int4pack.verify")
                and getattr(getattr(m, "check_layer", None), "__module__", "") == n)
    seen, stops = set(), []

    def watch(frame, event, arg):
        code = frame.f_code
        if event == "call" and code not in seen and not code.co_name.startswith("<") and _is_verify(code.co_filename):
            seen.add(code)
            stops.append(str(Path(code.co_filename).relative_to(ROOT)))

    def traced(*a, **k):
        sys.setprofile(watch)
        try:
            return real(*a, **k)
        finally:
            sys.setprofile(None)

    holders = [m for n, m in sys.modules.items() if n.startswith("int4pack.verify") and getattr(m, "check_layer", None)
               is real]
    for m in holders:
        m.check_layer = traced
    try:
        r = int4pack.verify(out, against=against, layers="0,", experts=1, threads=1, processes=False, dense=False)
    finally:
        for m in holders:
            m.check_layer = real
    assert r["ok"] and r["layers"], r["verdict"]
    return stops


TRIPS = (("exact path", "gptq_q3_sym", True), ("requantised", "awq_q3", True), ("no source", "gptq_q3_sym", False))
TRIP_RUN = r"""
import json, sys, tempfile
from pathlib import Path
import int4pack, house_counts
fixtures = house_counts.ROOT / "tests" / "fixtures"
out = {}
with tempfile.TemporaryDirectory() as d:
    for what, name, against in house_counts.TRIPS:
        folder = Path(d) / name
        if not folder.exists():
            int4pack.convert(fixtures / name, folder)
        stays, returns = house_counts.trip(house_counts.layer_trip(folder, fixtures / name if against else None))
        out[what] = {"fixture": name, "stays": stays, "returns": returns}
print(json.dumps(out))
"""


def top_level_modules(package: Path) -> tuple[list[str], list[str]]:
    """(the .py files directly under ``package``, its subpackages)."""
    return ([p.name for p in sorted(package.glob("*.py"))],
            [p.name for p in sorted(package.iterdir()) if (p / "__init__.py").is_file()])


def verify_files() -> list[Path]:
    """verify's source files: int4pack/verify/ (and, before the package, int4pack/verify*.py)."""
    return sorted((ROOT / "int4pack").glob("verify*.py")) + sorted((ROOT / "int4pack" / "verify").glob("*.py"))


def long_functions(files, limit: int) -> list[str]:
    """"path:line name (N lines)" of each function over ``limit`` lines (its closures included)."""
    out = []
    for p in files:
        for n in ast.walk(ast.parse(Path(p).read_text())):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit:
                where = Path(p).relative_to(ROOT) if Path(p).is_relative_to(ROOT) else Path(p)
                out.append(f"{where}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)")
    return out


def release_files() -> list[str]:
    """The product files (int4pack/) that write a vLLM release number."""
    return [str(p.relative_to(ROOT)) for p in sorted((ROOT / "int4pack").rglob("*.py"))
            if RELEASE_NUMBER.search(p.read_text())]


def main() -> None:
    edges = graph()
    floor = _floors(edges)
    back = [(a, b) for a, ds in edges.items() for b in ds if floor[b] >= floor[a]]
    src_closure = sorted(reach(edges, "int4pack.vllm_plugin"))
    run = subprocess.run([sys.executable, "-c", PLUGIN_RUN], capture_output=True, text=True,
                         cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    runtime = json.loads(run.stdout) if run.returncode == 0 else {"error": run.stderr[-400:]}
    long_files, unexplained = [], []
    for p in sorted((ROOT / "int4pack").rglob("*.py")):
        n = len(p.read_text().splitlines())
        if n > 500:
            long_files.append((str(p.relative_to(ROOT)), n))
            doc = ast.get_docstring(ast.parse(p.read_text())) or ""
            if "Long:" not in doc:
                unexplained.append(str(p.relative_to(ROOT)))
    minus_one = []
    for p in sorted((ROOT / "int4pack").rglob("*")):
        if p.suffix in (".py", ".cpp", ".h"):
            for i, line in enumerate(p.read_text().splitlines(), 1):
                for m in MINUS_ONE.finditer(line):
                    minus_one.append(f"{p.relative_to(ROOT)}:{i}: {m.group(0)}")
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT).stdout.split()
    machine = []
    for f in tracked:
        if f.endswith(".safetensors") or f in ("tests/house_counts.py", "tests/test_house.py") or not (ROOT / f).is_file():
            continue
        text = (ROOT / f).read_text(errors="replace")
        hits = [m.group(0) for m in MACHINE.finditer(text)]
        if f.endswith((".json", ".txt", ".log")) or any(h != '"/tmp/' for h in hits):
            if hits:
                machine.append(f"{f} ({len(hits)})")
    fixtures = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "tests").rglob("*.py"))
                for i, line in enumerate(p.read_text().splitlines(), 1) if re.match(r"\s*FIXTURES\s*[:=]", line)]
    trips = subprocess.run([sys.executable, "-c", TRIP_RUN], capture_output=True, text=True, cwd=ROOT,
                           env={"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "PATH": "/usr/bin:/bin"})
    py, packages = top_level_modules(ROOT / "int4pack")
    out = {
        "top_level_py_files": len(py),
        "top_level_packages": packages,
        "top_level_named_verify_": [m for m in py if m.startswith("verify_")],
        "files_over_600": [f for f in long_files if f[1] > 600],
        "verify_functions_over_80": long_functions(verify_files(), 80),
        "release_number_files": release_files(),
        "moe_layer_trip": json.loads(trips.stdout) if trips.returncode == 0 else {"error": trips.stderr[-600:]},
        "circles": cycles(edges),
        "arrows_back_up": back,
        "plugin_source_closure": len(src_closure),
        "plugin_source_closure_modules": src_closure,
        "plugin_runtime_register": runtime.get("register", runtime),
        "plugin_runtime_load": runtime.get("load", runtime),
        "files_over_500": long_files,
        "files_over_500_without_reason": unexplained,
        "minus_one_means_k": len(minus_one),
        "minus_one_means_k_places": minus_one,
        "machine_path_files": len(machine),
        "machine_path_file_list": machine,
        "fixtures_definitions": fixtures,
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
