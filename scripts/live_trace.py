"""A multi-turn request trace against a live OpenAI-compatible server, timed as users see it.

    python3 scripts/live_trace.py run --url http://127.0.0.1:8000 --model DIR --mode NAME \\
        --out FILE.json [--conversations 14] [--turns 3] [--concurrency 8] [--seed 0]
    python3 scripts/live_trace.py combine FILE.json... --out SUMMARY.json [--device TEXT]

``run`` sends prompts as token ids (the server runs with ``--skip-tokenizer-init``) over
HTTP, streamed, so the time to the first token is seen. Conversations open with one of a
few shared system prompts and a first turn of 512 to 32000 tokens; each later turn is the
whole conversation so far (prompt and the tokens the model answered) plus a short new
user message. Every conversation's first turn goes out before any second turn, in a
shuffled order, so that by its next turn a conversation's KV has left the GPU's small
cache and comes back from the CPU tier.

Two passes over one trace shape, each with its own token ids:
- ``sequential``: one request at a time, greedy, a fixed number of output tokens. The
  server's ``/metrics`` is read before and after each request, so each request carries
  what the offload tier moved for it (``vllm:kv_offload_*``) and kvcore's counters. Its
  output tokens are what ``combine`` compares across modes.
- ``concurrent``: the same shape, ``--concurrency`` requests in flight per turn, for
  throughput.

A request counts as a CPU-tier hit when it is a later turn and the offload tier loaded
bytes for it (where the server's counters are not read, when it is a later turn).
``combine`` recomputes each mode's sequential summary from its requests, and
writes the summary (per mode: TTFT of CPU-tier hits, median and p99, tokens per second,
whether the sequential outputs equal the first mode's, and per first-turn size the hit
TTFT median's difference from the first mode's with a 95% bootstrap interval) as
docs/bench/h200-live-*.json.
``run`` uses only the standard library: the client runs beside the server on the GPU
machine; ``combine`` also takes kvcore's paired speed and median difference (kvcore is
installed there too).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import platform
import random
import re
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

FIRST_TURN_TOKENS = (512, 1024, 2048, 4096, 8192, 16384, 32000)
SYSTEM_PROMPT_TOKENS = (256, 384, 512)
NEW_USER_TOKENS = 64
# Token ids drawn below Llama 3's special tokens (128000 on).
TOKEN_RANGE = (1000, 120000)
# Counters read from /metrics around each sequential request; a name matches by prefix.
COUNTED_PREFIXES = ("vllm:kv_offload_", "kvcore_", "vllm:prefix_cache_", "vllm:prompt_tokens")
LOAD_BYTES = "vllm:kv_offload_load_bytes"
LOAD_TIME = "vllm:kv_offload_load_time"
# The load-size histogram's sample count: the load jobs the tier ran for the request.
LOAD_JOBS = "vllm:kv_offload_load_size_count"
BASELINE_MODE = "stock"
# What kvcore's vLLM handler logs for each load while it shares loads with stock
# (KVCORE_STOCK_SHARE; kvcore_vllm.transfers.AB_LOG_PREFIX): job id, blocks, the copy.
AB_LINE = re.compile(r"kvcore A/B: load job (\d+), (\d+) blocks: (\S+)")
KVCORE_COPY = "kvcore"
STOCK_SHARE = "stock_share"
ATTRIBUTED = "every load job's copy attributed"
SAMPLE_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
GAUGE_LINE = re.compile(r"^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) gauge\s*$")


@dataclass
class Conversation:
    index: int
    system: list[int]
    first_user: list[int]
    later_users: list[list[int]]
    history: list[int] = field(default_factory=list)

    @property
    def size(self) -> int:
        """Tokens of the first turn."""
        return len(self.system) + len(self.first_user)

    def prompt(self, turn: int) -> list[int]:
        """Turn 0: system prompt and first message; later: all so far and a new message."""
        if turn == 0:
            return self.system + self.first_user
        return self.history + self.later_users[turn - 1]


@dataclass
class Result:
    conversation: int
    first_turn_tokens: int
    turn: int
    prompt_tokens: int
    ttft_s: float
    total_s: float
    output: list[int]
    counted: dict[str, float] = field(default_factory=dict)
    """Change of each counted /metrics series over the request (sequential pass only)."""
    copies: list[str] = field(default_factory=list)
    """The copy each of the request's load jobs got, from the server's A/B log lines
    (``run --ab-log``; sequential pass only): ``kvcore``, ``stock_share`` (stock's, drawn),
    or the reason kvcore's rule passed it."""

    @property
    def cpu_tier_hit(self) -> bool:
        """A later turn whose conversation came back from the CPU tier (a first turn may
        load only a shared system prompt from there: that is not its conversation's)."""
        return self.turn > 0 and self.counted.get(LOAD_BYTES, 0.0) > 0


def tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(count)]


