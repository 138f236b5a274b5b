"""The MLX reader against mlx-lm's own checkpoint and mlx's own dequantisation (fixture
``mlx_qwen3moe_mixed``: 4-bit group 64, 8-bit routers, an 8-bit group 32 expert projection and
group 128 q/k projections, each from config.json's per-module entries)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import int4pack  # noqa: E402
from int4pack import kernels  # noqa: E402
from _reference import FIXTURES  # noqa: E402
from int4pack.sources.containers import open_checkpoint  # noqa: E402
from int4pack.errors import RefusedError  # noqa: E402
from int4pack.formats import open_reader  # noqa: E402
from int4pack.verify import verify  # noqa: E402

MLX = FIXTURES / "mlx_qwen3moe_mixed"


def _mlx_arithmetic(ck, lin) -> torch.Tensor:
    """mlx's bf16 dequantisation of our unpacked codes, scales and biases: q * scale rounded to bf16,
    then + bias rounded again (what mx.dequantize computes in bf16; checked against it on mlx 0.32.4)."""
    codes, s, b = (torch.from_numpy(x.copy()) for x in ck.linear_data(lin))
    scale = s.repeat_interleave(lin.group, dim=1)
    bias = b.repeat_interleave(lin.group, dim=1).to(torch.bfloat16)
    return (codes.float() * scale).to(torch.bfloat16) + bias


def _check(ck, r, spec, want: torch.Tensor) -> None:
    lin = ck.mlx_linears[spec.name]
    assert torch.equal(_mlx_arithmetic(ck, lin), want), spec.name  # the same ints, scales and biases as mlx's
    codes, s, b = (torch.from_numpy(x.copy()) for x in ck.linear_data(lin))
    exact = codes.float() * s.repeat_interleave(lin.group, 1) + b.repeat_interleave(lin.group, 1)
    assert torch.equal(r.read(spec).dequantize(), exact)  # float32, one rounding: what gets requantised


@pytest.mark.skipif(kernels.ext() is None, reason="the C++ batches decode MLX")
@pytest.mark.parametrize("name", ["mlx_qwen3moe_mixed", "mlx_q3_mixed_4_8"])
def test_the_batches_decode_every_linear_as_mlx_values(name):
    """convert's C++ batches decode each MLX linear (4- and 8-bit, groups 32/64/128) in place to the float32
    q * scale + bias of the ints, scales and biases ``_check`` finds to be mlx's own."""
    import numpy as np

    from int4pack import batch

    with open_checkpoint(FIXTURES / name) as ck:
        r = open_reader(ck)
        for m, spec in r.linears().items():
            words, scales, biases, bits, group = r.mlx_in_place(spec)
            parts = [ck.read_bytes(t.name) for t in (words, scales, biases)]
            buf = np.frombuffer(b"".join(parts), np.uint8)
            d = np.zeros(batch.FIELDS, np.int64)
            d[[batch._LAYOUT, batch._WORDS, batch._N, batch._K, batch._SCALES, batch._STYPE, batch._ZEROS,
               batch._ZBYTE, batch._SRCG, batch._GS]] = batch._MLX, 0, spec.n, spec.k, len(parts[0]), \
                batch._SCALE_TYPES[scales.dtype], len(parts[0]) + len(parts[1]), bits, group, spec.k // group
            codes, s, b = (torch.from_numpy(x.copy()) for x in ck.linear_data(ck.mlx_linears[m]))
            exact = codes.float() * s.repeat_interleave(group, 1) + b.repeat_interleave(group, 1)
            assert torch.equal(torch.from_numpy(kernels.ext().float_rows(buf, d)), exact), m


# mlx_lm.convert's own folders (tests/fixtures/make_fixtures_formats.py): reference keys "<module>.weight"
CONVERTED = ["mlx_q3_4bit_g64", "mlx_q3_mixed_4_8"]


