"""Which copy each load job of the live trace got, read back from the server's log.

While kvcore's vLLM handler shares loads with stock's copy (``KVCORE_STOCK_SHARE``), it
logs one line per load job; the offload tier's load-job counter says how many jobs each
sequential request ran, so the lines, in order, can be dealt out to the requests. Done at
``run --ab-log`` and again by ``attribute`` from a saved log, where the first attempt
found the counts and the lines disagreeing.
"""

from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.vllm.live_trace_metrics import LOAD_JOBS
from benchmarks.vllm.live_trace_result import Result

# What kvcore's vLLM handler logs for each load while it shares loads with stock
# (KVCORE_STOCK_SHARE; kvcore_vllm.transfers.AB_LOG_PREFIX): job id, blocks, the copy.
AB_LINE = re.compile(r"kvcore A/B: load job (\d+), (\d+) blocks: (\S+)")
KVCORE_COPY = "kvcore"
STOCK_SHARE = "stock_share"
ATTRIBUTED = "every load job's copy attributed"


def ab_copies(log: Path, offset: int) -> list[str]:
    """The copies the server's A/B lines name, one a load job in the order first logged,
    from byte ``offset`` of ``log``. A job's line may be there more than once (a process
    whose root logger prints it beside another handler, workers of one engine)."""
    with log.open("rb") as stream:
        stream.seek(offset)
        text = stream.read().decode("utf-8", "replace")
    by_job: dict[str, str] = {}
    for match in AB_LINE.finditer(text):
        by_job.setdefault(match.group(1), match.group(3))
    return list(by_job.values())


def attribute_copies(results: list[Result], copies: list[str]) -> str | None:
    """Give each request the copies of its load jobs (as many as the tier counted for it),
    in order; what went wrong where the counts and the lines disagree (nothing is given)."""
    counts = [int(r.counted.get(LOAD_JOBS, 0.0)) for r in results]
    if sum(counts) != len(copies):
        return f"{len(copies)} A/B lines for {sum(counts)} load jobs; copies not attributed"
    taken = 0
    for result, count in zip(results, counts, strict=True):
        result.copies = copies[taken : taken + count]
        taken += count
    return None


def attribution(results: list[Result], log: Path, offset: int) -> str:
    """Attribute the copies of ``log`` (from ``offset``) to ``results``; what came of it."""
    problem = attribute_copies(results, ab_copies(log, offset))
    return problem or ATTRIBUTED


def reattribute(report: dict[str, Any], log: Path) -> dict[str, Any]:
    """``report`` with its sequential requests' copies taken again from the server's saved
    ``log`` (from the offset the run recorded; 0 for reports written before they did)."""
    results = [Result(**request) for request in report["sequential_requests"]]
    outcome = attribution(results, log, int(report.get("ab_log_offset", 0)))
    return {
        **report,
        "ab_attribution": outcome,
        "sequential_requests": [asdict(r) for r in results],
    }
