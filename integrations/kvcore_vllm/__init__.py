"""kvcore's vLLM adapter.

For now it only reports the engine's status; the patches come with the adapter's
hook table. Only kvcore and the standard library are imported here: this module is
loaded through the engine's plugin entry point, before the engine is ready.
"""

from __future__ import annotations

from kvcore.config import KVCoreConfig
from kvcore.engine_status import EngineStatus, probe_engine

ENGINE = "vllm"
DISTRIBUTION = "vllm"
SUPPORTED_VERSIONS: tuple[str, ...] = ("0.32.0", "0.33.0")


def status(config: KVCoreConfig | None = None) -> EngineStatus:
    """vLLM's status here; ``config`` defaults to the one in the environment."""
    config = KVCoreConfig.from_env() if config is None else config
    return probe_engine(
        ENGINE, DISTRIBUTION, SUPPORTED_VERSIONS, enabled=config.enabled_for(ENGINE)
    )
