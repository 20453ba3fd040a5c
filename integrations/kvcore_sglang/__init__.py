"""kvcore's SGLang adapter.

The ``sglang.srt.plugins`` entry point is :func:`kvcore_sglang.plugin.load`; it
registers the hooks (today: the host-slot allocator, :mod:`kvcore_sglang.host_slots`)
that pass the version guard (:mod:`kvcore_sglang.guard`). Only kvcore and the
standard library are imported here: this module is loaded through the engine's
plugin entry point, before the engine is ready.
"""

from __future__ import annotations

import copy
import time

from kvcore.config import KVCoreConfig
from kvcore.engine_status import EngineStatus, probe_engine, release_of, settings_shown
from kvcore_sglang.guard import FINGERPRINTS

ENGINE = "sglang"
DISTRIBUTION = "sglang"
# The tested releases are exactly those with fingerprints.
SUPPORTED_VERSIONS: tuple[str, ...] = tuple(FINGERPRINTS)


def status(config: KVCoreConfig | None = None) -> EngineStatus:
    """SGLang's status here; ``config`` defaults to the one in the environment.

    In a process where the plugin registered its hooks, the patched and skipped
    targets are those (``plugin_applied``); elsewhere nothing was patched and the
    skipped targets are the guard's verdict. Where SGLang is installed and enabled,
    ``would_patch`` is what the guard passes for the installed source (read from its
    files, SGLang is not imported) under ``config``'s KVCORE_TRANSFERS, KVCORE_HOST_POOL and
    KVCORE_HOST_POOL_PIN_FIRST.
    """
    from kvcore_sglang.plugin import applied_status

    config = KVCoreConfig.from_env() if config is None else config
    applied = applied_status()
    if applied is not None:
        found = copy.deepcopy(applied)
    else:
        found = probe_engine(
            ENGINE, DISTRIBUTION, SUPPORTED_VERSIONS, enabled=config.enabled_for(ENGINE)
        )
    if found.installed and found.enabled and found.version is not None:
        _add_guard_verdict(found, config)
    return found


def _add_guard_verdict(found: EngineStatus, config: KVCoreConfig) -> None:
    from kvcore_sglang import guard

    found.settings = settings_shown(config)
    found.target_groups = {group: list(t) for group, t in guard.EVERY_GROUP.items()}
    checked = dict(guard.TARGET_GROUPS)
    for groups, on, off in (
        (guard.TRANSFER_GROUPS, config.transfers, "KVCORE_TRANSFERS=0"),
        (guard.HOST_MEMORY_GROUPS, config.host_pool, "KVCORE_HOST_POOL=0"),
        (guard.PINNING_GROUPS, config.host_pool_pin_first > 0, "KVCORE_HOST_POOL_PIN_FIRST=0"),
    ):
        if on:
            checked.update(groups)
        else:
            found.groups_off.update(dict.fromkeys(groups, off))
    started = time.perf_counter()
    for group, targets in checked.items():
        result = guard.check_targets(release_of(found.version or ""), {group: targets})
        found.would_patch.extend(result.patchable)
        if not found.plugin_applied:
            # In the engine's process the plugin's own skips stand: they are what happened.
            for skipped in result.skipped:
                found.skip(skipped.target, skipped.reason, group)
    found.guard_seconds = round(time.perf_counter() - started, 4)
