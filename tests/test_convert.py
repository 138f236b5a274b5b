"""End-to-end: every real fixture converts, and the output dequantises to what the producer's
own dequantisation of the source gives (independent decoders in tests/_reference.py)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import int4pack
from int4pack.architectures import vllm_output_names
from _reference import (
    FAMILY_FIXTURES_2026,
    FORMAT_FIXTURES,
    FIXTURES,
    awq_decode,
    ct_decode,
    ct_modules,
    gptq_decode,
    gptq_modules,
    load_all,
    load_raw,
    qconfig,
    rel_l2,
    vllm_detects_w4a8,
    w4a8_decode,
)


ALL = sorted(p.name for p in FIXTURES.iterdir()
             if p.is_dir() and p.name != "dense_qwen3moe" and p.name not in FAMILY_FIXTURES_2026
             and p.name not in FORMAT_FIXTURES) \
    if FIXTURES.is_dir() else []


def _int4_throughout(name: str) -> bool:
    """GPTQ, AWQ or compressed-tensors with every module int4: what _source_refs decodes. The other
    fixtures (AutoRound, mixed precision) are checked against their producers' own dequantisation
    in tests/formats/test_autoround.py and test_compressed_tensors.py."""
    q = qconfig(FIXTURES / name)
    if q.get("quant_method") in ("gptq", "awq"):
        return True
    groups = (q.get("config_groups") or {}).values()
    return q.get("quant_method") == "compressed-tensors" and all(g["weights"]["num_bits"] == 4 for g in groups)


INT4 = [n for n in ALL if _int4_throughout(n)]


def _source_refs(name: str) -> dict[str, dict]:
    """module -> reference decode of the source, by the producer's own formula."""
    folder = FIXTURES / name
    t = load_all(folder)
    q = qconfig(folder)
    if q["quant_method"] == "gptq":
        return {m: gptq_decode(t, m, v1=True) for m in gptq_modules(t)}
    if q["quant_method"] == "awq":
        return {m: awq_decode(t, m, q["group_size"]) for m in gptq_modules(t)}
    grp = next(iter(q["config_groups"].values()))["weights"]
    return {m: ct_decode(t, m, grp.get("group_size")) for m in ct_modules(t)}


def _fold_perms(refs: dict, mods: dict) -> dict[str, np.ndarray]:
    """module -> row/column permutation a fold applied (stable argsort of down's g_idx, per the spec
    of the fold), for the down projection and its expert's gate and up."""
    perms = {}
    for m, st in mods.items():
        if st["path"] == "fold":
            perm = np.argsort(refs[m]["g_idx"], kind="stable")
            base = m.rsplit(".", 1)[0]
            for sib in mods:
                if sib.rsplit(".", 1)[0] == base:
                    perms[sib] = perm
    return perms


