"""The one mover an SGLang adapter's transfer hooks copy through.

Built from the adapter's configuration on the first call that needs it (SGLang's load
and backup threads may both arrive first: one staging buffer only), or set by a benchmark
or a test (:meth:`HookMover.use`); with it, what a request's pass counts in its metrics
(:func:`count_request_pass`, or :attr:`HookMover.pass_counts` where no call may be spent).
Apart from the hooks so that what owns the mover is one small class, and the hooks only
ask it.
"""

from __future__ import annotations

import threading
from collections import defaultdict

from kvcore.config import KVCoreConfig
from kvcore.metrics import METRICS, Metrics
from kvcore.mover import Mover
from kvcore.planning.path_policy import (
    SGLANG_DMA_IN_PLACE_RUN_BYTES,
    PathPolicy,
    dma_in_place_policy,
    policy_from_config,
)


class HookMover:
    """The mover of one adapter, built from ``config`` on first use."""

    def __init__(self, config: KVCoreConfig) -> None:
        self._config = config
        self._mover: Mover | None = None
        self._lock = threading.Lock()
        self.pass_counts: defaultdict[str, int] | None = None
        """The mover in use's :meth:`~kvcore.metrics.Metrics.pass_tally`, None where it
        counts nothing (or none is in use yet): a binding that passes whole requests adds
        to it with no call and no lock. SGLang 0.5.23 makes its loads and backups from one
        thread (the scheduler's); were two threads to add to one reason at once, a pass
        could go uncounted, never a byte moved otherwise."""
        # The metrics pass_counts came from, kept apart from the mover: warm-up sets a
        # mover's metrics aside for a while (kvcore.warm_up), so they cannot be read back.
        self._counted_by: Metrics | None = None

    def mover(self) -> Mover:
        """The mover in use, built from the configuration on first use."""
        built = self._mover
        if built is not None:
            # Every hook call asks; once built, reading it needs no lock.
            return built
        with self._lock:
            if self._mover is None:
                metrics = METRICS if self._config.metrics else None
                self._mover = Mover(sglang_policy(self._config), metrics=metrics)
                self._count_passes_in(self._mover)
            return self._mover

    def use(self, chosen: Mover | None) -> Mover | None:
        """Copy through ``chosen`` (a benchmark's or a test's mover; None: one built from
        the configuration on next use); returns the one in use until now (None where none
        was built), for the caller to put back."""
        with self._lock:
            previous, self._mover = self._mover, chosen
            self._count_passes_in(chosen)
        return previous

    def built(self) -> Mover | None:
        """The mover in use, or None before the first call that needs one."""
        return self._mover

    def _count_passes_in(self, chosen: Mover | None) -> None:
        """Point :attr:`pass_counts` at a new pass tally of ``chosen``'s metrics, giving the
        last one back to its metrics (the caller holds the lock)."""
        old, owner = self.pass_counts, self._counted_by
        if old is not None and owner is not None:
            owner.release_tally(old)
        metrics = None if chosen is None else chosen.metrics
        self.pass_counts = None if metrics is None else metrics.pass_tally()
        self._counted_by = metrics


def count_request_pass(chosen: Mover, reason: str) -> None:
    """A whole request passed to stock: its decision and its pass, in one count."""
    if chosen.metrics is not None:
        chosen.metrics.record_pass(reason)


def sglang_policy(config: KVCoreConfig) -> PathPolicy:
    """The path policy SGLang's hooks copy with: ``config``'s, with pages of
    :data:`~kvcore.planning.path_policy.SGLANG_DMA_IN_PLACE_RUN_BYTES` and more by DMA
    straight into place under ``KVCORE_SGLANG_DMA_IN_PLACE``
    (:func:`kvcore.planning.path_policy.dma_in_place_policy`)."""
    if config.sglang_dma_in_place:
        return dma_in_place_policy(config, shortest_run=SGLANG_DMA_IN_PLACE_RUN_BYTES)
    return policy_from_config(config)
