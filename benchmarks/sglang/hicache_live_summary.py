"""The summary of one mode of the live HiCache run (:mod:`benchmarks.sglang.hicache_live`).

:func:`summarize` reduces the requests' results and the cache's counters to the load-back
times (median, p99 by nearest rank), tokens, wrong bytes, evictions and write-throughs,
with :func:`by_size` per first-turn size, and, where load-backs were shared with stock's
copy inside the process, :func:`in_process_ab`; :mod:`benchmarks.sglang.hicache_live_combine`
puts the modes' summaries side by side.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

from benchmarks.median_difference import median_difference_interval
from benchmarks.sglang.hicache_live_rig import CacheCounters
from benchmarks.sglang.hicache_live_serve import RequestResult


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile by the nearest rank; None for no values."""
    if not values:
        return None
    ranked = sorted(values)
    return ranked[min(len(ranked), max(1, math.ceil(q * len(ranked)))) - 1]


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def by_size(results: Sequence[RequestResult], token_bytes: int) -> list[dict[str, Any]]:
    """Per first-turn size bucket: its load-backs' tokens and times, medians."""
    rows = []
    for size in sorted({r.first_turn_tokens for r in results}):
        loads = [r for r in results if r.first_turn_tokens == size and r.loadback_ms is not None]
        if not loads:
            continue
        ms = statistics.median(r.loadback_ms for r in loads if r.loadback_ms is not None)
        tokens = statistics.median(r.loaded_tokens for r in loads)
        rows.append(
            {
                "first_turn_tokens": size,
                "loadbacks": len(loads),
                "loaded_tokens_p50": tokens,
                "loadback_ms_p50": _round(ms),
                "gb_per_s": _round(tokens * token_bytes / ms / 1e6) if ms else None,
            }
        )
    return rows


def in_process_ab(results: Sequence[RequestResult]) -> list[dict[str, Any]]:
    """Per first-turn size, the load-backs kvcore copied against those drawn for stock's
    copy in the same process (``KVCORE_STOCK_SHARE``): counts, loaded tokens and times
    (medians), and kvcore's median less stock's with its bootstrap interval."""
    rows = []
    for size in sorted({r.first_turn_tokens for r in results}):
        arms = {
            copy: [
                r
                for r in results
                if r.first_turn_tokens == size and r.copy == copy and r.loadback_ms is not None
            ]
            for copy in ("kvcore", "stock_share")
        }
        kvcore, stock = arms["kvcore"], arms["stock_share"]
        if not kvcore or not stock:
            continue
        kvcore_ms = [r.loadback_ms for r in kvcore if r.loadback_ms is not None]
        stock_ms = [r.loadback_ms for r in stock if r.loadback_ms is not None]
        low, high = median_difference_interval(kvcore_ms, stock_ms, seed=size)
        rows.append(
            {
                "first_turn_tokens": size,
                "kvcore_loadbacks": len(kvcore),
                "stock_loadbacks": len(stock),
                "kvcore_tokens_p50": statistics.median(r.loaded_tokens for r in kvcore),
                "stock_tokens_p50": statistics.median(r.loaded_tokens for r in stock),
                "kvcore_ms_p50": _round(statistics.median(kvcore_ms)),
                "stock_ms_p50": _round(statistics.median(stock_ms)),
                "ms_p50_difference": _round(
                    statistics.median(kvcore_ms) - statistics.median(stock_ms)
                ),
                "ms_difference_interval": [_round(low), _round(high)],
            }
        )
    return rows


def summarize(
    results: Sequence[RequestResult], counters: CacheCounters, token_bytes: int
) -> dict[str, Any]:
    loads = [r for r in results if r.loadback_ms is not None]
    ms = [r.loadback_ms for r in loads if r.loadback_ms is not None]
    issue = [r.issue_ms for r in loads if r.issue_ms is not None]
    start_loading = [r.start_loading_ms for r in loads if r.start_loading_ms is not None]
    return {
        "requests": len(results),
        "loadbacks": len(loads),
        "loadbacks_declined": sum(r.loadback_declined for r in results),
        "loadback_ms_p50": _round(statistics.median(ms)) if ms else None,
        "loadback_ms_p99": _round(percentile(ms, 0.99)),
        "issue_ms_p50": _round(statistics.median(issue)) if issue else None,
        "start_loading_ms_p50": (
            _round(statistics.median(start_loading)) if start_loading else None
        ),
        "loaded_tokens": sum(r.loaded_tokens for r in results),
        "device_hit_tokens": sum(r.device_hit_tokens for r in results),
        "host_hit_tokens": sum(r.host_hit_tokens for r in results),
        "mismatched_bytes": sum(r.mismatched_bytes + r.resident_mismatched_bytes for r in results),
        "settled_mismatched_bytes": sum(r.settled_mismatched_bytes for r in results),
        "checks_failed": sum(not r.check_passed for r in results),
        "errors": sum(r.error is not None for r in results),
        "evictions": {
            "calls": counters.evict_calls,
            "device_tokens": counters.evicted_tokens,
            "dropped_tokens": counters.dropped_tokens,
            "host_calls": counters.host_evict_calls,
            "host_tokens": counters.host_evicted_tokens,
        },
        "write_throughs": {
            "ops": counters.write_through_ops,
            "tokens": counters.write_through_tokens,
        },
        "by_size": by_size(results, token_bytes),
        **(copies_compared(loads) if any(r.copy is not None for r in loads) else {}),
    }


def copies_compared(loads: Sequence[RequestResult]) -> dict[str, Any]:
    """How many load-backs each copy made and, where both kvcore's and the drawn stock
    copy made some, :func:`in_process_ab`: a run whose rule passed every load-back to
    SGLang's copy says so (all ``stock``) rather than leaving the comparison empty."""
    copies = dict(sorted(Counter(r.copy for r in loads if r.copy is not None).items()))
    compared: dict[str, Any] = {"loadback_copies": copies}
    if "stock_share" in copies:
        compared["in_process_ab"] = in_process_ab(loads)
    return compared