@pytest.mark.parametrize("name", INT4)
def test_fixture_converts_and_matches_producer_dequant(name, converted):
    out, report = converted(name)
    refs = _source_refs(name)
    got = load_all(out)
    dst = load_raw(out)
    mods = report["modules"]
    assert set(mods) == set(refs), "every int4 module of the source is converted"
    perms = _fold_perms(refs, mods)
    # output tensors carry the names vLLM loads (Mixtral: mlp.experts.E.gate_proj -> block_sparse_moe...w1)
    ren = {k[:-7]: v[:-7] for k, v in vllm_output_names(report["plan"]["model_type"],
                                                         [f"{m}.weight" for m in refs]).items()}
    for m, ref in refs.items():
        o = w4a8_decode(got, ren.get(m, m))
        assert o["q"].min() >= -8 and o["q"].max() <= 7
        st = mods[m]
        src_q = ref["u"] - 8 if "u" in ref else ref["q"]
        gi = ref.get("g_idx", np.arange(src_q.shape[1]) // max(1, src_q.shape[1] // ref["s"].shape[1]))
        ref_w, scale_dt = ref["w"], dst[f"{ren.get(m, m)}.weight_scale"].dtype
        if st["path"] == "fold":  # down: its columns permuted so act-order groups become contiguous
            p = perms[m]
            src_q, gi, ref_w = src_q[:, p], gi[p], ref_w[:, p]
        elif m in perms:  # gate/up of a folded expert: rows permuted by the same perm
            p = perms[m]
            src_q, ref_w, ref = src_q[p], ref_w[p], {**ref, "s": ref["s"][p]}
        if st["path"] in ("lossless", "reemit", "fold"):
            # ints bit-identical to the source's; scales the source's cast to the shipped dtype
            assert np.array_equal(o["q"], src_q), m
            s_src = ref["s"][:, gi[:: o["group"]]] if o["s"].shape[1] > 1 else ref["s"][:, :1]
            want = torch.tensor(s_src).to(scale_dt).float().numpy()
            assert np.array_equal(o["s"], want), m
            assert rel_l2(o["w"], ref_w) < 0.01, m  # only the scale cast differs
        elif st["path"] == "requant":
            err = rel_l2(o["w"], ref_w)
            assert err == pytest.approx(float(st["rel_l2"]), rel=1e-3, abs=1e-6), m
            assert err < 0.12, (m, err)
            assert float(st["rel_l2"]) <= float(st["baseline_rel_l2"]) + 1e-9, m
        else:
            pytest.fail(f"{m}: unexpected path {st['path']}")


def _out_name(report: dict, name: str) -> str:
    """The output name of a source tensor (convert renames Mixtral experts/routers to what vLLM loads)."""
    return vllm_output_names(report["plan"]["model_type"], [name]).get(name, name)


def got_dtype(out: Path, name: str) -> torch.dtype:
    return load_raw(out)[name].dtype


@pytest.mark.parametrize("name", ALL)
def test_every_source_tensor_accounted_and_copies_bit_exact(name, converted):
    out, report = converted(name)
    src = load_raw(FIXTURES / name)
    dst = load_raw(out)
    assert set(report["tensors"]) == set(src)
    for key, fate in report["tensors"].items():
        if fate == "copied":
            a, b = src[key], dst[_out_name(report, key)]
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), key
        else:
            assert fate.startswith("converted:")


@pytest.mark.parametrize("name", ALL)
def test_output_config_is_what_vllm_detects_as_w4a8(name, converted):
    out, report = converted(name)
    cfg = json.loads((out / "config.json").read_text())
    q = cfg["quantization_config"]
    assert vllm_detects_w4a8(q)
    assert q["format"] == "int-quantized"
    w = q["config_groups"]["group_0"]["weights"]
    dst = load_raw(out)
    # every quantised module's scale dtype matches the scheme (bf16 group / fp32 channel)
    for m, rec in report["modules"].items():
        if rec["path"] == "dequant":  # kept in bf16 (an 8-bit dense linear), listed in ignore
            assert _out_name(report, f"{m}.weight")[: -len(".weight")] in q["ignore"]
            continue
        s = dst[_out_name(report, f"{m}.weight_scale")]
        if w["strategy"] == "channel":
            assert s.dtype == torch.float32 and s.shape[1] == 1
        else:
            assert s.dtype == torch.bfloat16 and dst[_out_name(report, f"{m}.weight")].shape[1] // s.shape[1] == w["group_size"]
    # routers and lm_head stay float and are ignored by the W4A8 scheme
    for name_ in dst:
        if name_.endswith(".gate.weight") or name_ == "lm_head.weight":
            assert name_[: -len(".weight")] in q["ignore"]
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(idx["weight_map"]) == set(dst)
    for f in (FIXTURES / name).iterdir():
        if f.name.startswith("tokenizer") or f.name == "generation_config.json":
            assert (out / f.name).read_bytes() == f.read_bytes()


