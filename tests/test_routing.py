"""Expert routing (int4pack/routing.py) and the plugin's routing glue (vllm_plugin/_routing.py),
without vLLM: every routing type against a float64 per-token reference written here, the routing
types named as vLLM names them, and refusals that name the type."""

from __future__ import annotations

import enum
import math
from types import SimpleNamespace

import pytest
import torch

from int4pack import routing as rt
from int4pack.architectures import routing_from_config
from int4pack.errors import RefusedError
from int4pack.vllm_plugin import _routing as glue


def reference(logits, *, k, scoring, renorm, bias=None, n_group=None, topk_group=None, scale=1.0):
    """Per token in float64 with Python sorts: (ids, weights); ties go to the lower index."""
    ids_out, w_out = [], []
    for row in logits.double().tolist():
        if scoring == "softmax":
            m = max(row)
            ex = [math.exp(v - m) for v in row]
            scores = [v / sum(ex) for v in ex]
        else:
            scores = [1.0 / (1.0 + math.exp(-v)) for v in row]
        choice = [s + (0.0 if bias is None else float(bias[e])) for e, s in enumerate(scores)]
        allowed = list(range(len(row)))
        if n_group:
            size = len(row) // n_group
            gscore = []
            for g in range(n_group):
                members = sorted(choice[g * size:(g + 1) * size], reverse=True)
                gscore.append(members[0] + members[1] if bias is not None else members[0])
            kept = sorted(range(n_group), key=lambda g: (-gscore[g], g))[:topk_group]
            allowed = [e for e in allowed if e // size in kept]
        chosen = sorted(allowed, key=lambda e: (-choice[e], e))[:k]
        w = [scores[e] for e in chosen]
        if renorm:
            w = [v / sum(w) for v in w]
        ids_out.append(chosen)
        w_out.append([v * scale for v in w])
    return torch.tensor(ids_out), torch.tensor(w_out, dtype=torch.float64)


def check(r: rt.Routing, logits, bias=None, scale=None):
    """int4pack's select_experts through the glue (the plugin's call) against the reference."""
    scale = r.scale if scale is None else scale
    w, ids = glue.route(r, None, logits, bias, scale, select=rt.select_experts)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    ref_ids, ref_w = reference(logits, k=r.top_k, scoring=r.scoring, renorm=r.renormalize, bias=bias if r.bias else None,
                               n_group=r.n_group if (r.n_group or 0) > 0 else None, topk_group=r.topk_group, scale=scale)
    assert torch.equal(ids.long(), ref_ids), (ids, ref_ids)
    torch.testing.assert_close(w.double(), ref_w, rtol=2e-6, atol=1e-7)
    return ids, w


GEN = torch.Generator().manual_seed(24)


def rand(*shape):
    return torch.randn(*shape, generator=GEN)


def test_softmax_default_and_renormalised():
    logits = rand(7, 8) * 3
    ids, w = check(rt.Routing("softmax", 2, False), logits)
    assert rt.Routing("softmax", 2, False).kind == "Default" and float(w.sum(-1).max()) < 1
    _, w = check(rt.Routing("softmax", 2, True), logits)
    assert rt.Routing("softmax", 2, True).kind == "RenormalizeNaive"
    torch.testing.assert_close(w.sum(-1), torch.ones(7))


def test_deepseek_v3_grouped_sigmoid_bias_and_scaling():
    r = rt.Routing("sigmoid", 4, True, bias=True, n_group=4, topk_group=2, scale=2.5)
    assert r.kind == "DeepSeekV3" and r.problem(16) is None
    logits, bias = rand(9, 16) * 2, rand(16) * 0.3
    _, w = check(r, logits, bias)
    torch.testing.assert_close(w.sum(-1), torch.full((9,), 2.5))
    # the experts chosen all lie in two groups per token
    ids, _ = check(r, logits, bias)
    assert all(len({int(e) // 4 for e in row}) <= 2 for row in ids)


def test_topk_group_equal_to_n_group_keeps_every_group():
    logits, bias = rand(6, 16), rand(16) * 0.3
    grouped = rt.Routing("sigmoid", 3, True, bias=True, n_group=4, topk_group=4)
    ids_g, w_g = check(grouped, logits, bias)
    ids_m, w_m = check(rt.Routing("sigmoid", 3, True, bias=True), logits, bias)  # MiniMax2: no groups
    assert torch.equal(ids_g, ids_m) and torch.equal(w_g, w_m)


def test_topk_group_one_keeps_the_best_group_only():
    r = rt.Routing("sigmoid", 2, True, bias=True, n_group=4, topk_group=1)
    logits = torch.zeros(1, 8)
    logits[0, 0] = 4.0  # group 0 holds the single best expert ...
    logits[0, 6], logits[0, 7] = 3.0, 3.0  # ... group 3 the best pair (sum of two)
    ids, _ = check(r, logits, torch.zeros(8))
    assert sorted(ids[0].tolist()) == [6, 7]


def test_ties_go_to_the_lower_index():
    # experts 1, 2 and 5 tie exactly (sigmoid(0) + 0.25 is exact); k=2 takes 1 and 2
    r = rt.Routing("sigmoid", 2, True, bias=True)
    logits = torch.tensor([[-1.0, 0.0, 0.0, -2.0, -3.0, 0.0]])
    ids, w = check(r, logits, torch.tensor([0.0, 0.25, 0.25, 0.0, 0.0, 0.25]))
    assert ids[0].tolist() == [1, 2] and torch.equal(w, torch.tensor([[0.5, 0.5]]))
    # group scores tie (groups 1 and 2 hold the same pair): topk_group 1 keeps group 1
    g = rt.Routing("sigmoid", 2, True, bias=True, n_group=3, topk_group=1)
    ids, _ = check(g, torch.tensor([[0.0, -4.0, 1.0, 2.0, 1.0, 2.0]]), torch.zeros(6))
    assert sorted(ids[0].tolist()) == [2, 3]
    # softmax logits tie
    ids, _ = check(rt.Routing("softmax", 1, False), torch.tensor([[1.0, 3.0, 3.0, 0.0]]))
    assert ids[0].tolist() == [1]


def test_bias_changes_the_winner_but_not_the_weight():
    r = rt.Routing("sigmoid", 1, False, bias=True, n_group=None)  # MiniMax2 needs renormalise: not served
    assert r.kind == "Unspecified" and "Unspecified" in r.problem(4)
    r = rt.Routing("sigmoid", 2, True, bias=True, n_group=2, topk_group=1, scale=1.0)
    logits = torch.tensor([[2.0, 1.5, 0.0, -0.5]])
    unbiased, _ = check(r, logits, torch.zeros(4))
    assert sorted(unbiased[0].tolist()) == [0, 1]
    bias = torch.tensor([0.0, 0.0, 0.9, 0.9])  # lifts group 1 above group 0
    ids, w = check(r, logits, bias)
    assert sorted(ids[0].tolist()) == [2, 3]
    s = torch.sigmoid(torch.tensor([0.0, -0.5], dtype=torch.float64))
    torch.testing.assert_close(w[0].double(), (s / s.sum()).float().double(), rtol=2e-6, atol=0)


def test_minimax2_is_the_one_group_case_of_grouped_topk():
    r = rt.Routing("sigmoid", 3, True, bias=True)
    assert r.kind == "MiniMax2"
    kw = r.select_kwargs()
    assert kw["use_grouped_topk"] and kw["num_expert_group"] == 1 and kw["topk_group"] == 1
    logits, bias = rand(11, 12), rand(12) * 0.5
    ids, w = check(r, logits, bias)
    # and without the one-group mapping (ungrouped call) the same
    w2, ids2 = rt.select_experts(None, logits, 3, False, True, scoring_func="sigmoid", e_score_correction_bias=bias)
    assert torch.equal(ids, ids2) and torch.equal(w, w2)


def test_softmax_groups_without_bias_score_groups_by_their_best_expert():
    r = rt.Routing("softmax", 2, False, n_group=4, topk_group=2)  # DeepSeek-V2's group_limited_greedy
    assert r.kind == "Default"
    check(r, rand(8, 16) * 2)


def test_kinds_named_and_refused():
    assert rt.Routing("sigmoid", 1, False, custom="Llama4MoE.custom_routing_function").kind == "Llama4"
    refused = {
        "Custom": rt.Routing("softmax", 2, False, custom="phimoe_routing_function"),
        "Sigmoid": rt.Routing("sigmoid", 2, False),
        "SigmoidRenorm": rt.Routing("sigmoid", 2, True),
        "Unspecified": rt.Routing("softmax", 2, True, bias=True),
    }
    # served: DeepSeek-V4's sqrtsoftplus, a Custom whose facts are known (Gemma-4, Laguna)
    assert rt.Routing("sqrtsoftplus", 2, True, bias=True).problem(8) is None
    assert rt.Routing("softmax", 2, True, per_expert_scale=True).problem(8) is None
    for kind, r in refused.items():
        assert r.kind == kind
        with pytest.raises(RefusedError, match=f"routing type {kind} is not one int4pack routes"):
            r.check(8, "model.layers.1.mlp")
    ds = rt.Routing("sigmoid", 4, True, bias=True, n_group=4, topk_group=2)
    assert "do not split into 4 groups" in ds.problem(18)
    assert "topk_group 5 is outside" in rt.Routing("sigmoid", 2, True, bias=True, n_group=4, topk_group=5).problem(16)
    assert "best two experts" in rt.Routing("sigmoid", 2, True, bias=True, n_group=8, topk_group=2).problem(8)
    assert "exceeds the 4 experts of 1 kept groups" in rt.Routing(
        "sigmoid", 5, True, bias=True, n_group=4, topk_group=1).problem(16)


def test_from_config_follows_the_vllm_model_classes():
    v3 = {"num_experts_per_tok": 8, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 8,
          "topk_group": 4, "norm_topk_prob": True, "routed_scaling_factor": 2.5}
    for mt in ("deepseek_v3", "kimi_k2"):
        r = routing_from_config(mt, v3)
        assert (r.kind, r.n_group, r.topk_group, r.scale) == ("DeepSeekV3", 8, 4, 2.5)
    # a DeepSeek-V3 config without scoring_func/topk_method: vLLM routes it softmax, bias ignored
    assert routing_from_config("deepseek_v3", {"num_experts_per_tok": 8, "n_group": 8, "topk_group": 4}).kind == \
        "RenormalizeNaive"
    assert routing_from_config("deepseek_v2", {"num_experts_per_tok": 6}).kind == "Default"
    assert routing_from_config("glm4_moe", {"num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
                                       "norm_topk_prob": True, "routed_scaling_factor": 2.5}).kind == "DeepSeekV3"
    mm = routing_from_config("minimax_m2", {"num_experts_per_tok": 8, "scoring_func": "sigmoid", "use_routing_bias": True})
    assert mm.kind == "MiniMax2" and mm.n_group is None
    assert routing_from_config("mixtral", {"num_experts_per_tok": 2}).kind == "RenormalizeNaive"
    assert routing_from_config("qwen3_moe", {"num_experts_per_tok": 8, "norm_topk_prob": False}).kind == "Default"
    assert routing_from_config("phimoe", {"num_experts_per_tok": 2}).kind == "Custom"
    assert routing_from_config("llama", {}) is None


def fake_layer(**kw):
    base = dict(top_k=4, renormalize=True, use_grouped_topk=True, num_expert_group=4, topk_group=2,
                scoring_func="sigmoid", routed_scaling_factor=1.0, e_score_correction_bias=None,
                custom_routing_function=None, global_num_experts=16, apply_router_weight_on_input=False)
    base.update(kw)
    return SimpleNamespace(**base)


def test_glue_routes_a_deepseek_layer_with_the_layers_own_scaling():
    """vLLM's DeepSeek-V3 / GLM-4-MoE classes give the layer routed_scaling_factor 1.0 and scale
    the output themselves: the packed method must not scale again."""
    bias = torch.nn.Parameter(rand(16) * 0.2, requires_grad=False)
    layer = fake_layer(e_score_correction_bias=bias)
    r = glue.layer_routing(layer, "model.layers.1.mlp.experts")
    assert r.kind == "DeepSeekV3" and r.scale == 1.0
    logits = rand(5, 16)
    _, w = check(r, logits, layer.e_score_correction_bias, layer.routed_scaling_factor)
    torch.testing.assert_close(w.sum(-1), torch.ones(5))
    # a layer that scales inside the MoE method (routed_scaling_factor passed through)
    scaled = fake_layer(e_score_correction_bias=bias, routed_scaling_factor=2.5)
    _, w = check(glue.layer_routing(scaled), logits, bias, scaled.routed_scaling_factor)
    torch.testing.assert_close(w.sum(-1), torch.full((5,), 2.5))
    # the bias is read at forward time: loading new values changes the choice
    with torch.no_grad():
        bias.copy_(torch.linspace(-1, 1, 16))
    ids, _ = check(r, logits, layer.e_score_correction_bias, 1.0)
    with pytest.raises(ValueError, match="needs the layer's e_score_correction_bias"):
        glue.route(r, None, logits, None, 1.0, select=rt.select_experts)


def phimoe_routing_function():  # the name of the function vLLM's phimoe model passes
    raise AssertionError("never called")


def test_glue_refuses_at_load_naming_the_type():
    with pytest.raises(ValueError, match="model.layers.0.mlp.experts: routing type Custom is not one int4pack "
                                         "routes \\(a custom routing function \\(phimoe_routing_function\\)\\)"):
        glue.layer_routing(fake_layer(custom_routing_function=phimoe_routing_function, use_grouped_topk=False,
                                      scoring_func="softmax"), "model.layers.0.mlp.experts")
    with pytest.raises(ValueError, match="routing type SigmoidRenorm"):
        glue.layer_routing(fake_layer(use_grouped_topk=False))
    minimax = glue.layer_routing(fake_layer(use_grouped_topk=False, num_expert_group=None, topk_group=None,
                                            e_score_correction_bias=torch.zeros(16)))
    assert minimax.kind == "MiniMax2"


def test_op_arguments_by_schema():
    v019 = ["x", "topk_ids", "topk_weights", "w13_packed", "w2_packed", "H", "I", "I2", "group_size",
            "apply_router_weight_on_input", "activation_kind"]
    v032 = ["x", "topk_ids", "topk_weights", "w13_packed", "w2_packed", "hidden_size", "intermediate_size",
            "group_size", "apply_router_weight_on_input", "activation_kind"]
    assert glue.moe_op_args(v019, 256, 128, 32) == (256, 128, 256, 32)
    assert glue.moe_op_args(v032, 256, 128, -1) == (256, 128, -1)
    with pytest.raises(RuntimeError, match="a form this int4pack does not know"):
        glue.moe_op_args(v032[:5] + ["n", "group_size"], 256, 128, 32)


class _Kind(enum.IntEnum):  # the members of vLLM's RoutingMethodType the glue uses
    Default = 0
    DeepSeekV3 = 2
    RenormalizeNaive = 4
    MiniMax2 = 7


def test_backend_sees_an_accepted_type_only_while_the_method_is_built():
    for kind in (_Kind.DeepSeekV3, _Kind.MiniMax2):
        layer = SimpleNamespace(moe_config=SimpleNamespace(routing_method=kind))
        with glue.backend_accepts_routing(layer):
            assert layer.moe_config.routing_method is _Kind.RenormalizeNaive
        assert layer.moe_config.routing_method is kind
        with pytest.raises(KeyError):
            with glue.backend_accepts_routing(layer):
                raise KeyError("vLLM refused")
        assert layer.moe_config.routing_method is kind
    other = SimpleNamespace(moe_config=SimpleNamespace(routing_method=_Kind.Default))
    with glue.backend_accepts_routing(other):
        assert other.moe_config.routing_method is _Kind.Default


class Llama4MoE:  # the qualname vLLM's llama4.py passes: Llama4MoE.custom_routing_function
    calls = 0

    @staticmethod
    def custom_routing_function(hidden_states, gating_output, topk, renormalize):
        """Llama-4's routing as its model card states it: the top-k logits, then their sigmoids."""
        Llama4MoE.calls += 1
        v, i = gating_output.topk(topk, dim=-1)
        return v.float().sigmoid(), i.to(torch.int32)


def test_llama4_routes_top1_with_the_sigmoid_of_the_logit():
    layer = fake_layer(top_k=1, renormalize=False, use_grouped_topk=False, num_expert_group=None, topk_group=None,
                       scoring_func="softmax", custom_routing_function=Llama4MoE.custom_routing_function,
                       apply_router_weight_on_input=True)
    r = glue.layer_routing(layer, "language_model.model.layers.1.feed_forward.experts")
    assert r.kind == "Llama4" and "applied to the expert input" in r.describe()
    logits = rand(9, 16) * 3
    want_ids = logits.double().argmax(-1, keepdim=True)
    want_w = logits.double().max(-1, keepdim=True).values.sigmoid()
    # int4pack's own selection (no custom function given), and the model's function passed through
    for custom in (None, layer.custom_routing_function):
        before = Llama4MoE.calls
        w, ids = glue.route(r, None, logits, None, 1.0, select=rt.select_experts, custom=custom)
        assert Llama4MoE.calls == before + (custom is not None)
        assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.is_contiguous()
        assert torch.equal(ids.long(), want_ids)
        torch.testing.assert_close(w.double(), want_w, rtol=2e-6, atol=1e-7)
    # the softmax probability stock vLLM's W4A8 path weights the input with instead: not the same
    softmax_w = logits.double().softmax(-1).max(-1, keepdim=True).values
    assert (softmax_w - want_w).abs().max() > 0.1
    with pytest.raises(ValueError, match="for top-1 only, not top-2"):
        glue.layer_routing(fake_layer(top_k=2, renormalize=False, use_grouped_topk=False,
                                      custom_routing_function=Llama4MoE.custom_routing_function))


# -- the kinds of late 2026: sqrt-softplus scores, Gemma-4's per-expert scale, DeepSeek-V4's hash
# routing, Laguna's soft-capped logits; each against a float64 reference written here --------------


def reference_2026(logits, *, k, scoring, renorm, bias=None, scale=1.0, softcap=None, per_expert=None,
                   hash_ids=None):
    """Per token in float64 with Python math, in the order the model classes compute it
    (transformers 5.23.0: laguna/modeling_laguna.py LagunaTopKRouter caps then scores;
    deepseek_v4/modeling_deepseek_v4.py DeepseekV4TopKRouter / DeepseekV4HashRouter; gemma4/
    modeling_gemma4.py Gemma4TextRouter renormalises, then multiplies by per_expert_scale[ids])."""
    ids_out, w_out = [], []
    for t, row in enumerate(logits.double().tolist()):
        if softcap:
            row = [softcap * math.tanh(v / softcap) for v in row]
        if scoring == "softmax":
            m = max(row)
            ex = [math.exp(v - m) for v in row]
            scores = [v / sum(ex) for v in ex]
        elif scoring == "sigmoid":
            scores = [1.0 / (1.0 + math.exp(-v)) for v in row]
        else:  # sqrt(log(1 + e^v)), written so that large v does not overflow
            scores = [math.sqrt(v + math.log1p(math.exp(-v)) if v > 0 else math.log1p(math.exp(v))) for v in row]
        if hash_ids is not None:
            chosen = [int(e) for e in hash_ids[t]]
        else:
            choice = [s + (0.0 if bias is None else float(bias[e])) for e, s in enumerate(scores)]
            chosen = sorted(range(len(row)), key=lambda e: (-choice[e], e))[:k]
        w = [scores[e] for e in chosen]
        if renorm:
            w = [v / sum(w) for v in w]
        if per_expert is not None:
            w = [v * float(per_expert[e]) for v, e in zip(w, chosen)]
        ids_out.append(chosen)
        w_out.append([v * scale for v in w])
    return torch.tensor(ids_out), torch.tensor(w_out, dtype=torch.float64)


def check_2026(r: rt.Routing, logits, **tensors):
    w, ids = r.select(logits, **tensors)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    hashed = tensors["hash_table"][tensors["input_ids"]] if r.hash_routed else None
    ref_ids, ref_w = reference_2026(logits, k=r.top_k, scoring=r.scoring, renorm=r.renormalize,
                                    bias=tensors.get("bias") if r.bias else None, scale=r.scale, softcap=r.softcap,
                                    per_expert=tensors.get("per_expert_scale"), hash_ids=hashed)
    assert torch.equal(ids.long(), ref_ids), (ids, ref_ids)
    torch.testing.assert_close(w.double(), ref_w, rtol=3e-6, atol=1e-7)
    return ids, w


def test_sqrtsoftplus_with_bias_renormalised_and_scaled():
    r = rt.Routing("sqrtsoftplus", 6, True, bias=True, scale=1.5)
    assert r.kind == "DeepseekV4" and r.problem(16) is None  # the plugin routes it (vllm_plugin._routing)
    logits, bias = rand(9, 16) * 4, rand(16) * 0.2
    _, w = check_2026(r, logits, bias=bias)
    torch.testing.assert_close(w.sum(-1), torch.full((9,), 1.5))
    # large logits: sqrt(softplus(x)) -> sqrt(x), no overflow; very negative ones -> 0, still ordered
    check_2026(r, torch.tensor([[80.0, -80.0, 0.0, 30.0, -30.0, 1.0, 2.0, 3.0] * 2]), bias=torch.zeros(16))
    # not renormalised: vLLM has no name for it
    assert rt.Routing("sqrtsoftplus", 2, False).kind == "Unspecified"


def test_sqrtsoftplus_is_not_softmax_or_sigmoid():
    logits = rand(5, 8) * 3
    a = rt.scores(logits, "sqrtsoftplus")
    assert (a - logits.softmax(-1)).abs().max() > 0.1 and (a - logits.sigmoid()).abs().max() > 0.1
    with pytest.raises(ValueError, match="scoring function 'tanh' is not one of softmax, sigmoid, sqrtsoftplus"):
        rt.scores(logits, "tanh")


def test_per_expert_scale_multiplies_after_renormalising():
    r = rt.Routing("softmax", 3, True, per_expert_scale=True)
    assert r.kind == "Custom" and "per-expert scale" in r.describe()
    logits, pes = rand(7, 8) * 2, torch.rand(8, generator=GEN) + 0.5
    ids, w = check_2026(r, logits, per_expert_scale=pes)
    # the scale does not steer the choice: the ids are those of plain renormalised softmax
    pw, plain = rt.Routing("softmax", 3, True).select(logits)
    assert torch.equal(ids, plain) and not torch.allclose(w, pw)
    torch.testing.assert_close(w, pw * pes[ids.long()])
    with pytest.raises(ValueError, match="needs per_expert_scale"):
        r.select(logits)


def test_hash_routing_takes_the_ids_from_the_table_and_the_weights_from_the_scores():
    r = rt.Routing("sqrtsoftplus", 2, True, hash_routed=True, scale=1.5)
    assert r.kind == "DeepseekV4"
    table = torch.tensor([[0, 1], [7, 3], [5, 5], [2, 6]])  # token 2 maps to one expert twice
    input_ids = torch.tensor([3, 1, 0, 2, 1])
    logits = rand(5, 8) * 2
    ids, w = check_2026(r, logits, hash_table=table, input_ids=input_ids)
    assert torch.equal(ids.long(), table[input_ids])
    torch.testing.assert_close(w[3], torch.tensor([0.75, 0.75]))  # a repeated expert: equal halves of 1.5
    # the logits do not choose: a logit far above the rest changes weights only
    hot = logits.clone()
    hot[:, 4] = 50.0
    _, ids2 = r.select(hot, hash_table=table, input_ids=input_ids)
    assert torch.equal(ids, ids2)
    with pytest.raises(ValueError, match="needs hash_table, input_ids"):
        r.select(logits)
    with pytest.raises(ValueError, match="not \\[tokens 5, top_k 3\\]"):
        rt.select_experts(None, logits, 3, False, True, hash_table=table, input_ids=input_ids)


def test_soft_capped_logits_before_sigmoid_scoring():
    r = rt.Routing("sigmoid", 2, True, bias=True, scale=2.5, softcap=3.0)
    assert r.kind == "Custom" and "soft-capped at 3" in r.describe()
    logits, bias = rand(9, 8) * 6, rand(8) * 0.1
    ids, w = check_2026(r, logits, bias=bias)
    raw_w, _ = rt.Routing("sigmoid", 2, True, bias=True, scale=2.5).select(logits, bias=bias)
    assert (w - raw_w).abs().max() > 1e-3
    # and the choice: logits 10 and 4 capped at 1 score 0.7311 and 0.7309, so a bias of 0.01 lifts
    # expert 1 above expert 0; uncapped (0.99995 against 0.9820 + 0.01) expert 0 wins
    one = rt.Routing("sigmoid", 1, True, bias=True, softcap=1.0)
    two = torch.tensor([[10.0, 4.0]])
    assert check_2026(one, two, bias=torch.tensor([0.0, 0.01]))[0].tolist() == [[1]]
    assert rt.Routing("sigmoid", 1, True, bias=True).select(two, bias=torch.tensor([0.0, 0.01]))[1].tolist() == [[0]]
    # a cap of 0 or None is no cap (Laguna's moe_router_logit_softcapping 0.0)
    a = rt.select_experts(None, logits, 2, False, True, scoring_func="sigmoid", logit_softcap=0.0)
    b = rt.select_experts(None, logits, 2, False, True, scoring_func="sigmoid")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_new_kinds_break_ties_to_the_lower_index():
    # four equal logits: soft-capped sigmoid, sqrt-softplus and per-expert-scaled softmax all take 0, 1
    logits = torch.zeros(1, 4)
    for r, kw in ((rt.Routing("sigmoid", 2, True, bias=True, softcap=5.0), {"bias": torch.zeros(4)}),
                  (rt.Routing("sqrtsoftplus", 2, True, bias=True), {"bias": torch.zeros(4)}),
                  (rt.Routing("softmax", 2, True, per_expert_scale=True), {"per_expert_scale": torch.ones(4)})):
        ids, w = check_2026(r, logits, **kw)
        assert ids[0].tolist() == [0, 1]
        torch.testing.assert_close(w[0], torch.full((2,), 0.5 * r.scale))


def test_the_old_call_still_routes_as_before():
    """select_experts' positional signature (vLLM's CPU select_experts) is unchanged."""
    logits, bias = rand(6, 16), rand(16) * 0.3
    w, ids = rt.select_experts(None, logits, 4, True, True, 2, 4, "sigmoid", 2.5, bias)
    ref_ids, ref_w = reference(logits, k=4, scoring="sigmoid", renorm=True, bias=bias, n_group=4, topk_group=2,
                               scale=2.5)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(w.double(), ref_w, rtol=2e-6, atol=1e-7)


def test_records_round_trip():
    for r in (rt.Routing("sigmoid", 4, True, bias=True, n_group=4, topk_group=2, scale=2.5),
              rt.Routing("sqrtsoftplus", 6, True, hash_routed=True, scale=1.5),
              rt.Routing("softmax", 8, True, per_expert_scale=True),
              rt.Routing("sigmoid", 8, True, bias=True, softcap=30.0)):
        rec = r.to_record()
        assert rec["kind"] == r.kind and rt.from_record(rec) == r


# -- one routing table: the disagreements between architectures.routing_from_config and the
# family facts, each decided by what the model classes do -------------------------------------------


def test_sqrtsoftplus_deepseek_config_is_deepseekv4_in_every_reader():
    """A DeepSeek config with scoring_func sqrtsoftplus (and topk_method noaux_tc): vLLM's
    get_routing_method_type checks sqrtsoftplus + renormalize first (DeepseekV4); the family facts
    used to say RenormalizeNaive (and Unspecified with noaux_tc)."""
    from int4pack.architectures import moe_config
    from int4pack.families import family

    for extra in ({}, {"topk_method": "noaux_tc"}):
        cfg = {"num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, **extra}
        assert routing_from_config("deepseek_v3", cfg).kind == "DeepseekV4"
        assert family("deepseek_v3").facts(cfg)["kind"] == "DeepseekV4"
        assert moe_config("deepseek_v3", "deepseek_v3", cfg)[0].routing["kind"] == "DeepseekV4"


def test_mixtral_renormalises_whatever_norm_topk_prob_says():
    """transformers 5.23.0 mixtral/modeling_mixtral.py MixtralTopKRouter always divides the top-k
    by their sum, and vLLM's mixtral.py builds FusedMoE(renormalize=True): a config's
    norm_topk_prob false changes neither. The float64 reference below is that router's code."""
    from int4pack.architectures import moe_config
    from int4pack.families import family

    cfg = {"num_experts_per_tok": 2, "norm_topk_prob": False, "num_local_experts": 8}
    r = routing_from_config("mixtral", cfg)
    assert r.renormalize and family("mixtral").facts(cfg)["renormalize"]
    assert moe_config("mixtral", "mixtral", cfg)[0].renormalize  # verify's reference weights
    logits = rand(6, 8) * 2
    probs = logits.double().softmax(-1)
    top = probs.topk(2, dim=-1)
    want = top.values / top.values.sum(-1, keepdim=True)
    w, ids = r.select(logits)
    assert torch.equal(ids.long(), top.indices)
    torch.testing.assert_close(w.double(), want, rtol=2e-6, atol=1e-7)


def test_phimoe_does_not_renormalise():
    """vLLM's phimoe.py: FusedMoE(renormalize=False, custom_routing_function=phimoe_routing_function);
    the family facts used to say True."""
    from int4pack.families import family

    cfg = {"num_experts_per_tok": 2}
    assert routing_from_config("phimoe", cfg).renormalize is False
    assert family("phimoe").facts(cfg)["renormalize"] is False
    assert routing_from_config("phimoe", cfg).kind == "Custom"


def test_one_router_pattern_and_one_layer_pattern():
    from int4pack import architectures as arch
    from int4pack.verify import checkpoint_checks

    names = ["model.layers.0.mlp.gate.weight", "model.layers.1.block_sparse_moe.gate.weight",
             "language_model.model.layers.2.feed_forward.router.weight", "model.layers.3.mlp.router.weight",
             "model.language_model.layers.4.router.proj.weight", "model.layers.5.mlp.shared_expert_gate.weight",
             "model.layers.6.ffn.gate.weight", "model.layers.7.mlp.gate_proj.weight"]
    got = arch.routers(names)
    assert got == {"model.layers.0.mlp": names[0], "model.layers.1.block_sparse_moe": names[1],
                   "language_model.model.layers.2.feed_forward": names[2], "model.layers.3.mlp": names[3],
                   "model.language_model.layers.4": names[4], "model.layers.6.ffn": names[6]}
    # discovery's float routers are the same pattern's matches (the shared expert gate kept as one)
    assert sorted(n for n in names if arch.ROUTER.search(n[:-7])) == sorted([*got.values(), names[5]])
    assert checkpoint_checks.layer_index is arch.layer_index
    assert [arch.layer_index(p) for p in ("model.layers.12.mlp", "layers.3", "lm_head", "mtp.layers.0.x")] == \
        [12, 3, -1, 0]
