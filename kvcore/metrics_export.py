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
import threading
from collections.abc import Mapping
from typing import Any

from kvcore.metrics import METRICS, Metrics

MULTIPROC_ENV = ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")
DEFAULT_INTERVAL_S = 5.0

logger = logging.getLogger("kvcore.metrics")


def multiprocess_dir(environ: Mapping[str, str] = os.environ) -> str | None:
    """The directory prometheus_client's multiprocess mode writes to, if it is on."""
    for name in MULTIPROC_ENV:
        if environ.get(name):
            return environ[name]
    return None


class MultiprocessExporter:
    """Mirrors one :class:`Metrics` into prometheus_client metrics of this process."""

    def __init__(self, metrics: Metrics = METRICS, registry: Any = None) -> None:
        from prometheus_client import Counter, Gauge

        kwargs = {} if registry is None else {"registry": registry}
        labels = ["direction", "path"]
        self._metrics = metrics
        self._bytes = Counter(
            "kvcore_transfer_bytes", "Bytes moved by kvcore transfers", labels, **kwargs
        )
        self._count = Counter("kvcore_transfers", "Transfers executed", labels, **kwargs)
        self._fallbacks = Counter(
            "kvcore_fallbacks", "Transfers handed to the engine's stock path", ["reason"], **kwargs
        )
        self._decisions = Counter(
            "kvcore_decisions",
            "Requests kvcore served or passed to the engine's stock copy, by reason",
            ["decision", "reason"],
            **kwargs,
        )
        self._pinned = Gauge(
            "kvcore_pinned_bytes_in_use",
            "Pinned host bytes leased",
            multiprocess_mode="livesum",
            **kwargs,
        )
        self._one_run = Gauge(
            "kvcore_allocator_one_run_fraction",
            "Share of host-slot allocations served by one contiguous run, per process",
            multiprocess_mode="liveall",
            **kwargs,
        )
        self._exported: dict[tuple[str, ...], float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def export_once(self) -> None:
        """Add what was counted since the last export; set the gauges."""
        snapshot = self._metrics.snapshot()
        with self._lock:
            for transfer in snapshot["transfers"]:
                labels = (transfer["direction"], transfer["path"])
                self._add(self._bytes, ("bytes", *labels), transfer["bytes"], labels)
                self._add(self._count, ("count", *labels), transfer["count"], labels)
            for reason, count in snapshot["fallbacks"].items():
                self._add(self._fallbacks, ("fallback", reason), count, (reason,))
            for entry in snapshot["decisions"]:
                labels = (entry["decision"], entry["reason"])
                self._add(self._decisions, ("decision", *labels), entry["count"], labels)
            self._pinned.set(snapshot["pinned"]["in_use_bytes"])
            self._one_run.set(snapshot["allocator"]["one_run_fraction"])

    def _add(self, counter: Any, key: tuple[str, ...], total: float, labels: tuple) -> None:
        delta = total - self._exported.get(key, 0)
        # A reset of the Metrics (tests do it) starts the count again from zero.
        if delta < 0:
            delta = total
        if delta:
            counter.labels(*labels).inc(delta)
        self._exported[key] = total

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
