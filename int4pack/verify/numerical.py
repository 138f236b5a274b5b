"""verify's numerical pass: every random draw made first, in one order (so a seed gives one check
whatever runs at once), then the chosen MoE layers (moe_layer.py) and dense linears
(dense_linear.py) through the kernel and the references, on the worker processes (processes.py)
or on threads, each result kept for the report."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from .dense_linear import check_linear
from .moe_layer import check_layer
from .processes import Workers, guarded
from .random_inputs import dense_input, moe_inputs
from .source import Source, check_copies
from .threads import PerThread, parallel, shutting
from .w4a8_output import W4A8Output

__all__ = ["draw", "planned", "numerical"]


def draw(output: W4A8Output, chosen: list[str], dense_mods: list[str], experts, tokens, dense_tokens: int, gen,
          clock) -> tuple[dict, dict]:
    """Every random draw of the numerical pass, in the order one layer after the other makes them:
    ({prefix: moe_inputs}, {module: rows}); a layer or module that cannot even be read gets its
    failed result instead."""
    layer_in: dict = {}
    for p in chosen:
        r = guarded(p, "moe", lambda: layer_in.__setitem__(p, moe_inputs(output, p, experts, tokens, gen, clock)))
        if r is not None:
            layer_in[p] = r  # could not even be read: reported as such
    dense_in: dict = {}
    for m in dense_mods:
        r = guarded(m, "dense", lambda: dense_in.__setitem__(m, dense_input(output, m, dense_tokens, gen)))
        if r is not None:
            dense_in[m] = r
    return layer_in, dense_in


def planned(output: W4A8Output, draws) -> set[tuple[str, str]]:
    """The (shard, tensor) pairs the numerical pass reads: the shard scan leaves them to it."""
    if draws is None:
        return set()
    layer_in, dense_in = draws
    mods = [m for p, ins in layer_in.items() for e in ins.get("sampled", ()) for m in output.layers[p][e].values()]
    mods += [m for m, x in dense_in.items() if not isinstance(x, dict)]
    tensors = output.ckpt.tensors
    return {(tensors[n].file, n) for m in mods for n in output.read_names(m) if n in tensors}


def numerical(output: W4A8Output, chosen: list[str], dense_mods: list[str], src: Source | None, conv_report, draws,
               clock, progress, pool, procs: Workers | None) -> dict:
    """Every chosen MoE layer and dense module through the kernel and the references:
    {"layers": {prefix: result}, "dense": {module: result}, "copies": the copied tensors' check};
    on the worker processes ``procs`` (processes.py), else on the pool's threads."""
    copies = check_copies(output, src, clock) if src is not None else None
    layer_in, dense_in = draws

    def dense_one(m):
        x = dense_in[m]
        if isinstance(x, dict):
            return x
        return guarded(m, "dense", lambda: check_linear(output, m, src, conv_report, x, clock))

    work = PerThread(dict)  # each thread's expert buffers, from one layer to the next

    def layer_one(p):
        ins = layer_in[p]
        if "res" not in ins:
            return ins
        progress.advance(what=p)
        return guarded(p, "moe", lambda: check_layer(
            output, p, src, conv_report, ins, clock, tick=lambda: progress.advance(experts=1), pool=pool, work=work))

    out: dict = {"layers": {}, "dense": {}, "copies": copies}
    if procs:
        def done(kind: str, name: str, r: dict) -> None:
            if kind == "moe":
                out["layers"][name] = r
                progress.advance(layers=1, experts=len(layer_in[name]["sampled"]), what=name)
            else:
                out["dense"][name] = r
                progress.advance(dense=1, what=name)

        procs.run({p: ins for p, ins in layer_in.items() if "res" in ins},
                  {m: x for m, x in dense_in.items() if not isinstance(x, dict)}, clock, done,
                  lambda kind, name: layer_one(name) if kind == "moe" else dense_one(name))
        out["layers"] = {p: out["layers"].get(p, layer_in[p]) for p in chosen}  # (a draw that failed)
        out["dense"] = {m: out["dense"].get(m, dense_in[m]) for m in dense_mods}
        return out
    # the dense modules queue on the pool first; two layers at a time feed it their experts,
    # so that one layer's own serial steps (routing, sums) overlap the other's experts
    dense_f = [pool.submit(dense_one, m) for m in dense_mods] if pool is not None else None
    layers_pool = ThreadPoolExecutor(max_workers=2) if pool is not None and len(chosen) > 1 else None
    with shutting(layers_pool):
        for p, r in zip(chosen, parallel(layers_pool, layer_one, [(p,) for p in chosen])):
            out["layers"][p] = r
            progress.advance(layers=1)
    for i, m in enumerate(dense_mods):
        progress.advance(what=m)
        out["dense"][m] = dense_one(m) if dense_f is None else dense_f[i].result()
        progress.advance(dense=1)
    return out
