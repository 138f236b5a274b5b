"""inspect on every real fixture: the format verdict, act-order flags, the predicted path; the CLI's
JSON; and the nibble-layout dump checked against an independent decode (tests/_reference.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

import int4pack
from _reference import FAMILY_FIXTURES_2026, FIXTURES, FORMAT_FIXTURES, awq_decode, gptq_decode, load_all
from int4pack.cli import app
from int4pack.inspect import kleidiai_gate


# fixture -> (format, detail substring, act-order on every module?, predicted paths)
EXPECTED = {
    "gptq_q3_sym": ("gptq", "gptq v1", False, {"lossless"}),
    "gptq_q3_asym": ("gptq", "gptq v1", False, {"requant"}),
    "gptq_q3_descact": ("gptq", "gptq v1", True, {"fold", "requant"}),
    "gptq_mixtral_sym": ("gptq", "gptq v1", False, {"lossless"}),
    "awq_q3": ("awq", "awq gemm", False, {"requant"}),
    "awqpack_mixtral": ("awq", "awq gemm", False, {"requant"}),
    # auto-round 0.16.1: full-range symmetric scales are signed, so symmetric modules are requantised too
    "autoround_q3_sym_g32": ("auto-round", "gptq v1", False, {"requant"}),
    "autoround_q3_sym_g128": ("auto-round", "gptq v1", False, {"requant"}),
    "autoround_q3_gptq_asym_g32": ("auto-round", "gptq v1", False, {"requant"}),
    "autoround_q3_awq_g32": ("auto-round", "awq gemm", False, {"requant"}),
    "ct_qwen3moe_w4a16": ("compressed-tensors", "pack-quantized", False, {"lossless"}),
    "ct_qwen3moe_w4a16_asym_g32": ("compressed-tensors", "pack-quantized", False, {"requant"}),
    "ct_qwen3moe_w4a16_channel": ("compressed-tensors", "pack-quantized", False, {"lossless"}),
    "ct_qwen3moe_w4a8_int_g32": ("compressed-tensors", "int-quantized", False, {"reemit"}),
    "ct018_q3_actorder": ("compressed-tensors", "pack-quantized", True, {"fold", "requant"}),
    "mf_mixtral": ("compressed-tensors", "pack-quantized", False, {"lossless"}),
    "mlx_qwen3moe_mixed": ("mlx", "mlx affine", False, {"requant"}),
    "mlx_q3_4bit_g64": ("mlx", "mlx affine", False, {"requant"}),
    "mlx_q3_mixed_4_8": ("mlx", "mlx affine", False, {"requant", "dequant"}),  # 8-bit attention: bf16
    "gguf_qwen3moe_q4_0": ("gguf", "gguf qwen3moe", False, {"requant"}),
    # Q4_K_M on K = 128 falls back to Q5_0 (kept in bf16 when dense) and Q8_0 (the down experts)
    "gguf_qwen3moe_q4_k_m": ("gguf", "gguf qwen3moe", False, {"requant", "dequant"}),
    "gguf_q3_q8_0": ("gguf", "gguf qwen3moe", False, {"requant", "dequant"}),  # Q8_0 attention: bf16
    "gguf_q3_q4_0": ("gguf", "gguf qwen3moe", False, {"requant"}),
    "gguf_q3_q4_k_m": ("gguf", "gguf qwen3moe", False, {"requant", "dequant"}),
}
# mixed-precision fixtures (8-bit and bf16 modules, an MTP block): their verdicts and each module's decision
# are checked in tests/formats/test_autoround.py and test_compressed_tensors.py
MIXED = {"autoround_q3_asym_g32", "autoround_q3_mixed_g32", "ct_qwen3moe_mixed_w4w8", "ct_qwen3moe_mixed_experts"}


def test_every_fixture_is_listed():
    # the other formats' fixtures (GGUF, MLX, FP8, FP4, float) are read by their own formats' tests
    others = FORMAT_FIXTURES - set(EXPECTED) - MIXED
    present = {p.name for p in FIXTURES.iterdir() if p.is_dir()} - {"dense_qwen3moe"} - FAMILY_FIXTURES_2026 - others
    assert present == set(EXPECTED) | MIXED


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_verdict(name):
    fmt, detail, act, paths = EXPECTED[name]
    r = int4pack.inspect(FIXTURES / name)
    assert r["format"]["format"] == fmt
    assert detail in r["format"]["detail"]
    assert r["format"]["evidence"]
    mods = r["modules"]
    assert mods and all(m["act_order"] == act for m in mods.values())
    assert {m["path"] for m in mods.values()} == paths
    assert r["plan"]["ok"]
    assert len(r["moe"]["layers"]) == 2 and all(m["experts"] == 4 for m in r["moe"]["layers"])
    # after convert every W4A8 module takes KleidiAI (a module kept in bf16 is no W4A8 module)
    assert all(m["kleidiai"] for m in mods.values() if m["path"] != "dequant")
    assert sum(t["bytes"] for t in r["tensors"]) == r["bytes"]
    if fmt == "gptq":
        assert r["format"]["zero_convention"] == "v1"
    if name.endswith("asym") or name.startswith("awq") or "asym_g32" in name:
        assert not any(m["sym"] for m in mods.values())


def test_float_checkpoint_shows_data_free_plan():
    r = int4pack.inspect(FIXTURES / "dense_qwen3moe")
    assert r["format"]["format"] == "float" and "quantised from float, data-free" in r["format"]["detail"]
    assert r["plan"]["ok"] and r["plan"]["paths"]["requant"] == len(r["modules"]) > 0
    assert r["tensor_count"] > 0


def test_kleidiai_gate_rules():
    assert kleidiai_gate(256, 32, "BF16")[0]
    assert kleidiai_gate(256, -1, "F32")[0] and kleidiai_gate(256, 256, "F32")[0]
    assert not kleidiai_gate(256, 32, "F16")[0]  # wrong scale dtype: silent fallback
    assert not kleidiai_gate(256, -1, "BF16")[0]
    assert not kleidiai_gate(256, 96, "BF16")[0] and not kleidiai_gate(256, 256, "BF16")[0]


def test_gptq_qweight_dump_matches_independent_decode():
    name = "model.layers.0.mlp.experts.1.gate_proj"
    r = int4pack.inspect(FIXTURES / "gptq_q3_sym", f"{name}.qweight")
    ref = gptq_decode(load_all(FIXTURES / "gptq_q3_sym"), name)
    first = [e for e in r["nibbles"] if e["word"] == [0, 0]]
    assert [e["k"] for e in first] == list(range(8)) and {e["n"] for e in first} == {0}
    assert [e["raw"] for e in first] == ref["u"][0, :8].tolist()
    q_ref = ref["u"][:8, :8] - ref["z"][:8, ref["g_idx"][:8]]
    assert np.array_equal(np.array(r["window"]["q"]), q_ref)
    assert np.allclose(np.array(r["window"]["scales"]), ref["s"][:8, ref["g_idx"][:8]])


def test_awq_dump_shows_interleave():
    name = "model.layers.0.mlp.experts.0.up_proj"
    r = int4pack.inspect(FIXTURES / "awq_q3", name)
    first = [e for e in r["nibbles"] if e["word"] == [0, 0]]
    assert [e["n"] for e in first] == [0, 2, 4, 6, 1, 3, 5, 7] and {e["k"] for e in first} == {0}
    ref = awq_decode(load_all(FIXTURES / "awq_q3"), name, 32)
    assert [e["raw"] for e in first] == [int(ref["u"][e["n"], 0]) for e in first]


def test_a_format_without_a_word_map_dumps_its_decoded_values(monkeypatch):
    """A reader whose modules name another format (a format added to the reader table) is dumped as
    it unpacks them, equal to the independent decode, without a nibble map of its words."""
    from int4pack.formats.awq import AWQReader

    spec_of = AWQReader._spec
    monkeypatch.setattr(AWQReader, "_spec", lambda self, name: (s := spec_of(self, name), setattr(s, "fmt", "new"))[0])
    name = "model.layers.0.mlp.experts.0.up_proj"
    r = int4pack.inspect(FIXTURES / "awq_q3", f"{name}.qweight")
    ref = awq_decode(load_all(FIXTURES / "awq_q3"), name, 32)
    assert r["format"] == "new" and "nibbles" not in r and r["layout"].startswith("new: ")
    g = np.arange(8) // 32
    assert np.array_equal(np.array(r["window"]["q"]), ref["u"][:8, :8] - ref["z"][:8][:, g])


def test_output_dump(tmp_path):
    out = tmp_path / "out"
    int4pack.convert(FIXTURES / "ct_qwen3moe_w4a16", out)
    r = int4pack.inspect(out)
    assert r["is_w4a8_output"] and r["format"]["detail"].startswith("int-quantized")
    assert r["kleidiai_summary"]["fallback"] == 0
    d = int4pack.inspect(out, "model.layers.0.mlp.experts.0.gate_proj")
    assert d["layout"].startswith("int8 [N, K]")


def test_cli_json():
    runner = CliRunner()
    res = runner.invoke(app, ["inspect", str(FIXTURES / "gptq_q3_descact"), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["ok"] and data["format"]["format"] == "gptq" and data["plan"]["paths"]["fold"] == 8
    res = runner.invoke(app, ["inspect", str(FIXTURES / "gptq_q3_sym"),
                              "model.layers.0.self_attn.q_proj.qweight", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["nibbles"][0]["k"] == 0
    res = runner.invoke(app, ["inspect", str(FIXTURES / "gptq_q3_sym"), "no.such.tensor"])
    assert res.exit_code == 2 and "not found" in res.output  # a usage error: the argument names nothing
    res = runner.invoke(app, ["inspect", str(FIXTURES / "ct018_q3_actorder")])
    assert res.exit_code == 0 and "act-order" in res.output


def test_scheme_per_module_before_and_after_convert(tmp_path):
    """The DeepSeek-V3-style synthetic: inspect shows each module's target group before convert, and
    the converted checkpoint's modules under their own config groups (kv_b_proj channel, fp32)."""
    import _synth

    _synth.write_ct_deepseek_v3(tmp_path / "src")
    r = int4pack.inspect(tmp_path / "src")
    assert [(s["group_size"], s["modules"]) for s in r["plan"]["schemes"]] == [(32, 26), (-1, 2)]
    target = {m: v["target_group_size"] for m, v in r["modules"].items()}
    assert {m for m, g in target.items() if g == -1} == {f"model.layers.{i}.self_attn.kv_b_proj" for i in (0, 1)}
    assert all(v["kleidiai"] for v in r["modules"].values())
    int4pack.convert(tmp_path / "src", tmp_path / "out")
    o = int4pack.inspect(tmp_path / "out")
    kv_b = o["modules"]["model.layers.0.self_attn.kv_b_proj"]
    assert (kv_b["group_size"], kv_b["scale_dtype"], kv_b["kleidiai"]) == (32, "F32", True)  # channel: group == K
    assert {v["group_size"] for m, v in o["modules"].items() if "kv_b" not in m} == {32}
    res = CliRunner().invoke(app, ["inspect", str(tmp_path / "src")])
    assert res.exit_code == 0 and "group 32 (bf16 scales) x 26, channel (fp32 scales) x 2" in res.output


