"""kvcore's counters on an engine's Prometheus endpoint when the engine runs many processes.

SGLang serves ``/metrics`` from its HTTP process, while transfers happen in scheduler
processes; it runs prometheus_client in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``),
where each process writes its values to files that the HTTP process aggregates. A collector
registered in a scheduler process would never be scraped, so each process instead copies
its :class:`~kvcore.metrics.Metrics` into multiprocess-mode metrics on a background
thread, every few seconds: recording a transfer still never touches prometheus_client.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Mapping
from typing import Any

from kvcore.metrics import METRICS, SECONDS_BUCKETS, Metrics

MULTIPROC_ENV = ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")
DEFAULT_INTERVAL_S = 5.0

logger = logging.getLogger("kvcore.metrics")


def process_rank(environ: Mapping[str, str] = os.environ) -> str | None:
    """The rank of this process in the engine's torch.distributed group (what the engines'
    GPU workers join), else the launcher's ``RANK``/``LOCAL_RANK``; None before either is
    known. torch is only looked at where the engine has imported it already."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return str(distributed.get_rank())
    for name in ("RANK", "LOCAL_RANK"):
        if environ.get(name):
            return environ[name]
    return None


def multiprocess_dir(environ: Mapping[str, str] = os.environ) -> str | None:
    """The directory prometheus_client's multiprocess mode writes to, if it is on."""
    for name in MULTIPROC_ENV:
        if environ.get(name):
            return environ[name]
    return None


class MultiprocessExporter:
    """Mirrors one :class:`Metrics` into prometheus_client metrics of this process."""

    def __init__(
        self, metrics: Metrics = METRICS, registry: Any = None, rank: str | None = None
    ) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        kwargs = {} if registry is None else {"registry": registry}
        labels = ["rank", "direction", "path"]
        self._metrics = metrics
        self._rank = rank
        self._bytes = Counter(
            "kvcore_transfer_bytes", "Bytes moved by kvcore transfers", labels, **kwargs
        )
        self._count = Counter("kvcore_transfers", "Transfers executed", labels, **kwargs)
        self._seconds = Histogram(
            "kvcore_transfer_issue_seconds",
            "Host time spent issuing a transfer",
            labels,
            buckets=SECONDS_BUCKETS,
            **kwargs,
        )
        self._fallbacks = Counter(
            "kvcore_fallbacks",
            "Transfers handed to the engine's stock path",
            ["rank", "reason"],
            **kwargs,
        )
        self._decisions = Counter(
            "kvcore_decisions",
            "Requests kvcore served or passed to the engine's stock copy, by reason",
            ["rank", "decision", "reason"],
            **kwargs,
        )
        self._one_run = Gauge(
            "kvcore_allocator_one_run_fraction",
            "Share of host-slot allocations served by one contiguous run, per process",
            multiprocess_mode="liveall",
            **kwargs,
        )
        self._exported: dict[tuple[str, ...], float] = {}
        self._resets = metrics.resets
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def export_once(self) -> None:
        """Add what was counted since the last export; set the gauges."""
        snapshot = self._metrics.snapshot()
        with self._lock:
            if snapshot["resets"] != self._resets:
                # A reset of the Metrics (tests do it) starts every count again from zero.
                self._exported.clear()
                self._resets = snapshot["resets"]
            counted = snapshot["transfers"] or snapshot["fallbacks"] or snapshot["decisions"]
            rank = self._rank_label() if counted else ""
            for transfer in snapshot["transfers"]:
                labels = (rank, transfer["direction"], transfer["path"])
                self._add(self._bytes, ("bytes", *labels), transfer["bytes"], labels)
                self._add(self._count, ("count", *labels), transfer["count"], labels)
                self._add_histogram(labels, transfer["seconds_buckets"], transfer["seconds"])
            for reason, count in snapshot["fallbacks"].items():
                why = (rank, reason)
                self._add(self._fallbacks, ("fallback", *why), count, why)
            for entry in snapshot["decisions"]:
                decided = (rank, entry["decision"], entry["reason"])
                self._add(self._decisions, ("decision", *decided), entry["count"], decided)
            self._one_run.set(snapshot["allocator"]["one_run_fraction"])

    def _add(self, counter: Any, key: tuple[str, ...], total: float, labels: tuple) -> None:
        delta = self._delta(key, total)
        if delta:
            counter.labels(*labels).inc(delta)

    def _add_histogram(self, labels: tuple[str, ...], counts: list[int], total: float) -> None:
        """Add the observations made since the last export, bucket by bucket.

        kvcore's histogram has the exported one's buckets, so its new counts go into the
        same buckets (prometheus_client keeps a value per bucket and per sum, which in
        multiprocess mode are its files); re-observing values would lose their spread.
        """
        child = self._seconds.labels(*labels)
        for index, count in enumerate(counts):
            key = ("seconds_bucket", *labels, str(index))
            delta = self._delta(key, count)
            if delta:
                child._buckets[index].inc(delta)
        delta = self._delta(("seconds_sum", *labels), total)
        if delta:
            child._sum.inc(delta)

    def _delta(self, key: tuple[str, ...], total: float) -> float:
        delta = total - self._exported.get(key, 0)
        self._exported[key] = total
        return delta

    def _rank_label(self) -> str:
        """This process's rank among the engine's GPU workers, read when there is first
        something to export (copies come after the engine joined its process group) and
        kept, so that a process's series never change labels; empty where none is known."""
        if self._rank is None:
            self._rank = process_rank() or ""
        return self._rank

    def start(self, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        """Export every ``interval_s`` seconds on a daemon thread until :meth:`stop`."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._run, args=(interval_s,), name="kvcore-metrics", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.export_once()

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.export_once()
            except Exception:
                logger.exception("kvcore: exporting metrics failed; retrying")


_started: MultiprocessExporter | None = None
_started_lock = threading.Lock()


def start_multiprocess_export(
    metrics: Metrics = METRICS, interval_s: float = DEFAULT_INTERVAL_S
) -> MultiprocessExporter | None:
    """Start this process's exporter once, if multiprocess mode is on and the client installed.

    Returns the exporter, or None when there is nothing to export to.
    """
    global _started
    if multiprocess_dir() is None:
        return None
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return None
    with _started_lock:
        if _started is None:
            _started = MultiprocessExporter(metrics)
            _started.start(interval_s)
        return _started
