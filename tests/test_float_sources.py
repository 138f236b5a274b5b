"""Float, FP8 and FP4 sources: each reader's dequantisation against an independent reference, and
conversion in both serving formats checked by ``verify --against`` the source.

References: torch's own float8_e4m3fn -> float64 conversion for e4m3 (the readers decode the bits
with a table of their own), and the E2M1 values of the OCP Microscaling spec v1.0 (written out
below) times the scales in float64 for FP4. The sources are written here from the bf16 weights of
the real producer fixtures (dense_qwen3moe, and the sigmoid-routed DeepSeek-V3 fixture's weights).
"""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import int4pack
from _reference import FIXTURES
from int4pack import kernels
from int4pack.sources.checkpoint import Checkpoint
from int4pack.errors import InputError, RefusedError
from int4pack.formats import open_reader
from int4pack.formats.float_source import DATA_FREE

# OCP Microscaling Formats (MX) v1.0, table of FP4 E2M1: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa
OCP_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
OCP_E2M1 = OCP_E2M1 + [-v for v in OCP_E2M1]


def _is_linear(name: str, t: torch.Tensor) -> bool:
    """The linears a producer quantises: 2-D weights in the decoder layers, not routers."""
    return name.endswith(".weight") and t.dim() == 2 and ".layers." in name and not name.endswith(".gate.weight")


def _float_source(name: str) -> tuple[dict, dict]:
    """(bf16 tensors, config) of a float source: dense_qwen3moe as saved by transformers, or the
    DeepSeek-V3 fixture's int4 linears dequantised to bf16 (its weights, any weights will do)."""
    if name == "qwen3_moe":
        cfg = json.loads((FIXTURES / "dense_qwen3moe" / "config.json").read_text())
        return load_file(FIXTURES / "dense_qwen3moe" / "model.safetensors"), cfg
    folder = FIXTURES / "ct_deepseekv3_w4a16"
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("quantization_config")
    out = {}
    with Checkpoint(folder) as ck:
        reader = open_reader(ck)
        specs = reader.linears()
        consumed = {k for s in specs.values() for k in s.keys}
        for m, s in specs.items():
            out[f"{m}.weight"] = reader.read(s).dequantize().to(torch.bfloat16)
        for t in ck.tensors:
            if t not in consumed:
                out[t] = ck.get(t).clone()
    return out, cfg


