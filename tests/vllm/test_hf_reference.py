"""The lane's transformers references (tests/vllm/hf_reference.py) against the hand-written float64
forward of scripts/vllm_arm_e2e.py, an independent implementation, on the Qwen3-MoE and Mixtral
fixtures; and the loader's refusals. Opt-in (``pytest -m lane``): needs ``pip install -e '.[lane]'``.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from _reference import FIXTURES

pytestmark = pytest.mark.lane

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
IDS = [3, 17, 42, 99, 128, 200, 7, 64, 5, 9, 11, 250]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """fixture -> (float folder of the source, mirror folder of its W4A8 conversion, quantised names)."""
    import int4pack
    import float_ref as E

    out = {}
    for name in ("ct_qwen3moe_w4a16", "gptq_mixtral_sym"):
        d = tmp_path_factory.mktemp(name)
        E.write_float_folder(FIXTURES / name, d / "float")
        int4pack.convert(FIXTURES / name, d / "w4a8", overwrite=True)
        w, q = E.dequantised_w4a8(d / "w4a8")
        E.write_mirror_folder(d / "w4a8", d / "mirror", w)
        out[name] = (d / "float", d / "mirror", q)
    return out


@pytest.mark.parametrize("name", ["ct_qwen3moe_w4a16", "gptq_mixtral_sym"])
def test_transformers_reference_equals_the_hand_written_one(folders, name):
    """Float, int8-activation mirror and its bf16 rounding: transformers' class (fused 3-D experts
    loaded from per-expert names, a per-expert loop of ours) gives FloatRef's numbers."""
    import float_ref as E
    from hf_reference import HFRef

    fl, mirror, q = folders[name]
    cfg, mcfg = (json.loads((f / "config.json").read_text()) for f in (fl, mirror))
    got = HFRef(fl).logprobs(IDS)
    want = E.FloatRef(cfg, E.load_tensors(fl)).logprobs(IDS)
    assert torch.allclose(got, want, rtol=0, atol=1e-12), float((got - want).abs().max())
    w = E.load_tensors(mirror)
    for bf16 in (False, True):
        got = HFRef(mirror, q, a8=True, bf16=bf16).logprobs(IDS)
        want = E.FloatRef(mcfg, w, q, a8=True, bf16=bf16).logprobs(IDS)
        assert torch.allclose(got, want, rtol=0, atol=1e-12), (bf16, float((got - want).abs().max()))
    # the mirror's int8 activations move the logprobs: the hooks are in effect
    assert float((HFRef(mirror, q, a8=True).logprobs(IDS) - HFRef(mirror).logprobs(IDS)).abs().max()) > 1e-4


def test_a_tensor_the_class_does_not_take_is_refused(folders, tmp_path):
    from hf_reference import load

    fl = folders["ct_qwen3moe_w4a16"][0]
    bad = tmp_path / "bad"
    shutil.copytree(fl, bad)
    t = load_file(str(bad / "model.safetensors"))
    t.pop("model.layers.1.self_attn.o_proj.weight")
    t["model.layers.1.self_attn.extra.weight"] = torch.zeros(2, 2)
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="did not load the folder as it is"):
        load(bad)


def test_a_quantised_module_the_class_lacks_is_refused(folders):
    from hf_reference import HFRef

    fl, _, q = folders["ct_qwen3moe_w4a16"]
    with pytest.raises(ValueError, match="no linear of that name"):
        HFRef(fl, q | {"model.layers.0.self_attn.qkv_fused"}, a8=True)


def test_fused_experts_are_checked_against_the_per_expert_tensors(folders):
    """The loader's own check: an expert whose fused rows differ from its per-expert tensors."""
    from hf_reference import _check_experts, load

    fl = folders["ct_qwen3moe_w4a16"][0]
    _, experts = load(fl)
    m = next(iter(experts.values()))
    with torch.no_grad():
        m.gate_up_proj[1] = m.gate_up_proj[1].flip(0)  # gate and up rows swapped
    with pytest.raises(ValueError, match="expert 1"):
        _check_experts(fl, experts)


def test_float64_mode_keeps_float64_where_the_class_asks_float32():
    from hf_reference import Exact, Float64

    x = torch.tensor([1.0 + 2.0**-40], dtype=torch.float64)
    with Float64():
        assert x.float().dtype == torch.float64 and x.to(torch.float32).dtype == torch.float64
        assert torch.softmax(x, -1, dtype=torch.float32).dtype == torch.float64
        with Exact():
            assert x.to(torch.float32).dtype == torch.float32


