"""The per-module group choice: which W4A8 group each linear gets, and which conversion path
that predicts (the ints carried over, an act-order fold, or a requantisation).

Modules vLLM loads into one module (every expert of an MoE layer, q/k/v, gate/up) and each
act-order fold's triple are tied: they take one group. One model-wide scheme when it costs no unit
anything; otherwise each unit's preferred group. The group rules themselves are in groups.py.
"""

from __future__ import annotations

from .architectures import vllm_module
from .errors import RefusedError
from .groups import AUTO_GROUPS, auto_group, groupwise_problem, is_channel, nests, scheme_label
from .records import LinearSpec

__all__ = ["KEEPS_INTS", "one_scheme", "predict_path", "tied_units", "Unit", "choose_groups"]

KEEPS_INTS = ("lossless", "reemit", "fold")  # paths that carry the source's int4 values over unchanged


def one_scheme(specs: list[LinearSpec]) -> int:
    """The model-wide group: the source's when every module can run it, else the largest common one."""
    ks = sorted({s.k for s in specs})
    return auto_group({(-1 if s.group_size >= s.k else s.group_size) for s in specs}, ks)


def predict_path(spec: LinearSpec, g: int, folded: bool) -> str:
    if spec.bits != 4 or spec.signed_scales:  # read as float values, or a signed grid (records.py)
        return "requant"
    # each target group inside one source group: the ints carry over unchanged
    same_group = nests(spec.group_size, spec.k, g)
    if spec.sym and same_group and not spec.act_order:
        return spec.kept_path
    if folded and spec.sym and same_group:
        return "fold"
    return "requant"


def tied_units(specs: list[LinearSpec], fold_of: dict[str, list[str]]) -> list[list[LinearSpec]]:
    """Modules that must share one target group: what vLLM loads into one module (every expert of an
    MoE layer, the q/k/v of qkv_proj, gate/up of gate_up_proj) and each act-order fold's triple."""
    key = {s.name: vllm_module(s.name) for s in specs}
    alias: dict[str, str] = {}  # a fold joins its triple's vLLM modules under one key

    def rep(k: str) -> str:
        while k in alias:
            k = alias[k]
        return k

    for members in fold_of.values():
        ks = sorted({rep(key[m]) for m in members})
        for k in ks[1:]:
            alias[k] = ks[0]
    units: dict[str, list[LinearSpec]] = {}
    for s in sorted(specs, key=lambda s: s.name):
        units.setdefault(rep(key[s.name]), []).append(s)
    return list(units.values())


class Unit:
    """One tied unit's options: which groups vLLM can run for all its modules, which keep its ints."""

    def __init__(self, specs: list[LinearSpec], folded: set[str]):
        self.specs = specs
        self.key = vllm_module(specs[0].name)
        # modules differ only in these fields as far as the choice goes (an MoE layer has two kinds)
        sigs = {(s.k, s.group_size, s.sym, s.act_order, s.fmt, s.bits, s.name in folded): s for s in specs}
        self.kinds = list(sigs.items())
        self.ks = sorted({s.k for s in specs})
        self.sources = sorted({src for (k, src, *_) in sigs if src < k})  # real groups (not channel-like)
        cands = {-1, *AUTO_GROUPS}
        for src in self.sources:
            cands.update(d for d in range(32, src + 1, 32) if src % d == 0)
        self.keeps = {g for g in cands if self.problem(g) is None
                      and all(predict_path(sp, g, sig[-1]) in KEEPS_INTS for sig, sp in self.kinds)}

    def problem(self, g: int) -> str | None:
        return next((why for k in self.ks if (why := groupwise_problem(g, k))), None)

    def requant_group(self) -> int:
        """Requantising, the least error vLLM can run: the source's group, else the largest group that
        lies inside every source group (only the rounding within each source group changes), else 32
        (finer never fits worse), else channel; a channel source stays channel."""
        if not self.sources:
            return -1
        top = min(self.sources)
        inside = [g for g in range(top - top % 32, 31, -32)
                  if all(src % g == 0 for src in self.sources) and self.problem(g) is None]
        if inside:
            return inside[0]
        return 32 if self.problem(32) is None else -1

    def preferred(self, popular: dict[int, int]) -> int:
        """Keep the ints if some group can (the one most modules can share, then channel, then the
        coarsest); otherwise the least error."""
        if not self.keeps:
            return self.requant_group()
        return max(self.keeps, key=lambda g: (popular.get(g, 0), is_channel(g), g))

    def accepts(self, g: int) -> bool:
        """Whether one model-wide group ``g`` costs this unit nothing: its ints kept where they can
        be, else a group at least as fine as its own least-error one."""
        if self.keeps:
            return g in self.keeps
        want = self.requant_group()
        return self.problem(g) is None and (is_channel(want) or not is_channel(g) and g <= want)


def choose_groups(requested: int | None, units: list[Unit], strict: bool) -> tuple[dict[str, int], list[dict]]:
    """The target group of every W4A8 module, and the substitutions made for ``requested``.

    One scheme when the model-wide choice (``one_scheme``) costs no unit anything; otherwise each
    unit's preferred group: its ints kept where some group can, else the least error."""
    popular: dict[int, int] = {}
    for u in units:
        for g in u.keeps:
            popular[g] = popular.get(g, 0) + len(u.specs)
    subs: list[dict] = []
    if requested is None:
        g0 = one_scheme([s for u in units for s in u.specs])
        if all(u.accepts(g0) for u in units):
            chosen = [g0] * len(units)
        else:
            chosen = [u.preferred(popular) for u in units]
    elif requested == -1:
        chosen = [-1] * len(units)
    else:
        bad = [(u, u.problem(requested)) for u in units if u.problem(requested)]
        if bad and strict:
            u, why = bad[0]
            ks = sorted({k for u in units for k in u.ks})
            raise RefusedError(
                f"--group-size {requested}: {why} ({u.key}; {sum(len(b.specs) for b, _ in bad)} module(s) affected)",
                tensor=u.specs[0].name,
                hint="Pick a multiple of 32 smaller than and dividing every in_features ("
                     + ", ".join(map(str, ks[:6])) + "), --group-size channel, or leave out --strict-group-size "
                     "to let those modules take the group they can run.")
        chosen = []
        for u in units:
            why = u.problem(requested)
            if why is None:
                chosen.append(requested)
                continue
            g = u.preferred(popular)
            chosen.append(g)
            subs.append({"module": u.key, "modules": len(u.specs), "requested": requested, "group_size": g,
                         "scheme": scheme_label(g), "reason": why})
    groups = {s.name: g for u, g in zip(units, chosen) for s in u.specs}
    return groups, subs
