"""The expert activations (int4pack/activation.py), each against a float64 reference written here
from the model class's code (transformers 5.23.0; the file is named in each), at and around the
clamp limits; which of them vLLM's CPU W4A8 MoE op computes; refusals of incomplete facts."""

from __future__ import annotations

import math

import pytest
import torch

from int4pack import activation as act

GEN = torch.Generator().manual_seed(39)


def _silu(x):
    return x / (1.0 + math.exp(-x))


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def reference(name, gate, up, alpha=None, limit=None):
    """Element by element in float64."""
    out = []
    for g, u in zip(gate.double().flatten().tolist(), up.double().flatten().tolist()):
        if name == "silu":  # the SiLU-gated MLP of every other family
            v = _silu(g) * u
        elif name == "gelu_tanh":  # gemma4/modeling_gemma4.py Gemma4TextExperts: act_fn(gate) * up
            v = _gelu_tanh(g) * u
        elif name == "swigluoai":  # minimax_m3_vl/modeling_minimax_m3_vl.py MiniMaxM3VLExperts._apply_gate
            gc, uc = min(g, limit), max(-limit, min(u, limit))
            v = (uc + 1.0) * gc / (1.0 + math.exp(-alpha * gc))
        elif name == "swiglu_clamp":  # deepseek_v4 DeepseekV4Experts._apply_gate; glm5_next Glm5NextTextExperts
            v = _silu(min(g, limit)) * max(-limit, min(u, limit))
        else:  # swiglustep: step3p7/modeling_step3p7.py Step3p7Experts._apply_gate (clamp after the SiLU)
            v = min(_silu(g), limit) * max(-limit, min(u, limit))
        out.append(v)
    return torch.tensor(out, dtype=torch.float64).view(gate.shape)


KINDS = [act.SILU, act.GELU_TANH, act.OP_SWIGLUOAI, act.Activation("swigluoai", alpha=1.0, limit=5.0),
         act.Activation("swiglu_clamp", limit=10.0), act.Activation("swiglustep", limit=7.0)]


def inputs():
    """Random values wide enough to cross every limit, plus the limits themselves and their neighbours."""
    g = torch.randn(6, 40, generator=GEN) * 8
    edges = torch.tensor([-10.5, -10.0, -9.5, -7.5, -7.0, -6.5, 0.0, 6.5, 7.0, 7.5, 9.5, 10.0, 10.5, 40.0])
    return torch.cat([g.flatten(), edges, -edges]), torch.cat([(torch.randn(6, 40, generator=GEN) * 8).flatten(),
                                                              edges.flip(0), edges])


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.describe())
def test_each_kind_against_float64(kind):
    gate, up = inputs()
    want = reference(kind.name, gate, up, kind.alpha, kind.limit)
    torch.testing.assert_close(kind(gate.double(), up.double()), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kind(gate, up).double(), want, rtol=2e-6, atol=2e-5)
    # apply() on the concatenated gate/up output, halves
    gu = torch.cat([gate.view(1, -1), up.view(1, -1)], dim=1).double()
    torch.testing.assert_close(act.apply(kind, gu)[0], want, rtol=1e-12, atol=1e-12)


def test_the_clamps_differ_where_the_limit_is_crossed():
    """swiglu_clamp clamps the gate before the SiLU, swiglustep the SiLU's output: the same below
    the limit, different above it; without a clamp, plain SiLU."""
    gate, up = torch.tensor([3.0, 12.0, 12.0]), torch.tensor([2.0, 2.0, 12.0])
    before = act.Activation("swiglu_clamp", limit=10.0)(gate, up)
    after = act.Activation("swiglustep", limit=10.0)(gate, up)
    plain = act.SILU(gate, up)
    assert before[0] == after[0] == plain[0]
    assert before[1] < after[1] < plain[1] + 1e-6  # silu(10) * 2 < min(silu(12), 10) * 2
    assert before[2] == pytest.approx(_silu(10.0) * 10.0) and after[2] == pytest.approx(10.0 * 10.0)


