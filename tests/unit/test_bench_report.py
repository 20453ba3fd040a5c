"""The bench summary's figures, on a hand-made report whose answers are known."""

from __future__ import annotations

from typing import Any

import pytest

from kvcore.bench import report as bench_report


def row(scenario: str, path: str, kind: str, gbps: float, ceiling: float) -> dict[str, Any]:
    return {
        "scenario": scenario,
        "path": path,
        "kind": kind,
        "gbps": gbps,
        "bytes": 1 << 20,
        "identical": True,
        "share_of_ceiling": gbps / ceiling if ceiling else 0.0,
        "submit_us": 1.0,
    }


def layout(scenario: str, ceiling: list[float], auto: tuple[str, float], stock: float) -> list:
    median = sorted(ceiling)[len(ceiling) // 2]
    top = row(scenario, "ceiling:contiguous_copy", "ceiling", median, median)
    top["repeats_gbps"] = ceiling
    return [
        top,
        row(scenario, f"kvcore:{auto[0]} (auto)", "kvcore", auto[1], median),
        row(scenario, "kvcore:gather", "kvcore", 1.0, median),
        row(scenario, "stock:advanced_indexing", "stock", stock, median),
    ]


@pytest.fixture
def report() -> dict[str, Any]:
    results = [
        *layout(
            "mla-1152B/h2d/host-0%/device-contiguous", [9.0, 10.0, 11.0], ("single_copy", 9.0), 3.0
        ),
        *layout(
            "mla-1152B/h2d/host-50%/device-contiguous", [8.0, 10.0, 12.0], ("gather", 12.0), 2.0
        ),
        *layout(
            "mla-1152B/h2d/host-100%/device-contiguous", [7.0, 10.0, 10.0], ("gather", 5.0), 5.0
        ),
        *layout("mla-1152B/d2h/host-0%/device-contiguous", [4.0, 4.0, 4.0], ("staged", 4.0), 1.0),
        row("mla-1152B/strided-host-view (strided_rows)", "kvcore:fallback", "kvcore", 1.0, 0.0),
        # Both directions at once on a duplex link: 1.7x one way's ceiling, not noise.
        row("mha-4KiB/h2d+d2h/one-run/both-directions-at-once", "kvcore:x2", "kvcore", 17, 10),
    ]
    return {"device": "NVIDIA H200", "results": results}


def test_summary_counts_paths_and_spreads_over_layouts(report: dict[str, Any]) -> None:
    h2d, d2h = bench_report.summarize(report)
    assert (h2d["row_kind"], h2d["direction"], h2d["scenarios"]) == ("mla-1152B", "h2d", 3)
    assert h2d["auto_paths"] == {"gather": 2, "single_copy": 1}
    # Every repeat of every layout's ceiling, not their medians only.
    assert h2d["ceiling_gbps"] == {"min": 7.0, "median": 10.0, "max": 12.0}
    assert h2d["kvcore_share_of_ceiling"] == {"min": 0.5, "median": 0.9, "max": 1.2}
    assert h2d["kvcore_over_best_stock"] == {"min": 1.0, "median": 3.0, "max": 6.0}
    assert h2d["noise_rows"] == 1
    assert d2h["auto_paths"] == {"staged": 1} and d2h["noise_rows"] == 0


def test_noise_on_a_gpu_is_the_rows_over_the_ceiling_only(report: dict[str, Any]) -> None:
    assert bench_report.noise(report) == {
        "noisy": True,
        "reasons": ["1 row over 105% of the ceiling"],
        "rows_over_ceiling": 1,
    }
    quiet = {**report, "results": [r for r in report["results"] if "host-50%" not in r["scenario"]]}
    assert bench_report.noise(quiet)["noisy"] is False
    assert bench_report.format_noise(quiet) == []


def test_printed_summary_marks_a_share_over_the_ceiling(report: dict[str, Any]) -> None:
    lines = bench_report.format_summary(report)
    h2d = next(line for line in lines if line.startswith("mla-1152B  h2d"))
    assert "gather x2, single_copy x1" in h2d
    assert "7.0 / 10.0 / 12.0" in h2d
    assert "90% (50%-120%~)" in h2d
    assert "3.0x (1.0-6.0x)" in h2d
    full = bench_report.format_full_table(report)
    marked = [line for line in full if "~" in line]
    assert len(marked) == 1 and "host-50%" in marked[0] and "(auto)" in marked[0]
