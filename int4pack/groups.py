"""The W4A8 group-size rules, in one place: what a group size may be for a linear with in_features
K, how a ``--group-size`` value reads, and which group ``auto`` picks.

-1 is channelwise: one fp32 scale per row. A group size g is a multiple of 32 (KleidiAI packs 32
columns per block) that divides K. A group of all of K is channelwise too; as a groupwise block it
would ship bf16 scales, which KleidiAI refuses (torch then takes its float fallback), so the
model-wide group must stay below every K.
"""

from __future__ import annotations

from .errors import UsageError

__all__ = ["CHANNEL", "MULTIPLE", "AUTO_GROUPS", "is_channel", "is_channelwise", "channel_group", "scale_kind", "block", "scales_per_row",
           "nests", "scale_dtype", "scale_st_dtype", "group_scale", "group_name", "scheme_label",
           "check_group_size", "groupwise_problem", "parse_group_size", "normalize_group", "auto_group"]

CHANNEL = -1
MULTIPLE = 32
AUTO_GROUPS = (128, 64, 32)  # what auto tries, largest first, when the source's group cannot stay


def is_channel(group_size: int) -> bool:
    """Whether a group size is the channelwise spelling, -1 (a group of all of K is ``is_channelwise``)."""
    return group_size == CHANNEL


def channel_group(k: int, group_size: int) -> int:
    """The group as reports and records name it: -1 for a group of all of K, else itself."""
    return CHANNEL if is_channelwise(k, group_size) else group_size


def scale_kind(group_size: int) -> str:
    """"channel" (fp32 scales) or "group" (bf16 scales), as the serving tables name a scale kind."""
    return "channel" if is_channel(group_size) else "group"


def is_channelwise(k: int, group_size: int) -> bool:
    """One scale per row: -1, or a group that spans all of K."""
    return group_size == CHANNEL or group_size == k


def block(k: int, group_size: int) -> int:
    """The columns one scale covers, as the kernels and the packer take it: -1 is all of K."""
    return k if group_size == CHANNEL else group_size


def scales_per_row(k: int, group_size: int) -> int:
    """How many scales one row of K columns has: 1 for channelwise, K / g for a group."""
    return k // block(k, group_size)


def nests(source_group: int, k: int, group_size: int) -> bool:
    """Whether every contiguous target group lies inside one source group (of ``source_group``
    columns, K or more for a channelwise source), so the source's ints carry over unchanged."""
    return source_group >= k or (source_group > 0 and source_group % block(k, group_size) == 0)


# no W4A8 scale above 2^16 (fp16's largest value, 65504, in bf16): GPTQ and AWQ store fp16 scales,
# and a weight of 7 x 65536 is no model's; a flipped exponent bit of a bf16 scale lands far above it
MAX_SCALE = 65536.0


def scale_dtype(group_size: int) -> str:
    """The W4A8 scales' dtype: float32 for channelwise, bfloat16 for groups (what KleidiAI takes)."""
    return "float32" if group_size == CHANNEL else "bfloat16"


_ST_DTYPE = {"float32": "F32", "bfloat16": "BF16"}


def scale_st_dtype(group_size: int) -> str:
    """``scale_dtype`` as safetensors names it (F32, BF16)."""
    return _ST_DTYPE[scale_dtype(group_size)]


def group_scale(group_size: int) -> bool:
    """Whether the scales ship in bf16 (the kernels' "groupwise scales" flag): every group but -1."""
    return scale_dtype(group_size) == "bfloat16"


def group_name(g: int) -> str:
    """How a group reads in a message: 'channel' or 'group 32'."""
    return "channel" if is_channel(g) else f"group {g}"


def scheme_label(g: int) -> str:
    """How a target group reads in reports: 'group 32 (bf16 scales)' or 'channel (fp32 scales)'."""
    return "channel (fp32 scales)" if g == CHANNEL else f"group {g} (bf16 scales)"


def check_group_size(g: int, k: int) -> str | None:
    """Why ``g`` cannot be a W4A8 group size for in_features ``k`` (None when it can); -1 and K are
    channelwise and always can."""
    if isinstance(g, bool) or not isinstance(g, int):
        return f"group size {g!r} is not an integer"
    if g == CHANNEL:
        return None
    if g <= 0:
        return f"group size {g} must be positive (or -1 for channel)"
    if g % MULTIPLE:
        return f"group size {g} is not a multiple of {MULTIPLE} (KleidiAI needs 32, 64, 128, ...)"
    if g > k:
        return f"group size {g} is larger than K={k}"
    if k % g:
        return f"group size {g} does not divide K={k}"
    return None


def groupwise_problem(g: int, k: int) -> str | None:
    """Why ``g`` cannot be a groupwise (bf16-scale) block for in_features ``k``: check_group_size's
    rules, and g < K (a block of all of K with bf16 scales takes torch's slow float fallback)."""
    reason = check_group_size(g, k)
    if reason is None and g == k:
        return f"group size {g} equals K={k} (vLLM would take torch's slow fallback for this module)"
    return reason


def parse_group_size(requested) -> int | None:
    """A ``--group-size`` value: None/'auto' -> None; 'channel'/-1 -> -1; else a positive multiple of 32."""
    value = _parse(requested)
    if value not in (None, CHANNEL) and (value <= 0 or value % MULTIPLE):
        raise UsageError(f"--group-size {value}: must be a multiple of 32 (32, 64, 128, ...) or channel",
                         hint="KleidiAI's groupwise kernels need groups that are multiples of 32.")
    return value


def _parse(requested) -> int | None:
    if requested is None:
        return None
    if isinstance(requested, str):
        r = requested.strip().lower()
        if r in ("", "auto"):
            return None
        if r in ("channel", "-1", "per-channel", "channelwise"):
            return CHANNEL
        try:
            return int(r)
        except ValueError:
            pass
    elif isinstance(requested, int) and not isinstance(requested, bool):
        return requested
    raise UsageError(f"--group-size {requested!r}: expected auto, channel, or a multiple of 32 such as 128",
                     hint="Leave it at auto to keep the source's group when vLLM can run it.")


def normalize_group(g: int, k: int) -> int:
    """A valid group for in_features ``k`` as the W4A8 code takes it: K becomes -1."""
    if g == k:
        return CHANNEL
    reason = check_group_size(g, k)
    if reason is not None:
        raise UsageError(f"W4A8 group size {g} is invalid for K={k}: {reason}",
                         hint="Pick a multiple of 32 that divides K, or channel.")
    return g


def auto_group(source_groups: set[int], ks: list[int]) -> int:
    """The model-wide group ``auto`` picks: the source's one group when every K takes it, else the
    largest of AUTO_GROUPS that every K takes, else channel. ``source_groups`` holds -1 for a
    channelwise source."""
    if len(source_groups) == 1:
        (g,) = source_groups
        if g == CHANNEL or all(groupwise_problem(g, k) is None for k in ks):
            return g
    for g in AUTO_GROUPS:
        if all(groupwise_problem(g, k) is None for k in ks):
            return g
    return CHANNEL
