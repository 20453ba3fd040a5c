"""kvcore's counters through prometheus_client's multiprocess mode, as SGLang scrapes them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

from kvcore.metrics import Metrics
from kvcore.metrics_export import multiprocess_dir, start_multiprocess_export

prometheus_client = pytest.importorskip("prometheus_client")

REPO_ROOT = Path(__file__).resolve().parents[2]

# A scheduler-like process: records transfers, exports, records more, exports on stop.
_WORKER = textwrap.dedent(
    """
    import sys
    from kvcore.metrics import METRICS
    from kvcore.metrics_export import start_multiprocess_export

    scale = int(sys.argv[1])
    METRICS.record_transfer("h2d", "gather", 1000 * scale, 2e-5 * scale)
    METRICS.record_fallback("strided_rows")
    exporter = start_multiprocess_export(interval_s=3600)
    assert exporter is not None
    assert start_multiprocess_export() is exporter
    exporter.export_once()
    METRICS.record_transfer("h2d", "gather", 24 * scale, 2e-3)
    METRICS.record_transfer("d2h", "staged", 7, 1e-4)
    exporter.stop()
    """
)


def _scrape(directory: Path) -> dict[str, float]:
    """GET /metrics from an HTTP endpoint that serves ``directory`` as an engine's HTTP
    process does in multiprocess mode; the kvcore samples, by name and labels."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=30) as response:
            page = response.read().decode()
    finally:
        server.shutdown()
        thread.join()
    values = {}
    for line in page.splitlines():
        if line.startswith("kvcore_"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_two_ranks_are_scraped_apart_with_their_issue_time_histogram(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    for scale in (1, 2):
        # The second worker is rank 1 of its launcher's group, the first has no rank.
        rank = {"RANK": "1"} if scale == 2 else {}
        subprocess.run([sys.executable, "-c", _WORKER, str(scale)], env={**env, **rank}, check=True)
    values = _scrape(tmp_path)
    # Worker processes have exited: live gauges are gone, counters stay.
    gather = 'direction="h2d",path="gather",rank='
    assert values[f'kvcore_transfer_bytes_total{{{gather}""}}'] == 1024
    assert values[f'kvcore_transfer_bytes_total{{{gather}"1"}}'] == 2048
    assert values[f'kvcore_transfers_total{{{gather}"1"}}'] == 2
    assert values['kvcore_transfer_bytes_total{direction="d2h",path="staged",rank="1"}'] == 7
    assert values['kvcore_fallbacks_total{rank="",reason="strided_rows"}'] == 1

    # Rank 1 issued in 4e-5 s (under the 1e-4 bound) and 2e-3 s (under 3e-3); the sum is
    # exact, not re-estimated from the buckets.
    def bucket(bound: str) -> float:
        name = "kvcore_transfer_issue_seconds_bucket"
        return values[f'{name}{{direction="h2d",le="{bound}",path="gather",rank="1"}}']

    assert [bucket(b) for b in ("3e-05", "0.0001", "0.001", "0.003", "+Inf")] == [0, 1, 1, 2, 2]
    assert values[f'kvcore_transfer_issue_seconds_sum{{{gather}"1"}}'] == pytest.approx(2.04e-3)
    assert values[f'kvcore_transfer_issue_seconds_count{{{gather}"1"}}'] == 2


def test_exporter_adds_only_what_is_new_and_survives_a_reset() -> None:
    from prometheus_client import CollectorRegistry

    from kvcore.metrics_export import MultiprocessExporter

    registry = CollectorRegistry()
    metrics = Metrics()
    exporter = MultiprocessExporter(metrics, registry=registry, rank="3")
    metrics.record_transfer("h2d", "single_copy", 10, 1e-5)
    exporter.export_once()
    exporter.export_once()
    labels = {"rank": "3", "direction": "h2d", "path": "single_copy"}
    assert registry.get_sample_value("kvcore_transfer_bytes_total", labels) == 10
    assert registry.get_sample_value("kvcore_transfer_issue_seconds_count", labels) == 1
    metrics.reset()
    metrics.record_transfer("h2d", "single_copy", 3, 1e-5)
    exporter.export_once()
    assert registry.get_sample_value("kvcore_transfer_bytes_total", labels) == 13
    assert registry.get_sample_value("kvcore_transfer_issue_seconds_count", labels) == 2
    assert registry.get_sample_value("kvcore_transfer_issue_seconds_sum", labels) == 2e-5
    metrics.record_allocation(3)
    exporter.export_once()
    assert registry.get_sample_value("kvcore_allocator_one_run_fraction") == 0.0


def test_exporter_adds_what_a_tally_counts_once() -> None:
    from prometheus_client import CollectorRegistry

    from kvcore.metrics_export import MultiprocessExporter

    registry = CollectorRegistry()
    metrics = Metrics()
    exporter = MultiprocessExporter(metrics, registry=registry, rank="0")
    tally = metrics.fallback_tally()
    labels = {"rank": "0", "reason": "few_pages"}
    for exported in (3, 5):
        while tally["few_pages"] < exported:
            tally["few_pages"] += 1
        exporter.export_once()
        metrics.snapshot()
        exporter.export_once()
        assert registry.get_sample_value("kvcore_fallbacks_total", labels) == exported


def test_nothing_starts_without_multiprocess_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir"):
        monkeypatch.delenv(name, raising=False)
    assert multiprocess_dir() is None
    assert start_multiprocess_export() is None
    assert multiprocess_dir({"prometheus_multiproc_dir": "/x"}) == "/x"


def test_rank_comes_from_the_process_group_else_the_launcher(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvcore import metrics_export

    class Group:
        @staticmethod
        def is_available() -> bool:
            return True

        @staticmethod
        def is_initialized() -> bool:
            return True

        @staticmethod
        def get_rank() -> int:
            return 5

    monkeypatch.delitem(sys.modules, "torch.distributed", raising=False)
    assert metrics_export.process_rank({}) is None
    assert metrics_export.process_rank({"LOCAL_RANK": "2"}) == "2"
    assert metrics_export.process_rank({"RANK": "7", "LOCAL_RANK": "2"}) == "7"
    monkeypatch.setitem(sys.modules, "torch.distributed", Group)
    assert metrics_export.process_rank({"RANK": "7"}) == "5"
