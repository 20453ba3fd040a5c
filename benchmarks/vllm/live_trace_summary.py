"""One pass of the live trace (``scripts/live_trace.py``) summed up: hit TTFT, reload time,
time per output token and throughput.

``run`` summarizes each pass as it ends and ``combine`` summarizes each report's sequential
requests again, both through here, so that a mode's summary means the same in either.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.vllm.live_trace_metrics import LOAD_BYTES, LOAD_JOBS, LOAD_TIME
from benchmarks.vllm.live_trace_result import Result, ms, sizes


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile by the nearest rank; None for no values."""
    if not values:
        return None
    ranked = sorted(values)
    return ranked[min(len(ranked), max(1, math.ceil(q * len(ranked)))) - 1]


def summarize(results: list[Result], wall_s: float | None = None) -> dict[str, Any]:
    """TTFT of CPU-tier hits and of cold first turns, the reload time the tier reported
    for the hits, every request's time per output token after its first, and (given the
    pass's wall time) tokens per second: prompt and output, and output alone."""
    # Without the tier's counters (the concurrent pass reads none), later turns count.
    metered = any(LOAD_BYTES in r.counted for r in results)
    hits = [r for r in results if (r.cpu_tier_hit if metered else r.turn > 0)]
    cold = [r for r in results if r.turn == 0]
    tpots = _tpots(results)
    summary: dict[str, Any] = {
        "requests": len(results),
        "cpu_tier_hits": len(hits),
        "hits_counted_by": LOAD_BYTES if metered else "turn",
        "ttft_ms_p50": ms(statistics.median([r.ttft_s for r in hits]) if hits else None),
        "ttft_ms_p99": ms(percentile([r.ttft_s for r in hits], 0.99)),
        "cold_ttft_ms_p50": ms(statistics.median([r.ttft_s for r in cold]) if cold else None),
        "reload_ms_p50": ms(
            statistics.median([r.counted.get(LOAD_TIME, 0.0) for r in hits]) if hits else None
        ),
        "reload_bytes": sum(r.counted.get(LOAD_BYTES, 0.0) for r in hits),
        "by_size": _by_size(hits, cold),
        "tpot_ms_p50": ms(statistics.median(tpots) if tpots else None),
        "tpot_ms_p90": ms(percentile(tpots, 0.9)),
    }
    if wall_s is not None:
        output = sum(len(r.output) for r in results)
        produced = output + sum(r.prompt_tokens for r in results)
        summary.update(
            wall_s=round(wall_s, 3),
            tokens_per_s=round(produced / wall_s, 1),
            output_tokens_per_s=round(output / wall_s, 1),
        )
    return summary


def _tpots(results: list[Result]) -> list[float]:
    """Each request's seconds per output token after its first, as a running request
    sees the engine's decode steps; the first token's wait is TTFT's, so a request of one
    output token has none."""
    return [(r.total_s - r.ttft_s) / (len(r.output) - 1) for r in results if len(r.output) >= 2]


def _by_size(hits: list[Result], cold: list[Result]) -> list[dict[str, Any]]:
    """Per first-turn size: hit TTFT and reload time medians, the reload's GB/s, the
    median of each hit's TTFT less its reload time (the engine's own steps around the
    reload), and the load jobs a hit took (median and most: a reload split over two jobs
    waits for both). Beside them, the TTFT of that size's cold first turns, computed from
    nothing, and both sides' prompt lengths: a hit slower than a cold prompt about as
    long costs more than recomputing its prefix would."""
    rows = []
    for size in sizes(hits):
        group = [r for r in hits if r.first_turn_tokens == size]
        firsts = [r for r in cold if r.first_turn_tokens == size]
        reload_s = statistics.median([r.counted.get(LOAD_TIME, 0.0) for r in group])
        loaded = statistics.median([r.counted.get(LOAD_BYTES, 0.0) for r in group])
        rows.append(
            {
                "first_turn_tokens": size,
                "hits": len(group),
                "ttft_ms_p50": ms(statistics.median([r.ttft_s for r in group])),
                "reload_ms_p50": ms(reload_s),
                "reload_bytes_p50": loaded,
                "reload_gb_per_s": round(loaded / reload_s / 1e9, 2) if reload_s else None,
                "other_ms_p50": ms(
                    statistics.median([r.ttft_s - r.counted.get(LOAD_TIME, 0.0) for r in group])
                ),
                "load_jobs_p50": _jobs(group, statistics.median),
                "load_jobs_max": _jobs(group, max),
                "prompt_tokens_p50": statistics.median([r.prompt_tokens for r in group]),
                "cold_ttft_ms_p50": ms(statistics.median([r.ttft_s for r in firsts]))
                if firsts
                else None,
                "cold_prompt_tokens_p50": statistics.median([r.prompt_tokens for r in firsts])
                if firsts
                else None,
            }
        )
    return rows


def _jobs(group: list[Result], pick: Any) -> float | None:
    """``pick`` over the hits' load-job counts; None where the tier reported none."""
    counts = [r.counted[LOAD_JOBS] for r in group if LOAD_JOBS in r.counted]
    return pick(counts) if counts else None
