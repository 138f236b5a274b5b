"""groups.py: the W4A8 group-size rules, against tables worked out by hand from KleidiAI's needs
(a multiple of 32 that divides K; a block of all of K is channelwise)."""

from __future__ import annotations

import pytest

from int4pack.errors import UsageError
from int4pack.groups import auto_group, check_group_size, groupwise_problem, is_channelwise, parse_group_size


@pytest.mark.parametrize("g,k,ok", [
    (128, 768, True), (96, 768, True), (32, 768, True), (64, 768, True), (-1, 768, True),
    (768, 768, True), (48, 768, False), (100, 768, False), (0, 768, False), (-2, 768, False),
    (256, 128, False), (128, 320, False), (160, 320, True), (True, 768, False), ("32", 768, False),
])
def test_check_group_size_table(g, k, ok):
    reason = check_group_size(g, k)
    assert (reason is None) == ok, reason
    if not ok:
        assert str(g) in reason


@pytest.mark.parametrize("g,k,ok", [(128, 768, True), (768, 768, False), (32, 32, False), (-1, 768, True),
                                    (48, 768, False), (1024, 768, False)])
def test_groupwise_block_must_stay_below_k(g, k, ok):
    assert (groupwise_problem(g, k) is None) == ok
    assert is_channelwise(k, g) == (g in (-1, k))


@pytest.mark.parametrize("value,want", [
    (None, None), ("auto", None), ("", None), (" AUTO ", None), ("channel", -1), ("per-channel", -1), (-1, -1),
    ("-1", -1), (128, 128), ("64", 64), (1024, 1024),
])
def test_parse_group_size(value, want):
    assert parse_group_size(value) == want


@pytest.mark.parametrize("value", [48, "100", 0, -32, "sixty", 1.5, True])
def test_parse_group_size_refuses_what_no_linear_takes(value):
    with pytest.raises(UsageError) as ei:
        parse_group_size(value)
    assert "--group-size" in str(ei.value)


@pytest.mark.parametrize("source,ks,want", [
    ({32}, [768], 32), ({128}, [768], 128), ({96}, [768], 96),
    ({-1}, [768], -1),                                   # a channelwise source stays channelwise
    ({48}, [768], 128), ({100}, [800], 32),              # a source group no K takes -> the largest that all take
    ({16}, [96], 32), ({16}, [48], -1),                  # nothing divides -> channel
    ({32}, [32], -1),                                    # g == K would be a bf16 block of all of K
    ({128}, [768, 320], 64), ({32, 128}, [768], 128),    # every K must take it; mixed sources -> largest
])
def test_auto_group(source, ks, want):
    assert auto_group(source, ks) == want


# (g, K): is_channel, channel_group, scale dtype as safetensors names it, scales per row; by hand from
# the format: -1 ships one fp32 scale per row, any other group bf16 scales, K/g of them (1 for g == K)
@pytest.mark.parametrize("g,k,chan,named,st,per_row", [
    (-1, 768, True, -1, "F32", 1), (768, 768, False, -1, "BF16", 1), (128, 768, False, 128, "BF16", 6),
    (32, 64, False, 32, "BF16", 2), (-1, 96, True, -1, "F32", 1),
])
def test_the_one_home_of_channel_and_scale_dtype(g, k, chan, named, st, per_row):
    from int4pack.groups import channel_group, group_scale, is_channel, scale_kind, scale_st_dtype, scales_per_row

    assert is_channel(g) == chan and channel_group(k, g) == named
    assert scale_st_dtype(g) == st and group_scale(g) == (st == "BF16")
    assert scale_kind(g) == ("channel" if chan else "group") and scales_per_row(k, g) == per_row
