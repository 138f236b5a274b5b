"""The package's import graph has no cycle.

Read from the source with ast, not by importing: every ``import`` and ``from ... import`` of an
int4pack module, at module level or inside a function (a deferred import that closes a circle is
still a circle), resolved to the module it names (``from . import kernels`` is int4pack.kernels,
``from .records import X`` is int4pack.records). Dynamic imports (importlib) are not seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "int4pack"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:  # "from pkg import mod" names a module
                found.add(f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target)
    return {m for m in found if m in modules and m != name}


def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_reads_every_kind_of_import():
    g = graph()
    assert {"int4pack.kernels", "int4pack.records", "int4pack.scale_search"} <= g["int4pack.w4a8"]
    assert "int4pack.formats._common" in g["int4pack.formats.gptq"]  # from ._common import ...
    assert "int4pack.vllm_plugin._methods" in g["int4pack.vllm_plugin._config"]  # imported inside a function
    assert "int4pack.kernels" in g["int4pack.records"]  # from . import kernels


def test_package_imports_have_no_cycle():
    assert cycles(graph()) == []


# the readers and the planner: what the vLLM plugin must never load
CONVERTER_ONLY = ("int4pack.formats", "int4pack.sources.checkpoint", "int4pack.plan", "int4pack.blobs", "int4pack.convert",
                  "int4pack.families", "int4pack.architectures")
PLUGIN_BUDGET = 8  # int4pack modules the plugin may import beyond its own and the package's (_version, errors);
# 6 since the experts activate as the model does (int4pack.activation, the one home of those rules); 8 since
# the blob check opens the C++ library's CRC-32 (int4pack._ext and _build: where it is, whether it is off)


def reach(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(edges[m])
            todo.extend(".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 1))  # parents run first
    return seen


def test_the_plugin_never_reaches_the_readers_or_the_planner_in_the_source():
    """Every import the plugin's modules can run, deferred ones included."""
    g = graph()
    reached = set().union(*(reach(g, m) for m in g if m.startswith("int4pack.vllm_plugin")))
    assert not [m for m in reached if m.startswith(CONVERTER_ONLY)], sorted(reached)


def test_the_plugin_registers_and_loads_a_packed_checkpoint_with_few_modules(tmp_path):
    """register() under a stand-in of vLLM's registry hook, then a packed checkpoint through the
    loaders and checks the plugin runs at load, as vLLM calls them (blobs read with safetensors):
    the int4pack modules this imports, in a fresh interpreter."""
    import json
    import subprocess
    import sys

    import int4pack

    int4pack.convert(PACKAGE.parent / "tests" / "fixtures" / "awq_q3", tmp_path / "packed", serve_format="kleidiai")
    code = f"""
import json, sys, types
from pathlib import Path
hook = types.ModuleType("vllm.model_executor.layers.quantization")
hook.QUANTIZATION_METHODS, registered = [], {{}}
hook.register_quantization_config = lambda name: lambda cls: registered.setdefault(name, cls)
base = types.ModuleType("vllm.model_executor.layers.quantization.base_config")
base.QuantizationConfig = object
for name in ("vllm", "vllm.model_executor", "vllm.model_executor.layers"):
    sys.modules[name] = types.ModuleType(name)
sys.modules[hook.__name__], sys.modules[base.__name__] = hook, base

import torch
from safetensors.torch import load_file
from int4pack import vllm_plugin
vllm_plugin.register()
assert list(registered) == ["int4pack-kleidiai"], registered
from int4pack.vllm_plugin import _layout, _routing
from int4pack import serve_spec

folder = Path({str(tmp_path / "packed")!r})
rec = serve_spec.read_record(json.loads((folder / "config.json").read_text())["quantization_config"])
assert _layout.runtime_problem({{**rec, "layout_version": 2}})
blobs = {{}}
for f in folder.glob("*.safetensors"):
    blobs.update(load_file(f))
p = "model.layers.1.mlp.experts"
hidden, inter = 256, 128
eb = _layout.ExpertBlobs(4, hidden, inter, rec["group_size"], check=_layout.blob_check(rec, p, experts=4))
w13, w2 = eb.empty("w13"), eb.empty("w2")
for e in range(4):
    for proj, shard, param in (("gate_proj", "w1", w13), ("up_proj", "w3", w13), ("down_proj", "w2", w2)):
        eb.load(param, blobs[f"{{p}}.{{e}}.{{proj}}.weight_packed"], f"{{p}}.w13", shard, e)
assert eb.missing() == []
eb.check_bytes()
print(json.dumps(sorted(m for m in sys.modules if m.startswith("int4pack"))))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                       env={**__import__("os").environ, "PYTHONPATH": str(PACKAGE.parent)})
    assert r.returncode == 0, r.stderr
    loaded = set(json.loads(r.stdout.strip().splitlines()[-1]))
    assert "int4pack.vllm_plugin._layout" in loaded and "int4pack.vllm_plugin._config" in loaded
    assert not [m for m in loaded if m.startswith(CONVERTER_ONLY)], sorted(loaded)
    others = {m for m in loaded if not m.startswith("int4pack.vllm_plugin")} - {"int4pack", "int4pack._version",
                                                                               "int4pack.errors"}
    assert len(others) <= PLUGIN_BUDGET, sorted(others)
