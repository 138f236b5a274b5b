"""verify checks what it was asked to check, or says why not: a --layers selection the model does not
have is a usage error (exit 2) naming the missing index, a run never passes having checked nothing,
--json lists exactly the layers, experts and dense linears that ran, and the progress display counts
them. The expected module lists are read from the output's own safetensors index, not from verify."""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

import int4pack
from _reference import FIXTURES
from int4pack.cli import app
from int4pack.errors import EXIT_USAGE, UsageError
from int4pack.output import VerifyProgress

runner = CliRunner()


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    """gptq_q3_sym converted: 2 layers, each a MoE layer of 4 experts and 4 attention linears."""
    o = tmp_path_factory.mktemp("sel") / "out"
    int4pack.convert(FIXTURES / "gptq_q3_sym", o)
    return o


@pytest.fixture(scope="module")
def ds(tmp_path_factory) -> Path:
    """DeepSeek-V3-style synthetic: layer 0 dense (MLP and attention), layer 1 MoE."""
    import _synth

    root = tmp_path_factory.mktemp("ds")
    _synth.write_ct_deepseek_v3(root / "src")
    int4pack.convert(root / "src", root / "out")
    return root / "out"


def _w4a8_modules(folder: Path, layer: int) -> set[str]:
    """Non-expert W4A8 modules of one layer, from the index (independent of verify's own discovery)."""
    wmap = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    return {k[: -len(".weight_scale")] for k in wmap
            if k.endswith(".weight_scale") and f".layers.{layer}." in k and ".experts." not in k}


@pytest.mark.parametrize("spec,missing", [("5,", "5"), ("-1,", "-1"), ("0,7", "7"), ("1,2,3", "2, 3")])
def test_missing_layer_is_a_usage_error_naming_it(out, spec, missing):
    r = runner.invoke(app, ["verify", str(out), "--layers", spec])
    assert r.exit_code == EXIT_USAGE, r.output
    assert f"no layer {missing} to check" in r.output
    assert "PASS" not in r.output and "internal error" not in r.output
    with pytest.raises(UsageError, match=f"no layer {re.escape(missing)} "):
        int4pack.verify(out, layers=spec)


@pytest.mark.parametrize("spec", ["abc", "0", ",", "1,x", "all,", "-3"])
def test_malformed_layers_exit_2(out, spec):
    r = runner.invoke(app, ["verify", str(out), "--layers", spec, "--json"])
    assert r.exit_code == EXIT_USAGE, r.output
    err = json.loads(r.stdout)["error"]
    assert err["error"] == "usage" and err["exit_code"] == EXIT_USAGE and "--layers" in err["message"]


def test_library_refuses_bad_layer_lists(out):
    for bad in ([], [0, 9], "x", True, [0.5, "a"]):
        with pytest.raises(UsageError):
            int4pack.verify(out, layers=bad)


def test_json_lists_exactly_what_was_checked(out):
    r = runner.invoke(app, ["verify", str(out), "--against", str(FIXTURES / "gptq_q3_sym"), "--layers", "1,",
                            "--experts", "2", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    ch = d["checked"]
    assert ch["layers"] == [1] and ch["moe_layers"] == [1] and ch["numerical"] is True
    assert [lay["layer"] for lay in d["layers"]] == ["model.layers.1.mlp"]
    sampled = ch["experts_by_layer"]["model.layers.1.mlp"]
    assert len(sampled) == 2 and set(sampled) <= {0, 1, 2, 3} and ch["experts"] == 2
    assert d["layers"][0]["experts_sampled"] == sampled and set(d["layers"][0]["expert_stats"]) == set(map(str, sampled))
    assert set(ch["dense"]) == _w4a8_modules(out, 1) and len(ch["dense"]) == 4
    assert {x["module"] for x in d["dense"]} == set(ch["dense"])
    for x in d["dense"] + d["layers"]:  # each with its figures
        assert x["ok"] and x["rel_l2"] <= x["tolerance"]


def test_all_checks_every_layer_and_every_dense_linear(ds):
    d = int4pack.verify(ds)
    assert d["checked"]["moe_layers"] == [1] and d["checked"]["layers"] is None
    assert set(d["checked"]["dense"]) == _w4a8_modules(ds, 0) | _w4a8_modules(ds, 1)


def test_a_dense_only_layer_checks_its_linears_and_is_refused_without_them(ds):
    d = int4pack.verify(ds, layers="0,")
    assert d["ok"] and d["layers"] == [] and set(d["checked"]["dense"]) == _w4a8_modules(ds, 0)
    n = len(_w4a8_modules(ds, 0))
    assert n == 8 and d["verdict"] == f"PASS: structure ok, 0 MoE layer(s) and {n} dense linear(s) within tolerance"
    r = runner.invoke(app, ["verify", str(ds), "--layers", "0,", "--no-dense"])
    assert r.exit_code == EXIT_USAGE and "no layer 0 to check" in r.output and "layers with MoE experts: 1" in r.output


def test_nothing_checked_is_a_failure_never_a_pass(out, monkeypatch):
    # a model whose selection leaves nothing to run: no MoE layer found and --no-dense
    from int4pack.verify import structure

    real = structure.check_structure

    def no_moe(checks, *args):
        got = real(checks, *args)
        checks.output.layers = {}
        return got

    monkeypatch.setattr(sys.modules["int4pack.verify.passes"], "check_structure", no_moe)
    r = runner.invoke(app, ["verify", str(out), "--no-dense"])
    assert r.exit_code == 6 and "PASS" not in r.output and "nothing was checked" in r.output


def test_structural_only_says_the_numbers_were_not_checked(out):
    d = int4pack.verify(out, structural_only=True)
    assert d["ok"] and "numerical pass not run" in d["verdict"] and d["checked"]["numerical"] is False


def test_progress_counts_layers_experts_and_dense(out):
    seen = []

    class Rec:
        def phase(self, what):
            seen.append(("phase", what))

        def start(self, layers, experts, dense):
            seen.append(("start", layers, experts, dense))

        def advance(self, *, layers=0, experts=0, dense=0, what=""):
            seen.append(("advance", layers, experts, dense))

        def stop(self):
            seen.append(("stop",))

    int4pack.verify(out, layers="0,1", experts=3, progress=Rec())
    assert seen[0] == ("phase", "structure") and seen[-1] == ("stop",)
    start = next(s for s in seen if s[0] == "start")
    assert start[1:] == (2, 6, 8)  # 2 layers x 3 sampled experts, 4 attention linears per layer
    adv = [s for s in seen if s[0] == "advance"]
    assert tuple(sum(a[i] for a in adv) for i in (1, 2, 3)) == start[1:]


def test_rich_progress_on_a_terminal_only():
    buf = io.StringIO()
    p = VerifyProgress(Console(file=buf, force_terminal=True, width=120))
    p.phase("structure")
    p.start(2, 8, 8)
    p.advance(experts=4, what="model.layers.0.mlp")
    p.advance(layers=1)
    p._p.refresh()
    p.stop()
    text = buf.getvalue()
    assert "layers 1/2" in text and "experts 4/8" in text and "dense 0/8" in text and "0:00:0" in text
    quiet = io.StringIO()
    p = VerifyProgress(Console(file=quiet, force_terminal=False))
    p.start(2, 8, 8)
    p.advance(experts=8, layers=2)
    p.stop()
    assert quiet.getvalue() == ""


def test_interrupt_does_not_suggest_resume(out, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(sys.modules["int4pack.verify"], "verify", interrupted)
    r = runner.invoke(app, ["verify", str(out)])
    assert r.exit_code == 130 and "--resume" not in r.output and "verify writes nothing" in r.output