@pytest.mark.parametrize("name", ["mlx_qwen3moe_mixed", *CONVERTED])
def test_every_kind_of_module_dequantises_as_mlx_does(name):
    folder = FIXTURES / name
    ref = {k.removesuffix(".weight"): v for k, v in load_file(folder / "reference" / "mlx_dequantized.safetensors").items()}
    with open_checkpoint(folder) as ck:
        r = open_reader(ck)
        specs = r.linears()
        q = json.loads((folder / "config.json").read_text())["quantization"]
        for mod, spec in specs.items():  # the per-module entries (stacked experts: their switch_mlp entry)
            entry = q.get(mod.replace(".experts.", ".switch_mlp.").split(".switch_mlp.")[0] + ".switch_mlp." +
                          mod.rsplit(".", 1)[1]) if ".experts." in mod else q.get(mod)
            entry = entry if isinstance(entry, dict) else q
            assert (spec.bits, spec.group_size) == (entry["bits"], entry["group_size"]), mod
        for mod, want in ref.items():
            if ".switch_mlp." in mod:  # stacked [E, N, K]: one linear per expert
                moe, proj = mod.split(".switch_mlp.")
                for e in range(want.shape[0]):
                    _check(ck, r, specs[f"{moe}.experts.{e}.{proj}"], want[e])
            elif mod in specs:
                _check(ck, r, specs[mod], want)
            else:  # embeddings and routers: BF16 tensors vLLM loads in float, rounded once (mlx: twice)
                got = ck.get(f"{mod}.weight")
                assert got.dtype == torch.bfloat16 and ck.is_derived(f"{mod}.weight")
                # mlx's two roundings against our one: half a bf16 step of q * scale (at most
                # (2^bits - 1) * scale, the stored scales read with safetensors) and one of the value
                bits = (json.loads((folder / "config.json").read_text())["quantization"].get(mod) or {}).get("bits", 4)
                scales = load_file(folder / "model.safetensors")[f"{mod}.scales"].float()
                top = (2 ** bits - 1) * scales.abs().amax(dim=1, keepdim=True)  # mlx writes negative scales too
                tol = (top + want.float().abs()) * 2 ** -8
                assert bool(((got.float() - want.float()).abs() <= tol).all()), mod


@pytest.mark.parametrize("serve_format", ["compressed-tensors", "kleidiai"])
@pytest.mark.parametrize("name", ["mlx_qwen3moe_mixed", *CONVERTED])
def test_convert_and_verify_against_the_mlx_checkpoint(tmp_path, name, serve_format):
    out = tmp_path / "out"
    rep = int4pack.convert(FIXTURES / name, out, serve_format=serve_format)
    assert len(rep["modules"]) == 32
    for m, st in rep["modules"].items():  # the search never loses to plain RTN; 8-bit attention is kept bf16
        want = "dequant" if name == "mlx_q3_mixed_4_8" and ".self_attn." in m else "requant"
        assert st["path"] == want, m
        if want == "requant":
            assert float(st["rel_l2"]) <= float(st["baseline_rel_l2"]), m
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization" not in cfg and "quantization" not in cfg["quantization_config"]  # the MLX record stays behind
    assert verify(out, against=FIXTURES / name)["ok"]


def _edited(tmp_path: Path, edit) -> Path:
    src = tmp_path / "src"
    shutil.copytree(MLX, src)
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg["quantization"])
    cfg["quantization_config"] = cfg["quantization"]
    (src / "config.json").write_text(json.dumps(cfg))
    return src


def test_bits_int4pack_does_not_read_are_refused_naming_the_module(tmp_path):
    src = _edited(tmp_path, lambda q: q.update({"model.layers.0.self_attn.v_proj": {"group_size": 64, "bits": 3}}))
    with pytest.raises(RefusedError, match=r"model\.layers\.0\.self_attn\.v_proj: MLX 3-bit"):
        open_checkpoint(src)


def test_a_mode_other_than_affine_is_refused(tmp_path):
    src = _edited(tmp_path, lambda q: q.update({"mode": "mxfp4"}))
    with pytest.raises(RefusedError, match="'mxfp4'"):
        open_checkpoint(src)
