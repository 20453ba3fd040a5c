"""The ``vllm.general_plugins`` entry point: make kvcore's spec the one vLLM builds.

vLLM calls :func:`register` with no arguments in the API server, the engine core and
every worker, before any KV connector exists. When ``KVCORE_ENABLE`` names vllm, the
installed release is a tested one and every guarded function still has its tested
source, the factory's entry for the default spec name (``CPUOffloadingSpec``, the one
``--kv-offloading-size`` uses) is pointed at :class:`KVCoreCPUOffloadingSpec`, and the
same class is registered as ``KVCoreCPUOffloadingSpec`` for explicit selection.
Otherwise nothing changes and, where kvcore was asked for, one warning says why.

vLLM itself is imported only once all of that holds.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Mapping

from kvcore.config import KVCoreConfig, engine_config
from kvcore.engine_status import (
    EngineStatus,
    announce_activation,
    announce_stock_share,
    probe_engine,
    release_of,
    settings_shown,
)
from kvcore.metrics_export import start_multiprocess_export
from kvcore_vllm.guard import (
    DISTRIBUTION,
    ENGINE,
    FINGERPRINTS,
    SUPPORTED_VERSIONS,
    refusals,
    targets_for,
)
from kvcore_vllm.installation import INSTALLATION

DEFAULT_SPEC_NAME = "CPUOffloadingSpec"
SPEC_NAME = "KVCoreCPUOffloadingSpec"
REGISTRY_TARGET = (
    f"vllm.v1.kv_offload.factory.OffloadingSpecFactory._registry[{DEFAULT_SPEC_NAME!r}]"
)
# The adapter changes vLLM as one: the factory entry, and the methods kvcore's spec and
# manager override; every guarded function (TARGETS) is checked for it.
SPEC_GROUP = "kvcore offloading spec"


def spec_targets(version: str | None) -> list[str]:
    """The factory entry and the methods kvcore overrides, in ``version``'s own names."""
    targets = targets_for(release_of(version or ""))
    return [REGISTRY_TARGET, *(t.name for t in targets if t.overridden)]


logger = logging.getLogger("kvcore.vllm")

_lock = threading.Lock()


def register() -> None:
    """Entry point for ``vllm.general_plugins``; safe to call any number of times."""
    try:
        config = engine_config("vLLM")
        if config is not None:
            activate(config)
    except Exception:
        # vLLM does not catch errors raised by a general plugin: it would not start.
        logger.exception("kvcore: activating the vLLM adapter failed; vLLM runs stock")


def activate(
    config: KVCoreConfig, fingerprints: Mapping[str, Mapping[str, str]] = FINGERPRINTS
) -> EngineStatus:
    """Install kvcore's spec if ``config`` enables vLLM and the guard passes; the status.

    The first decision for an enabled config is final for the process: later calls
    return it again without patching or warning twice.
    """
    with _lock:
        return copy.deepcopy(_decide(config, fingerprints))


def _decide(config: KVCoreConfig, fingerprints: Mapping[str, Mapping[str, str]]) -> EngineStatus:
    decided = INSTALLATION.decided
    if decided is not None and config.enabled_for(ENGINE):
        return decided
    status = check(config, fingerprints)
    if not status.enabled or not status.installed:
        return status
    config.configure_logging()
    if not status.supported:
        logger.warning(
            "kvcore: vLLM %s is not a tested version (tested: %s); vLLM runs stock",
            status.version,
            ", ".join(SUPPORTED_VERSIONS),
        )
    elif status.skipped_targets:
        first = status.skipped_targets[0]
        logger.warning(
            "kvcore: %d of %d vLLM functions kvcore relies on differ from vLLM %s as tested "
            "(first: %s: %s); vLLM runs stock",
            len(status.skipped_targets),
            len(targets_for(release_of(status.version or ""))),
            status.version,
            first["target"],
            first["reason"],
        )
    else:
        install_spec()
        status.patched_targets = spec_targets(status.version)
        announce_activation(logger, "vLLM", status, config.transfers, config.serve_rule)
        if config.transfers:
            announce_stock_share(logger, "vLLM", config.stock_share)
        if config.metrics:
            # vLLM's workers are processes of their own: their counts reach /metrics through
            # prometheus_client's multiprocess files, when vLLM turns that mode on.
            start_multiprocess_export()
    status.plugin_applied = True
    INSTALLATION.decide(status)
    return status


def check(
    config: KVCoreConfig, fingerprints: Mapping[str, Mapping[str, str]] = FINGERPRINTS
) -> EngineStatus:
    """vLLM's status with the guard's verdict as skipped targets (every target, with why,
    on an untested release) and, where it passes, the targets as ``would_patch``; patches
    nothing and imports no vLLM module."""
    status = probe_engine(
        ENGINE, DISTRIBUTION, SUPPORTED_VERSIONS, enabled=config.enabled_for(ENGINE)
    )
    if not (status.installed and status.enabled and status.version is not None):
        return status
    status.settings = settings_shown(config)
    status.target_groups = {SPEC_GROUP: spec_targets(status.version)}
    started = time.perf_counter()
    refused = refusals(release_of(status.version), fingerprints)
    status.guard_seconds = round(time.perf_counter() - started, 4)
    for target, reason in refused.items():
        status.skip(target, reason, SPEC_GROUP)
    if not refused:
        status.would_patch = spec_targets(status.version)
    return status


def status(config: KVCoreConfig) -> EngineStatus:
    """What activation did in this process (``plugin_applied``) with what the guard would
    decide now, or only the latter where the plugin did not run."""
    verdict = check(config)
    decided = INSTALLATION.decided
    if decided is not None and config.enabled_for(ENGINE):
        applied = copy.deepcopy(decided)
        applied.would_patch = verdict.would_patch
        applied.guard_seconds = verdict.guard_seconds
        return applied
    return verdict


def install_spec() -> None:
    """kvcore's spec behind the factory's default name, and under its own name where that
    is free; what each held is recorded in :data:`INSTALLATION`. Idempotent."""
    # register_spec refuses a taken name, and the default name is taken by vLLM's own
    # spec; its registry maps a name to a zero-argument loader, so kvcore's loader goes
    # in directly, under both names.
    INSTALLATION.point_factory_entry(DEFAULT_SPEC_NAME, load_spec, replace=True)
    INSTALLATION.point_factory_entry(SPEC_NAME, load_spec, replace=False)


def uninstall() -> None:
    """Put back everything kvcore changed in vLLM, each original object as activation found
    it, and forget its decision, so the process is as one that never loaded the plugin
    (:meth:`kvcore_vllm.installation.Installation.uninstall`). Safe to call twice."""
    with _lock:
        INSTALLATION.uninstall()


def load_spec() -> type:
    """The factory's loader for kvcore's spec (vLLM and the spec are imported on call)."""
    from kvcore_vllm.spec import KVCoreCPUOffloadingSpec

    return KVCoreCPUOffloadingSpec
