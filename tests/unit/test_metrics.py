from __future__ import annotations

import threading
from collections import defaultdict

import pytest

from kvcore.metrics import Histogram, Metrics, register_prometheus


def test_histogram_buckets_are_cumulative_and_exact() -> None:
    hist = Histogram(buckets=(1.0, 2.0))
    for value in (0.5, 1.0, 1.5, 3.0, 7.0):
        hist.observe(value)
    assert hist.cumulative() == [(1.0, 2), (2.0, 3), (float("inf"), 5)]
    assert hist.total == pytest.approx(13.0)
    assert hist.observations == 5


def test_snapshot_counts_transfers_fallbacks_and_allocator() -> None:
    m = Metrics()
    m.record_transfer("h2d", "gather", 100, 0.001)
    m.record_transfer("h2d", "gather", 50, 0.002)
    m.record_transfer("d2h", "staged", 7, 0.5)
    m.record_fallback("strided_rows")
    m.record_fallback("strided_rows")
    for runs in (1, 1, 3):
        m.record_allocation(runs)
    snap = m.snapshot()
    assert set(snap) == {"resets", "transfers", "fallbacks", "decisions", "allocator"}
    # Buckets end at 1e-3 (the 5th), 3e-3 (the 6th) and 1.0 (the 11th), as Prometheus's do.
    buckets = {0.5: [0] * 10 + [1, 0, 0], 0.003: [0] * 4 + [1, 1] + [0] * 7}
    assert snap["transfers"] == [
        {
            "direction": "d2h",
            "path": "staged",
            "count": 1,
            "bytes": 7,
            "seconds": 0.5,
            "seconds_buckets": buckets[0.5],
        },
        {
            "direction": "h2d",
            "path": "gather",
            "count": 2,
            "bytes": 150,
            "seconds": 0.003,
            "seconds_buckets": buckets[0.003],
        },
    ]
    assert snap["fallbacks"] == {"strided_rows": 2}
    assert snap["allocator"]["one_run_fraction"] == pytest.approx(2 / 3)
    assert snap["allocator"]["runs_per_allocation"] == pytest.approx(5 / 3)
    m.reset()
    assert m.snapshot()["transfers"] == []
    assert m.snapshot()["allocator"]["one_run_fraction"] == 1.0


def test_recording_from_many_threads_loses_nothing() -> None:
    m = Metrics()

    def work() -> None:
        for _ in range(2000):
            m.record_transfer("h2d", "single_copy", 3, 1e-6)
            m.record_fallback("x")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (row,) = m.snapshot()["transfers"]
    assert row["count"] == 8000 and row["bytes"] == 24000
    assert m.snapshot()["fallbacks"] == {"x": 8000}


def test_prometheus_exposition_reads_the_store_at_scrape_time() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    m = Metrics()
    assert register_prometheus(registry, m)
    assert register_prometheus(registry, m)  # twice on one registry: no duplicate error
    m.record_transfer("h2d", "gather", 4096, 2e-4)
    m.record_fallback("dtype_mismatch")
    m.fallback_tally()["few_pages"] += 2
    m.record_allocation(1)
    text = prometheus_client.generate_latest(registry).decode()
    assert 'kvcore_transfer_bytes_total{direction="h2d",path="gather"} 4096.0' in text
    assert 'kvcore_transfers_total{direction="h2d",path="gather"} 1.0' in text
    bucket = 'kvcore_transfer_issue_seconds_bucket{direction="h2d",le="0.0003",path="gather"}'
    assert f"{bucket} 1.0" in text
    assert 'kvcore_fallbacks_total{reason="dtype_mismatch"} 1.0' in text
    assert 'kvcore_fallbacks_total{reason="few_pages"} 2.0' in text
    # A scrape and a snapshot take the tally in once between them.
    assert m.snapshot()["fallbacks"] == {"dtype_mismatch": 1, "few_pages": 2}
    assert "kvcore_pinned" not in text
    assert "kvcore_allocator_one_run_fraction 1.0" in text


