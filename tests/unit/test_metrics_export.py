"""kvcore's counters through prometheus_client's multiprocess mode, as SGLang scrapes them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
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
    METRICS.record_transfer("h2d", "gather", 1000 * scale, 1e-4)
    METRICS.record_fallback("strided_rows")
    exporter = start_multiprocess_export(interval_s=3600)
    assert exporter is not None
    assert start_multiprocess_export() is exporter
    exporter.export_once()
    METRICS.record_transfer("h2d", "gather", 24 * scale, 1e-4)
    METRICS.record_transfer("d2h", "staged", 7, 1e-4)
    METRICS.set_pinned(100 * scale, 1000)
    exporter.stop()
    """
)


def _scrape(directory: Path) -> dict[str, float]:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    values = {}
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("kvcore_"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_two_processes_sum_on_the_scraping_side(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    for scale in (1, 2):
        subprocess.run([sys.executable, "-c", _WORKER, str(scale)], env=env, check=True)
    values = _scrape(tmp_path)
    # Worker processes have exited: live gauges are gone, counters stay.
    assert values['kvcore_transfer_bytes_total{direction="h2d",path="gather"}'] == 3072
    assert values['kvcore_transfers_total{direction="h2d",path="gather"}'] == 4
    assert values['kvcore_transfer_bytes_total{direction="d2h",path="staged"}'] == 14
    assert values['kvcore_fallbacks_total{reason="strided_rows"}'] == 2


def test_exporter_adds_only_what_is_new_and_survives_a_reset() -> None:
    from prometheus_client import CollectorRegistry

    from kvcore.metrics_export import MultiprocessExporter

    registry = CollectorRegistry()
    metrics = Metrics()
    exporter = MultiprocessExporter(metrics, registry=registry)
    metrics.record_transfer("h2d", "single_copy", 10, 1e-5)
    exporter.export_once()
    exporter.export_once()
    labels = {"direction": "h2d", "path": "single_copy"}
    assert registry.get_sample_value("kvcore_transfer_bytes_total", labels) == 10
    metrics.reset()
    metrics.record_transfer("h2d", "single_copy", 3, 1e-5)
    exporter.export_once()
    assert registry.get_sample_value("kvcore_transfer_bytes_total", labels) == 13
    metrics.set_pinned(5, 10)
    exporter.export_once()
    assert registry.get_sample_value("kvcore_pinned_bytes_in_use") == 5


def test_nothing_starts_without_multiprocess_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir"):
        monkeypatch.delenv(name, raising=False)
    assert multiprocess_dir() is None
    assert start_multiprocess_export() is None
    assert multiprocess_dir({"prometheus_multiproc_dir": "/x"}) == "/x"
