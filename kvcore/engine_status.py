"""What kvcore knows about one serving engine on this machine, found without importing it.

Importing an engine is slow and can initialise CUDA, so the installed version is
read from the distribution's metadata instead.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvcore.config import KVCoreConfig


@dataclass
class EngineStatus:
    """One engine: installed or not, whether kvcore supports that version, and what it patched.

    ``patched_targets`` is what the adapter's plugin patched in this process
    (``plugin_applied``); ``would_patch`` is what the version guard passes for the installed
    source under these settings, found without starting the engine. ``target_groups`` maps
    each group the adapter patches as one (name -> its targets) and ``groups_off`` each group
    the settings leave stock (name -> which setting), so a report can group its targets.
    """

    engine: str
    distribution: str
    installed: bool
    version: str | None
    supported: bool
    supported_versions: list[str]
    enabled: bool
    patched_targets: list[str] = field(default_factory=list)
    skipped_targets: list[dict[str, str]] = field(default_factory=list)
    would_patch: list[str] = field(default_factory=list)
    target_groups: dict[str, list[str]] = field(default_factory=dict)
    groups_off: dict[str, str] = field(default_factory=dict)
    settings: dict[str, bool | float] = field(default_factory=dict)
    plugin_applied: bool = False
    # Wall time of the guard's check in this call; None where it did not run.
    guard_seconds: float | None = None

    @property
    def active(self) -> bool:
        """Whether kvcore should patch this engine: installed, a tested version, and enabled."""
        return self.installed and self.supported and self.enabled

    def skip(self, target: str, reason: str, group: str | None = None) -> None:
        entry = {"target": target, "reason": reason}
        if group is not None:
            entry["group"] = group
        self.skipped_targets.append(entry)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """One line for people, e.g. ``0.5.22, supported, enabled: 3 patched, 0 skipped``
        in an engine process, ``... enabled: would patch 3, 0 skipped`` elsewhere."""
        if not self.installed:
            return "not installed"
        if not self.supported:
            tested = ", ".join(self.supported_versions) or "none"
            return f"{self.version}, not a tested version (tested: {tested}); runs stock"
        if not self.enabled:
            return f"{self.version}, supported, not enabled (KVCORE_ENABLE); runs stock"
        done = (
            f"{len(self.patched_targets)} patched in this process"
            if self.plugin_applied
            else f"would patch {len(self.would_patch)}"
        )
        return f"{self.version}, supported, enabled: {done}, {len(self.skipped_targets)} skipped"


def announce_activation(
    logger: logging.Logger, engine: str, status: EngineStatus, transfers: bool, serve_rule: bool
) -> None:
    """The one line an engine's log gets where kvcore took effect in this process."""
    skipped = f", {len(status.skipped_targets)} left stock" if status.skipped_targets else ""
    logger.info(
        "kvcore: active in %s %s (pid %d): %d targets patched%s; transfers %s, serve rule %s",
        engine,
        status.version,
        os.getpid(),
        len(status.patched_targets),
        skipped,
        "on" if transfers else "off",
        "on" if serve_rule else "off",
    )


def announce_stock_share(logger: logging.Logger, engine: str, share: float) -> None:
    """One warning where reloads kvcore would serve are shared with the engine's own copy
    (``KVCORE_STOCK_SHARE``): a measurement setting, never one to serve with."""
    if share:
        logger.warning(
            "kvcore: KVCORE_STOCK_SHARE=%s: that share of the %s reloads kvcore would copy "
            "gets %s's own copy (an A/B measurement); unset it to serve",
            share,
            engine,
            engine,
        )


def settings_shown(config: KVCoreConfig) -> dict[str, bool | float]:
    """The settings an engine's status shows: the switches, and a stock share and a first
    pinned share where set."""
    shown: dict[str, bool | float] = {
        "transfers": config.transfers,
        "serve_rule": config.serve_rule,
        "host_pool": config.host_pool,
    }
    if config.stock_share:
        shown["stock_share"] = config.stock_share
    if config.host_pool_pin_first:
        shown["host_pool_pin_first"] = config.host_pool_pin_first
    return shown


def release_of(version: str) -> str:
    """``version`` without its local label: ``0.32.0+cu128`` is the 0.32.0 release's source."""
    return version.split("+", 1)[0]


def probe_engine(
    engine: str, distribution: str, supported_versions: Iterable[str], *, enabled: bool
) -> EngineStatus:
    """The engine's status from its installed metadata; supported means the release string is
    exactly one of ``supported_versions`` (a local label such as ``+cu128`` is ignored; ``.post1``
    or ``.dev`` builds are other releases)."""
    tested = list(supported_versions)
    try:
        version: str | None = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        version = None
    return EngineStatus(
        engine=engine,
        distribution=distribution,
        installed=version is not None,
        version=version,
        supported=version is not None and release_of(version) in tested,
        supported_versions=tested,
        enabled=enabled,
    )
