"""kvcore's SGLang adapter.

The ``sglang.srt.plugins`` entry point is :func:`kvcore_sglang.plugin.load`; it
registers the hooks (today: the host-slot allocator, :mod:`kvcore_sglang.host_slots`)
that pass the version guard (:mod:`kvcore_sglang.guard`). Only kvcore and the
standard library are imported here: this module is loaded through the engine's
plugin entry point, before the engine is ready.
"""

from __future__ import annotations

from kvcore.config import KVCoreConfig
from kvcore.engine_status import EngineStatus, probe_engine

ENGINE = "sglang"
DISTRIBUTION = "sglang"
SUPPORTED_VERSIONS: tuple[str, ...] = ("0.5.22", "0.5.23")


def status(config: KVCoreConfig | None = None) -> EngineStatus:
    """SGLang's status here; ``config`` defaults to the one in the environment.

    In a process where the plugin registered its hooks, the patched and skipped
    targets are those; elsewhere they are empty (nothing was patched there).
    """
    from kvcore_sglang.plugin import applied_status

    applied = applied_status()
    if applied is not None:
        return applied
    config = KVCoreConfig.from_env() if config is None else config
    return probe_engine(
        ENGINE, DISTRIBUTION, SUPPORTED_VERSIONS, enabled=config.enabled_for(ENGINE)
    )
