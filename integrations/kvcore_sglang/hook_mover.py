"""The one mover the SGLang transfer hooks copy through in a process.

Built from the ``KVCORE_*`` configuration on the first call that needs it (SGLang's load
and backup threads may both arrive first: one staging buffer only), or set by a benchmark
or a test (:func:`use_mover`), and what a request's pass counts in its metrics
(:func:`count_request_pass`, or :data:`PASS_COUNTS` where no call may be spent). Apart
from the hooks so that what owns the mover is one
small module, and the hooks only ask it.
"""

from __future__ import annotations

import threading
from collections import defaultdict

from kvcore.config import KVCoreConfig
from kvcore.metrics import METRICS, Metrics
from kvcore.mover import Mover
from kvcore.path_policy import policy_from_config

_mover: Mover | None = None
_mover_lock = threading.Lock()
PASS_COUNTS: list[defaultdict[str, int] | None] = [None]
"""The mover in use's :meth:`~kvcore.metrics.Metrics.pass_tally`, None where it counts
nothing (or none is in use yet): a binding that passes whole requests adds to it with no
call and no lock. SGLang 0.5.23 makes its loads and backups from one thread (the
scheduler's); were two threads to add to one reason at once, a pass could go uncounted,
never a byte moved otherwise."""
# The metrics PASS_COUNTS' tally came from, kept apart from the mover: warm-up sets a
# mover's metrics aside for a while (kvcore.warm_up), so they cannot be read back from it.
_counted_by: list[Metrics | None] = [None]


def mover() -> Mover:
    """This process's mover, built from the KVCORE_* configuration on first use."""
    global _mover
    built = _mover
    if built is not None:
        # Every hook call asks; once built, reading the global needs no lock.
        return built
    with _mover_lock:
        # SGLang's load and backup threads may both arrive first; one staging buffer only.
        if _mover is None:
            config = KVCoreConfig.from_env()
            metrics = METRICS if config.metrics else None
            _mover = Mover(policy_from_config(config), metrics=metrics)
            _count_passes_in(_mover)
        return _mover


def use_mover(chosen: Mover | None) -> Mover | None:
    """Have the hooks copy through ``chosen`` (a benchmark's or a test's mover; None: the
    process's own, built from the KVCORE_* configuration on next use); returns the one in
    use until now (None where none was built), for the caller to put back."""
    global _mover
    with _mover_lock:
        previous, _mover = _mover, chosen
        _count_passes_in(chosen)
    return previous


def _count_passes_in(chosen: Mover | None) -> None:
    """Point :data:`PASS_COUNTS` at a new pass tally of ``chosen``'s metrics, giving the
    last one back to its metrics (the caller holds the lock)."""
    old, owner = PASS_COUNTS[0], _counted_by[0]
    if old is not None and owner is not None:
        owner.release_tally(old)
    metrics = None if chosen is None else chosen.metrics
    PASS_COUNTS[0] = None if metrics is None else metrics.pass_tally()
    _counted_by[0] = metrics


def built_mover() -> Mover | None:
    """The mover the hooks use, or None before the first call that needs one."""
    return _mover


def count_request_pass(chosen: Mover, reason: str) -> None:
    """A whole request passed to stock: its decision and its pass, in one count."""
    if chosen.metrics is not None:
        chosen.metrics.record_pass(reason)