def test_the_op_computes_silu_and_gpt_oss_swiglu_only():
    assert act.SILU.kernel_kind == 0 and act.OP_SWIGLUOAI.kernel_kind == 1
    assert act.Activation("swigluoai", alpha=1.702, limit=7.0).kernel_kind == 1  # MiniMax-M3's constants
    # other constants, clamps and GELU: the op (hard-coded 1.702 / 7, no clamp for kind 0) cannot
    for a in (act.Activation("swigluoai", alpha=1.702, limit=10.0), act.Activation("swiglu_clamp", limit=10.0),
              act.Activation("swiglustep", limit=7.0), act.GELU_TANH,
              act.Activation("swigluoai", alpha=1.702, limit=7.0, order="interleaved")):
        assert a.kernel_kind is None, a


def test_interleaved_gate_up_split():
    gu = torch.arange(8.0).view(1, 8)
    g, u = act.Activation("silu", order="interleaved").split(gu)
    assert g.tolist() == [[0.0, 2.0, 4.0, 6.0]] and u.tolist() == [[1.0, 3.0, 5.0, 7.0]]
    g, u = act.SILU.split(gu)
    assert g.tolist() == [[0.0, 1.0, 2.0, 3.0]] and u.tolist() == [[4.0, 5.0, 6.0, 7.0]]


def test_incomplete_facts_are_refused():
    with pytest.raises(ValueError, match="swiglu_clamp needs a positive limit"):
        act.Activation("swiglu_clamp")
    with pytest.raises(ValueError, match="swiglustep needs a positive limit, not 0"):
        act.Activation("swiglustep", limit=0)
    with pytest.raises(ValueError, match="swigluoai needs its alpha"):
        act.Activation("swigluoai", limit=7.0)
    with pytest.raises(ValueError, match="activation 'relu' is not one of"):
        act.Activation("relu")
    assert act.from_hidden_act("gelu_pytorch_tanh") is act.GELU_TANH and act.from_hidden_act("silu") is act.SILU
    assert act.from_hidden_act("relu2") is None


def test_records_round_trip():
    for a in KINDS:
        rec = a.to_record()
        assert act.from_record(rec) == a and rec["kernel_kind"] == a.kernel_kind


def test_the_expert_forward_runs_the_models_activation_between_its_two_matmuls():
    """moe.MoeRun (verify's kernel side) and moe.expert_forward (its float reference) with an
    Activation the W4A8 op has none for: each expert's W13, then the activation, then W2, against
    float64 with DeepSeek-V4's clamp written out; the noise Jacobian against finite differences."""
    from int4pack import moe

    a = act.Activation("swiglu_clamp", limit=10.0)
    gen = torch.Generator().manual_seed(4)
    h, i = 64, 32
    x = torch.randn(5, h, generator=gen) * 4
    w13, w2 = torch.randn(2 * i, h, generator=gen), torch.randn(h, i, generator=gen) * 0.1
    y = (x.double() @ w13.double().t())
    assert float((y[:, :i] > 10).float().mean()) > 0.1  # the clamp is crossed
    want = reference("swiglu_clamp", y[:, :i], y[:, i:], limit=10.0) @ w2.double().t()
    torch.testing.assert_close(moe.expert_forward(x, w13, w2, a).double(), want, rtol=1e-4, atol=1e-4)
    silu = reference("silu", y[:, :i], y[:, i:]) @ w2.double().t()
    assert (silu - want).abs().max() > 1.0  # without the clamp: another result

    run = moe.MoeRun(x, torch.zeros(5, 1, dtype=torch.int32), torch.ones(5, 1), 1, h, i, -1, False, a)
    run.expert_with(0, lambda xx, q, s, blk: xx @ (q * s).t(), (w13, torch.ones(2 * i, 1)), (w2, torch.ones(h, 1)))
    torch.testing.assert_close(run.finish().double(), want, rtol=1e-4, atol=1e-4)

    g, u = torch.randn(200, generator=gen).double() * 12, torch.randn(200, generator=gen).double() * 12
    dg, du = moe._act_jacobian(g, u, a)
    eps = 1e-6
    torch.testing.assert_close(dg, (a(g + eps, u) - a(g - eps, u)) / (2 * eps), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(du, (a(g, u + eps) - a(g, u - eps)) / (2 * eps), rtol=1e-5, atol=1e-6)