def test_a_tally_reaches_the_fallbacks_once_however_often_they_are_read() -> None:
    m = Metrics()
    tally = m.fallback_tally()
    m.record_fallback("few_pages")
    tally["few_pages"] += 1
    tally["few_pages"] += 1
    tally["stock_store_large_pages"] += 1
    assert m.snapshot()["fallbacks"] == {"few_pages": 3, "stock_store_large_pages": 1}
    assert m.snapshot()["fallbacks"] == {"few_pages": 3, "stock_store_large_pages": 1}
    tally["few_pages"] += 1
    assert m.snapshot()["fallbacks"] == {"few_pages": 4, "stock_store_large_pages": 1}
    # A reset forgets what the tally counted before it, not the tally.
    tally["few_pages"] += 1
    m.reset()
    assert m.snapshot()["fallbacks"] == {}
    tally["few_pages"] += 1
    assert m.snapshot()["fallbacks"] == {"few_pages": 1}


def test_a_released_tally_keeps_its_counts_and_is_kept_no_longer() -> None:
    m = Metrics()
    first, second = m.fallback_tally(), m.fallback_tally()
    first["few_pages"] += 2
    assert m.snapshot()["fallbacks"] == {"few_pages": 2}
    first["few_pages"] += 3  # counted after the last read, before the release
    second["stock_dma_large_pages"] += 1
    m.release_tally(first)
    assert [counts for counts, _ in m._tallies] == [second]
    assert m.snapshot()["fallbacks"] == {"few_pages": 5, "stock_dma_large_pages": 1}
    first["few_pages"] += 7  # a released tally counts for nothing
    m.release_tally(first)
    m.release_tally(defaultdict(int))
    assert m.snapshot()["fallbacks"] == {"few_pages": 5, "stock_dma_large_pages": 1}


def test_a_pass_tally_counts_each_request_as_a_pass_decision_and_a_fallback() -> None:
    m = Metrics()
    passes, fallbacks = m.pass_tally(), m.fallback_tally()
    m.record_pass("small_request")
    passes["small_request"] += 2
    passes["stock_kernel_near_link"] += 1
    fallbacks["few_pages"] += 1  # a plain tally: a fallback, no decision
    for _ in range(2):  # read twice: taken in once
        snapshot = m.snapshot()
        assert snapshot["fallbacks"] == {
            "few_pages": 1,
            "small_request": 3,
            "stock_kernel_near_link": 1,
        }
        decisions = {(d["decision"], d["reason"]): d["count"] for d in snapshot["decisions"]}
        assert decisions == {("pass", "small_request"): 3, ("pass", "stock_kernel_near_link"): 1}
    passes["small_request"] += 4  # counted before the release, taken in by it
    m.release_tally(passes)
    passes["small_request"] += 9  # released: counts for nothing
    decisions = {(d["decision"], d["reason"]): d["count"] for d in m.snapshot()["decisions"]}
    assert decisions[("pass", "small_request")] == 7
    assert m._pass_tallies == set()


def test_tallies_counting_while_others_read_lose_and_double_nothing() -> None:
    m = Metrics()
    reads: list[int] = []
    done = threading.Event()

    def count() -> None:
        tally = m.fallback_tally()
        for n in range(20000):
            tally["few_pages" if n % 3 else f"reason_{n % 7}"] += 1

    def read() -> None:
        while not done.is_set():
            reads.append(sum(m.snapshot()["fallbacks"].values()))

    readers = [threading.Thread(target=read) for _ in range(2)]
    counters = [threading.Thread(target=count) for _ in range(2)]
    for t in readers + counters:
        t.start()
    for t in counters:
        t.join()
    done.set()
    for t in readers:
        t.join()
    fallbacks = m.snapshot()["fallbacks"]
    assert sum(fallbacks.values()) == 40000
    assert fallbacks["few_pages"] == 2 * sum(1 for n in range(20000) if n % 3)
    assert all(n <= 40000 for n in reads)
