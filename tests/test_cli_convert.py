"""The convert command as a user meets it: help, JSON, exit codes, errors without tracebacks."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from typer.testing import CliRunner

from _reference import FIXTURES
from int4pack.cli import app
from int4pack.errors import EXIT_OUTPUT, EXIT_REFUSED

runner = CliRunner()


def test_help_has_examples_and_exit_codes():
    r = runner.invoke(app, ["convert", "--help"])
    assert r.exit_code == 0
    assert "Examples" in r.output and "--dry-run" in r.output and "--group-size" in r.output
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0 and "convert" in r.output and "Exit codes" in r.output


def test_version_via_console_script():
    r = subprocess.run([sys.executable, "-m", "int4pack", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("int4pack ")


def test_dry_run_json_is_one_object_and_writes_nothing(tmp_path):
    r = runner.invoke(app, ["convert", str(FIXTURES / "gptq_q3_sym"), str(tmp_path / "o"), "--dry-run", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["ok"] is True and data["dry_run"] is True
    assert data["plan"]["format"]["zero_convention"] == "v1"
    assert data["plan"]["paths"]["lossless"] == 32
    assert not (tmp_path / "o").exists()


def test_existing_output_refused_with_hint(tmp_path):
    (tmp_path / "o").mkdir()
    r = runner.invoke(app, ["convert", str(FIXTURES / "gptq_q3_sym"), str(tmp_path / "o")])
    assert r.exit_code == EXIT_OUTPUT
    assert "already exists" in r.output and "--overwrite" in r.output and "Traceback" not in r.output


def test_refusal_exit_code_json_error_and_debug_traceback(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "gptq_q3_sym", src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"]["bits"] = 3
    (src / "config.json").write_text(json.dumps(cfg))
    (src / "quantize_config.json").unlink(missing_ok=True)
    r = runner.invoke(app, ["convert", str(src), str(tmp_path / "o"), "--json"])
    assert r.exit_code == EXIT_REFUSED
    err = json.loads(r.stdout)["error"]
    assert err["exit_code"] == EXIT_REFUSED and "3" in err["message"] and err["hint"]
    assert "Traceback" not in r.output
    r = runner.invoke(app, ["convert", str(src), str(tmp_path / "o"), "--debug"])
    assert r.exit_code == EXIT_REFUSED and "Traceback" in r.output
    assert not (tmp_path / "o").exists()


def test_human_output_reports_paths_and_errors(tmp_path):
    r = runner.invoke(app, ["convert", str(FIXTURES / "awq_q3"), str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    assert "requant" in r.output and "plain RTN" in r.output and "wrote" in r.output
    assert (tmp_path / "o" / "int4pack_report.json").is_file()


def test_overwrite_replaces_only_an_int4pack_output(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    r = runner.invoke(app, ["convert", str(FIXTURES / "ct_qwen3moe_w4a16"), str(out), "--overwrite"])
    assert r.exit_code == EXIT_OUTPUT and "not an int4pack output" in r.output
    assert (out / "precious.txt").read_text() == "keep me"
    (out / "precious.txt").unlink()
    assert runner.invoke(app, ["convert", str(FIXTURES / "ct_qwen3moe_w4a16"), str(out), "--overwrite"]).exit_code == 0
    r = runner.invoke(app, ["convert", str(FIXTURES / "ct_qwen3moe_w4a16"), str(out), "--overwrite"])
    assert r.exit_code == 0 and (out / "int4pack_report.json").is_file()


def test_group_size_substitution_warned_or_refused_with_strict(tmp_path):
    src, out = str(FIXTURES / "gptq_q3_sym"), str(tmp_path / "o")
    r = runner.invoke(app, ["convert", src, out, "--dry-run", "-g", "128"])
    assert r.exit_code == 0, r.output
    # experts (I = 128) and o_proj (K = 4 x 32 = 128) of both layers, on one line
    assert "26 module(s) cannot run group 128 (group size 128 equals K=128" in " ".join(r.stderr.split())
    assert "model.layers.0.mlp.experts and 3 more get group 32 (bf16 scales)" in " ".join(r.stderr.split())
    r = runner.invoke(app, ["convert", src, out, "--dry-run", "-g", "128", "--strict-group-size"])
    assert r.exit_code == EXIT_REFUSED and "--group-size 128" in r.output and "Traceback" not in r.output
