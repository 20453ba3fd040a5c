"""One live-trace run's report (``scripts/live_trace.py run``): both passes over one trace
shape against the server, with what the server's counters and log say of each request.

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
    server = Server(args.url, args.model, args.max_tokens)
    settings = ("conversations", "turns", "max_tokens", "concurrency", "seed", "first_turn_tokens")
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
    if args.concurrency > 1:
        concurrent = make_conversations(
            args.conversations, args.turns, args.seed + 1000, args.first_turn_tokens
        )
        results, wall = run_concurrent(server, concurrent, args.seed + 1000, args.concurrency)
        report["concurrent"] = summarize(results, wall)
    report["metrics_end"] = server.metrics()
    return report