def test_w4a8_source_reproduces_its_tensors_exactly(converted):
    out, report = converted("ct_qwen3moe_w4a8_int_g32")
    src, dst = load_raw(FIXTURES / "ct_qwen3moe_w4a8_int_g32"), load_raw(out)
    assert set(src) == set(dst)
    for k in src:
        assert src[k].dtype == dst[k].dtype and torch.equal(src[k], dst[k]), k
    assert {v["path"] for v in report["modules"].values()} == {"reemit"}


def test_ct_source_close_to_its_float_origin(converted):
    """The ct fixtures were made from dense_qwen3moe: a lossless conversion stays within
    the int4 grid of the float weights (half a step plus bf16 scale rounding)."""
    out, report = converted("ct_qwen3moe_w4a16")
    dense = load_all(FIXTURES / "dense_qwen3moe")
    got = load_all(out)
    for m in list(report["modules"])[:12]:
        o = w4a8_decode(got, m)
        w = dense[f"{m}.weight"].astype(np.float64)
        step = np.repeat(o["s"], o["group"], axis=1)
        assert np.all(np.abs(o["w"] - w) <= 0.55 * step + 1e-6), m


def test_two_runs_are_byte_identical(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    int4pack.convert(FIXTURES / "gptq_q3_asym", a, max_shard_size="300KB")
    int4pack.convert(FIXTURES / "gptq_q3_asym", b, max_shard_size="300KB", threads=1)
    fa = sorted(p.name for p in a.iterdir())
    assert fa == sorted(p.name for p in b.iterdir()) and len([f for f in fa if f.endswith(".safetensors")]) > 1
    for f in fa:
        assert hashlib.sha256((a / f).read_bytes()).digest() == hashlib.sha256((b / f).read_bytes()).digest(), f


def test_convert_leaves_process_wide_settings_alone(tmp_path, monkeypatch):
    """The library call changes nothing process-wide (the CLI makes those choices): the GC's frozen
    set and torch's thread count stay as they were, also while the jobs run; the kernels called from
    a worker take one thread each all the same."""
    import gc
    import sys

    import torch

    from int4pack import kernels

    mod = sys.modules["int4pack.convert"]  # the module (int4pack.convert is the function)
    real, seen = mod.run_job, []

    def spy(*a, **kw):
        seen.append((gc.get_freeze_count(), torch.get_num_threads(), kernels.kernel_threads()))
        return real(*a, **kw)

    monkeypatch.setattr(mod, "run_job", spy)
    threads, frozen = torch.get_num_threads(), gc.get_freeze_count()
    int4pack.convert(FIXTURES / "gptq_q3_asym", tmp_path / "a", threads=2)
    assert seen and set(seen) == {(frozen, threads, 1)}
    assert (gc.get_freeze_count(), torch.get_num_threads(), kernels.kernel_threads()) == (frozen, threads, threads)


def test_source_folder_untouched(tmp_path):
    src = FIXTURES / "awq_q3"
    before = {p.name: (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest()) for p in src.iterdir()}
    int4pack.convert(src, tmp_path / "o")
    after = {p.name: (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest()) for p in src.iterdir()}
    assert before == after


def test_dry_run_writes_nothing_and_reports_plan(tmp_path):
    r = int4pack.convert(FIXTURES / "gptq_q3_descact", tmp_path / "o", dry_run=True)
    assert not (tmp_path / "o").exists() and not list(tmp_path.iterdir())
    paths = r["plan"]["paths"]
    # desc_act: down projections fold exactly; gate/up (act-order on H) requantise
    assert paths.get("fold", 0) == 2 * 4 and paths.get("requant", 0) > 0
    assert r["plan"]["moe_layers"] == 2 and r["plan"]["experts_per_layer"] == [4]


def test_explicit_group_and_channel(converted):
    out, report = converted("gptq_q3_sym", group_size="channel")
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert q["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    assert {v["path"] for v in report["modules"].values()} == {"requant"}
    out, report = converted("ct_qwen3moe_w4a16_channel", group_size=32)
    # channel source -> group 32: each group inside the one channel group, ints unchanged
    assert {v["path"] for v in report["modules"].values()} == {"lossless"}


def test_dense_bf16_keeps_attention_float(converted):
    out, report = converted("gptq_q3_sym", dense="bf16")
    dst = load_raw(out)
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    attn = [k for k in dst if ".self_attn.q_proj." in k]
    assert attn == [k for k in attn if k.endswith(".weight")] and dst[attn[0]].dtype == torch.bfloat16
    assert any(i.endswith("self_attn.q_proj") for i in q["ignore"])
    assert all(".experts." in m for m in report["modules"] if report["modules"][m]["path"] != "dequant")


def test_deepseek_v3_kv_b_channel_every_int_kept(tmp_path):
    """A compressed-tensors group-32 DeepSeek-V3 whose kv_b_proj has K = 32: kv_b_proj goes channel
    (fp32 scales), every other module keeps group 32, and every module's ints and scales are the
    source's bit for bit (one model-wide group would have requantised all 26 others to channel)."""
    import _synth

    src = tmp_path / "ds"
    ints = _synth.write_ct_deepseek_v3(src)
    report = int4pack.convert(src, tmp_path / "out")
    dst = load_raw(tmp_path / "out")
    q = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert vllm_detects_w4a8(q) and len(q["config_groups"]) == 2
    assert {v["path"] for v in report["modules"].values()} == {"lossless"} and len(ints) == 28
    for m, (qs, s) in ints.items():
        assert torch.equal(dst[f"{m}.weight"], qs.to(torch.int8)), m
        if m.endswith("kv_b_proj"):
            assert dst[f"{m}.weight_scale"].dtype == torch.float32 and report["modules"][m]["group_size"] == -1
            assert torch.equal(dst[f"{m}.weight_scale"], s.float()), m  # one source group per row, exact
        else:
            assert torch.equal(dst[f"{m}.weight_scale"], s), m
            assert report["modules"][m]["group_size"] == 32
    assert [g["schemes"] for g in [report["plan"]]] == [[
        {"group_size": 32, "scheme": "group 32 (bf16 scales)", "modules": 26},
        {"group_size": -1, "scheme": "channel (fp32 scales)", "modules": 2}]]
    meta = json.loads(next(iter(_metadata(tmp_path / "out").values()))["int4pack.target"])
    assert meta["group_size"] is None and meta["group_sizes"] == [-1, 32]
    assert int4pack.verify(tmp_path / "out", against=src)["ok"]


def test_requested_group_is_substituted_and_reported(converted):
    from int4pack.errors import RefusedError

    # H = 256; I = 128 and o_proj's K = 4 x 32 = 128: 128 = K there (the slow fallback)
    out, report = converted("gptq_q3_sym", group_size=128)
    subs = report["plan"]["group_substitutions"]
    assert {s["module"] for s in subs} == {f"model.layers.{i}.{m}" for i in (0, 1)
                                           for m in ("mlp.experts", "self_attn.o_proj")}
    assert {s["group_size"] for s in subs} == {32}
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert sorted(g["weights"]["group_size"] for g in q["config_groups"].values()) == [32, 128]
    assert {report["modules"][m]["path"] for m in report["modules"] if ".experts." in m} == {"lossless"}
    with pytest.raises(RefusedError, match="--group-size 128"):
        int4pack.convert(FIXTURES / "gptq_q3_sym", out.parent / "strict", group_size=128, strict_group_size=True)


def _metadata(folder: Path) -> dict[str, dict]:
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            out[f.name] = fh.metadata()
    return out


def test_workers_capped_and_the_cap_moved_by_its_variable(monkeypatch):
    """--threads above the cap runs the cap's workers (the report's "workers"); INT4PACK_MAX_WORKERS
    moves the cap, and a value that is not a number leaves it where it was."""
    from int4pack.workers import job_workers

    monkeypatch.delenv("INT4PACK_MAX_WORKERS", raising=False)
    assert [job_workers(t) for t in (1, 3, 16, 32)] == [1, 3, 16, 16]
    monkeypatch.setenv("INT4PACK_MAX_WORKERS", "4")
    assert [job_workers(t) for t in (1, 3, 4, 16)] == [1, 3, 4, 4]
    monkeypatch.setenv("INT4PACK_MAX_WORKERS", "many")
    assert job_workers(32) == 16


@pytest.mark.parametrize("serve_format", ["compressed-tensors", "kleidiai"])
def test_a_convert_of_batches_alone_never_imports_torch(tmp_path, serve_format):
    """mf_mixtral's modules are all lossless, each in one source file: every one goes through the C++
    batches, so the CLI's convert never imports torch (its import is most of a small convert's time).
    The bytes are those of the per-job torch path (INT4PACK_BATCH=0, another process). So do the
    requantised modules of GPTQ asym and AWQ sources held in one file (the requant batches), and the
    three-file gptq_q3_asym, some of whose modules straddle its files (each read into a buffer of its
    own: a staged batch)."""
    import subprocess
    import sys

    from int4pack import kernels

    if kernels.ext() is None:
        pytest.skip("no batches without the C++ library")
    code = ("import runpy, sys\nsys.argv = ['int4pack', 'convert', *sys.argv[1:]]\n"
            "try:\n    runpy.run_module('int4pack', run_name='__main__')\nexcept SystemExit as e:\n"
            "    assert not e.code, e.code\nprint('torch' in sys.modules, file=sys.stderr)\n")

    def run(src: str, out: Path, batch: str) -> str:
        res = subprocess.run([sys.executable, "-c", code, str(FIXTURES / src), str(out), "--serve-format",
                              serve_format, "--json"], capture_output=True, text=True,
                             env={**os.environ, "INT4PACK_BATCH": batch})
        assert res.returncode == 0, res.stderr[-2000:]
        return res.stderr.strip().splitlines()[-1]

    assert run("mf_mixtral", tmp_path / "batch", "1") == "False"
    assert run("mf_mixtral", tmp_path / "job", "0") == "True"
    shards = sorted(p.name for p in (tmp_path / "batch").glob("*.safetensors"))
    assert shards == sorted(p.name for p in (tmp_path / "job").glob("*.safetensors")) and shards
    for name in shards:
        assert (tmp_path / "batch" / name).read_bytes() == (tmp_path / "job" / name).read_bytes(), name
    assert run("gptq_q3_asym", tmp_path / "asym", "1") == "False"
    assert run("gptq_q3_asym", tmp_path / "asym_job", "0") == "True"
    for name in sorted(p.name for p in (tmp_path / "asym").glob("*.safetensors")):
        assert (tmp_path / "asym" / name).read_bytes() == (tmp_path / "asym_job" / name).read_bytes(), name
    from safetensors.torch import load_file, save_file

    for name in ("gptq_q3_asym", "awq_q3"):
        one = tmp_path / f"one_{name}"  # the same tensors in one file, no index
        one.mkdir()
        tensors = {}
        for f in sorted((FIXTURES / name).iterdir()):
            if f.suffix == ".safetensors":
                tensors.update(load_file(f))
            elif f.name.endswith(".json") and not f.name.endswith(".index.json"):
                (one / f.name).write_bytes(f.read_bytes())
        save_file(tensors, str(one / "model.safetensors"), metadata={"format": "pt"})
        assert run(str(one), tmp_path / f"{name}_batch", "1") == "False", name
        assert run(str(one), tmp_path / f"{name}_job", "0") == "True", name
        a, b = tmp_path / f"{name}_batch" / "model.safetensors", tmp_path / f"{name}_job" / "model.safetensors"
        assert a.read_bytes() == b.read_bytes(), name
