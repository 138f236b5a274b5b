"""The structural half of ``verify``: is a converted checkpoint complete and well formed?

Reads the config, index and shard headers (and the int4 tensors' values) of a W4A8 output, plain
or in the packed serving format, and collects every problem instead of stopping at the first, so a
user sees the whole list at once: the config and the checkpoint as a whole (checkpoint_checks.py),
each module (module_checks.py) and every byte against the recorded checksums (shard_scan.py). The
numerical half (the package's __init__.py) runs the kernels on what the same view reads.
"""

from __future__ import annotations

import json
from collections import Counter

from ..sources.checkpoint import Checkpoint
from .checkpoint_checks import check_config, check_config_index, check_fused_ignore, check_layers, layer_index
from .module_checks import COUNTS, ModuleChecks, Problems
from .shard_scan import check_copy_checksums, check_hashes, finish_scan, scan

__all__ = ["read_report", "check_structure"]


def read_report(ckpt: Checkpoint, problems: Problems) -> dict | None:
    """convert's int4pack_report.json, or None (a problem when it is there but unusable)."""
    rp = ckpt.folder / "int4pack_report.json"
    if not rp.is_file():
        return None
    try:
        report = json.loads(rp.read_text())
    except (OSError, json.JSONDecodeError) as e:
        problems.add("int4pack_report.json", f"unreadable ({e})")
        return None
    if not isinstance(report, dict):
        problems.add("int4pack_report.json", f"a JSON {type(report).__name__}, not an object")
        return None
    return report


def check_structure(checks: ModuleChecks, pool=None, scanned: dict | None = None,
                    say=None) -> tuple[Problems, dict, dict | None]:
    """Run every structural check on the output ``checks`` watches: (problems, counts, convert's
    report). ``pool`` (a ThreadPoolExecutor): modules and shards are checked on its threads; the
    problems are listed in the same order as one thread lists them. ``scanned``: what ``scan`` read
    while the numerical pass ran (the rest comes from a ``Tapped`` checkpoint's taps, or is read now);
    the modules the numerical pass read were checked on its way (``checks.done``); ``say``: called
    with a line of where the pass is (the shards' checksums, then each layer whose modules are done)."""
    say = say or (lambda what: None)
    output, ckpt, problems = checks.output, checks.output.ckpt, Problems()
    check_config(output, problems)
    counts = {**dict.fromkeys(COUNTS, 0), "moe_layers": len(output.layers),
              "experts": sum(len(v) for v in output.layers.values())}
    report_problems = Problems()
    report = read_report(ckpt, report_problems)
    # every byte read once: the checksums and int8 ranges from the numerical pass's reads (taps)
    # and the scan of the rest; a module the numerical pass checked where it read it is not
    # checked again (the others read their small tensors, or blobs from the page cache)
    scanned = scanned or scan(ckpt, report, pool)
    digests, checks.ranges = finish_scan(ckpt, pool, scanned, getattr(ckpt, "taps", {}))
    left = Counter(i for i in map(layer_index, output.modules) if i >= 0)  # each layer's modules not yet checked
    done, n_layers = 0, len(left)
    say(f"structure: checking {len(output.modules)} modules")
    for m, (items, c) in zip(output.modules, _each(pool, checks.of, [(m,) for m in output.modules])):
        problems.items += items
        for key, v in c.items():
            counts[key] += v
        i = layer_index(m)
        left[i] -= 1
        if i >= 0 and not left[i]:
            done += 1
            say(f"structure: layers {done}/{n_layers}")
    check_layers(output, problems)
    check_config_index(output, problems)
    check_fused_ignore(output, problems)
    problems.items += report_problems.items  # listed where they always were: after the module checks
    check_hashes(ckpt, problems, report, digests)
    check_copy_checksums(ckpt, problems, scanned)
    return problems, counts, report


def _each(pool, fn, items: list):
    """fn(*item) for each item, in order, each result as it is ready (on the pool's threads)."""
    if pool is None:
        for it in items:
            yield fn(*it)
        return
    futs = [pool.submit(fn, *it) for it in items]
    try:
        for f in futs:
            yield f.result()
    finally:
        for f in futs:
            f.cancel()
