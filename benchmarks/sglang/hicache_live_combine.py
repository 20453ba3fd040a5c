"""One summary of the live HiCache run's modes (:mod:`benchmarks.sglang.hicache_live`).

    python -m benchmarks.sglang.hicache_live_combine STOCK.json KVCORE.json [MORE.json ...] \
        --out SUMMARY.json

Per run (its ``label``, else its mode): the load-back times (median, p99), the mismatched
bytes and failed checks, what the cache did, and kvcore's counters. Then, per first-turn
size bucket, kvcore's median load-back time over stock's, taken over the requests that
loaded back in both modes (same trace, same seed: the same requests hit the host tier in
both, which ``same_hits`` checks), with both runs' issue times; the same for every other
run against stock's (``against_stock``: a second stock run there shows how far the machine
drifts between runs). Where stock and kvcore each ran more than once (``MODES="stock kvcore
stock kvcore ..."``), ``paired_processes`` pairs the n-th stock process with the n-th
kvcore one and gives, per size, each process's median and kvcore's speed over stock's as
the median of the pairs' ratios with a bootstrap interval: a host-bound load-back's
median moves between processes of one mode as much as between modes.
A report that is missing (its mode did not finish) is named in ``missing``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.paired_speed import paired_speed

BASELINE, CANDIDATE = "stock", "kvcore"


def mode_summary(report: dict[str, Any]) -> dict[str, Any]:
    summary = report["summary"]
    patched = (report.get("prepared") or {}).get("plugins", {}).get("patched_targets", [])
    return {
        "loadback_ms_p50": summary["loadback_ms_p50"],
        "loadback_ms_p99": summary["loadback_ms_p99"],
        "issue_ms_p50": summary.get("issue_ms_p50"),
        "start_loading_ms_p50": summary.get("start_loading_ms_p50"),
        "loadbacks": summary["loadbacks"],
        "loaded_tokens": summary["loaded_tokens"],
        "mismatches": summary["mismatched_bytes"],
        "settled_mismatches": summary.get("settled_mismatched_bytes", 0),
        "checks_failed": summary["checks_failed"],
        "requests": summary["requests"],
        "cut_short": summary.get("cut_short", False),
        "evictions": summary["evictions"],
        "write_throughs": summary["write_throughs"],
        "loadback_copies": summary.get("loadback_copies"),
        "in_process_ab": summary.get("in_process_ab"),
        "patched_targets": len(patched),
        "counters": report.get("kvcore_counters"),
        "process_state": report.get("process_state"),
    }


def _loads(report: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """The report's load-backs by request index."""
    return {r["index"]: r for r in report["requests"] if r.get("loadback_ms") is not None}


