"""One live-trace run's report (``scripts/live_trace.py run``): the sequential pass and a
concurrent pass per concurrency level, each over one trace shape against the server, with
what the server's counters and log say of each sequential request.

The report keeps every sequential request, not only the summary, so that ``combine`` and
``attribute`` can work from the saved file after the server is gone.
"""

from __future__ import annotations

import argparse
import platform
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.vllm.live_trace_attribution import attribution
from benchmarks.vllm.live_trace_client import Server, run_concurrent, run_sequential
from benchmarks.vllm.live_trace_shape import make_conversations
from benchmarks.vllm.live_trace_summary import summarize


def machine_id() -> str:
    """This machine's boot id (a fresh one for each machine lent, each boot), else its
    name: reports that share it ran on one machine."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text(encoding="utf-8").strip()
    except OSError:
        return platform.node()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The report of one server process: the sequential pass, then one concurrent pass per
    level of ``args.concurrency`` above 1, in the order given (level 1 is the sequential
    pass's own)."""
    server = Server(args.url, args.model, args.max_tokens)
    settings = (
        "conversations",
        "turns",
        "max_tokens",
        "concurrent_max_tokens",
        "concurrency",
        "seed",
        "first_turn_tokens",
    )
    report: dict[str, Any] = {
        "mode": args.mode,
        "label": args.label or args.mode,
        "machine": machine_id(),
        "settings": {name: getattr(args, name) for name in settings},
    }
    sequential = make_conversations(
        args.conversations, args.turns, args.seed, args.first_turn_tokens
    )
    ab_offset = args.ab_log.stat().st_size if args.ab_log is not None else 0
    started = time.perf_counter()
    results = run_sequential(server, sequential, args.seed)
    wall_s = time.perf_counter() - started
    if args.ab_log is not None:
        report["ab_log_offset"] = ab_offset
        report["ab_attribution"] = attribution(results, args.ab_log, ab_offset)
    report["sequential"] = summarize(results, wall_s)
    report["sequential_requests"] = [asdict(r) for r in results]
    levels: list[dict[str, Any]] = []
    # Longer answers in the concurrent passes keep requests decoding while later turns'
    # hits load beside them, which is what the passes' output tokens/s and TPOT are for.
    decoding = Server(args.url, args.model, args.concurrent_max_tokens or args.max_tokens)
    for k, level in enumerate((level for level in args.concurrency if level > 1), start=1):
        # Each level its own token ids, so that no level finds another's prompts cached.
        seed = args.seed + 1000 * k
        concurrent = make_conversations(
            args.conversations, args.turns, seed, args.first_turn_tokens
        )
        results, wall = run_concurrent(decoding, concurrent, seed, level)
        summary = summarize(results, wall)
        # The first level's pass also goes where reports had their one concurrent pass:
        # combine's tokens_per_s reads it there, in older reports and in these.
        report.setdefault("concurrent", summary)
        levels.append({**summary, "concurrency": level})
    report["concurrent_levels"] = levels
    report["metrics_end"] = server.metrics()
    return report
