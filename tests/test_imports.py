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