def _median(values: Sequence[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def by_size(
    baseline: dict[str, Any], candidate: dict[str, Any], name: str = CANDIDATE
) -> list[dict[str, Any]]:
    """Per first-turn size: both runs' median load-back and issue times (the host time of
    ``load_back`` and ``ready_to_load_host_cache``) over the requests loaded in both; the
    candidate's keys carry ``name``."""
    base, cand = _loads(baseline), _loads(candidate)
    paired = sorted(set(base) & set(cand))
    rows = []
    for size in sorted({base[i]["first_turn_tokens"] for i in paired}):
        group = [i for i in paired if base[i]["first_turn_tokens"] == size]
        base_ms = _median([base[i]["loadback_ms"] for i in group])
        cand_ms = _median([cand[i]["loadback_ms"] for i in group])
        issue = {
            f"{run}_issue_ms_p50": _median(
                [loads[i]["issue_ms"] for i in group if loads[i].get("issue_ms") is not None]
            )
            for run, loads in ((BASELINE, base), (name, cand))
        }
        rows.append(
            {
                "first_turn_tokens": size,
                "loadbacks": len(group),
                "loaded_tokens_p50": statistics.median(base[i]["loaded_tokens"] for i in group),
                f"{BASELINE}_ms_p50": base_ms,
                f"{name}_ms_p50": cand_ms,
                "ratio": round(cand_ms / base_ms, 3) if base_ms and cand_ms is not None else None,
                **issue,
            }
        )
    return rows


def _group_median(loads: dict[int, dict[str, Any]], group: Sequence[int]) -> float:
    return round(statistics.median(loads[i]["loadback_ms"] for i in group), 3)


def paired_processes(reports: Sequence[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """Per first-turn size, the n-th stock process against the n-th kvcore one (runs in
    the order given), over the requests every one of them loaded back; None where either
    mode ran fewer than twice."""
    stock = [_loads(r) for r in reports if r["mode"] == BASELINE]
    kvcore = [_loads(r) for r in reports if r["mode"] == CANDIDATE]
    pairs = min(len(stock), len(kvcore))
    if pairs < 2:
        return None
    stock, kvcore = stock[:pairs], kvcore[:pairs]
    common = set.intersection(*(set(loads) for loads in (*stock, *kvcore)))
    rows = []
    for size in sorted({stock[0][i]["first_turn_tokens"] for i in common}):
        group = [i for i in common if stock[0][i]["first_turn_tokens"] == size]
        stock_ms = [_group_median(loads, group) for loads in stock]
        kvcore_ms = [_group_median(loads, group) for loads in kvcore]
        speed = paired_speed(stock_ms, kvcore_ms)
        rows.append(
            {
                "first_turn_tokens": size,
                "loadbacks": len(group),
                "processes": pairs,
                "stock_ms_p50": stock_ms,
                "kvcore_ms_p50": kvcore_ms,
                "speed": None if speed is None else round(speed.median, 3),
                "speed_low": None if speed is None else round(speed.low, 3),
                "speed_high": None if speed is None else round(speed.high, 3),
                "stock_spread": round(max(stock_ms) / min(stock_ms), 3) if all(stock_ms) else None,
            }
        )
    return rows


def _label(report: dict[str, Any]) -> str:
    return str(report.get("label") or report["mode"])


def same_hits(reports: Sequence[dict[str, Any]]) -> bool:
    """Whether every mode's requests (as far as each ran) hit and loaded the same tokens."""

    def hits(report: dict[str, Any]) -> dict[int, tuple[int, int, int]]:
        return {
            r["index"]: (r["device_hit_tokens"], r["host_hit_tokens"], r["loaded_tokens"])
            for r in report["requests"]
            if r.get("error") is None
        }

    first = hits(reports[0])
    for report in reports[1:]:
        other = hits(report)
        if any(first[i] != other[i] for i in set(first) & set(other)):
            return False
    return True


def combine(reports: Sequence[dict[str, Any]], missing: Sequence[str] = ()) -> dict[str, Any]:
    if not reports:
        return {"engine": "sglang", "modes": {}, "missing": list(missing)}
    first = reports[0]
    by_mode = {_label(report): report for report in reports}
    summary: dict[str, Any] = {
        "device": first["device"],
        "engine": "sglang",
        "version": first["version"],
        "layout": first["layout"],
        "io_backend": first["io_backend"],
        "geometry": first["geometry"],
        "trace": first["trace"],
        "modes": {mode: mode_summary(report) for mode, report in by_mode.items()},
        "same_hits": same_hits(reports),
        "all_checks_passed": all(
            r["summary"]["checks_failed"] == 0 and r["summary"]["mismatched_bytes"] == 0
            for r in reports
        ),
        "missing": list(missing),
    }
    if BASELINE in by_mode and CANDIDATE in by_mode:
        summary["by_size"] = by_size(by_mode[BASELINE], by_mode[CANDIDATE])
    if BASELINE in by_mode:
        summary["against_stock"] = {
            label: by_size(by_mode[BASELINE], report, label)
            for label, report in by_mode.items()
            if label not in (BASELINE, CANDIDATE)
        }
    paired = paired_processes(reports)
    if paired is not None:
        summary["paired_processes"] = paired
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("reports", type=Path, nargs="+", help="each mode's --json report")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    present = [path for path in args.reports if path.is_file()]
    missing = [str(path) for path in args.reports if not path.is_file()]
    reports = [json.loads(path.read_text(encoding="utf-8")) for path in present]
    summary = combine(reports, missing)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    for mode, row in summary["modes"].items():
        print(
            f"{mode}: p50 {row['loadback_ms_p50']} ms, p99 {row['loadback_ms_p99']} ms, "
            f"{row['loadbacks']} load-backs, mismatched bytes {row['mismatches']}"
        )
        state = (row.get("process_state") or {}).get("before_trace")
        if state:
            print(
                f"  process: {state['python_call_us']} us per 1000 Python calls, tracer "
                f"{state['tracer']}, profiler {state['profiler']}, monitoring "
                f"{state['monitoring_tools']}, {len(state['threads'])} threads, "
                f"{state['gc_tracked_objects']} gc objects, default stream "
                f"{state['current_stream_is_default']}"
            )
    runs = {CANDIDATE: summary.get("by_size", []), **summary.get("against_stock", {})}
    for label, rows in runs.items():
        for row in rows:
            print(
                f"  {row['first_turn_tokens']:>6} tokens: {BASELINE} {row[f'{BASELINE}_ms_p50']} "
                f"ms, {label} {row[f'{label}_ms_p50']} ms, ratio {row['ratio']}; issue "
                f"{row[f'{BASELINE}_issue_ms_p50']} / {row[f'{label}_issue_ms_p50']} ms"
            )
    for row in summary.get("paired_processes", []):
        print(
            f"  {row['first_turn_tokens']:>6} tokens, {row['processes']} process pairs: "
            f"speed {row['speed']} ({row['speed_low']}-{row['speed_high']}), stock's own "
            f"spread {row['stock_spread']}x; stock {row['stock_ms_p50']} ms, kvcore "
            f"{row['kvcore_ms_p50']} ms"
        )
    return 0 if summary.get("all_checks_passed") and not missing else 1


if __name__ == "__main__":
    raise SystemExit(main())
