"""The command line as a new user meets it: help without torch, choices as choices, help in whole
sentences, output folders made as mkdir -p would, and tables that fit an 80-column terminal."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from _reference import FIXTURES
from int4pack import kernels
from int4pack.cli import app
from int4pack.cli._common import help_text
from int4pack.cli.convert import convert_cmd
from int4pack.cli.inspect import inspect_cmd
from int4pack.cli.verify import verify_cmd
from int4pack.errors import EXIT_OUTPUT, EXIT_USAGE

runner = CliRunner()
PATHS = ("lossless", "requant", "fold", "reemit", "dequant")


def _imported_by(*args: str) -> set[str]:
    """Top-level modules a fresh interpreter imports to run ``int4pack ARGS`` (python -X importtime)."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "int4pack", *args], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    names = re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)", r.stderr, re.M)
    assert names, "python -X importtime printed nothing"
    return {n.split(".")[0] for n in names}


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["convert", "--help"], ["verify", "--help"],
                                  ["inspect", "--help"]])
def test_help_and_version_do_not_import_torch(args):
    mods = _imported_by(*args)
    assert "typer" in mods and "int4pack" in mods
    assert not {"torch", "numpy", "safetensors", "huggingface_hub"} & mods


_TORCH_MARK = "<<torch imported>>"
# runs the console script's main() with an audit hook that prints a mark into stdout when torch is imported
_HOOKED_CLI = (
    "import atexit, gc, sys\n"
    "def hook(event, args):\n"
    "    if event == 'import' and args[0] == 'torch':\n"
    f"        print({_TORCH_MARK!r}, flush=True)\n"
    "sys.addaudithook(hook)\n"
    "atexit.register(lambda: print('frozen', gc.get_freeze_count(), file=sys.stderr))\n"
    "sys.argv = ['int4pack', *sys.argv[1:]]\n"
    "from int4pack.cli import main\n"
    "main()\n")


