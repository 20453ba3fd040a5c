"""Stock's server processes paired with each other mode's, for the live trace's summary
(``scripts/live_trace.py combine``): what kvcore does to hit TTFT, told apart from the
engine's drift between processes. The pairing itself (:func:`stock_pairs`) is also what
live_trace_concurrency pairs the concurrent passes by. Another mode may stand where stock
does (``baseline``, e.g. ``kvcore-transfers`` to judge a setting on top of it): the fields
named ``stock_*`` then hold that mode's processes.
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


Run = tuple[str, dict[str, Any]]
"""One server process: its label in the summary and its report."""


def labelled(reports: Sequence[dict[str, Any]]) -> list[Run]:
    """Each report with its label (:func:`unique_labels`)."""
    return list(zip(unique_labels(reports), reports, strict=True))


def stock_pairs(
    runs: Sequence[Run], baseline: str = BASELINE_MODE
) -> dict[str, list[tuple[Run, Run]]]:
    """Per mode other than stock that ran in two or more processes, as stock did, and made
    two or more pairs: stock's processes paired with the mode's. Pairs never cross
    machines (a report's ``machine``: machines differ in speed more than kvcore moves a
    hit): on each machine the n-th stock process goes with the n-th of the mode's, in the
    order given, the fewer side's processes taken again in turn where the two counts
    differ. One process a mode cannot tell kvcore from the engine's drift between
    processes, which has moved hit TTFT as much as kvcore does (docs/lab/benchmarks.md,
    sessions 25 and 26). ``baseline`` names the mode standing where stock does."""
    machines: dict[Any, dict[str, list[Run]]] = {}
    for label, report in runs:
        by_mode = machines.setdefault(report.get("machine"), {})
        by_mode.setdefault(report["mode"], []).append((label, report))
    modes = dict.fromkeys(m for by_mode in machines.values() for m in by_mode)
    pairs_of = {}
    for mode in modes:
        if mode == baseline:
            continue
        paired: list[tuple[Run, Run]] = []
        for by_mode in machines.values():
            stock_runs, mode_runs = by_mode.get(baseline, []), by_mode.get(mode, [])
            if stock_runs and mode_runs:
                count = max(len(stock_runs), len(mode_runs))
                paired += [
                    (stock_runs[i % len(stock_runs)], mode_runs[i % len(mode_runs)])
                    for i in range(count)
                ]
        runs_of = [
            sum(len(by_mode.get(name, [])) for by_mode in machines.values())
            for name in (baseline, mode)
        ]
        if min(runs_of) >= 2 and len(paired) >= 2:
            pairs_of[mode] = paired
    return pairs_of


def paired_processes(
    reports: Sequence[dict[str, Any]], baseline: str = BASELINE_MODE
) -> dict[str, list[dict[str, Any]]]:
    """Per mode paired with stock (:func:`stock_pairs`): per first-turn size, each pair's
    hit TTFT medians, stock's process against the mode's, with stock's own spread across
    its processes. The pairs' speed is kvcore's paired_speed (the median of the pairs'
    ratios and its bootstrap interval), imported here so that ``run`` stays on the
    standard library, and only where there are pairs."""
    compared = {}
    for mode, paired in stock_pairs(labelled(reports), baseline).items():
        from benchmarks.paired_speed import paired_speed

        stock = [_hits(report) for (_, report), _ in paired]
        processes = [_hits(report) for _, (_, report) in paired]
        pairs = len(paired)
        labels = [[stock_label, mode_label] for (stock_label, _), (mode_label, _) in paired]
        rows = []
        for size in sizes([r for hits in stock + processes for r in hits]):
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


def _hits(report: dict[str, Any]) -> list[Result]:
    """The report's sequential requests that were CPU-tier hits."""
    requests = [Result(**r) for r in report["sequential_requests"]]
    return [r for r in requests if r.cpu_tier_hit]
