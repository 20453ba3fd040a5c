"""A multi-turn request trace against a live OpenAI-compatible server, timed as users see it.

    python3 scripts/live_trace.py run --url http://127.0.0.1:8000 --model DIR --mode NAME \\
        --out FILE.json [--conversations 14] [--turns 3] [--concurrency 8[,32...]] [--seed 0]
    python3 scripts/live_trace.py combine FILE.json... --out SUMMARY.json [--device TEXT]
        [--baseline MODE]

``run`` sends prompts as token ids (the server runs with ``--skip-tokenizer-init``) over
HTTP, streamed, so the time to the first token is seen. Conversations open with one of a
few shared system prompts and a first turn of 512 to 32000 tokens; each later turn is the
whole conversation so far (prompt and the tokens the model answered) plus a short new
user message. Every conversation's first turn goes out before any second turn, in a
shuffled order, so that by its next turn a conversation's KV has left the GPU's small
cache and comes back from the CPU tier.

Passes over one trace shape, each with its own token ids:
- ``sequential``: one request at a time, greedy, a fixed number of output tokens. The
  server's ``/metrics`` is read before and after each request, so each request carries
  what the offload tier moved for it (``vllm:kv_offload_*``) and kvcore's counters. Its
  output tokens are what ``combine`` compares across modes. The report keeps its summary
  (``sequential``) and every request (``sequential_requests``).
- concurrent: one pass per level of ``--concurrency`` (comma-separated, e.g. ``8,32``;
  level 1 is the sequential pass's and adds none), in the order given, with that many
  requests in flight per turn, for throughput. ``concurrent_levels`` holds each pass's
  summary with its ``concurrency``; ``concurrent`` is the first one's, as in reports
  that had one concurrent pass. A summary has tokens per second (prompt and output, and
  ``output_tokens_per_s``) and each request's time per output token after its first
  (``tpot_ms_p50``, ``tpot_ms_p90``).

A request counts as a CPU-tier hit when it is a later turn and the offload tier loaded
bytes for it (where the server's counters are not read, when it is a later turn).
``combine`` recomputes each mode's sequential summary from its requests, and
writes the summary (per mode: TTFT of CPU-tier hits, median and p99, tokens per second,
whether the sequential outputs equal the first mode's, and per first-turn size the hit
TTFT median's difference from the first mode's with a 95% bootstrap interval) as
docs/bench/h200-live-*.json. Where a mode ran in two or more server processes, as stock
did, the summary pairs stock's processes with the mode's on each machine: hit TTFT
(``paired_processes``), and per concurrency level output tokens per second and TPOT
(``paired_concurrency``).
``run`` uses only the standard library: the client runs beside the server on the GPU
machine; ``combine`` also takes kvcore's paired speed and median difference (kvcore is
installed there too).
The trace's code is in benchmarks/vllm/live_trace_*.py; this file is its command line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# The engine benches are in the checkout's benchmarks/ package, not in the wheel.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.vllm.live_trace_attribution import ATTRIBUTED, reattribute
from benchmarks.vllm.live_trace_combine import combine
from benchmarks.vllm.live_trace_run import run
from benchmarks.vllm.live_trace_shape import FIRST_TURN_TOKENS, check_first_turns


def _token_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of integers: {text!r}"
        ) from None
    try:
        check_first_turns(counts)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return counts


def _levels(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of integers: {text!r}"
        ) from None
    if min(levels) < 1:
        raise argparse.ArgumentTypeError(f"a level below 1 in {text!r}")
    if len(set(levels)) < len(levels):
        # Two passes at one level could not be told apart when combine pairs them.
        raise argparse.ArgumentTypeError(f"a level given twice in {text!r}")
    return levels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("run", help="send the trace to a server and write its report")
    one.add_argument("--url", default="http://127.0.0.1:8000")
    one.add_argument("--model", required=True, help="the served model's name (its path)")
    one.add_argument("--mode", required=True, help="what the server runs, e.g. stock")
    one.add_argument("--label", help="this run's name in the summary (default: the mode)")
    one.add_argument("--out", type=Path, required=True)
    one.add_argument("--conversations", type=int, default=14)
    one.add_argument("--turns", type=int, default=3)
    one.add_argument("--max-tokens", type=int, default=16)
    one.add_argument(
        "--concurrent-max-tokens",
        type=int,
        help="each answer's length in the concurrent passes (default: --max-tokens), "
        "e.g. 256 to keep requests decoding while later turns' hits load",
    )
    one.add_argument(
        "--concurrency",
        type=_levels,
        default=[8],
        help="requests in flight in each concurrent pass, one pass per level, "
        "comma-separated (default 8; 1: no concurrent pass)",
    )
    one.add_argument("--seed", type=int, default=0)
    one.add_argument(
        "--first-turn-tokens",
        type=_token_counts,
        default=list(FIRST_TURN_TOKENS),
        help="first-turn sizes the conversations cycle through, comma-separated "
        f"(default {','.join(map(str, FIRST_TURN_TOKENS))})",
    )
    one.add_argument(
        "--ab-log",
        type=Path,
        help="the server's log, where kvcore logs each load's copy (KVCORE_STOCK_SHARE): "
        "the sequential requests get their loads' copies, and combine compares the arms",
    )
    one.add_argument(
        "--startup-s",
        type=float,
        help="seconds the server took from its start until /health answered (recorded as "
        "given, with --cpu-tier-gib: the start-up cost of pinning the CPU tier)",
    )
    one.add_argument("--cpu-tier-gib", type=float, help="the server's --kv-offloading-size")
    again = commands.add_parser(
        "attribute",
        help="a run's report with its loads' copies taken again from the saved server log",
    )
    again.add_argument("report", type=Path)
    again.add_argument("--ab-log", type=Path, required=True)
    again.add_argument("--out", type=Path, required=True)
    both = commands.add_parser("combine", help="one summary of several modes' reports")
    both.add_argument("reports", type=Path, nargs="+")
    both.add_argument("--out", type=Path, required=True)
    both.add_argument("--device", default="unknown")
    both.add_argument("--version", default="unknown")
    both.add_argument(
        "--baseline",
        default="stock",
        help="the mode the others are paired with (default stock; e.g. kvcore-transfers to "
        "judge kvcore-background on top of it: the summary's stock_* fields then hold it)",
    )
    args = parser.parse_args(argv)
    if args.command == "run":
        if args.turns < 2:
            parser.error("--turns must be at least 2: hits come from later turns")
        for option, value in (
            ("--max-tokens", args.max_tokens),
            ("--concurrent-max-tokens", args.concurrent_max_tokens),
        ):
            if value is not None and value < 1:
                parser.error(f"{option} {value}: give 1 or more tokens")
        report = run(args)
        report["startup_s"], report["cpu_tier_gib"] = args.startup_s, args.cpu_tier_gib
        args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        print(json.dumps({"mode": args.mode, **report["sequential"]}, indent=1))
        return 0
    if args.command == "attribute":
        report = reattribute(json.loads(args.report.read_text(encoding="utf-8")), args.ab_log)
        args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        print(f"{report['label']}: {report['ab_attribution']}")
        return 0 if report["ab_attribution"] == ATTRIBUTED else 1
    reports = []
    for path in args.reports:
        report = json.loads(path.read_text(encoding="utf-8"))
        # Reports written before they named their machine: one call's reports share its
        # folder, and one call runs on one machine.
        report.setdefault("machine", str(path.resolve().parent))
        reports.append(report)
    summary = combine(reports, args.device, args.version, args.baseline)
    args.out.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    for mode, row in summary["modes"].items():
        print(
            f"{mode:>18}: hit TTFT p50 {row['ttft_ms_p50']} ms p99 {row['ttft_ms_p99']} ms, "
            f"{row['tokens_per_s']} tok/s, outputs identical: {row['outputs_identical']}"
        )
        for ab in row.get("in_process_ab", []):
            print(
                f"{'':>20}A/B {ab['first_turn_tokens']:>5} tokens: kvcore "
                f"{ab['kvcore_ttft_ms_p50']} ms ({ab['kvcore_hits']}) against stock "
                f"{ab['stock_ttft_ms_p50']} ms ({ab['stock_hits']}), difference "
                f"{ab['ttft_ms_p50_difference']} {ab['ttft_ms_difference_interval']}"
            )
    for mode, rows in summary.get("paired_concurrency", {}).items():
        for row in rows:
            print(
                f"{mode:>18}: concurrency {row['concurrency']}, {row['processes']} pairs: "
                f"output tok/s x{row['throughput']} {row['throughput_interval']}, "
                f"TPOT x{row['tpot_speed']} {row['tpot_speed_interval']} against stock"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