def check_first_turns(first_turns: Sequence[int]) -> None:
    """Raises ValueError unless every first turn holds the longest system prompt."""
    if not first_turns or min(first_turns) < max(SYSTEM_PROMPT_TOKENS):
        raise ValueError(
            f"first turns must be at least {max(SYSTEM_PROMPT_TOKENS)} tokens (the longest "
            f"system prompt), got {list(first_turns)}"
        )


def make_conversations(
    count: int, turns: int, seed: int, first_turns: Sequence[int] = FIRST_TURN_TOKENS
) -> list[Conversation]:
    """``count`` conversations whose first turns cycle through ``first_turns``."""
    check_first_turns(first_turns)
    rng = random.Random(seed)
    systems = [tokens(rng, n) for n in SYSTEM_PROMPT_TOKENS]
    conversations = []
    for index in range(count):
        system = systems[index % len(systems)]
        first = first_turns[index % len(first_turns)]
        conversations.append(
            Conversation(
                index,
                system,
                tokens(rng, first - len(system)),
                [tokens(rng, NEW_USER_TOKENS) for _ in range(turns - 1)],
            )
        )
    return conversations


def turn_orders(count: int, turns: int, seed: int) -> list[list[int]]:
    """Per turn, the order the conversations are sent in (each turn its own shuffle)."""
    rng = random.Random(seed + 1)
    orders = []
    for _ in range(turns):
        order = list(range(count))
        rng.shuffle(order)
        orders.append(order)
    return orders


def parse_metrics(text: str) -> dict[str, float]:
    """Counted series of a Prometheus text page, by name: counters and histograms summed over
    label sets (each engine process adds its own); a gauge (``# TYPE ... gauge``, such as a
    share per process) its lowest value, since a sum of shares is no share."""
    totals: dict[str, float] = {}
    gauges: set[str] = set()
    for line in text.splitlines():
        declared = GAUGE_LINE.match(line)
        if declared is not None:
            gauges.add(declared.group(1))
            continue
        match = SAMPLE_LINE.match(line)
        if match is None or not match.group(1).startswith(COUNTED_PREFIXES):
            continue
        name = match.group(1)
        if name.endswith(("_bucket", "_created")):
            continue
        for suffix in ("_total", "_sum"):
            name = name.removesuffix(suffix)
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        if name in gauges and name in totals:
            totals[name] = min(totals[name], value)
        else:
            totals[name] = totals.get(name, 0.0) + value
    return totals


def difference(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


class Server:
    """The server's HTTP endpoints, one connection per call (threads share nothing)."""

    def __init__(self, url: str, model: str, max_tokens: int, timeout_s: float = 600.0) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.model, self.max_tokens, self.timeout_s = model, max_tokens, timeout_s

    def _connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)

    def get(self, path: str) -> str:
        connection = self._connection()
        try:
            connection.request("GET", path)
            response = connection.getresponse()
            body = response.read().decode()
            if response.status != 200:
                raise RuntimeError(f"GET {path}: HTTP {response.status}: {body[:200]}")
            return body
        finally:
            connection.close()

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.get("/metrics"))

    def complete(self, prompt: list[int]) -> tuple[float, float, list[int]]:
        """(seconds to the first token, seconds to the last, the output token ids)."""
        body = json.dumps(
            {
                "model": self.model,
                "prompt": prompt,
                "max_tokens": self.max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
            }
        )
        connection = self._connection()
        started = time.perf_counter()
        first: float | None = None
        output: list[int] = []
        try:
            connection.request(
                "POST", "/v1/completions", body, {"Content-Type": "application/json"}
            )
            response = connection.getresponse()
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {response.read().decode()[:300]}")
            for event in server_sent_events(response):
                for choice in event.get("choices", ()):
                    ids = choice.get("token_ids") or []
                    if ids and first is None:
                        first = time.perf_counter() - started
                    output += ids
        finally:
            connection.close()
        total = time.perf_counter() - started
        if first is None:
            raise RuntimeError("the stream carried no token ids (is return_token_ids served?)")
        return first, total, output


def server_sent_events(stream: Any) -> Iterator[dict[str, Any]]:
    """The JSON events of an OpenAI-style stream, up to ``[DONE]``."""
    for raw in stream:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def run_sequential(server: Server, conversations: list[Conversation], seed: int) -> list[Result]:
    results = []
    for turn, order in enumerate(turn_orders(len(conversations), _turns(conversations), seed)):
        for index in order:
            conversation = conversations[index]
            prompt = conversation.prompt(turn)
            before = server.metrics()
            ttft, total, output = server.complete(prompt)
            counted = difference(server.metrics(), before)
            conversation.history = prompt + output
            results.append(
                Result(index, conversation.size, turn, len(prompt), ttft, total, output, counted)
            )
    return results


