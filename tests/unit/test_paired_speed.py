"""benchmarks.paired_speed and the sweep summary's resolvably-slower count."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.paired_speed import paired_speed
from benchmarks.sweep_report import SweepRow, report, summary


def test_a_constant_speed_has_a_point_interval() -> None:
    got = paired_speed([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])
    assert got is not None
    assert (got.median, got.low, got.high, got.pairs) == (2.0, 2.0, 2.0, 3)


def test_pairs_see_through_a_drift_that_the_medians_ratio_does_not() -> None:
    """Both sides equal within each repeat, the machine twice as slow for kvcore's half of
    the repeats in the middle: the medians' ratio reads a slowdown, the pairs read none."""
    rng = np.random.default_rng(3)
    base = rng.uniform(0.9, 1.1, size=41)
    slow = np.r_[np.ones(10), np.full(21, 2.0), np.ones(10)]
    stock = base * np.where(np.arange(41) % 2 == 0, 1.0, slow)
    kvcore = stock * rng.uniform(0.995, 1.005, size=41)
    assert np.median(stock) / np.median(kvcore) == pytest.approx(1.0, abs=0.01)
    got = paired_speed(stock.tolist(), kvcore.tolist())
    assert got is not None
    assert got.low <= got.median <= got.high
    assert got.low > 0.99 and got.high < 1.01


def test_a_real_slowdown_is_resolved() -> None:
    rng = np.random.default_rng(5)
    stock = rng.uniform(1.0, 1.2, size=41)
    got = paired_speed(stock.tolist(), (stock * rng.uniform(1.2, 1.3, size=41)).tolist())
    assert got is not None and got.high < 0.85


def test_too_few_or_unusable_times_give_none_and_misaligned_ones_raise() -> None:
    assert paired_speed([1.0], [1.0]) is None
    assert paired_speed([1.0, 0.0], [1.0, 1.0]) is None
    with pytest.raises(ValueError, match="2 stock times against 3"):
        paired_speed([1.0, 1.0], [1.0, 1.0, 1.0])


def _row(stock_ms: float, kvcore_ms: float, stock: list[float], kvcore: list[float]) -> SweepRow:
    return SweepRow(
        engine="vllm",
        case=f"case-{stock_ms}-{kvcore_ms}",
        tokens=16,
        layers=32,
        nbytes=1,
        stock_ms=stock_ms,
        kvcore_ms=kvcore_ms,
        stock_host_ms=0.1,
        kvcore_host_ms=0.1,
        identical=True,
        calls=1,
        kvcore_served=0,
        paired=paired_speed(stock, kvcore),
    )


def test_the_summary_counts_the_cells_under_the_line_and_those_resolvably_under() -> None:
    noisy = _row(0.8, 1.0, [1.0, 0.5, 1.0, 0.5], [0.5, 1.0, 1.0, 0.5])
    slow = _row(0.8, 1.0, [0.8, 0.8, 0.8], [1.0, 1.0, 1.0])
    fine = _row(1.0, 1.0, [1.0, 1.0], [1.0, 1.0])
    assert not noisy.resolvably_slower and slow.resolvably_slower
    assert not fine.resolvably_slower
    line = summary([noisy, slow, fine])
    assert "2 under 0.97x, 1 of them resolvably" in line
    document = json.loads(json.dumps(report("cpu", [slow])))
    assert document["rows"][0]["paired"] == {"median": 0.8, "low": 0.8, "high": 0.8, "pairs": 3}