def _hooked_cli(*args: str) -> tuple[str, int]:
    r = subprocess.run([sys.executable, "-c", _HOOKED_CLI, *args], capture_output=True, text=True,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stdout, int(re.search(r"^frozen (\d+)$", r.stderr, re.M).group(1))


@pytest.mark.parametrize("fixture, fmt, torch_used", [("gptq_q3_sym", "gptq (gptq v1 zero points)", False),
                                                      ("gptq_q3_asym", "gptq (gptq v1 zero points)", False),
                                                      ("gptq_q3_descact", "gptq (gptq v1 zero points)", True),
                                                      ("awq_q3", "awq (awq gemm)", False),
                                                      ("ct_qwen3moe_w4a16", "compressed-tensors", False)])
def test_convert_prints_its_plan_before_torch_is_imported(tmp_path, fixture, fmt, torch_used):
    """The plan (format, paths, bytes) is out before torch's ~3 s import starts; then work the C++
    batches hand back (act-order's g_idx) imports torch once, and the console script freezes what
    that import made. Where the batches take every module (modules across two source files too),
    torch is never imported."""
    if kernels.ext() is None and not torch_used:
        pytest.skip("without the C++ library every module takes torch's path")
    out, frozen = _hooked_cli("convert", str(FIXTURES / fixture), str(tmp_path / "out"))
    lines = out.splitlines()
    assert lines[0].startswith(f"{FIXTURES / fixture}: {fmt}"), lines[0]
    plan_line = re.compile(r"  tensors: \d+ in -> \d+ out in 1 shard\(s\); .* read -> ")
    plan = next(i for i, ln in enumerate(lines) if plan_line.match(ln))
    if not torch_used:
        assert _TORCH_MARK not in lines and any(ln.startswith("wrote ") for ln in lines), out
        return
    assert lines.count(_TORCH_MARK) == 1, out
    mark = lines.index(_TORCH_MARK)
    assert plan < mark < next(i for i, ln in enumerate(lines) if ln.startswith("wrote "))
    assert frozen > 100_000  # torch's objects, frozen out of the GC's scans


def test_convert_dry_run_never_imports_torch(tmp_path):
    out, _ = _hooked_cli("convert", str(FIXTURES / "gptq_q3_sym"), str(tmp_path / "out"), "--dry-run",
                         "--serve-format", "kleidiai")
    assert _TORCH_MARK not in out and "dry run: nothing written" in out and "serve format: kleidiai" in out
    assert not (tmp_path / "out").exists()


def test_choices_are_choices():
    r = runner.invoke(app, ["convert", "SRC", "OUT", "--serve-format", "kleidai"])
    assert r.exit_code == EXIT_USAGE and "kleidiai" in r.output and "compressed-tensors" in r.output
    r = runner.invoke(app, ["convert", "SRC", "OUT", "--dense", "fp16"])
    assert r.exit_code == EXIT_USAGE and "bf16" in r.output
    r = runner.invoke(app, ["convert", "--help"], terminal_width=120)
    assert "compressed-tensors|kleidiai" in r.output and "w4a8|bf16" in r.output


@pytest.mark.parametrize("name,cmd", [("convert", convert_cmd), ("verify", verify_cmd), ("inspect", inspect_cmd)])
def test_help_reads_as_sentences_with_examples(name, cmd):
    r = runner.invoke(app, [name, "--help"], terminal_width=400)
    assert r.exit_code == 0
    lines = [line.strip() for line in r.output.splitlines()]
    paragraphs = help_text(cmd.__doc__).split("\n\n")
    assert len(paragraphs) >= 2
    for par in paragraphs:  # each paragraph is one line on a wide terminal: no break mid-sentence
        assert par.endswith(".") and par in lines, par
    i = lines.index("Examples")
    examples = [(lines[j - 1], lines[j]) for j in range(i + 1, len(lines)) if lines[j].startswith("int4pack ")]
    assert len(examples) >= 3
    for sentence, _ in examples:  # every command line is introduced by a sentence
        assert sentence[0].isupper() and sentence.endswith(":"), sentence


@pytest.mark.parametrize("name", ["convert", "verify", "inspect"])
def test_help_reads_at_80_columns(name):
    """Every line fits and no word is split across lines (hyphenated compounds aside)."""
    r = runner.invoke(app, [name, "--help"], terminal_width=80)
    assert r.exit_code == 0
    lines = r.output.splitlines()
    assert all(len(x) <= 80 for x in lines), max(lines, key=len)
    assert len(lines) < 100, len(lines)
    words = set(re.findall(r"[A-Za-z_]+", runner.invoke(app, [name, "--help"], terminal_width=400).output))
    for a, b in zip(lines, lines[1:]):
        left, right = re.search(r"([A-Za-z_]*)$", a).group(1), re.match(r"\s*([A-Za-z_]*)", b).group(1)
        assert not (left and right and left + right in words and left not in words), (a, b)


def test_output_parent_folders_are_created(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    r = runner.invoke(app, ["convert", str(FIXTURES / "ct_qwen3moe_w4a16"), str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    assert (out / "config.json").is_file()
    (tmp_path / "file").write_text("x")
    r = runner.invoke(app, ["convert", str(FIXTURES / "ct_qwen3moe_w4a16"), str(tmp_path / "file" / "out")])
    assert r.exit_code == EXIT_OUTPUT and "cannot create" in r.output and "Traceback" not in r.output


def _table_lines(output: str) -> list[str]:
    """The lines tables print: text lines are indented, and the first line, 'wrote' and the verdict are text."""
    lines = output.splitlines()[1:]
    return [ln for ln in lines if ln and not ln.startswith(("  ", "wrote ", "next: ", "PASS", "FAIL"))]


def _fits(output: str) -> None:
    wide = [ln for ln in _table_lines(output) if len(ln) > 80]
    assert wide == [], "\n".join(wide)


def _rows(output: str, first: str) -> list[list[str]]:
    """The cells of each table row that starts with ``first`` (cells hold no spaces here)."""
    return [ln.split() for ln in output.splitlines() if ln.split(" ", 1)[0] == first]


def _row(output: str, first: str) -> list[str]:
    (cells,) = _rows(output, first)
    return cells


def test_convert_and_verify_tables_fit_80_columns(tmp_path):
    src, out = FIXTURES / "gptq_q3_descact", tmp_path / "out"
    r = runner.invoke(app, ["convert", str(src), str(out), "-v"], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    _fits(r.stdout)
    report = json.loads((out / "int4pack_report.json").read_text())
    for module, stats in report["modules"].items():  # every module's row, each value whole
        rows = _rows(r.stdout, module)  # in "Every module", and maybe in "Largest weight errors"
        assert len(rows) in (1, 2) and stats["path"] in PATHS
        for cells in rows:
            assert cells[:2] == [module, stats["path"]]
            assert float(cells[2]) == pytest.approx(float(stats["rel_l2"]), rel=5e-3)
    r = runner.invoke(app, ["verify", str(out), "--against", str(src), "-v"], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    _fits(r.stdout)
    data = json.loads(runner.invoke(app, ["verify", str(out), "--against", str(src), "--json"]).stdout)
    for layer in data["layers"]:
        index = re.search(r"\.layers\.(\d+)\.", layer["layer"]).group(1)
        assert _row(r.stdout, index)[1] == f"{layer['experts_checked']}/{layer['experts']}"
    for d in data["dense"]:
        assert _row(r.stdout, d["module"])[-1] == "True"


@pytest.mark.parametrize("fixture", ["awq_q3", "ct_qwen3moe_w4a16_channel", "gptq_q3_descact"])
def test_inspect_tables_fit_80_columns(fixture):
    r = runner.invoke(app, ["inspect", str(FIXTURES / fixture), "-v"], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    _fits(r.stdout)
    data = json.loads(runner.invoke(app, ["inspect", str(FIXTURES / fixture), "--json"]).stdout)
    for t in data["tensors"]:  # every tensor's row, in the table of its file, name whole
        assert _row(r.stdout, t["name"])[1] == t["dtype"]
        assert f"Tensors in {t['file']}" in r.stdout
    rows = [ln.split() for ln in _table_lines(r.stdout) if ln.split(" ", 1)[0] in ("expert", "attention")]
    assert sum(int(row[8]) for row in rows) == len(data["modules"])
    assert {row[7] for row in rows} <= set(PATHS) and {row[9] for row in rows} <= {"yes", "no"}


def test_the_console_script_freezes_what_the_library_import_made():
    """Process-wide settings are the CLI's: its process freezes torch's objects (the GC need not
    rescan them); the same app called in another process (here: the tests) leaves the GC alone."""
    code = ("import atexit, gc, sys\n"
            "atexit.register(lambda: print('frozen', gc.get_freeze_count(), gc.isenabled(), file=sys.stderr))\n"
            f"sys.argv = ['int4pack', 'inspect', {str(FIXTURES / 'awq_q3')!r}, '--json']\n"
            "from int4pack.cli import main\nmain()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    _, count, enabled = re.search(r"^frozen (\d+) (\w+)$", r.stderr, re.M).group(0).split()
    assert int(count) > 100_000 and enabled == "True"
    import gc

    before = gc.get_freeze_count()
    assert runner.invoke(app, ["inspect", str(FIXTURES / "awq_q3"), "--json"]).exit_code == 0
    assert gc.get_freeze_count() == before
