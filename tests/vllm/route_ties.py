"""Routing ties: the (MoE layer, position) pairs where vLLM chose other experts than the mirror, and
the mirror's own choice won by less than rounding moves the router's scores.

A router picks its top-k by score. Where the k-th and the next expert are nearly level, bf16 and the
kernel's int8 activations decide the order, and vLLM may choose either side: its logprobs at that
position then differ from both references by far more than the gates allow (Step-3.5-Flash: one
pair of 30, margin 0.0054 in sigmoid score, 0.916 in logprob), without anything wrong. The measure
of "nearly" is the fixture's own: how far the bf16 mirror's selection scores lie from the float64
mirror's in that MoE layer, over every position of the same forward (the rounding alone, no vLLM).
A pair is a tie where the mirror's weakest chosen expert scores at most twice that above the
weakest expert vLLM took instead (each of the two may move by that much).

``tie_routes`` finds the ties and the experts the references must take there to follow vLLM
(``HFRef.logprobs(ids, force=...)``); a flip that is not a tie is never forced. Forcing one pair can
resolve others (the next MoE layer at that position sees the other experts' output), so the mirror
runs again with the ties found so far until no new one appears.
"""

from __future__ import annotations

from lane_checks import vllm_routes


def _gap(scores, mine: list[int], theirs: list[int]) -> float:
    """How much the weakest of the mirror's experts outscores the weakest expert vLLM took instead."""
    other = [e for e in theirs if e not in mine]
    return float(min(scores[e] for e in mine) - min(scores[e] for e in other))


def tie_routes(calls: list, ids: list[int], mirror, mirror64, rounds: int = 8) -> tuple[dict, list[dict]]:
    """({MoE layer: {position: vLLM's experts}} to force, one record per tie). ``mirror`` and
    ``mirror64``: HFRef mirrors (bf16 and float64) that record their routers' scores; a reference
    without them (the hand-written one) gives no ties."""
    force: dict = {}
    ties: list[dict] = []
    for _ in range(rounds):
        mirror.logprobs(ids, force)
        mirror64.logprobs(ids, force)
        scores, scores64 = getattr(mirror, "scores", None), getattr(mirror64, "scores", None)
        n = len(mirror.routes)
        if not n or not scores or len(scores) != n or any(s is None for s in scores) or len(calls) % n:
            return {}, []
        theirs = vllm_routes(calls, n)
        new = []
        for layer in range(n):
            noise = float((scores[layer] - scores64[layer]).abs().max())
            for pos, (v, m) in enumerate(zip(theirs[layer], mirror.routes[layer])):
                if v == m or pos in force.get(layer, {}):
                    continue
                gap = _gap(scores[layer][pos], m, v)
                if gap <= 2 * noise:
                    new.append({"layer": layer, "position": pos, "vllm": v, "mirror": m,
                                "margin": round(gap, 5), "rounding_moves_scores_by": round(noise, 5)})
        if not new:
            break
        for t in new:
            force.setdefault(t["layer"], {})[t["position"]] = t["vllm"]
        ties += new
    return force, ties
