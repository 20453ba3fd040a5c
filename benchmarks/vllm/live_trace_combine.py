"""One summary of several live-trace reports (``scripts/live_trace.py combine``), as
written to docs/bench/h200-live-*.json.

Each report's sequential summary is recomputed from its requests, not taken as stored, so
that every mode in one summary is counted by this checkout's definition of a hit, whatever
version wrote its report.
"""

from __future__ import annotations

from typing import Any

from benchmarks.vllm.live_trace_compare import compare_hits, in_process_ab
from benchmarks.vllm.live_trace_concurrency import paired_concurrency
from benchmarks.vllm.live_trace_pairs import BASELINE_MODE, paired_processes, unique_labels
from benchmarks.vllm.live_trace_result import Result
from benchmarks.vllm.live_trace_summary import summarize


def combine(
    reports: list[dict[str, Any]], device: str, version: str, baseline: str = BASELINE_MODE
) -> dict[str, Any]:
    """The summary across runs (keyed by label: a mode run again is ``<mode>-2``, ...);
    outputs and hit TTFT are compared with the first report's, and modes run in several
    processes with ``baseline``'s (stock's unless named) in pairs: hit TTFT
    (:func:`paired_processes`), and output tokens per second and TPOT per concurrency level
    (:func:`paired_concurrency`)."""
    reference = [r["output"] for r in reports[0]["sequential_requests"]]
    reference_requests = [Result(**r) for r in reports[0]["sequential_requests"]]
    modes: dict[str, dict[str, Any]] = {}
    for report, label in zip(reports, unique_labels(reports), strict=True):
        outputs = [r["output"] for r in report["sequential_requests"]]
        requests = [Result(**r) for r in report["sequential_requests"]]
        sequential = summarize(requests, report["sequential"].get("wall_s"))
        concurrent = report.get("concurrent", {})
        modes[label] = {
            "ttft_ms_p50": sequential["ttft_ms_p50"],
            "ttft_ms_p99": sequential["ttft_ms_p99"],
            "tokens_per_s": concurrent.get("tokens_per_s", sequential.get("tokens_per_s")),
            "outputs_identical": outputs == reference,
            "sequential": sequential,
            "concurrent": concurrent,
            "concurrent_levels": report.get("concurrent_levels", []),
            "startup_s": report.get("startup_s"),
            "cpu_tier_gib": report.get("cpu_tier_gib"),
            "hit_ttft_against_first_mode": compare_hits(requests, reference_requests),
            "kvcore_counters": {
                k: v for k, v in report["metrics_end"].items() if k.startswith("kvcore_")
            },
        }
        if any(r.copies for r in requests):
            modes[label]["in_process_ab"] = in_process_ab(requests)
    summary = {
        "device": device,
        "engine": "vllm",
        "version": version,
        "baseline": baseline,
        "modes": modes,
    }
    paired = paired_processes(reports, baseline)
    if paired:
        summary["paired_processes"] = paired
    by_level = paired_concurrency(reports, baseline)
    if by_level:
        summary["paired_concurrency"] = by_level
    return summary