def test_routes_are_recorded_per_moe_layer_and_position(folders):
    """What the lane's routing check compares with vLLM: one [positions][top-k] list of distinct
    experts per MoE layer, for the last forward only."""
    from hf_reference import HFRef

    fl = folders["ct_qwen3moe_w4a16"][0]
    cfg = json.loads((fl / "config.json").read_text())
    ref = HFRef(fl)
    ref.logprobs(IDS[:5])
    ref.logprobs(IDS)
    assert len(ref.routes) == cfg["num_hidden_layers"]
    for layer in ref.routes:
        assert len(layer) == len(IDS)
        assert all(len(set(r)) == cfg["num_experts_per_tok"] and max(r) < cfg["num_local_experts"] for r in layer)


def test_gpt_oss_float_folder_is_transformers_mxfp4_model(tmp_path):
    """gpt-oss: the float folder of int4pack's MXFP4 reader, laid out for transformers' class (gate/up
    interleaved again), computes what transformers' own MXFP4 reader makes of the fixture; the
    mirror reads the per-expert W4A8 layout (transposed, gate then up) and stays close to it."""
    import int4pack
    import float_ref as E
    from hf_reference import HFRef
    from transformers import GptOssForCausalLM, Mxfp4Config

    src = FIXTURES / "gptoss_mxfp4"
    E.write_float_folder(src, tmp_path / "float")
    got = HFRef(tmp_path / "float").logprobs(IDS)
    model = GptOssForCausalLM.from_pretrained(str(src), quantization_config=Mxfp4Config(dequantize=True),
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(input_ids=torch.tensor([IDS])).logits[0].double().log_softmax(-1)
    assert float((got - want).abs().max()) < 1e-5  # float32 there, float64 here
    int4pack.convert(src, tmp_path / "w4a8")
    w, q = E.dequantised_w4a8(tmp_path / "w4a8")
    assert "model.layers.1.mlp.experts.3.up_proj" in q and w["model.layers.1.mlp.experts.3.up_proj.bias"].shape == (64,)
    E.write_mirror_folder(tmp_path / "w4a8", tmp_path / "mirror", w)
    mirror = HFRef(tmp_path / "mirror", q, a8=True, bf16=True).logprobs(IDS)
    assert 1e-4 < float((mirror - got).abs().max()) < 0.05


def _text_copy(wrapper: Path, dst: Path, prefix: str = "language_model.") -> None:
    """The text model of a wrapper folder written out on its own: text_config as config.json, the
    prefixed tensors renamed, the vision tower's left out (files, not the loader's key mapping)."""
    cfg = json.loads((wrapper / "config.json").read_text())
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(cfg["text_config"]))
    t = {}
    for f in sorted(wrapper.glob("*.safetensors")):
        t.update({k[len(prefix):]: v for k, v in load_file(str(f)).items() if k.startswith(prefix)})
    save_file(t, str(dst / "model.safetensors"))


def test_kimi_k25_reference_is_its_deepseek_v3_text_model(tmp_path):
    """Kimi-K2.5 (no transformers class): the reference is transformers' DeepSeek-V3 class on the
    wrapper's text_config with the ``language_model.`` prefix mapped away, the vision tower left
    out; it equals the same class on a copy of the text model written out with renamed files, for
    the float folder and for the int8-activation mirror (quantised names as the checkpoint has them)."""
    import int4pack
    import float_ref as E
    from hf_reference import HFRef

    src = FIXTURES / "ct_kimik25_w4a16"
    E.write_float_folder(src, tmp_path / "float")
    ref = HFRef(tmp_path / "float")
    assert ref.cls == "DeepseekV3ForCausalLM" and ref.model_type == "kimi_k2"
    _text_copy(tmp_path / "float", tmp_path / "text")
    want = HFRef(tmp_path / "text").logprobs(IDS)
    assert torch.equal(ref.logprobs(IDS), want)
    int4pack.convert(src, tmp_path / "w4a8")
    w, q = E.dequantised_w4a8(tmp_path / "w4a8")
    assert q and all(m.startswith("language_model.") for m in q)
    E.write_mirror_folder(tmp_path / "w4a8", tmp_path / "mirror", w)
    _text_copy(tmp_path / "mirror", tmp_path / "mirror_text")
    got = HFRef(tmp_path / "mirror", q, a8=True, bf16=True).logprobs(IDS)
    plain = {m[len("language_model."):] for m in q}
    assert torch.equal(got, HFRef(tmp_path / "mirror_text", plain, a8=True, bf16=True).logprobs(IDS))
    assert 1e-4 < float((got - want).abs().max()) < 0.1  # the mirror's hooks are in effect


def test_a_wrapper_tensor_outside_its_text_model_and_towers_is_refused(tmp_path):
    import float_ref as E
    from hf_reference import load

    E.write_float_folder(FIXTURES / "ct_kimik25_w4a16", tmp_path / "float")
    f = next((tmp_path / "float").glob("*.safetensors"))
    t = load_file(str(f))
    t["extra_head.weight"] = torch.zeros(2, 2)
    save_file(t, str(f))
    with pytest.raises(ValueError, match="did not load the folder as it is"):
        load(tmp_path / "float")