def run_concurrent(
    server: Server, conversations: list[Conversation], seed: int, concurrency: int
) -> tuple[list[Result], float]:
    """Each turn's requests with ``concurrency`` in flight; (results, wall seconds)."""
    results: list[Result] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    started = time.perf_counter()
    for turn, order in enumerate(turn_orders(len(conversations), _turns(conversations), seed)):
        queue = list(order)

        def worker(turn: int = turn, queue: list[int] = queue) -> None:
            while True:
                with lock:
                    if not queue or errors:
                        return
                    index = queue.pop(0)
                conversation = conversations[index]
                prompt = conversation.prompt(turn)
                try:
                    ttft, total, output = server.complete(prompt)
                except BaseException as exc:
                    with lock:
                        errors.append(exc)
                    return
                conversation.history = prompt + output
                with lock:
                    results.append(
                        Result(index, conversation.size, turn, len(prompt), ttft, total, output)
                    )

        threads = [threading.Thread(target=worker) for _ in range(concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
    return results, time.perf_counter() - started


def _turns(conversations: list[Conversation]) -> int:
    return 1 + len(conversations[0].later_users)


def sizes(results: Sequence[Result]) -> list[int]:
    """The first-turn sizes the results hold, smallest first."""
    return sorted({r.first_turn_tokens for r in results})


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile by the nearest rank; None for no values."""
    if not values:
        return None
    ranked = sorted(values)
    return ranked[min(len(ranked), max(1, math.ceil(q * len(ranked)))) - 1]


def summarize(results: list[Result], wall_s: float | None = None) -> dict[str, Any]:
    """TTFT of CPU-tier hits and of cold first turns, the reload time the tier reported
    for the hits, and (given the pass's wall time) tokens per second."""
    # Without the tier's counters (the concurrent pass reads none), later turns count.
    metered = any(LOAD_BYTES in r.counted for r in results)
    hits = [r for r in results if (r.cpu_tier_hit if metered else r.turn > 0)]
    cold = [r for r in results if r.turn == 0]
    summary: dict[str, Any] = {
        "requests": len(results),
        "cpu_tier_hits": len(hits),
        "hits_counted_by": LOAD_BYTES if metered else "turn",
        "ttft_ms_p50": _ms(statistics.median([r.ttft_s for r in hits]) if hits else None),
        "ttft_ms_p99": _ms(percentile([r.ttft_s for r in hits], 0.99)),
        "cold_ttft_ms_p50": _ms(statistics.median([r.ttft_s for r in cold]) if cold else None),
        "reload_ms_p50": _ms(
            statistics.median([r.counted.get(LOAD_TIME, 0.0) for r in hits]) if hits else None
        ),
        "reload_bytes": sum(r.counted.get(LOAD_BYTES, 0.0) for r in hits),
        "by_size": _by_size(hits),
    }
    if wall_s is not None:
        produced = sum(r.prompt_tokens + len(r.output) for r in results)
        summary.update(wall_s=round(wall_s, 3), tokens_per_s=round(produced / wall_s, 1))
    return summary


def _by_size(hits: list[Result]) -> list[dict[str, Any]]:
    """Per first-turn size: hit TTFT and reload time medians, the reload's GB/s, the
    median of each hit's TTFT less its reload time (the engine's own steps around the
    reload), and the load jobs a hit took (median and most: a reload split over two jobs
    waits for both)."""
    rows = []
    for size in sizes(hits):
        group = [r for r in hits if r.first_turn_tokens == size]
        reload_s = statistics.median([r.counted.get(LOAD_TIME, 0.0) for r in group])
        loaded = statistics.median([r.counted.get(LOAD_BYTES, 0.0) for r in group])
        rows.append(
            {
                "first_turn_tokens": size,
                "hits": len(group),
                "ttft_ms_p50": _ms(statistics.median([r.ttft_s for r in group])),
                "reload_ms_p50": _ms(reload_s),
                "reload_bytes_p50": loaded,
                "reload_gb_per_s": round(loaded / reload_s / 1e9, 2) if reload_s else None,
                "other_ms_p50": _ms(
                    statistics.median([r.ttft_s - r.counted.get(LOAD_TIME, 0.0) for r in group])
                ),
                "load_jobs_p50": _jobs(group, statistics.median),
                "load_jobs_max": _jobs(group, max),
            }
        )
    return rows


def _jobs(group: list[Result], pick: Any) -> float | None:
    """``pick`` over the hits' load-job counts; None where the tier reported none."""
    counts = [r.counted[LOAD_JOBS] for r in group if LOAD_JOBS in r.counted]
    return pick(counts) if counts else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def machine_id() -> str:
    """This machine's boot id (a fresh one for each machine lent, each boot), else its
    name: reports that share it ran on one machine."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text(encoding="utf-8").strip()
    except OSError:
        return platform.node()


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


def in_process_ab(requests: list[Result]) -> list[dict[str, Any]]:
    """Per first-turn size, the CPU-tier hits of one process whose loads kvcore copied
    against those whose loads were drawn for stock's copy (``stock_share``): TTFT and
    reload medians of each, and kvcore's TTFT median less stock's with its bootstrap
    interval. Both arms share the process, its engine and its drift."""
    from benchmarks.median_difference import median_difference_interval

    rows = []
    for size in sizes(requests):
        hits = [r for r in requests if r.cpu_tier_hit and r.first_turn_tokens == size]
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
                "kvcore_ttft_ms_p50": _ms(statistics.median(r.ttft_s for r in kvcore)),
                "stock_ttft_ms_p50": _ms(statistics.median(r.ttft_s for r in stock)),
                "kvcore_reload_ms_p50": _ms(
                    statistics.median(r.counted.get(LOAD_TIME, 0.0) for r in kvcore)
                ),
                "stock_reload_ms_p50": _ms(
                    statistics.median(r.counted.get(LOAD_TIME, 0.0) for r in stock)
                ),
                "ttft_ms_p50_difference": _ms(
                    statistics.median(r.ttft_s for r in kvcore)
                    - statistics.median(r.ttft_s for r in stock)
                ),
                "ttft_ms_difference_interval": [_ms(low), _ms(high)],
                "reload_ms_difference_interval": [_ms(reload_low), _ms(reload_high)],
            }
        )
    return rows


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


def compare_hits(requests: list[Result], reference: list[Result]) -> list[dict[str, Any]]:
    """Per first-turn size, a mode's CPU-tier-hit TTFT against the reference mode's: the
    difference of the medians (negative: faster than the reference) with its bootstrap
    interval, so that a size's gain or loss is told apart from the engine's own spread."""
    from benchmarks.median_difference import median_difference_interval

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
                "ttft_ms_p50_difference": _ms(statistics.median(mine) - statistics.median(theirs)),
                "ttft_ms_difference_interval": [_ms(low), _ms(high)],
            }
        )
    return rows


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
                    "stock_ttft_ms_p50": [_ms(t) for t in stock_ttft],
                    "ttft_ms_p50": [_ms(t) for t in other_ttft],
                    "stock_reload_ms_p50": [_ms(r) for _, r in medians["stock"]],
                    "reload_ms_p50": [_ms(r) for _, r in medians["other"]],
                    "speed": None if speed is None else round(speed.median, 3),
                    "speed_interval": None
                    if speed is None
                    else [round(speed.low, 3), round(speed.high, 3)],
                    "stock_spread": round(max(stock_ttft) / min(stock_ttft), 3),
                }
            )
        compared[mode] = rows
    return compared


def combine(reports: list[dict[str, Any]], device: str, version: str) -> dict[str, Any]:
    """The summary across runs (keyed by label: a mode run again is ``<mode>-2``, ...);
    outputs and hit TTFT are compared with the first report's, and modes run in several
    processes with stock's in pairs (:func:`paired_processes`)."""
    reference = [r["output"] for r in reports[0]["sequential_requests"]]
    reference_requests = [Result(**r) for r in reports[0]["sequential_requests"]]
    modes: dict[str, dict[str, Any]] = {}
    for report, label in zip(reports, unique_labels(reports), strict=True):
        outputs = [r["output"] for r in report["sequential_requests"]]
        requests = [Result(**r) for r in report["sequential_requests"]]
        sequential = summarize(requests, report["sequential"].get("wall_s"))
        concurrent = report.get("concurrent", {})
        modes[label] = {
            "ttft_ms_p50": sequential["ttft_ms_p50"],
            "ttft_ms_p99": sequential["ttft_ms_p99"],
            "tokens_per_s": concurrent.get("tokens_per_s", sequential.get("tokens_per_s")),
            "outputs_identical": outputs == reference,
            "sequential": sequential,
            "concurrent": concurrent,
            "hit_ttft_against_first_mode": compare_hits(requests, reference_requests),
            "kvcore_counters": {
                k: v for k, v in report["metrics_end"].items() if k.startswith("kvcore_")
            },
        }
        if any(r.copies for r in requests):
            modes[label]["in_process_ab"] = in_process_ab(requests)
    summary = {"device": device, "engine": "vllm", "version": version, "modes": modes}
    paired = paired_processes(reports)
    if paired:
        summary["paired_processes"] = paired
    return summary


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
    one.add_argument("--concurrency", type=int, default=8)
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
    args = parser.parse_args(argv)
    if args.command == "run":
        if args.turns < 2:
            parser.error("--turns must be at least 2: hits come from later turns")
        report = run(args)
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
    summary = combine(reports, args.device, args.version)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
