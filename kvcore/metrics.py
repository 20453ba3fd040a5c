"""Counters and histograms for kvcore's transfers, serve-or-pass decisions and allocators.

The numbers are kept in plain Python so that they cost nothing when nobody reads
them; :func:`register_prometheus` exposes them through prometheus_client when it
is installed (the engines' own metrics endpoints then show them). A hot path that
passes work to the engine counts its reasons in a tally of its own
(:meth:`Metrics.fallback_tally`), which the metrics take in whenever they are read.
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

SECONDS_BUCKETS: tuple[float, ...] = (
    1e-5,
    3e-5,
    1e-4,
    3e-4,
    1e-3,
    3e-3,
    1e-2,
    3e-2,
    1e-1,
    3e-1,
    1.0,
    3.0,
)


@dataclass
class Histogram:
    """Cumulative-bucket histogram in the Prometheus sense."""

    buckets: Sequence[float] = SECONDS_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    observations: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.observations += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, count of observations <= bound), ending with +Inf."""
        out: list[tuple[float, int]] = []
        running = 0
        for bound, count in zip([*self.buckets, float("inf")], self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out


TransferKey = tuple[str, str]


class Metrics:
    """Thread-safe store of everything kvcore counts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tallies: list[tuple[defaultdict[str, int], dict[str, int]]] = []
        """Each tally handed out, with the counts of it already in :attr:`fallbacks`."""
        self._pass_tallies: set[int] = set()
        """The ids of the tallies that count whole-request passes (:meth:`pass_tally`)."""
        self.resets = -1
        self.reset()

    def reset(self) -> None:
        with self._lock:
            # Exporters that add what is new since their last look start again from zero.
            self.resets += 1
            for counts, taken in self._tallies:
                taken.update(counts.copy())
            self.transfer_bytes: dict[TransferKey, int] = defaultdict(int)
            self.transfer_count: dict[TransferKey, int] = defaultdict(int)
            self.transfer_seconds: dict[TransferKey, Histogram] = defaultdict(Histogram)
            self.fallbacks: dict[str, int] = defaultdict(int)
            self.decisions: dict[tuple[str, str], int] = defaultdict(int)
            self.allocator_allocs = 0
            self.allocator_one_run_allocs = 0
            self.allocator_runs = 0

    def record_transfer(self, direction: str, path: str, nbytes: int, seconds: float) -> None:
        """One executed transfer; ``seconds`` is host time spent issuing it."""
        key = (direction, path)
        with self._lock:
            self.transfer_bytes[key] += nbytes
            self.transfer_count[key] += 1
            self.transfer_seconds[key].observe(seconds)

    def record_fallback(self, reason: str) -> None:
        with self._lock:
            self.fallbacks[reason] += 1

    def fallback_tally(self) -> defaultdict[str, int]:
        """Fallback counts by reason for one thread to add to, ``tally[reason] += 1``: no
        lock and no call, for a path that counts each job it passes to the engine. Every
        read of these metrics takes in what is new in it, so each count reaches
        :attr:`fallbacks` once. The metrics keep each tally until
        :meth:`release_tally` (its holder's shutdown)."""
        tally: defaultdict[str, int] = defaultdict(int)
        with self._lock:
            self._tallies.append((tally, {}))
        return tally

    def pass_tally(self) -> defaultdict[str, int]:
        """A :meth:`fallback_tally` whose counts are whole requests passed to the engine:
        each is taken in as a ``pass`` decision too, as :meth:`record_pass` counts one."""
        tally = self.fallback_tally()
        with self._lock:
            self._pass_tallies.add(id(tally))
        return tally

    def release_tally(self, tally: defaultdict[str, int]) -> None:
        """Take in what ``tally`` counted and keep it no longer: its holder counts no more
        (a handler shut down), so a process that builds handlers again and again keeps no
        tally of the old ones. A tally these metrics did not hand out is ignored."""
        with self._lock:
            for counts, taken in self._tallies:
                if counts is tally:
                    self._take_in(counts, taken)
            self._tallies = [entry for entry in self._tallies if entry[0] is not tally]
            self._pass_tallies.discard(id(tally))

    def _take_in_tallies(self) -> None:
        """Add to :attr:`fallbacks` what the tallies counted since the last read (the caller
        holds the lock)."""
        for counts, taken in self._tallies:
            self._take_in(counts, taken)

    def _take_in(self, counts: defaultdict[str, int], taken: dict[str, int]) -> None:
        # A copy in one step: the tally's thread may add a reason meanwhile. It only ever
        # raises a count, so what this read misses the next one takes in.
        now = counts.copy()
        passes = id(counts) in self._pass_tallies
        for reason, count in now.items():
            new = count - taken.get(reason, 0)
            if new:
                self.fallbacks[reason] += new
                if passes:
                    self.decisions[("pass", reason)] += new
        taken.update(now)

    def record_decision(self, decision: str, reason: str) -> None:
        """One request's serve-or-pass decision (``serve`` or ``pass``) and its reason."""
        with self._lock:
            self.decisions[(decision, reason)] += 1

    def record_pass(self, reason: str) -> None:
        """A request passed to the engine's stock copy: its decision and its fallback."""
        with self._lock:
            self.decisions[("pass", reason)] += 1
            self.fallbacks[reason] += 1

    def record_allocation(self, runs: int) -> None:
        """One successful allocation that was served by ``runs`` free runs."""
        with self._lock:
            self.allocator_allocs += 1
            self.allocator_runs += runs
            if runs == 1:
                self.allocator_one_run_allocs += 1

    def snapshot(self) -> dict[str, Any]:
        """A plain-data copy of every value, for logs, JSON and tests."""
        with self._lock:
            self._take_in_tallies()
            allocs = self.allocator_allocs
            return {
                "resets": self.resets,
                "transfers": [
                    {
                        "direction": direction,
                        "path": path,
                        "count": self.transfer_count[(direction, path)],
                        "bytes": self.transfer_bytes[(direction, path)],
                        "seconds": self.transfer_seconds[(direction, path)].total,
                        "seconds_buckets": list(self.transfer_seconds[(direction, path)].counts),
                    }
                    for direction, path in sorted(self.transfer_count)
                ],
                "fallbacks": dict(sorted(self.fallbacks.items())),
                "decisions": [
                    {"decision": decision, "reason": reason, "count": count}
                    for (decision, reason), count in sorted(self.decisions.items())
                ],
                "allocator": {
                    "allocations": allocs,
                    "one_run_fraction": self.allocator_one_run_allocs / allocs if allocs else 1.0,
                    "runs_per_allocation": self.allocator_runs / allocs if allocs else 0.0,
                },
            }


METRICS = Metrics()


class _PrometheusCollector:
    """Reads :class:`Metrics` at scrape time, so recording never touches prometheus_client."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        m = self._metrics
        labels = ["direction", "path"]
        nbytes = CounterMetricFamily(
            "kvcore_transfer_bytes", "Bytes moved by kvcore transfers", labels=labels
        )
        count = CounterMetricFamily("kvcore_transfers", "Transfers executed", labels=labels)
        seconds = HistogramMetricFamily(
            "kvcore_transfer_issue_seconds", "Host time spent issuing a transfer", labels=labels
        )
        fallbacks = CounterMetricFamily(
            "kvcore_fallbacks", "Transfers handed to the engine's stock path", labels=["reason"]
        )
        decisions = CounterMetricFamily(
            "kvcore_decisions",
            "Requests kvcore served or passed to the engine's stock copy, by reason",
            labels=["decision", "reason"],
        )
        with m._lock:
            m._take_in_tallies()
            for (decision, reason), n in sorted(m.decisions.items()):
                decisions.add_metric([decision, reason], n)
            for key in sorted(m.transfer_count):
                nbytes.add_metric(list(key), m.transfer_bytes[key])
                count.add_metric(list(key), m.transfer_count[key])
                hist = m.transfer_seconds[key]
                buckets = [
                    ("+Inf" if bound == float("inf") else repr(bound), c)
                    for bound, c in hist.cumulative()
                ]
                seconds.add_metric(list(key), buckets, hist.total)
            for reason, n in sorted(m.fallbacks.items()):
                fallbacks.add_metric([reason], n)
            allocs = m.allocator_allocs
            one_run = m.allocator_one_run_allocs
        yield nbytes
        yield count
        yield seconds
        yield fallbacks
        yield decisions
        yield GaugeMetricFamily(
            "kvcore_allocator_one_run_fraction",
            "Share of host-slot allocations served by one contiguous run",
            value=one_run / allocs if allocs else 1.0,
        )


def register_prometheus(registry: Any = None, metrics: Metrics = METRICS) -> bool:
    """Expose ``metrics`` on a prometheus_client registry (the default one if None).

    Returns False when prometheus_client is not installed. Registering the same
    Metrics twice on one registry is a no-op.
    """
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return False
    target = REGISTRY if registry is None else registry
    key = (id(target), id(metrics))
    with _REGISTERED_LOCK:
        if key not in _REGISTERED:
            target.register(_PrometheusCollector(metrics))
            _REGISTERED.add(key)
    return True


_REGISTERED: set[tuple[int, int]] = set()
_REGISTERED_LOCK = threading.Lock()