def _save(folder, tensors: dict, cfg: dict, qcfg: dict | None):
    folder.mkdir(parents=True)
    cfg = dict(cfg)
    if qcfg is not None:
        cfg["quantization_config"] = qcfg
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def _expand(s: torch.Tensor, n: int, k: int, bn: int, bk: int) -> torch.Tensor:
    return s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def _fp8(tensors: dict, block: tuple[int, int] | None, scale_dtype=torch.float32, e8m0: bool = False):
    """FP8 e4m3 per block (None: per tensor) by torch's own cast; returns (tensors, {module: float64 reference})."""
    out, ref = {}, {}
    for name, t in tensors.items():
        if not _is_linear(name, t):
            out[name] = t
            continue
        w = t.double()
        n, k = w.shape
        bn, bk = block or (n, k)
        amax = torch.zeros(-(-n // bn), -(-k // bk), dtype=torch.float64)
        for i in range(amax.shape[0]):
            for j in range(amax.shape[1]):
                amax[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().max()
        s = (amax / 448).clamp_min(1e-12)
        if e8m0:
            s = torch.exp2(torch.ceil(torch.log2(s)))
        s = s.to(torch.float8_e8m0fnu if e8m0 else scale_dtype)
        q = (w / _expand(s.double(), n, k, bn, bk)).to(torch.float8_e4m3fn)
        out[name] = q
        out[name[:-7] + ".weight_scale_inv"] = s.reshape(()) if block is None else s
        ref[name[:-7]] = q.to(torch.float64) * _expand(s.double().reshape(amax.shape), n, k, bn, bk)
    return out, ref


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code of each value (of the OCP table), ties to the lower code."""
    table = torch.tensor(OCP_E2M1, dtype=torch.float64)
    return (x.unsqueeze(-1) - table).abs().argmin(dim=-1).to(torch.uint8)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [N, K] -> [N, K/2]: value 2j in the low nibble of byte j (numpy, not int4pack)."""
    c = codes.numpy().astype(np.uint8)
    return torch.from_numpy((c[:, 0::2] | (c[:, 1::2] << 4)).astype(np.uint8))


def _fp4(tensors: dict, kind: str):
    """MXFP4 (E8M0 per 32) / NVFP4 (E4M3 per 16 + global) / ModelOpt NVFP4; (tensors, float64 references)."""
    table = torch.tensor(OCP_E2M1, dtype=torch.float64)
    block = 32 if kind == "mxfp4" else 16
    out, ref = {}, {}
    for name, t in tensors.items():
        if not _is_linear(name, t):
            out[name] = t
            continue
        m = name[:-7]
        w = t.double()
        n, k = w.shape
        amax = w.abs().reshape(n, k // block, block).amax(-1).clamp_min(1e-12)
        if kind == "mxfp4":
            e = torch.ceil(torch.log2(amax / 6)).clamp(-127, 127)
            s = torch.exp2(e)
            out[f"{m}.weight_scale"] = (e + 127).to(torch.uint8)
        else:
            gs = 448 * 6 / float(w.abs().max())  # the global scale llm-compressor's NVFP4 derives
            s8 = (amax / 6 * gs).to(torch.float8_e4m3fn)
            s = s8.double() / torch.tensor(gs, dtype=torch.float32).double()
            if kind == "nvfp4":
                out[f"{m}.weight_scale"] = s8
                out[f"{m}.weight_global_scale"] = torch.tensor([gs], dtype=torch.float32)
            else:  # ModelOpt stores the reciprocal as weight_scale_2
                s2 = torch.tensor(1 / gs, dtype=torch.float32)
                out[f"{m}.weight_scale"], out[f"{m}.weight_scale_2"] = s8, s2
                s = s8.double() * s2.double()
        codes = _e2m1_codes(w / s.repeat_interleave(block, 1))
        out[f"{m}.weight_packed" if kind != "modelopt" else f"{m}.weight"] = _pack_nibbles(codes)
        ref[m] = table[codes.long()] * s.repeat_interleave(block, 1)
    return out, ref


def _ct_config(fmt: str, weights: dict) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed", "version": "0.20.0",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": fmt, "weights": weights}},
            "ignore": ["lm_head", "re:.*mlp.gate$"]}


SOURCES = {
    "float": lambda t: (t, {k[:-7]: v.double() for k, v in t.items() if _is_linear(k, v)}, None),
    "fp8_block": lambda t: (*_fp8(t, (32, 32)), {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                                 "weight_block_size": [32, 32]}),
    "fp8_ue8m0": lambda t: (*_fp8(t, (48, 48), e8m0=True), {"quant_method": "fp8", "weight_block_size": [48, 48],
                                                            "scale_fmt": "ue8m0"}),
    "fp8_tensor": lambda t: (*_fp8(t, None), {"quant_method": "fp8", "weight_block_size": None}),
    "ct_fp8_block": lambda t: (*_ct_fp8(t, (32, 32)), _ct_config("float-quantized", {
        "num_bits": 8, "type": "float", "symmetric": True, "strategy": "block", "block_structure": [32, 32]})),
    "ct_fp8_channel": lambda t: (*_ct_fp8(t, "channel"), _ct_config("float-quantized", {
        "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"})),
    "ct_fp8_tensor": lambda t: (*_ct_fp8(t, None), _ct_config("float-quantized", {
        "num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"})),
    "ct_mxfp4": lambda t: (*_fp4(t, "mxfp4"), _ct_config("mxfp4-pack-quantized", {
        "num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32})),
    "ct_nvfp4": lambda t: (*_fp4(t, "nvfp4"), _ct_config("nvfp4-pack-quantized", {
        "num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16})),
    "mxfp4_blocks": lambda t: (*_blocks_layout(*_fp4(t, "mxfp4")), {"quant_method": "mxfp4"}),
    "fp8_fp4_experts": lambda t: (*_fp4_experts(t), {"quant_method": "fp8", "weight_block_size": [32, 32],
                                                     "scale_fmt": "ue8m0", "expert_dtype": "fp4"}),
    "modelopt_nvfp4": lambda t: (*_fp4(t, "modelopt"), {"quant_method": "modelopt", "quant_algo": "NVFP4",
                                                        "group_size": 16, "exclude_modules": ["lm_head"]}),
}


def _blocks_layout(tensors: dict, ref: dict):
    """OpenAI's MXFP4 naming per linear: weight_blocks [N, K/32, 16], weight_scales [N, K/32]."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight_packed"):
            m = name[: -len(".weight_packed")]
            out[f"{m}.weight_blocks"] = t.reshape(t.shape[0], -1, 16)
            out[f"{m}.weight_scales"] = tensors[f"{m}.weight_scale"]
        elif not name.endswith(".weight_scale"):
            out[name] = t
    return out, ref


def _fp4_experts(tensors: dict):
    """DeepSeek-V4 style: experts as E2M1 pairs in I8 [N, K/2] with an E8M0 weight_scale_inv per 32, the other
    linears FP8 per 32x32 block."""
    experts = {k: v for k, v in tensors.items() if ".experts." in k}
    out, ref = _fp8({k: v for k, v in tensors.items() if k not in experts}, (32, 32))
    packed, ref4 = _fp4(experts, "mxfp4")
    for name, t in packed.items():
        if name.endswith(".weight_packed"):
            m = name[: -len(".weight_packed")]
            out[f"{m}.weight"] = t.view(torch.int8)
            out[f"{m}.weight_scale_inv"] = packed[f"{m}.weight_scale"].view(torch.float8_e8m0fnu)
    return out, {**ref, **ref4}


def _ct_fp8(tensors: dict, strategy):
    """compressed-tensors float-quantized: weight F8_E4M3 + weight_scale (bf16, as llm-compressor writes it)."""
    if strategy == "channel":
        out, ref = {}, {}
        for name, t in tensors.items():
            if not _is_linear(name, t):
                out[name] = t
                continue
            w = t.double()
            s = (w.abs().amax(1, keepdim=True) / 448).to(torch.bfloat16)
            q = (w / s.double()).to(torch.float8_e4m3fn)
            out[name], out[name[:-7] + ".weight_scale"] = q, s
            ref[name[:-7]] = q.double() * s.double()
        return out, ref
    out, ref = _fp8(tensors, strategy, scale_dtype=torch.bfloat16)
    for k in [k for k in out if k.endswith(".weight_scale_inv")]:
        v = out.pop(k)
        out[k[: -len("_inv")]] = v.reshape(1) if v.dim() == 0 else v
    return out, ref


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """sources(family, kind) -> (folder, {module: float64 reference}), written once per module."""
    cache = {}

    def get(family: str, kind: str):
        if (family, kind) not in cache:
            tensors, cfg = _float_source(family)
            out, ref, qcfg = SOURCES[kind](tensors)
            folder = _save(tmp_path_factory.mktemp(f"{family}_{kind}") / "src", out, cfg, qcfg)
            cache[family, kind] = folder, ref
        return cache[family, kind]

    return get


# exact: every product fits float32 (bf16/E8M0 scales, E2M1 x E8M0); otherwise a float32 rounding of it
_EXACT = {"float", "fp8_ue8m0", "ct_fp8_block", "ct_fp8_channel", "ct_fp8_tensor", "ct_mxfp4", "mxfp4_blocks"}


@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_reader_dequantises_as_the_reference(sources, kind):
    folder, ref = sources("qwen3_moe", kind)
    with Checkpoint(folder) as ck:
        reader = open_reader(ck)
        specs = reader.linears()
        assert set(specs) == set(ref)  # every producer-quantised linear, no router, lm_head or embedding
        assert DATA_FREE in reader.verdict().detail
        for m, s in specs.items():
            got = reader.read(s).dequantize().double()
            want = ref[m].float().double() if kind == "float" else ref[m]
            if kind in _EXACT:
                assert torch.equal(got, want), m
            else:  # one float32 rounding of the exact product, or the division by the global scale
                assert torch.allclose(got, want, rtol=2.0**-21, atol=0), m
            assert s.sym is False and s.group_size == 32  # never lossless; the least-error group vLLM runs


@pytest.mark.parametrize("kind", ["float", "fp8_block", "ct_fp8_block", "ct_mxfp4", "ct_nvfp4", "modelopt_nvfp4",
                                  "mxfp4_blocks", "fp8_fp4_experts"])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_converts_and_verifies_against_the_source(sources, tmp_path, family, kind):
    folder, _ = sources(family, kind)
    formats = ["compressed-tensors", "kleidiai"] if family == "qwen3_moe" else ["compressed-tensors"]
    for fmt in formats:
        out = tmp_path / fmt
        rep = int4pack.convert(folder, out, serve_format=fmt)
        assert DATA_FREE in rep["plan"]["format"]["detail"]
        assert rep["plan"]["group_size"] == 32
        mods = rep["modules"]
        assert mods and all(v["path"] == "requant" for v in mods.values())
        for m, v in mods.items():  # the search never loses to plain RTN on the same group
            assert float(v["rel_l2"]) <= float(v["baseline_rel_l2"]) * (1 + 1e-9), m
        r = int4pack.verify(out, against=folder, tokens=32)
        assert r["ok"], r
        seen = int4pack.inspect(out)  # the output says where it came from, with each module's errors
        assert DATA_FREE in seen["converted_from"]["detail"]
        assert {m: (v["rel_l2"], v["baseline_rel_l2"]) for m, v in seen["modules"].items()} == \
            {m: (v["rel_l2"], v["baseline_rel_l2"]) for m, v in mods.items()}


def _fused_experts(tensors: dict, transposed: bool) -> dict:
    """transformers 5's fused experts: gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I], or
    transposed ([E, H, 2I], [E, I, H]) as Llama-4 stores them."""
    out = {k: v for k, v in tensors.items() if ".experts." not in k}
    for moe in sorted({k.split(".experts.")[0] for k in tensors if ".experts." in k}):
        n = len({k.split(".experts.")[1].split(".")[0] for k in tensors if k.startswith(moe + ".experts.")})
        gu = torch.stack([torch.cat([tensors[f"{moe}.experts.{e}.gate_proj.weight"],
                                     tensors[f"{moe}.experts.{e}.up_proj.weight"]]) for e in range(n)])
        dn = torch.stack([tensors[f"{moe}.experts.{e}.down_proj.weight"] for e in range(n)])
        out[f"{moe}.experts.gate_up_proj"] = gu.transpose(1, 2).contiguous() if transposed else gu
        out[f"{moe}.experts.down_proj"] = dn.transpose(1, 2).contiguous() if transposed else dn
    return out


@pytest.mark.parametrize("transposed", [False, True])
def test_fused_float_experts_split_per_expert(tmp_path, transposed):
    tensors, cfg = _float_source("qwen3_moe")
    src = _save(tmp_path / "src", _fused_experts(tensors, transposed), cfg, None)
    with Checkpoint(src) as ck:
        reader = open_reader(ck)
        specs = reader.linears()
        want = {k[:-7]: v for k, v in tensors.items() if _is_linear(k, v)}
        assert set(specs) == set(want)
        for m, s in specs.items():
            assert torch.equal(reader.read(s).dequantize(), want[m].float()), m
    out = tmp_path / "out"
    rep = int4pack.convert(src, out)
    assert all(v["path"] == "requant" for v in rep["modules"].values())
    assert int4pack.verify(out, against=src, tokens=32)["ok"]


def _batched_and_per_job(src, out, monkeypatch, seen, serve_format="compressed-tensors"):
    """convert with the C++ batches and without: (report, modules the batches took, handed back); the
    two outputs' files and reports the same, byte for byte. ``seen``: the ``counted`` fixture."""
    import filecmp

    from int4pack import batch

    rep = int4pack.convert(src, out / "a", serve_format=serve_format)
    monkeypatch.setattr(batch, "ENABLED", False)
    rep_b = int4pack.convert(src, out / "b", serve_format=serve_format)
    monkeypatch.setattr(batch, "ENABLED", True)
    varies = ("seconds", "seconds_plan", "workers")
    assert json.dumps({k: v for k, v in rep.items() if k not in varies}).replace(str(out / "a"), "OUT") == \
        json.dumps({k: v for k, v in rep_b.items() if k not in varies}).replace(str(out / "b"), "OUT")
    names = sorted(p.name for p in (out / "a").iterdir())
    assert names == sorted(p.name for p in (out / "b").iterdir())
    for n in names:
        assert filecmp.cmp(out / "a" / n, out / "b" / n, shallow=False), n
    return rep, seen["batched"], seen["handed_back"]


@pytest.mark.skipif(kernels.ext() is None or not kernels.ext().requant_ok, reason="needs the C++ requant kernels")
@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_float_sources_in_the_requant_batches_are_the_per_job_bytes(sources, tmp_path, monkeypatch, counted, kind):
    """Every float source kind: the C++ batches (which decode bf16, e4m3, E2M1 with E8M0/E4M3 scales and
    NVFP4's global scale in place) write the per-job path's files and report; every layout but
    OpenAI's 3-D MXFP4 blocks goes through them."""
    folder, _ = sources("qwen3_moe", kind)
    rep, batched, handed = _batched_and_per_job(folder, tmp_path, monkeypatch, counted)
    requant = sum(1 for m in rep["modules"].values() if m["path"] == "requant")
    assert requant and handed == 0
    if kind == "mxfp4_blocks":
        assert batched == 0
    else:
        assert batched == requant, (batched, requant)


@pytest.mark.skipif(kernels.ext() is None or not kernels.ext().requant_ok, reason="needs the C++ requant kernels")
@pytest.mark.parametrize("transposed", [False, True])
def test_fused_float_experts_in_the_requant_batches_are_the_per_job_bytes(tmp_path, monkeypatch, counted, transposed):
    """Fused [E, 2I, H] experts: each expert's gate and up rows read in place by the batches (the
    transposed layout per job), the same bytes either way."""
    tensors, cfg = _float_source("qwen3_moe")
    src = _save(tmp_path / "src", _fused_experts(tensors, transposed), cfg, None)
    rep, batched, handed = _batched_and_per_job(src, tmp_path, monkeypatch, counted, "kleidiai")
    experts = sum(1 for m in rep["modules"] if ".experts." in m)
    assert experts and handed == 0
    assert (batched >= experts) if not transposed else (batched < experts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_nvfp4_global_scale_read_for_the_batches_is_torchs_value(tmp_path, dtype):
    """The batches read NVFP4's global scale without torch: the value torch reads, in each dtype."""
    from int4pack.formats.fp4 import _scalar

    v = torch.tensor([1234.567], dtype=dtype)
    save_file({"g": v, "big": torch.ones(2, dtype=dtype)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    with Checkpoint(tmp_path) as ck:
        assert _scalar(ck, "g") == float(v.float()[0])
        assert _scalar(ck, "big") is None


def test_float_checkpoint_of_an_unknown_family_is_refused(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "dense_qwen3moe", src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "llama"
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RefusedError, match="float checkpoint .*'llama'.*MoE family"):
        int4pack.convert(src, tmp_path / "out")


def test_float_linears_kept_float(sources):
    """Routers, norms, embeddings and lm_head stay as they are: copied byte for byte."""
    folder, _ = sources("deepseek_v3", "float")
    with Checkpoint(folder) as ck:
        specs = open_reader(ck).linears()
        assert not any(m.endswith(("mlp.gate", "lm_head", "embed_tokens")) or "norm" in m for m in specs)
        assert any(".mlp.shared_experts." in m for m in specs) and any(".self_attn." in m for m in specs)


def test_modelopt_side_file(sources, tmp_path):
    """ModelOpt's older exports keep the config in hf_quant_config.json, not in config.json."""
    folder, ref = sources("qwen3_moe", "modelopt_nvfp4")
    src = tmp_path / "src"
    shutil.copytree(folder, src)
    cfg = json.loads((src / "config.json").read_text())
    q = cfg.pop("quantization_config")
    (src / "config.json").write_text(json.dumps(cfg))
    (src / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt", "version": "0.37.0"},
                                                          "quantization": {"quant_algo": q["quant_algo"],
                                                                           "group_size": 16}}))
    with Checkpoint(src) as ck:
        reader = open_reader(ck)
        assert reader.name == "modelopt-nvfp4" and set(reader.linears()) == set(ref)
    int4pack.convert(src, tmp_path / "out")  # the side file is the source's record: not copied (vLLM would read it)
    assert not (tmp_path / "out" / "hf_quant_config.json").exists()


def test_fp8_nan_byte_is_named(sources, tmp_path):
    folder, _ = sources("qwen3_moe", "fp8_block")
    src = tmp_path / "src"
    shutil.copytree(folder, src)
    t = load_file(src / "model.safetensors")
    name = "model.layers.0.mlp.experts.1.up_proj.weight"
    w = t[name].view(torch.uint8).clone()
    w[3, 5] = 0x7F
    t[name] = w.view(torch.float8_e4m3fn)
    save_file(t, str(src / "model.safetensors"))
    with Checkpoint(src) as ck:
        reader = open_reader(ck)
        with pytest.raises(InputError, match=name.replace(".", r"\.") + ".*NaN"):
            reader.read(reader.linears()[name[:-7]])


def test_fp8_scale_shape_that_fits_no_block_is_named(sources, tmp_path):
    folder, _ = sources("qwen3_moe", "fp8_block")
    src = tmp_path / "src"
    shutil.copytree(folder, src)
    t = load_file(src / "model.safetensors")
    name = "model.layers.1.self_attn.q_proj.weight_scale_inv"
    t[name] = torch.ones(3, 5)
    save_file(t, str(src / "model.safetensors"))
    with Checkpoint(src) as ck, pytest.raises(InputError, match=name.replace(".", r"\.") + r".*fits no block"):
        open_reader(ck).linears()


def test_e4m3_table_covers_every_byte():
    """The readers' own e4m3 decoding against torch's for all 256 bytes (NaN bytes refused)."""
    from int4pack.formats.minifloat import e4m3

    b = torch.arange(256, dtype=torch.uint8)
    finite = (b & 0x7F) != 0x7F
    assert torch.equal(e4m3(b[finite]), b[finite].view(torch.float8_e4m3fn).float())
    with pytest.raises(ValueError):
        e4m3(b)
    assert math.isnan(float(b[~finite][:1].view(torch.float8_e4m3fn).float()))


def test_e2m1_and_e8m0_tables_cover_every_byte():
    """The FP4 decoding against torch's own float types for all 256 bytes: each byte's two E2M1 codes
    (low nibble first, the OCP MX value set) and E8M0 2^(e - 127), 255 (NaN) refused."""
    from int4pack.formats.minifloat import e8m0, unpack_e2m1

    b = torch.arange(256, dtype=torch.uint8)
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    want = torch.stack([e2m1[(b & 0x0F).long()], e2m1[(b >> 4).long()]], dim=-1).reshape(2, 256)
    got = unpack_e2m1(b.reshape(2, 128))
    assert got.dtype == torch.float32 and torch.equal(got.view(torch.int32), want.view(torch.int32))  # -0.0 kept
    assert unpack_e2m1(b.reshape(4, 2, 32)).shape == (4, 2, 64)
    ok = b[:255]
    assert torch.equal(e8m0(ok), ok.view(torch.float8_e8m0fnu).float())
    assert float(e8m0(torch.tensor([0], dtype=torch.uint8))) == 2.0**-127
    with pytest.raises(ValueError):
        e8m0(b)


# ---- the real producers' checkpoints (tests/fixtures/README.md, "Other source formats")

def _raw(folder) -> dict:
    out = {}
    for f in sorted(folder.glob("model*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _producer_reference(name: str) -> dict:
    """{module: float64 weights} decoded here from the producer's tensors: torch's e4m3 cast, the OCP E2M1 table."""
    t = _raw(FIXTURES / name)
    table = torch.tensor(OCP_E2M1, dtype=torch.float64)
    ref = {}
    for key, v in t.items():
        if name.startswith("fp8") and key.endswith(".weight_scale_inv"):
            m = key[: -len(".weight_scale_inv")]
            w = t[f"{m}.weight"].double()
            n, k = w.shape
            ref[m] = w * _expand(v.double(), n, k, 32, 32)
        elif name.endswith("fp8_block") and key.endswith(".weight_scale") and t[key[:-6]].dtype == torch.float8_e4m3fn:
            m = key[: -len(".weight_scale")]
            w = t[f"{m}.weight"].double()
            n, k = w.shape
            ref[m] = w * _expand(v.double(), n, k, -(-n // v.shape[0]), -(-k // v.shape[1]))
        elif key.endswith(".weight_packed"):
            m = key[: -len(".weight_packed")]
            b = v.numpy()
            codes = torch.from_numpy(np.stack([b & 0x0F, b >> 4], axis=-1).reshape(b.shape[0], -1).astype(np.int64))
            s = t[f"{m}.weight_scale"]
            if name.endswith("mxfp4a16"):
                s = torch.exp2(s.double() - 127)
            else:
                s = s.double() / t[f"{m}.weight_global_scale"].double()
            block = codes.shape[1] // s.shape[1]
            ref[m] = table[codes] * s.repeat_interleave(block, 1)
    return ref


PRODUCED = ["fp8_qwen3moe_block32", "ct_qwen3moe_fp8_block", "ct_qwen3moe_nvfp4a16", "ct_qwen3moe_mxfp4a16"]


@pytest.mark.parametrize("name", PRODUCED)
def test_producer_fixture_dequantised_as_decoded_independently(name):
    ref = _producer_reference(name)
    dense = _raw(FIXTURES / "dense_qwen3moe")  # the float model every one of them was made from
    with Checkpoint(FIXTURES / name) as ck:
        reader = open_reader(ck)
        specs = reader.linears()
        assert set(specs) == set(ref) and ref
        for m, s in specs.items():
            got = reader.read(s).dequantize().double()
            assert torch.allclose(got, ref[m], rtol=2.0**-21, atol=0), m
            assert rel_err(got, dense[f"{m}.weight"].double()) < 0.2, m  # the layout read as its producer meant


@pytest.mark.parametrize("name", [n for n in PRODUCED if n.startswith("ct_")])
def test_producer_fixture_matches_compressed_tensors_own_decompression(name):
    """compressed-tensors 0.19's own decompress (bf16, stored beside the fixture): the readers' float32
    values cast to bf16 are those bits."""
    want = load_file(str(FIXTURES / name / "reference" / "ct_dequantized.safetensors"))
    with Checkpoint(FIXTURES / name) as ck:
        reader = open_reader(ck)
        specs = reader.linears()
        for key, w in want.items():
            got = reader.read(specs[key[: -len(".weight")]]).dequantize()
            assert torch.equal(got.to(torch.bfloat16), w), key


def rel_err(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("name", PRODUCED + ["dense_glm4moe"])
def test_producer_fixture_converts_and_verifies(tmp_path, name):
    for fmt in ("compressed-tensors", "kleidiai"):
        out = tmp_path / fmt
        rep = int4pack.convert(FIXTURES / name, out, serve_format=fmt)
        assert DATA_FREE in rep["plan"]["format"]["detail"]
        mods = rep["modules"]
        assert mods and all(v["path"] == "requant" and float(v["rel_l2"]) <= float(v["baseline_rel_l2"]) * (1 + 1e-9)
                            for v in mods.values())
        assert int4pack.verify(out, against=FIXTURES / name, tokens=32)["ok"]


def _decoded(weight: np.ndarray, layout: int, n: int, k: int, scales: np.ndarray, stype: int, bk: int,
             glob: tuple[int, float] | None = None) -> np.ndarray | None:
    """The values convert's C++ requant batch decodes from a weight and its block scales (one block row)."""
    from int4pack import batch

    w, sc = np.ascontiguousarray(weight).view(np.uint8).ravel(), np.ascontiguousarray(scales).view(np.uint8).ravel()
    buf = np.concatenate([w, sc])
    d = np.zeros(batch.FIELDS, np.int64)
    d[[batch._LAYOUT, batch._WORDS, batch._N, batch._K, batch._SCALES, batch._STYPE, batch._GS, batch._GGROUP,
       batch._SRCG]] = layout, 0, n, k, w.size, stype, -(-k // bk), n, bk
    if glob is not None:
        d[batch._ZBYTE], d[batch._ZBYTES] = glob[0], int(np.float32(glob[1]).view(np.uint32))
    return kernels.ext().float_rows(buf, d)


@pytest.mark.skipif(kernels.ext() is None, reason="the C++ library decodes FP8 and FP4 in convert's batches")
def test_the_batches_decode_every_e4m3_e2m1_and_e8m0_byte():
    """Every e4m3 byte as torch's float8_e4m3fn reads it, every E2M1 nibble as the OCP table has it, and every
    E8M0 scale as 2^(e - 127), decoded by the C++ batches (NaN where the reference is NaN)."""
    b = np.arange(256, dtype=np.uint8)
    got = _decoded(b[None], 13, 1, 256, np.float32([[1.0]]), 0, 256)
    want = torch.from_numpy(b.copy()).view(torch.float8_e4m3fn).float().numpy()[None]
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan) and np.array_equal(got[~nan].view(np.int32), want[~nan].view(np.int32))
    got = _decoded(b[None], 14, 1, 512, np.uint8([[127] * 16]), 3, 32)  # E8M0 127: 1.0
    want = np.float32([[OCP_E2M1[int(x) & 15] for i in b for x in (i & 15, i >> 4)]])
    assert np.array_equal(got.view(np.int32), want.view(np.int32))
    e = np.arange(255, dtype=np.uint8)  # E8M0 scales of e4m3 1.0 (0x38) per block of 1
    got = _decoded(np.full((1, 255), 0x38, np.uint8), 13, 1, 255, e[None], 3, 1)
    assert np.array_equal(got, np.exp2(e.astype(np.float64) - 127).astype(np.float32)[None])
    assert _decoded(np.full((1, 1), 0x38, np.uint8), 13, 1, 1, np.uint8([[255]]), 3, 1) is None  # a NaN scale
    s = np.arange(127, dtype=np.uint8)  # every positive E4M3 scale (NVFP4's), a global scale divided in
    got = _decoded(np.full((1, 2 * s.size), 0x22, np.uint8), 14, 1, 4 * s.size, s[None], 4, 4, (1, 3.0))  # E2M1 1.0
    sv = torch.from_numpy(s.copy()).view(torch.float8_e4m3fn).float().numpy() / np.float32(3.0)
    assert np.array_equal(got[0], np.repeat(sv, 4))
