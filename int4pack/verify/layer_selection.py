"""verify's ``--layers``: all, a seeded sample or layer indices, parsed strictly (verify must
never check less than it was asked to) and checked against what the model has."""

from __future__ import annotations

from ..errors import UsageError
from ..architectures import layer_index
from .random_inputs import pick

__all__ = ["LAYERS_HELP", "parse_layers", "spans", "missing", "select_layers"]

LAYERS_HELP = "--layers takes all, a count N for a seeded sample, or layer indices such as 0,12,47 (one index as 12,)."


def parse_layers(layers) -> int | list[int] | None:
    """``layers`` as given (None, "all", a count, "0,3", [0, 3]) -> None (all), a count, or sorted indices.
    Anything else is a usage error: verify must never check less than it was asked to."""
    if layers is None:
        return None
    spec = layers
    if isinstance(layers, str):
        s = layers.replace(" ", "")
        if s == "all":
            return None
        if s.isdigit():
            layers = int(s)
        elif "," in s:
            parts = [x for x in s.split(",") if x]
            bad = [x for x in parts if not x.lstrip("-").isdigit()]
            if bad or not parts:
                why = f"{bad[0]} is not a layer index" if bad else "no layer index given"
                raise UsageError(f"--layers {spec}: {why}", hint=LAYERS_HELP)
            layers = [int(x) for x in parts]
        else:
            raise UsageError(f"--layers {spec}: not all, a count or a list of layer indices", hint=LAYERS_HELP)
    if isinstance(layers, bool) or not isinstance(layers, (int, list, tuple, set)):
        raise UsageError(f"layers={spec!r}: not all, a count or a list of layer indices", hint=LAYERS_HELP)
    if isinstance(layers, int):
        if layers < 1:
            raise UsageError(f"--layers {spec}: a sample needs at least 1 layer (layer 0 alone is --layers 0,)",
                             hint=LAYERS_HELP)
        return layers
    try:
        idx = sorted({int(v) for v in layers})
    except (TypeError, ValueError):
        raise UsageError(f"layers={spec!r}: not a list of layer indices", hint=LAYERS_HELP) from None
    if not idx:
        raise UsageError("layers=[]: no layer to check", hint=LAYERS_HELP)
    return idx


def spans(idx) -> str:
    """[0, 1, 2, 5] -> '0-2, 5': a 48-layer model's list stays short."""
    out, run = [], []
    for i in sorted(idx):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)))
        run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)))
    return ", ".join(out) or "none"


def missing(spec, want: list[int], have: set[int], what: str, out) -> None:
    miss = [i for i in want if i not in have]
    if miss:
        raise UsageError(f"--layers {spec}: no layer {', '.join(map(str, miss))} to check in {out} ({what}: "
                         f"{spans(have)})",
                         hint="Pick layer indices from that list, a count N for a seeded sample, or all.")


def select_layers(prefixes: list[str], sel, gen) -> list[str]:
    if sel is None:
        return prefixes
    if isinstance(sel, int):
        return pick(prefixes, sel, gen)
    want = set(sel)
    return [p for p in prefixes if layer_index(p) in want]
