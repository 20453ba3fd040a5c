"""Stock's server processes paired with each other mode's, for the live trace's summary
(``scripts/live_trace.py combine``): what kvcore does to hit TTFT, told apart from the
engine's drift between processes.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.vllm.live_trace_metrics import LOAD_TIME
from benchmarks.vllm.live_trace_result import Result, ms, sizes

BASELINE_MODE = "stock"


def unique_labels(reports: Sequence[dict[str, Any]]) -> list[str]:
    """Each report's label (its mode where it has none); a label seen again, as in the
    reports of several calls that each label their runs from the start, becomes
    ``LABEL#2``, ``LABEL#3``, ..."""
    labels: list[str] = []
    for report in reports:
        label = str(report.get("label") or report["mode"])
        if label in labels:
            seen = [known for known in labels if known.split("#")[0] == label]
            label = f"{label}#{len(seen) + 1}"
        labels.append(label)
    return labels


def paired_processes(reports: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per mode other than stock that ran in two or more processes, as stock did: per
    first-turn size, each pair's hit TTFT medians, stock's process against the mode's,
    with stock's own spread across its processes. Pairs never cross machines (a report's
    ``machine``: machines differ in speed more than kvcore moves a hit): on each machine
    the n-th stock process goes with the n-th of the mode's, in the order given, the
    fewer side's processes taken again in turn where the two counts differ. One process a
    mode cannot tell kvcore from the engine's drift between processes, which has moved
    hit TTFT as much as kvcore does (docs/lab/benchmarks.md, sessions 25 and 26). The pairs'
    speed is kvcore's paired_speed (the median of the pairs' ratios and its bootstrap
    interval), imported here so that ``run`` stays on the standard library, and only
    where there are pairs."""
    machines: dict[Any, dict[str, list[tuple[str, list[Result]]]]] = {}
    for report, label in zip(reports, unique_labels(reports), strict=True):
        requests = [Result(**r) for r in report["sequential_requests"]]
        hits = [r for r in requests if r.cpu_tier_hit]
        by_mode = machines.setdefault(report.get("machine"), {})
        by_mode.setdefault(report["mode"], []).append((label, hits))
    modes = dict.fromkeys(m for by_mode in machines.values() for m in by_mode)
    compared = {}
    for mode in modes:
        if mode == BASELINE_MODE:
            continue
        paired: list[tuple[tuple[str, list[Result]], tuple[str, list[Result]]]] = []
        for by_mode in machines.values():
            stock_runs, mode_runs = by_mode.get(BASELINE_MODE, []), by_mode.get(mode, [])
            if stock_runs and mode_runs:
                count = max(len(stock_runs), len(mode_runs))
                paired += [
                    (stock_runs[i % len(stock_runs)], mode_runs[i % len(mode_runs)])
                    for i in range(count)
                ]
        runs_of = [
            sum(len(by_mode.get(name, [])) for by_mode in machines.values())
            for name in (BASELINE_MODE, mode)
        ]
        if min(runs_of) < 2 or len(paired) < 2:
            continue
        from benchmarks.paired_speed import paired_speed

        stock = [hits for (_, hits), _ in paired]
        processes = [hits for _, (_, hits) in paired]
        pairs = len(paired)
        labels = [[stock_label, mode_label] for (stock_label, _), (mode_label, _) in paired]
        rows = []
        for size in sizes([r for pair in paired for _, hits in pair for r in hits]):
            medians = {}
            for side, group in (("stock", stock), ("other", processes)):
                per_process = [[r for r in hits if r.first_turn_tokens == size] for hits in group]
                if not all(per_process):
                    break
                medians[side] = [
                    (
                        statistics.median(r.ttft_s for r in hits),
                        statistics.median(r.counted.get(LOAD_TIME, 0.0) for r in hits),
                    )
                    for hits in per_process
                ]
            if len(medians) < 2:
                continue
            stock_ttft = [ttft for ttft, _ in medians["stock"]]
            other_ttft = [ttft for ttft, _ in medians["other"]]
            speed = paired_speed(stock_ttft, other_ttft, seed=size)
            rows.append(
                {
                    "first_turn_tokens": size,
                    "processes": pairs,
                    "pairs": labels,
                    "stock_ttft_ms_p50": [ms(t) for t in stock_ttft],
                    "ttft_ms_p50": [ms(t) for t in other_ttft],
                    "stock_reload_ms_p50": [ms(r) for _, r in medians["stock"]],
                    "reload_ms_p50": [ms(r) for _, r in medians["other"]],
                    "speed": None if speed is None else round(speed.median, 3),
                    "speed_interval": None
                    if speed is None
                    else [round(speed.low, 3), round(speed.high, 3)],
                    "stock_spread": round(max(stock_ttft) / min(stock_ttft), 3),
                }
            )
        compared[mode] = rows
    return compared
