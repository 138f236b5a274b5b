"""The plan's per-module target group: what vLLM ties together, where the source's ints are kept,
what a requantised module gets, and --group-size N as a model-wide request."""

from __future__ import annotations

import pytest

from int4pack.sources.checkpoint import Checkpoint
from int4pack.errors import RefusedError
from int4pack.group_choice import Unit, choose_groups, tied_units
from int4pack.plan import make_plan
from int4pack.records import LinearSpec
import _synth

H, I = 128, 64


def spec(name: str, k: int, group: int = 32, *, sym: bool = True, act_order: bool = False) -> LinearSpec:
    return LinearSpec(name=name, fmt="gptq", n=64, k=k, bits=4, group_size=min(group, k) if group > 0 else k,
                      sym=sym, act_order=act_order, keys=(), scale_dtype="F16")


def moe_layer(li: int, h: int = H, i: int = I, group: int = 32, sym: bool = True) -> list[LinearSpec]:
    return [spec(f"model.layers.{li}.mlp.experts.{e}.{p}", h if p != "down_proj" else i, group, sym=sym)
            for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")]


def attention(li: int, k: int = H, group: int = 32, sym: bool = True, o_k: int | None = None) -> list[LinearSpec]:
    a = f"model.layers.{li}.self_attn"
    return [spec(f"{a}.{p}_proj", o_k if p == "o" and o_k else k, group, sym=sym) for p in "qkvo"]


def choose(specs, requested=None, strict=False, fold_of=None):
    fold_of = fold_of or {}
    folded = {m[2] for m in fold_of.values()}
    units = [Unit(u, folded) for u in tied_units(specs, fold_of)]
    return choose_groups(requested, units, strict)


def by_group(groups: dict[str, int]) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for m, g in groups.items():
        out.setdefault(g, set()).add(m)
    return out


# -- what vLLM ties together ---------------------------------------------------------------------------

def test_tied_units_follow_vllm_modules():
    specs = attention(0) + moe_layer(1) + [
        spec("model.layers.0.mlp.gate_proj", H), spec("model.layers.0.mlp.up_proj", H),
        spec("model.layers.0.mlp.down_proj", 2 * I),
        spec("model.layers.0.self_attn.q_a_proj", H), spec("model.layers.0.self_attn.kv_a_proj_with_mqa", H),
        spec("model.layers.0.self_attn.kv_b_proj", 32)]
    units = {frozenset(s.name for s in u) for u in tied_units(specs, {})}
    a = "model.layers.0.self_attn"
    assert frozenset(f"{a}.{p}_proj" for p in "qkv") in units  # -> qkv_proj
    assert frozenset({f"{a}.q_a_proj", f"{a}.kv_a_proj_with_mqa"}) in units  # -> fused_qkv_a_proj
    assert frozenset({"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"}) in units  # -> gate_up_proj
    assert frozenset(s.name for s in moe_layer(1)) in units  # every expert of the layer, w13 and w2
    for alone in (f"{a}.o_proj", f"{a}.kv_b_proj", "model.layers.0.mlp.down_proj"):
        assert frozenset({alone}) in units
    assert len(units) == 7


def test_act_order_fold_ties_its_triple():
    mlp = [spec("model.layers.0.mlp.gate_proj", H), spec("model.layers.0.mlp.up_proj", H),
           spec("model.layers.0.mlp.down_proj", 2 * I, act_order=True)]
    members = [s.name for s in mlp]
    units = tied_units(mlp, {m: members for m in members})
    assert [sorted(s.name for s in u) for u in units] == [sorted(members)]


# -- the choice ----------------------------------------------------------------------------------------

def test_one_scheme_when_the_source_group_runs_everywhere():
    groups, subs = choose(attention(0) + moe_layer(1))
    assert set(groups.values()) == {32} and subs == []


def test_k_equal_to_the_source_group_gets_channel_alone():
    """DeepSeek-V3's case: kv_b_proj K = 32 = group. A model-wide group would be channel for all."""
    kv_b = spec("model.layers.0.self_attn.kv_b_proj", 32)
    groups, _ = choose(attention(0) + moe_layer(1) + [kv_b])
    assert by_group(groups) == {-1: {kv_b.name}, 32: set(groups) - {kv_b.name}}


def test_requantised_modules_keep_the_source_grouping():
    """All asymmetric (nothing keeps its ints): the others stay at group 32, not channel."""
    specs = attention(0, sym=False) + moe_layer(1, sym=False) + [spec("model.layers.0.self_attn.kv_b_proj", 32, sym=False)]
    groups, _ = choose(specs)
    assert by_group(groups)[-1] == {"model.layers.0.self_attn.kv_b_proj"}
    assert len(by_group(groups)[32]) == len(specs) - 1


def test_moe_layer_whose_intermediate_is_the_group_goes_channel_as_one():
    """I = 32: vLLM runs one group for w13 and w2, 32 = I cannot, so the whole layer is channel
    (w2 exactly, w13 requantised) while attention keeps group 32."""
    experts = moe_layer(1, i=32)
    groups, _ = choose(attention(0) + experts)
    assert by_group(groups) == {-1: {s.name for s in experts}, 32: {s.name for s in attention(0)}}


def test_coarser_source_inside_a_common_group_stays_one_scheme():
    """ct group 128 with I = 128 (mf_mixtral's shape): 64 keeps every int, as the model-wide choice did."""
    groups, _ = choose(attention(0, k=256, group=128) + moe_layer(1, h=256, i=128, group=128))
    assert set(groups.values()) == {64}


def test_split_schemes_share_a_group_where_they_can():
    """Attention at 64 could stay at 64 or go to 32; the experts (32) and kv_b (channel) force a split:
    attention joins the experts at 32 rather than adding a third scheme."""
    kv_b = spec("model.layers.0.self_attn.kv_b_proj", 32)
    groups, _ = choose(attention(0, group=64) + moe_layer(1) + [kv_b])
    assert set(groups.values()) == {32, -1} and groups[kv_b.name] == -1


def test_requested_group_substitutes_where_it_cannot_run():
    groups, subs = choose(attention(0) + moe_layer(1), requested=64)
    assert {groups[s.name] for s in attention(0)} == {64}
    assert {groups[s.name] for s in moe_layer(1)} == {32}  # I = 64: 64 = K; 32 keeps the ints
    assert subs == [{"module": "model.layers.1.mlp.experts", "modules": 6, "requested": 64, "group_size": 32,
                     "scheme": "group 32 (bf16 scales)",
                     "reason": "group size 64 equals K=64 (vLLM would take torch's slow fallback for this module)"}]


def test_strict_group_size_refuses_naming_the_module():
    with pytest.raises(RefusedError, match=r"--group-size 64: group size 64 equals K=64 .*mlp\.experts; 6 module"):
        choose(attention(0) + moe_layer(1), requested=64, strict=True)


def test_requested_channel_is_one_scheme():
    groups, subs = choose(attention(0) + moe_layer(1) + [spec("model.layers.0.self_attn.kv_b_proj", 32)], requested=-1)
    assert set(groups.values()) == {-1} and subs == []


# -- on a written checkpoint ---------------------------------------------------------------------------

def test_deepseek_v3_plan_keeps_every_int(tmp_path):
    _synth.write_ct_deepseek_v3(tmp_path / "ds")
    with Checkpoint(tmp_path / "ds") as ck:
        plan = make_plan(ck)
    assert plan.group_size is None  # mixed
    assert {p for j in plan.jobs for p in j.paths.values()} == {"lossless"}
    assert plan.schemes() == {32: 26, -1: 2}
    assert {m for m, g in plan.groups.items() if g == -1} == {f"model.layers.{i}.self_attn.kv_b_proj" for i in (0, 1)}
    s = plan.summary()
    assert s["schemes"][1] == {"group_size": -1, "scheme": "channel (fp32 scales)", "modules": 2}
    assert s["scale_dtype"] is None and s["group_substitutions"] == []