def test_inspect_says_which_int4pack_made_an_output_and_prints_no_python_reprs(tmp_path):
    from datetime import datetime, timezone

    from typer.testing import CliRunner

    from int4pack import __version__
    from int4pack.cli import app

    runner = CliRunner()
    src = FIXTURES / "gptq_q3_sym"
    before = datetime.now(timezone.utc).replace(second=0, microsecond=0)
    for fmt in ("compressed-tensors", "kleidiai"):
        out = tmp_path / fmt
        int4pack.convert(src, out, serve_format=fmt)
        r = runner.invoke(app, ["inspect", str(out)], env={"COLUMNS": "80"})
        assert r.exit_code == 0, r.output
        line = next(x for x in r.output.splitlines() if x.startswith("  made by: "))
        assert line.startswith(f"  made by: int4pack {__version__} from {src}, "), line
        made = datetime.strptime(line.rsplit(", written ", 1)[1], "%Y-%m-%d %H:%M UTC").replace(tzinfo=timezone.utc)
        assert before <= made <= datetime.now(timezone.utc)
        for repr_ in ("None", "{'", "['", "True", "False"):
            assert repr_ not in r.output, (repr_, r.output)
        assert "refused" not in r.output, r.output  # a healthy output: nothing to refuse
        # -vv shows more than -v: every quantised module on a row of its own
        v1 = runner.invoke(app, ["inspect", str(out), "-v"], env={"COLUMNS": "200"}).output
        v2 = runner.invoke(app, ["inspect", str(out), "-vv"], env={"COLUMNS": "200"}).output
        mods = json.loads(runner.invoke(app, ["inspect", str(out), "--json"]).stdout)["modules"]
        assert "Every quantised module" in v2 and "Every quantised module" not in v1
        rows = v2[v2.index("Every quantised module"):].splitlines()
        assert all(any(x.split()[:1] == [m] for x in rows) for m in mods), sorted(mods)[:3]
    assert runner.invoke(app, ["inspect", str(src)]).output.count("made by") == 0  # not ours


