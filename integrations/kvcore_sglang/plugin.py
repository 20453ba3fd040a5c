"""The ``sglang.srt.plugins`` entry point: registers kvcore's hooks with SGLang's HookRegistry.

SGLang calls :func:`load` with no arguments in its launcher and first thing in every
scheduler process, then applies every registered hook. :func:`load` does nothing
unless ``KVCORE_ENABLE`` names sglang, patches nothing on an untested version,
skips any target group whose source changed, and registers each hook at most
once per process however often it is called.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from kvcore.config import KVCoreConfig, engine_config
from kvcore.engine_status import (
    EngineStatus,
    announce_activation,
    announce_stock_share,
    probe_engine,
    release_of,
)
from kvcore.metrics_export import start_multiprocess_export

from . import DISTRIBUTION, ENGINE, SUPPORTED_VERSIONS
from .installation import INSTALLATION

if TYPE_CHECKING:
    from .adapter import SGLangAdapter

logger = logging.getLogger("kvcore.sglang")

# The group of the host pool classes whose allocator stays stock (host_slots.STOCK_POOLS).
STOCK_POOLS_GROUP = "host pools left stock"

_lock = threading.Lock()


def load() -> None:
    """Entry point for SGLang's ``load_plugins()``."""
    try:
        config = engine_config("SGLang")
        if config is not None:
            register_hooks(config)
    except Exception:
        # A plugin failure must leave SGLang running stock, never stop it.
        logger.exception("kvcore: registering SGLang hooks failed; SGLang runs stock")


def register_hooks(
    config: KVCoreConfig | None = None,
    *,
    with_transfers: bool | None = None,
    adapter: SGLangAdapter | None = None,
) -> EngineStatus:
    """Check versions and fingerprints, register the hooks that pass; the resulting status.

    Only the first call that finds kvcore enabled registers anything; later calls
    return that call's status. ``with_transfers`` adds the host-pool transfer hooks
    (:mod:`kvcore_sglang.transfers`); by default it follows ``KVCORE_TRANSFERS`` (on
    unless set to 0). They close over ``adapter`` (a test's or a benchmark's), by default
    one built from ``config``.
    """
    config = KVCoreConfig.from_env() if config is None else config
    with _lock:
        if INSTALLATION.status is not None:
            return INSTALLATION.status
        status = probe_engine(
            ENGINE, DISTRIBUTION, SUPPORTED_VERSIONS, enabled=config.enabled_for(ENGINE)
        )
        if not status.enabled:
            return status
        if not status.supported:
            logger.warning("kvcore: %s; nothing patched", status.summary())
            return status
        config.configure_logging()
        _register(status, release_of(status.version or ""))
        transfers = config.transfers if with_transfers is None else with_transfers
        if transfers:
            _register_transfers(
                status,
                release_of(status.version or ""),
                INSTALLATION.adapter_for(config, adapter),
            )
        if config.host_pool:
            _register_host_memory(status, release_of(status.version or ""))
        if config.host_pool_pin_first:
            _register_pinning(status, release_of(status.version or ""), config)
        announce_activation(logger, "SGLang", status, transfers, config.serve_rule)
        if transfers:
            announce_stock_share(logger, "SGLang", config.stock_share)
        if config.metrics:
            # Scheduler processes reach SGLang's /metrics (served by the HTTP process)
            # only through prometheus_client's multiprocess files (--enable-metrics).
            start_multiprocess_export()
        status.plugin_applied = True
        INSTALLATION.status = status
        return status


def installed_adapter() -> SGLangAdapter | None:
    """The adapter the installed transfer hooks close over, or None."""
    return INSTALLATION.adapter


def applied_status() -> EngineStatus | None:
    """The status of the hooks registered in this process, or None if none were."""
    return INSTALLATION.status


def uninstall() -> None:
    """Take back every hook :func:`register_hooks` registered, restoring each original
    (:meth:`kvcore_sglang.installation.Installation.uninstall`)."""
    with _lock:
        INSTALLATION.uninstall()


def _register(status: EngineStatus, version: str) -> None:
    # Imported here: both modules import torch, and the plugin module is loaded
    # by SGLang's launcher whether or not kvcore is enabled.
    from . import guard, host_slots

    result = guard.check_targets(version)
    groups = _group_of(guard.TARGET_GROUPS)
    for skipped in result.skipped:
        status.skip(skipped.target, skipped.reason, groups[skipped.target])
    if result.skipped:
        changed = "; ".join(f"{s.target}: {s.reason}" for s in result.skipped)
        logger.warning("kvcore: SGLang %s targets left stock: %s", version, changed)
    hooks = {f"{guard.HOST_KV_CACHE}.{name}": hook for name, hook in host_slots.HOOKS.items()}
    for target in result.patchable:
        INSTALLATION.register(target, hooks[target])
        status.patched_targets.append(target)
    if set(guard.ALLOCATOR_TARGETS) <= set(result.patchable):
        for pool, reason in host_slots.STOCK_POOLS.items():
            status.skip(pool, reason, STOCK_POOLS_GROUP)


def _register_transfers(status: EngineStatus, version: str, adapter: SGLangAdapter) -> None:
    from . import guard, pool_warm_up, transfers

    hooks = {**transfers.hooks(adapter), **pool_warm_up.hooks(adapter)}
    _register_checked(status, version, guard.TRANSFER_GROUPS, hooks, "transfers")


def _register_host_memory(status: EngineStatus, version: str) -> None:
    from . import guard, host_memory

    _register_checked(status, version, guard.HOST_MEMORY_GROUPS, host_memory.HOOKS, "host pool")


def _register_pinning(status: EngineStatus, version: str, config: KVCoreConfig) -> None:
    from . import guard, pool_pinning

    if not set(guard.ALLOCATOR_TARGETS) <= set(status.patched_targets):
        reason = "the host-slot allocator stays stock: only kvcore's hands out pinned slots alone"
        for target in guard.PINNING_TARGETS:
            status.skip(target, reason, guard.PINNING_GROUP)
        logger.warning("kvcore: SGLang's host pools are pinned whole: %s", reason)
        return
    hooks = pool_pinning.hooks(config)
    _register_checked(status, version, guard.PINNING_GROUPS, hooks, "host pool pinning")


def _register_checked(
    status: EngineStatus,
    version: str,
    groups: Mapping[str, tuple[str, ...]],
    hooks: Mapping[str, Callable[..., Any]],
    what: str,
) -> None:
    """Register ``hooks`` for the targets of ``groups`` whose sources match ``version``'s
    fingerprints; the others are skipped in ``status``, with why."""
    from . import guard

    result = guard.check_targets(version, dict(groups))
    group_of = _group_of(groups)
    for skipped in result.skipped:
        status.skip(skipped.target, skipped.reason, group_of[skipped.target])
    if result.skipped:
        changed = "; ".join(f"{s.target}: {s.reason}" for s in result.skipped)
        logger.warning("kvcore: SGLang %s %s left stock: %s", version, what, changed)
    for target in result.patchable:
        INSTALLATION.register(target, hooks[target])
        status.patched_targets.append(target)


def _group_of(groups: Mapping[str, tuple[str, ...]]) -> dict[str, str]:
    return {target: group for group, targets in groups.items() for target in targets}
