"""Hit TTFT of the live trace compared between groups of requests that are not paired:
one mode's against the first mode's, and, inside one process, kvcore's copies against the
loads drawn for stock's.

The medians' difference comes with a bootstrap interval, so that a size's gain or loss is
told apart from the engine's own spread. :mod:`benchmarks.median_difference` is standard
library only, so ``scripts/live_trace.py`` imports this at its top and its ``run`` still
needs nothing beyond the standard library beside the server.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.median_difference import median_difference_interval
from benchmarks.vllm.live_trace_attribution import KVCORE_COPY, STOCK_SHARE
from benchmarks.vllm.live_trace_metrics import LOAD_BYTES, LOAD_TIME
from benchmarks.vllm.live_trace_result import Result, ms, sizes


def compare_hits(requests: list[Result], reference: list[Result]) -> list[dict[str, Any]]:
    """Per first-turn size, a mode's CPU-tier-hit TTFT against the reference mode's: the
    difference of the medians (negative: faster than the reference) with its bootstrap
    interval, so that a size's gain or loss is told apart from the engine's own spread."""
    rows = []
    for size in sizes(requests):
        mine = [r.ttft_s for r in requests if r.cpu_tier_hit and r.first_turn_tokens == size]
        theirs = [r.ttft_s for r in reference if r.cpu_tier_hit and r.first_turn_tokens == size]
        if not mine or not theirs:
            continue
        low, high = median_difference_interval(mine, theirs, seed=size)
        rows.append(
            {
                "first_turn_tokens": size,
                "hits": len(mine),
                "reference_hits": len(theirs),
                "ttft_ms_p50_difference": ms(statistics.median(mine) - statistics.median(theirs)),
                "ttft_ms_difference_interval": [ms(low), ms(high)],
            }
        )
    return rows


# A later turn can find most of its conversation still on the GPU and load only a
# top-up from the CPU tier. Against a whole-prefix reload that is not the same work,
# so the A/B keeps the hits that loaded at least this share of their size's largest load.
WHOLE_RELOAD_SHARE = 0.5


def whole_reloads(hits: list[Result]) -> list[Result]:
    """The hits that reloaded their conversation's prefix, not a top-up of it."""
    largest = max((r.counted.get(LOAD_BYTES, 0.0) for r in hits), default=0.0)
    return [r for r in hits if r.counted.get(LOAD_BYTES, 0.0) >= WHOLE_RELOAD_SHARE * largest]


def in_process_ab(requests: list[Result]) -> list[dict[str, Any]]:
    """Per first-turn size, the CPU-tier hits of one process whose loads kvcore copied
    against those whose loads were drawn for stock's copy (``stock_share``): TTFT and
    reload medians of each, and kvcore's TTFT median less stock's with its bootstrap
    interval. Both arms share the process, its engine and its drift. Top-up loads are left
    out (:func:`whole_reloads`) and counted as ``top_ups_left_out``."""
    rows = []
    for size in sizes(requests):
        sized = [r for r in requests if r.cpu_tier_hit and r.first_turn_tokens == size]
        hits = whole_reloads(sized)
        arms = {
            copy: [r for r in hits if r.copies and set(r.copies) == {copy}]
            for copy in (KVCORE_COPY, STOCK_SHARE)
        }
        kvcore, stock = arms[KVCORE_COPY], arms[STOCK_SHARE]
        if not kvcore or not stock:
            continue
        low, high = median_difference_interval(
            [r.ttft_s for r in kvcore], [r.ttft_s for r in stock], seed=size
        )
        reload_low, reload_high = median_difference_interval(
            [r.counted.get(LOAD_TIME, 0.0) for r in kvcore],
            [r.counted.get(LOAD_TIME, 0.0) for r in stock],
            seed=size,
        )
        rows.append(
            {
                "first_turn_tokens": size,
                "kvcore_hits": len(kvcore),
                "stock_hits": len(stock),
                "top_ups_left_out": len(sized) - len(hits),
                "kvcore_ttft_ms_p50": ms(statistics.median(r.ttft_s for r in kvcore)),
                "stock_ttft_ms_p50": ms(statistics.median(r.ttft_s for r in stock)),
                "kvcore_reload_ms_p50": ms(
                    statistics.median(r.counted.get(LOAD_TIME, 0.0) for r in kvcore)
                ),
                "stock_reload_ms_p50": ms(
                    statistics.median(r.counted.get(LOAD_TIME, 0.0) for r in stock)
                ),
                "ttft_ms_p50_difference": ms(
                    statistics.median(r.ttft_s for r in kvcore)
                    - statistics.median(r.ttft_s for r in stock)
                ),
                "ttft_ms_difference_interval": [ms(low), ms(high)],
                "reload_ms_difference_interval": [ms(reload_low), ms(reload_high)],
            }
        )
    return rows
