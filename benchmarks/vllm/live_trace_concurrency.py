"""The concurrent passes of stock's server processes paired with each other mode's, per
concurrency level, for the live trace's summary (``scripts/live_trace.py combine``): what
kvcore does to output tokens per second and to the running requests' time per output token
while many requests share the engine, told apart from the engine's drift between processes
as hit TTFT is (live_trace_pairs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.vllm.live_trace_pairs import BASELINE_MODE, labelled, stock_pairs


def paired_concurrency(
    reports: Sequence[dict[str, Any]], baseline: str = BASELINE_MODE
) -> dict[str, list[dict[str, Any]]]:
    """Per mode paired with stock (:func:`stock_pairs`, among the reports that ran passes
    by level: an older report's one concurrent pass names no level, so it is left out) and
    per concurrency level that both processes of two or more pairs ran: each pair's output
    tokens per second and median time per output token (TPOT), and the pairs' speed in
    each by kvcore's paired_speed (the median of the pairs' ratios and its bootstrap
    interval). ``throughput`` is over 1 where the mode made more output tokens a second
    than stock's process beside it, ``tpot_speed`` where its running requests were
    faster. A mode with no level to compare has no entry. ``baseline`` stands where stock
    does (:func:`~benchmarks.vllm.live_trace_pairs.stock_pairs`)."""
    runs = [
        (label, report) for label, report in labelled(reports) if report.get("concurrent_levels")
    ]
    compared = {}
    for mode, paired in stock_pairs(runs, baseline).items():
        sides = [
            ([stock_label, mode_label], _by_level(stock), _by_level(other))
            for (stock_label, stock), (mode_label, other) in paired
        ]
        rows = []
        for level in sorted({level for _, stock, _ in sides for level in stock}):
            at = [
                (labels, stock[level], other[level])
                for labels, stock, other in sides
                if level in stock and level in other
            ]
            if len(at) < 2:
                continue
            stock_tps = [s.get("output_tokens_per_s") for _, s, _ in at]
            tps = [o.get("output_tokens_per_s") for _, _, o in at]
            stock_tpot = [s.get("tpot_ms_p50") for _, s, _ in at]
            tpot = [o.get("tpot_ms_p50") for _, _, o in at]
            # A rate's inverse is a time: stock's over the mode's is then the mode's rate
            # over stock's.
            throughput = _speed(_times(stock_tps, rate=True), _times(tps, rate=True), level)
            tpot_speed = _speed(_times(stock_tpot), _times(tpot), level)
            rows.append(
                {
                    "concurrency": level,
                    "processes": len(at),
                    "pairs": [labels for labels, _, _ in at],
                    "stock_output_tokens_per_s": stock_tps,
                    "output_tokens_per_s": tps,
                    "throughput": throughput[0],
                    "throughput_interval": throughput[1],
                    "stock_tpot_ms_p50": stock_tpot,
                    "tpot_ms_p50": tpot,
                    "tpot_speed": tpot_speed[0],
                    "tpot_speed_interval": tpot_speed[1],
                }
            )
        if rows:
            compared[mode] = rows
    return compared


def _by_level(report: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """A report's concurrent passes by their level."""
    return {entry["concurrency"]: entry for entry in report["concurrent_levels"]}


def _times(values: Sequence[float | None], *, rate: bool = False) -> list[float] | None:
    """The pairs' values as times for paired_speed (a rate as its inverse); None where one
    is missing (no request of the pass had two output tokens) or not positive, as no
    pair's ratio could then be taken."""
    known = [v for v in values if v is not None and v > 0]
    if len(known) < len(values):
        return None
    return [1 / v for v in known] if rate else known


def _speed(
    stock_s: list[float] | None, other_s: list[float] | None, seed: int
) -> tuple[float | None, list[float] | None]:
    """paired_speed's median and 95% interval, rounded, imported here so that ``run``
    stays on the standard library; (None, None) where there is none."""
    if stock_s is None or other_s is None:
        return None, None
    from benchmarks.paired_speed import paired_speed

    speed = paired_speed(stock_s, other_s, seed=seed)
    if speed is None:
        return None, None
    return round(speed.median, 3), [round(speed.low, 3), round(speed.high, 3)]
