"""The one mover the SGLang transfer hooks copy through in a process.

Built from the ``KVCORE_*`` configuration on the first call that needs it (SGLang's load
and backup threads may both arrive first: one staging buffer only), or set by a benchmark
or a test (:func:`use_mover`), and what a request's pass counts in its metrics
(:func:`count_request_pass`). Apart from the hooks so that what owns the mover is one
small module, and the hooks only ask it.
"""

from __future__ import annotations

import threading

from kvcore.config import KVCoreConfig
from kvcore.metrics import METRICS
from kvcore.mover import Mover
from kvcore.path_policy import policy_from_config

_mover: Mover | None = None
_mover_lock = threading.Lock()


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
        return _mover


def use_mover(chosen: Mover | None) -> Mover | None:
    """Have the hooks copy through ``chosen`` (a benchmark's or a test's mover; None: the
    process's own, built from the KVCORE_* configuration on next use); returns the one in
    use until now (None where none was built), for the caller to put back."""
    global _mover
    with _mover_lock:
        previous, _mover = _mover, chosen
    return previous


def built_mover() -> Mover | None:
    """The mover the hooks use, or None before the first call that needs one."""
    return _mover


def count_request_pass(chosen: Mover, reason: str) -> None:
    """A whole request passed to stock: its decision and its pass, in one count."""
    if chosen.metrics is not None:
        chosen.metrics.record_pass(reason)
