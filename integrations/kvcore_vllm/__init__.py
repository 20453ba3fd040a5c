"""kvcore's vLLM adapter.

The plugin (:mod:`kvcore_vllm.plugin`, entry point ``vllm.general_plugins``) makes
vLLM's CPU offloading build kvcore's spec, whose manager allocates host chunks
contiguously; :mod:`kvcore_vllm.guard` holds the tested releases and fingerprints.
Only kvcore and the standard library are imported here: this module is loaded
through the engine's plugin entry point, before the engine is ready.
"""

from __future__ import annotations

from kvcore.config import KVCoreConfig
from kvcore.engine_status import EngineStatus
from kvcore_vllm import plugin
from kvcore_vllm.guard import DISTRIBUTION, ENGINE, SUPPORTED_VERSIONS

__all__ = ["DISTRIBUTION", "ENGINE", "SUPPORTED_VERSIONS", "status"]


def status(config: KVCoreConfig | None = None) -> EngineStatus:
    """vLLM's status here: what the plugin patched in this process, or would patch, and
    what the version guard refuses; ``config`` defaults to the one in the environment."""
    config = KVCoreConfig.from_env() if config is None else config
    return plugin.status(config)