@pytest.mark.parametrize("name, kinds", [("gguf_qwen3moe_q4_k_m", {"5-bit", "8-bit"}),
                                         ("gguf_gptoss_mxfp4", {"MXFP4"})])
def test_inspect_does_not_call_gguf_values_int4(name, kinds):
    """A GGUF source's Q5_0/Q8_0/MXFP4 modules are not int4 values: inspect says what they are, and
    counts as int4 asymmetric only 4-bit integer modules (it called them all 'asymmetric int4')."""
    out = CliRunner().invoke(app, ["inspect", str(FIXTURES / name)]).output
    line = next(x for x in out.splitlines() if "modules:" in x)
    assert "int4 modules" not in line and "0 int4 asymmetric" in line, line
    shown = {row.split()[4] for row in out.splitlines() if row.startswith(("expert ", "attention "))}
    assert kinds <= shown and not shown & {"asym", "sym"}, shown


@pytest.mark.parametrize("name, held, not_held", [
    ("gguf_gptoss_mxfp4", "ffn_{gate,up,down}_exps", "gate_up_proj_blocks"),
    ("mlx_qwen3moe_mixed", "switch_mlp", "mlp.experts.E."),
    ("gptoss_mxfp4", "gate_up_proj_blocks", "ffn_"),
])
def test_inspect_names_the_experts_as_the_source_holds_them(name, held, not_held):
    """A GGUF or MLX source holds a family's experts in its own fused tensors: inspect's family line
    describes those, not the family's safetensors release (gpt-oss from GGUF was described as
    the release's MXFP4 blocks)."""
    naming = int4pack.inspect(FIXTURES / name)["moe"]["expert_naming"]
    assert held in naming and not_held not in naming, naming
