"""scripts/live_trace.py against a stand-in server: the trace's shape, its streamed timing,
its per-request /metrics differences and the summary across modes."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from benchmarks.vllm.live_trace_attribution import ATTRIBUTED, ab_copies, attribute_copies
from benchmarks.vllm.live_trace_combine import combine
from benchmarks.vllm.live_trace_compare import compare_hits, in_process_ab
from benchmarks.vllm.live_trace_concurrency import paired_concurrency
from benchmarks.vllm.live_trace_metrics import LOAD_BYTES, LOAD_JOBS, LOAD_TIME, parse_metrics
from benchmarks.vllm.live_trace_result import Result
from benchmarks.vllm.live_trace_run import machine_id
from benchmarks.vllm.live_trace_shape import (
    FIRST_TURN_TOKENS,
    SYSTEM_PROMPT_TOKENS,
    TOKEN_RANGE,
    make_conversations,
    turn_orders,
)
from benchmarks.vllm.live_trace_summary import percentile, summarize
from tests.support.scripts import load_script

live_trace = load_script("live_trace")


class StandIn:
    """A server that answers each prompt with tokens derived from it (``shift`` changes
    them) and counts a CPU-tier load for every prompt that extends an earlier answer."""

    def __init__(self, shift: int = 0) -> None:
        self.shift = shift
        self.seen: list[tuple[int, ...]] = []
        self.load_bytes = 0.0
        self.load_time = 0.0
        self.lock = threading.Lock()

    def answer(self, prompt: list[int], count: int) -> list[int]:
        with self.lock:
            if any(len(p) < len(prompt) and tuple(prompt[: len(p)]) == p for p in self.seen):
                self.load_bytes += 1000.0 * len(prompt)
                self.load_time += 0.002
            start = sum(prompt) % 5000 + self.shift
            output = [start + i for i in range(count)]
            self.seen.append(tuple(prompt + output))
        return output

    def metrics(self) -> str:
        return "\n".join(
            [
                "# HELP vllm:kv_offload_load_bytes_total bytes",
                f'vllm:kv_offload_load_bytes_total{{engine="0"}} {self.load_bytes}',
                f"vllm:kv_offload_load_time_total {self.load_time}",
                'vllm:kv_offload_load_size_bucket{le="1e6"} 3.0',
                f'kvcore_transfers_total{{direction="h2d",path="gather"}} {len(self.seen)}',
                "vllm:unrelated_total 7.0",
            ]
        )


@pytest.fixture
def serve() -> Iterator:
    servers = []

    def start(stand_in: StandIn) -> str:
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                del args

            def do_GET(self) -> None:
                body = stand_in.metrics().encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                assert request["stream"] and request["return_token_ids"]
                assert request["temperature"] == 0.0 and request["ignore_eos"]
                output = stand_in.answer(request["prompt"], request["max_tokens"])
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                first = {"choices": [{"text": "", "token_ids": []}]}
                self.wfile.write(f"data: {json.dumps(first)}\n\n".encode())
                for token in output:
                    event = {"choices": [{"text": "", "token_ids": [token]}]}
                    self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()


def test_trace_shape_sizes_shared_system_prompts_and_turn_orders():
    conversations = make_conversations(14, 3, seed=5)
    assert [c.size for c in conversations] == list(FIRST_TURN_TOKENS) * 2
    assert len({tuple(c.system) for c in conversations}) == len(SYSTEM_PROMPT_TOKENS)
    low, high = TOKEN_RANGE
    assert all(low <= t < high for c in conversations for t in c.prompt(0))
    orders = turn_orders(14, 3, seed=5)
    assert all(sorted(order) == list(range(14)) for order in orders)
    assert orders[0] != orders[1]
    # The same seed, the same trace: modes compare like with like.
    again = make_conversations(14, 3, seed=5)
    assert [c.prompt(0) for c in again] == [c.prompt(0) for c in conversations]


def test_metrics_page_sums_label_sets_and_drops_buckets_and_other_series():
    page = StandIn().metrics()
    assert parse_metrics(page) == {
        "vllm:kv_offload_load_bytes": 0.0,
        "vllm:kv_offload_load_time": 0.0,
        "kvcore_transfers": 0.0,
    }


def test_metrics_page_takes_a_gauge_of_several_processes_at_its_lowest_not_their_sum():
    page = "\n".join(
        [
            "# TYPE kvcore_allocator_one_run_fraction gauge",
            'kvcore_allocator_one_run_fraction{pid="1"} 1.0',
            'kvcore_allocator_one_run_fraction{pid="2"} 0.75',
            "# TYPE kvcore_transfers_total counter",
            'kvcore_transfers_total{pid="1"} 3',
            'kvcore_transfers_total{pid="2"} 4',
        ]
    )
    assert parse_metrics(page) == {
        "kvcore_allocator_one_run_fraction": 0.75,
        "kvcore_transfers": 7.0,
    }


def test_sequential_pass_times_streams_and_marks_cpu_tier_hits(serve, tmp_path):
    stand_in = StandIn()
    url = serve(stand_in)
    out = tmp_path / "stock.json"
    argv = ["run", "--url", url, "--model", "m", "--mode", "stock", "--out", str(out)]
    assert live_trace.main([*argv, "--conversations", "7", "--concurrency", "3"]) == 0
    report = json.loads(out.read_text())
    requests = report["sequential_requests"]
    assert len(requests) == 7 * 3
    # Every later turn extends its conversation's last answer: a hit; first turns are not.
    hits = [r for r in requests if r["counted"].get(LOAD_BYTES, 0) > 0]
    assert sorted((r["conversation"], r["turn"]) for r in hits) == sorted(
        (c, t) for c in range(7) for t in (1, 2)
    )
    assert all(r["counted"][LOAD_BYTES] == 1000.0 * r["prompt_tokens"] for r in hits)
    assert all(len(r["output"]) == 16 and 0 < r["ttft_s"] <= r["total_s"] for r in requests)
    summary = report["sequential"]
    assert summary["cpu_tier_hits"] == 14 and summary["requests"] == 21
    assert summary["reload_ms_p50"] == 2.0
    assert [row["first_turn_tokens"] for row in summary["by_size"]] == list(FIRST_TURN_TOKENS)
    assert report["concurrent"]["requests"] == 21 and report["concurrent"]["tokens_per_s"] > 0


def test_combine_compares_outputs_with_the_first_mode(serve, tmp_path):
    paths = []
    for mode, shift, startup in (("stock", 0, "81"), ("kvcore", 0, "23.5"), ("broken", 1, None)):
        out = tmp_path / f"{mode}.json"
        url = serve(StandIn(shift))
        argv = ["run", "--url", url, "--model", "m", "--mode", mode, "--out", str(out)]
        if startup is not None:
            argv += ["--startup-s", startup, "--cpu-tier-gib", "48"]
        live_trace.main([*argv, "--conversations", "3", "--concurrency", "1"])
        paths.append(str(out))
    summary_path = tmp_path / "summary.json"
    assert live_trace.main(["combine", *paths, "--out", str(summary_path), "--device", "d"]) == 0
    summary = json.loads(summary_path.read_text())
    assert summary["device"] == "d" and summary["engine"] == "vllm"
    modes = summary["modes"]
    assert [modes[m]["outputs_identical"] for m in ("stock", "kvcore", "broken")] == [
        True,
        True,
        False,
    ]
    assert modes["kvcore"]["kvcore_counters"] == {"kvcore_transfers": 9.0}
    # Each server's start-up, as the run script timed it, with its CPU tier's size.
    startups = [(modes[m]["startup_s"], modes[m]["cpu_tier_gib"]) for m in modes]
    assert startups == [(81.0, 48.0), (23.5, 48.0), (None, None)]
    assert modes["stock"]["ttft_ms_p50"] is not None and modes["stock"]["tokens_per_s"] > 0


def test_percentile_is_nearest_rank():
    assert percentile([], 0.99) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile(list(range(100)), 0.99) == 98


def test_a_first_turn_that_loads_only_a_shared_system_prompt_is_not_a_hit():
    def result(turn: int, loaded: float, ttft_s: float):
        counted = {LOAD_BYTES: loaded, LOAD_TIME: loaded / 1e10}
        return Result(0, 512, turn, 512, ttft_s, ttft_s, [1], counted)

    cold_with_system_prompt = result(0, 4096.0, 0.9)
    hit, miss = result(1, 1e6, 0.05), result(2, 0.0, 0.2)
    assert [r.cpu_tier_hit for r in (cold_with_system_prompt, hit, miss)] == [False, True, False]
    summary = summarize([cold_with_system_prompt, hit, miss])
    assert summary["cpu_tier_hits"] == 1 and summary["ttft_ms_p50"] == 50.0
    assert summary["reload_bytes"] == 1e6 and summary["cold_ttft_ms_p50"] == 900.0


def _hits(size: int, ttfts_s: list[float]) -> list:
    counted = {LOAD_BYTES: 1e6, LOAD_TIME: 1e-3}
    return [Result(i, size, 1, size, t, t, [1], counted) for i, t in enumerate(ttfts_s)]


def test_hit_comparison_is_per_size_with_an_interval_that_holds_the_median_difference():
    stock = _hits(512, [0.050, 0.060, 0.070, 0.055, 0.065]) + _hits(1024, [0.1, 0.1])
    faster = _hits(512, [0.020, 0.030, 0.040, 0.025, 0.035])
    rows = compare_hits(faster, stock)
    assert [row["first_turn_tokens"] for row in rows] == [512]
    (row,) = rows
    assert row["hits"] == 5 and row["reference_hits"] == 5
    assert row["ttft_ms_p50_difference"] == pytest.approx(-30.0)
    low, high = row["ttft_ms_difference_interval"]
    assert low <= -30.0 <= high and high < 0


def test_hit_comparison_interval_spans_zero_for_the_same_spread():
    same = [0.050, 0.080, 0.055, 0.075, 0.060, 0.070, 0.065]
    (row,) = compare_hits(_hits(2048, same), _hits(2048, list(reversed(same))))
    low, high = row["ttft_ms_difference_interval"]
    assert row["ttft_ms_p50_difference"] == 0.0 and low < 0 < high


def test_misses_and_first_turns_are_not_compared():
    counted = {LOAD_BYTES: 0.0}
    miss = Result(0, 512, 1, 600, 0.2, 0.2, [1], counted)
    assert compare_hits([miss], _hits(512, [0.05])) == []


def test_each_size_splits_hit_ttft_into_reload_and_the_rest_and_counts_load_jobs():
    def hit(size: int, ttft_s: float, load_s: float, jobs: float | None) -> Any:
        counted = {LOAD_BYTES: 1e6, LOAD_TIME: load_s}
        if jobs is not None:
            counted[LOAD_JOBS] = jobs
        return Result(0, size, 1, size, ttft_s, ttft_s, [1], counted)

    hits = [hit(512, 0.050, 0.010, 1), hit(512, 0.070, 0.020, 2), hit(512, 0.060, 0.030, 1)]
    hits.append(hit(1024, 0.080, 0.040, None))
    by_size = {row["first_turn_tokens"]: row for row in summarize(hits)["by_size"]}
    # TTFT less reload: 40, 50, 30 ms; the median is 40.
    assert by_size[512]["other_ms_p50"] == pytest.approx(40.0)
    assert by_size[512]["load_jobs_p50"] == 1 and by_size[512]["load_jobs_max"] == 2
    # A tier that reports no load-size histogram: no job count, not zero.
    assert by_size[1024]["load_jobs_p50"] is None and by_size[1024]["load_jobs_max"] is None
    # No cold first turn of either size among these requests.
    assert by_size[512]["cold_ttft_ms_p50"] is None and by_size[512]["prompt_tokens_p50"] == 512


def test_each_size_puts_its_hits_beside_its_cold_first_turns():
    counted = {LOAD_BYTES: 1e6, LOAD_TIME: 0.01}
    hits = [Result(0, 512, t, 560 + t, 0.040 + t / 100, 0.1, [1, 2], counted) for t in (1, 2)]
    firsts = [
        Result(c, size, 0, size, ttft, 0.1, [1, 2])
        for c, size, ttft in ((1, 512, 0.030), (2, 512, 0.050), (3, 512, 0.070), (4, 1024, 0.090))
    ]
    (row,) = summarize([*hits, *firsts])["by_size"]
    assert row["first_turn_tokens"] == 512 and row["hits"] == 2
    assert row["ttft_ms_p50"] == pytest.approx(55.0) and row["prompt_tokens_p50"] == 561.5
    assert row["cold_ttft_ms_p50"] == pytest.approx(50.0)
    assert row["cold_prompt_tokens_p50"] == 512


def _report(mode: str, label: str, ttfts_s: dict[int, list[float]], load_s: float) -> dict:
    counted = {LOAD_BYTES: 1e6, LOAD_TIME: load_s}
    requests = [
        Result(i, size, 1, size, t, t, [1], counted)
        for size, times in ttfts_s.items()
        for i, t in enumerate(times)
    ]
    return {
        "mode": mode,
        "label": label,
        "sequential": {"wall_s": 1.0},
        "sequential_requests": [asdict(r) for r in requests],
        "metrics_end": {},
    }


def test_repeated_modes_are_paired_with_stock_process_by_process():
    # Process drift: the second pair runs 20% slower on both sides; kvcore is 10% faster
    # than the stock process beside it at 512 tokens, and no faster at 1024.
    reports = []
    for drift in (1.0, 1.2, 1.1):
        stock = {512: [0.050 * drift, 0.060 * drift, 0.055 * drift], 1024: [0.07 * drift] * 3}
        mine = {512: [t / 1.1 for t in stock[512]], 1024: list(stock[1024])}
        reports.append(_report("stock", f"stock-{drift}", stock, 0.004))
        reports.append(_report("kvcore-transfers", f"kvcore-{drift}", mine, 0.003))
    reports.append(_report("kvcore", "kvcore", {512: [0.05]}, 0.004))
    summary = combine(reports, "d", "v")
    assert set(summary["modes"]) == {r["label"] for r in reports}
    paired = summary["paired_processes"]
    # A mode that ran once is not paired.
    assert list(paired) == ["kvcore-transfers"]
    rows = {row["first_turn_tokens"]: row for row in paired["kvcore-transfers"]}
    assert rows[512]["processes"] == 3
    assert rows[512]["speed"] == pytest.approx(1.1, abs=1e-3)
    low, high = rows[512]["speed_interval"]
    assert low == pytest.approx(1.1, abs=1e-3) and high == pytest.approx(1.1, abs=1e-3)
    assert rows[1024]["speed"] == pytest.approx(1.0)
    assert rows[512]["stock_spread"] == pytest.approx(1.2)
    assert rows[512]["stock_ttft_ms_p50"] == [55.0, 66.0, 60.5]
    assert rows[512]["reload_ms_p50"] == [3.0, 3.0, 3.0]
    assert rows[512]["stock_reload_ms_p50"] == [4.0, 4.0, 4.0]


def test_one_process_a_mode_has_no_pairs():
    reports = [
        _report("stock", "stock", {512: [0.05, 0.06]}, 0.004),
        _report("kvcore-transfers", "kvcore-transfers", {512: [0.05, 0.06]}, 0.003),
    ]
    assert "paired_processes" not in combine(reports, "d", "v")


def test_reports_of_two_calls_keep_every_run_under_its_own_label():
    first_call = [_report("stock", "stock", {512: [0.05]}, 0.004)]
    second_call = [_report("stock", "stock", {512: [0.06]}, 0.004)] * 2
    summary = combine(first_call + second_call, "d", "v")
    assert list(summary["modes"]) == ["stock", "stock#2", "stock#3"]
    assert summary["modes"]["stock#2"]["ttft_ms_p50"] == 60.0


class SharingStandIn(StandIn):
    """A stand-in whose every load is one load job, logged as kvcore's handler logs it
    while it shares loads with stock: every third job drawn for stock's copy."""

    def __init__(self, log) -> None:
        super().__init__()
        self.log = log
        self.copies: list[str] = []

    def answer(self, prompt: list[int], count: int) -> list[int]:
        loaded = self.load_bytes
        output = super().answer(prompt, count)
        if self.load_bytes != loaded:
            copy = "stock_share" if len(self.copies) % 3 == 2 else "kvcore"
            self.copies.append(copy)
            with self.log.open("a") as log:
                log.write(f"INFO kvcore A/B: load job {len(self.copies)}, 12 blocks: {copy}\n")
        return output

    def metrics(self) -> str:
        return f"{super().metrics()}\nvllm:kv_offload_load_size_count {len(self.copies)}.0"


def test_ab_log_gives_each_hit_its_loads_copy_and_combine_compares_the_arms(serve, tmp_path):
    log = tmp_path / "server.log"
    # Lines from before the trace (start-up, another pass) are not the trace's.
    log.write_text("INFO kvcore A/B: load job 0, 3 blocks: few_pages\nINFO other\n")
    stand_in = SharingStandIn(log)
    out = tmp_path / "ab.json"
    argv = ["run", "--url", serve(stand_in), "--model", "m", "--mode", "kvcore-ab"]
    argv += ["--out", str(out), "--ab-log", str(log), "--conversations", "14"]
    assert live_trace.main([*argv, "--concurrency", "1"]) == 0
    report = json.loads(out.read_text())
    assert report["ab_attribution"] == "every load job's copy attributed"
    requests = report["sequential_requests"]
    assert [c for r in requests for c in r["copies"]] == stand_in.copies
    assert all(len(r["copies"]) == (r["turn"] > 0) for r in requests)
    summary_path = tmp_path / "summary.json"
    assert live_trace.main(["combine", str(out), "--out", str(summary_path)]) == 0
    rows = json.loads(summary_path.read_text())["modes"]["kvcore-ab"]["in_process_ab"]
    arms: dict[int, list[str]] = {}
    for r in requests:
        arms.setdefault(r["first_turn_tokens"], []).extend(r["copies"])
    # A size is compared where both arms have hits, with every hit of the size in one.
    both = {size: copies for size, copies in arms.items() if len(set(copies)) == 2}
    assert both and [row["first_turn_tokens"] for row in rows] == sorted(both)
    for row in rows:
        copies = both[row["first_turn_tokens"]]
        assert row["kvcore_hits"] == copies.count("kvcore")
        assert row["stock_hits"] == copies.count("stock_share")


def test_copies_are_not_attributed_where_the_log_and_the_job_counts_disagree():
    counted = {LOAD_BYTES: 1e6, LOAD_JOBS: 2.0}
    results = [Result(0, 512, 1, 600, 0.05, 0.06, [1], dict(counted))]
    problem = attribute_copies(results, ["kvcore"])
    assert problem == "1 A/B lines for 2 load jobs; copies not attributed"
    assert results[0].copies == []
    assert attribute_copies(results, ["kvcore", "stock_share"]) is None
    assert results[0].copies == ["kvcore", "stock_share"]


def test_a_load_jobs_line_logged_twice_counts_once(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(
        "INFO kvcore A/B: load job 0, 3 blocks: few_pages\n"
        "(EngineCore) INFO kvcore A/B: load job 4, 9 blocks: kvcore\n"
        "(EngineCore) INFO:kvcore.vllm:kvcore A/B: load job 4, 9 blocks: kvcore\n"
        "(EngineCore) INFO kvcore A/B: load job 7, 9 blocks: stock_share\n"
        "(EngineCore) INFO:kvcore.vllm:kvcore A/B: load job 7, 9 blocks: stock_share\n"
    )
    assert ab_copies(log, 0) == ["few_pages", "kvcore", "stock_share"]
    offset = len(log.read_text().splitlines()[0]) + 1
    assert ab_copies(log, offset) == ["kvcore", "stock_share"]


def test_attribute_takes_the_copies_again_from_the_saved_log(tmp_path):
    counted = {LOAD_BYTES: 1e6, LOAD_JOBS: 1.0}
    requests = [Result(c, 2048, 1, 2200, 0.07, 0.08, [c], dict(counted)) for c in range(3)]
    log = tmp_path / "server.log"
    log.write_text(
        "INFO kvcore A/B: load job 1, 3 blocks: few_pages\n"
        + "".join(
            f"INFO kvcore A/B: load job {job}, 9 blocks: {copy}\n" * 2
            for job, copy in ((5, "kvcore"), (6, "stock_share"), (8, "kvcore"))
        )
    )
    report = {
        "label": "kvcore-ab",
        "ab_log_offset": len("INFO kvcore A/B: load job 1, 3 blocks: few_pages\n"),
        "ab_attribution": "6 A/B lines for 3 load jobs; copies not attributed",
        "sequential_requests": [asdict(r) for r in requests],
    }
    path, out = tmp_path / "report.json", tmp_path / "again.json"
    path.write_text(json.dumps(report))
    argv = ["attribute", str(path), "--ab-log", str(log), "--out", str(out)]
    assert live_trace.main(argv) == 0
    again = json.loads(out.read_text())
    assert again["ab_attribution"] == ATTRIBUTED
    assert [r["copies"] for r in again["sequential_requests"]] == [
        ["kvcore"],
        ["stock_share"],
        ["kvcore"],
    ]
    # Without the recorded offset the start-up line is counted, and nothing is attributed.
    del report["ab_log_offset"]
    path.write_text(json.dumps(report))
    assert live_trace.main(argv) == 1
    assert json.loads(out.read_text())["sequential_requests"][0]["copies"] == []


def _hit(ttft_s: float, copies: list[str], size: int = 2048, load_bytes: float = 1e6) -> Any:
    """A CPU-tier hit whose reload took a tenth of its TTFT."""
    counted = {LOAD_BYTES: load_bytes, LOAD_TIME: ttft_s / 10}
    return Result(0, size, 1, size, ttft_s, ttft_s, [1], counted, copies)


def test_in_process_ab_compares_kvcores_hits_with_stocks_and_leaves_mixed_ones_out():
    requests = [_hit(t, ["kvcore"]) for t in (0.050, 0.052, 0.054)]
    requests += [_hit(t, ["stock_share"]) for t in (0.060, 0.062)]
    # Mixed copies, a rule's pass, and a size with one arm only: in neither arm.
    requests += [_hit(0.001, ["kvcore", "stock_share"]), _hit(0.001, ["few_pages"])]
    requests.append(_hit(0.070, ["kvcore"], size=4096))
    (row,) = in_process_ab(requests)
    assert row["first_turn_tokens"] == 2048
    assert (row["kvcore_hits"], row["stock_hits"]) == (3, 2)
    assert row["kvcore_ttft_ms_p50"] == 52.0 and row["stock_ttft_ms_p50"] == 61.0
    assert row["kvcore_reload_ms_p50"] == 5.2 and row["stock_reload_ms_p50"] == 6.1
    assert row["ttft_ms_p50_difference"] == pytest.approx(-9.0)
    low, high = row["ttft_ms_difference_interval"]
    assert low <= -9.0 <= high < 0
    low, high = row["reload_ms_difference_interval"]
    assert low <= -0.9 <= high < 0


def test_in_process_ab_leaves_out_a_later_turns_top_up_load():
    # The kvcore arm reloads the whole 32k prefix; stock's only draw was a later turn that
    # found most of its conversation on the GPU and loaded a fourteenth of it.
    requests = [_hit(0.120, ["kvcore"], 32000, load_bytes=4.2e9)]
    requests.append(_hit(0.049, ["stock_share"], 32000, load_bytes=0.3e9))
    assert in_process_ab(requests) == []
    requests.append(_hit(0.130, ["stock_share"], 32000, load_bytes=4.0e9))
    (row,) = in_process_ab(requests)
    assert (row["kvcore_hits"], row["stock_hits"], row["top_ups_left_out"]) == (1, 1, 1)
    assert row["ttft_ms_p50_difference"] == pytest.approx(-10.0)


def test_a_trace_of_chosen_first_turns_is_summarized_at_those_sizes_only():
    conversations = make_conversations(6, 2, seed=1, first_turns=[768, 1536])
    assert [c.size for c in conversations] == [768, 1536] * 3
    requests = [
        _hit(t, [copy], size)
        for size in (768, 1536)
        for t, copy in ((0.010, "kvcore"), (0.011, "kvcore"), (0.012, "stock_share"))
    ]
    assert [row["first_turn_tokens"] for row in in_process_ab(requests)] == [
        768,
        1536,
    ]
    assert [row["first_turn_tokens"] for row in summarize(requests, None)["by_size"]] == [
        768,
        1536,
    ]


@pytest.mark.parametrize("text", ["", "1024,abc", "256,1024"])
def test_first_turn_sizes_refuse_what_no_conversation_could_hold(text: str) -> None:
    with pytest.raises(SystemExit):
        live_trace.main(
            ["run", "--model", "m", "--mode", "stock", "--out", "x", "--first-turn-tokens", text]
        )
    with pytest.raises(ValueError, match="at least 512"):
        make_conversations(2, 2, seed=0, first_turns=[256])


def test_processes_are_paired_on_their_own_machine_only():
    # Machine "b" runs everything 20% slower; on each machine kvcore is 10% faster than
    # stock. Paired across machines (by order alone) the pairs would disagree.
    def on(machine: str, mode: str, label: str, ttft_s: float) -> dict:
        report = _report(mode, label, {512: [ttft_s] * 3}, 0.004)
        report["machine"] = machine
        return report

    reports = [
        on("a", "stock", "stock", 0.050),
        on("a", "kvcore-transfers", "kvcore-transfers", 0.050 / 1.1),
        on("a", "stock", "stock-2", 0.050),
        on("b", "kvcore-transfers", "kvcore-transfers", 0.060 / 1.1),
        on("b", "stock", "stock", 0.060),
        on("b", "kvcore-transfers", "kvcore-transfers-2", 0.060 / 1.1),
    ]
    (row,) = combine(reports, "d", "v")["paired_processes"]["kvcore-transfers"]
    assert row["pairs"] == [
        ["stock", "kvcore-transfers"],
        ["stock-2", "kvcore-transfers"],
        ["stock#2", "kvcore-transfers#2"],
        ["stock#2", "kvcore-transfers-2"],
    ]
    assert row["speed"] == pytest.approx(1.1, abs=1e-3)
    assert row["speed_interval"] == [pytest.approx(1.1, abs=1e-3)] * 2


def test_a_report_names_the_machine_it_ran_on_and_combine_falls_back_to_its_folder(serve, tmp_path):
    assert machine_id()
    paths = []
    for call in ("one", "two"):
        out = tmp_path / call / "live-stock.json"
        out.parent.mkdir()
        argv = ["run", "--url", serve(StandIn()), "--model", "m", "--mode", "stock"]
        live_trace.main([*argv, "--out", str(out), "--conversations", "2", "--concurrency", "1"])
        report = json.loads(out.read_text())
        assert report["machine"] == machine_id()
        del report["machine"]  # as written before reports named it
        out.write_text(json.dumps(report))
        paths.append(str(out))
    for call in ("one", "two"):
        for label in ("kvcore-transfers", "kvcore-transfers-2"):
            path = tmp_path / call / f"live-{label}.json"
            report = json.loads((tmp_path / call / "live-stock.json").read_text())
            path.write_text(json.dumps({**report, "mode": "kvcore-transfers", "label": label}))
            paths.append(str(path))
    summary_path = tmp_path / "summary.json"
    assert live_trace.main(["combine", *paths, "--out", str(summary_path)]) == 0
    rows = json.loads(summary_path.read_text())["paired_processes"]["kvcore-transfers"]
    # Each call's folder is its machine: its one stock process goes with both of its own.
    assert rows[0]["pairs"] == [
        ["stock", "kvcore-transfers"],
        ["stock", "kvcore-transfers-2"],
        ["stock#2", "kvcore-transfers#2"],
        ["stock#2", "kvcore-transfers-2#2"],
    ]


@pytest.mark.parametrize(
    ("text", "levels"), [("8", [8]), ("8,32", [8, 32]), ("1,32,8", [1, 32, 8])]
)
def test_concurrency_is_a_list_of_levels_in_the_order_given(text: str, levels: list[int]) -> None:
    assert live_trace._levels(text) == levels


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("8,x", "not a comma-separated list of integers: '8,x'"),
        ("", "not a comma-separated list of integers: ''"),
        ("8,,32", "not a comma-separated list of integers: '8,,32'"),
        ("2.5", "not a comma-separated list of integers: '2.5'"),
        ("0", "a level below 1 in '0'"),
        ("8,-1", "a level below 1 in '8,-1'"),
        ("8,8", "a level given twice in '8,8'"),
    ],
)
def test_a_bad_concurrency_is_a_one_line_usage_error(text: str, reason: str, capsys) -> None:
    argv = ["run", "--model", "m", "--mode", "stock", "--out", "x", "--concurrency", text]
    with pytest.raises(SystemExit) as stopped:
        live_trace.main(argv)
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert error.splitlines()[-1].endswith(f" run: error: argument --concurrency: {reason}")
    assert "Traceback" not in error


def test_summary_times_each_output_token_after_the_first_and_counts_output_tokens_per_s():
    def request(tpot_s: float, outputs: int) -> Result:
        return Result(0, 512, 0, 100, 0.25, 0.25 + tpot_s * (outputs - 1), [7] * outputs)

    # 10 to 100 ms a token, over 2 to 11 output tokens; a request of one token has no
    # time per output token and is left out of it.
    requests = [request(0.010 * n, n + 1) for n in range(1, 11)] + [request(0.0, 1)]
    summary = summarize(requests, 4.0)
    # The median of ten; the nearest rank's 0.9 is the ninth (an interpolation gives 91).
    assert summary["tpot_ms_p50"] == 55.0 and summary["tpot_ms_p90"] == 90.0
    # 66 output tokens and 1100 prompt tokens over 4 s.
    assert summary["output_tokens_per_s"] == 16.5 and summary["tokens_per_s"] == 291.5
    assert "output_tokens_per_s" not in summarize(requests)
    alone = summarize([request(0.0, 1)], 1.0)
    assert alone["tpot_ms_p50"] is None and alone["tpot_ms_p90"] is None
    assert alone["output_tokens_per_s"] == 1.0


def test_each_concurrency_level_runs_its_own_pass_on_its_own_conversations(serve, tmp_path):
    stand_in = StandIn()
    out = tmp_path / "stock.json"
    argv = ["run", "--url", serve(stand_in), "--model", "m", "--mode", "stock"]
    argv += ["--out", str(out), "--conversations", "4", "--concurrency", "1,3,2"]
    assert live_trace.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["concurrency"] == [1, 3, 2]
    levels = report["concurrent_levels"]
    assert [level["concurrency"] for level in levels] == [3, 2]
    assert [level["requests"] for level in levels] == [12, 12]
    assert all(level["output_tokens_per_s"] > 0 for level in levels)
    assert all(level["tpot_ms_p50"] is not None for level in levels)
    assert report["concurrent"] == {k: v for k, v in levels[0].items() if k != "concurrency"}
    # The sequential pass and each level send prompts of their own: none is sent twice.
    assert len(stand_in.seen) == 3 * 12 and len(set(stand_in.seen)) == 3 * 12


def test_concurrent_passes_answer_at_their_own_length(serve, tmp_path):
    class Lengths(StandIn):
        def __init__(self) -> None:
            super().__init__()
            self.counts: list[int] = []

        def answer(self, prompt: list[int], count: int) -> list[int]:
            self.counts.append(count)
            return super().answer(prompt, count)

    stand_in = Lengths()
    out = tmp_path / "stock.json"
    argv = ["run", "--url", serve(stand_in), "--model", "m", "--mode", "stock"]
    argv += ["--out", str(out), "--conversations", "3", "--concurrency", "2"]
    assert live_trace.main([*argv, "--max-tokens", "4", "--concurrent-max-tokens", "40"]) == 0
    # The sequential pass's 9 answers are 4 tokens long, the concurrent pass's 9 are 40.
    assert stand_in.counts[:9] == [4] * 9 and stand_in.counts[9:] == [40] * 9
    report = json.loads(out.read_text())
    assert report["settings"]["concurrent_max_tokens"] == 40
    level = report["concurrent_levels"][0]
    assert level["output_tokens_per_s"] > 0 and level["tpot_ms_p50"] is not None


@pytest.mark.parametrize("option", ["--max-tokens", "--concurrent-max-tokens"])
def test_an_answer_length_under_one_is_a_one_line_usage_error(option: str, capsys) -> None:
    argv = ["run", "--model", "m", "--mode", "stock", "--out", "x", option, "0"]
    with pytest.raises(SystemExit) as stopped:
        live_trace.main(argv)
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert error.splitlines()[-1].endswith(f"error: {option} 0: give 1 or more tokens")


def _levels_report(
    mode: str, label: str, machine: str, levels: dict[int, tuple[float, float | None]]
) -> dict:
    """A report of concurrent passes only: per level, output tokens/s and TPOT p50 (ms)."""
    return {
        "mode": mode,
        "label": label,
        "machine": machine,
        "concurrent_levels": [
            {"concurrency": level, "output_tokens_per_s": tps, "tpot_ms_p50": tpot}
            for level, (tps, tpot) in levels.items()
        ],
    }


def test_concurrent_passes_are_paired_per_level_with_stocks_processes():
    # An older report (no levels) comes first: it keeps the label "stock" but pairs with
    # nothing, or stock would have three processes and kvcore's be taken again.
    old = {"mode": "stock", "label": "stock", "machine": "a", "concurrent": {}}
    reports = [
        old,
        _levels_report("stock", "stock", "a", {8: (100.0, 20.0), 32: (300.0, 40.0)}),
        _levels_report("kvcore", "kvcore", "a", {8: (110.0, 16.0), 32: (300.0, 40.0)}),
        _levels_report("stock", "stock-2", "a", {8: (120.0, 24.0), 32: (330.0, None)}),
        _levels_report("kvcore", "kvcore-2", "a", {8: (156.0, 20.0), 32: (330.0, 44.0)}),
        # One process: not paired. A level only one pair ran: not compared.
        _levels_report("kvcore-ab", "kvcore-ab", "a", {8: (1.0, 1.0)}),
    ]
    reports[1]["concurrent_levels"].append(
        {"concurrency": 64, "output_tokens_per_s": 1.0, "tpot_ms_p50": 1.0}
    )
    reports[2]["concurrent_levels"].append(
        {"concurrency": 64, "output_tokens_per_s": 2.0, "tpot_ms_p50": 1.0}
    )
    paired = paired_concurrency(reports)
    assert list(paired) == ["kvcore"]
    at_8, at_32 = paired["kvcore"]
    assert at_8 == {
        "concurrency": 8,
        "processes": 2,
        "pairs": [["stock#2", "kvcore"], ["stock-2", "kvcore-2"]],
        "stock_output_tokens_per_s": [100.0, 120.0],
        "output_tokens_per_s": [110.0, 156.0],
        # kvcore's tokens/s over stock's: 1.1 and 1.3; stock's TPOT over kvcore's: 1.25, 1.2.
        "throughput": 1.2,
        "throughput_interval": [1.1, 1.3],
        "stock_tpot_ms_p50": [20.0, 24.0],
        "tpot_ms_p50": [16.0, 20.0],
        "tpot_speed": 1.225,
        "tpot_speed_interval": [1.2, 1.25],
    }
    assert at_32["concurrency"] == 32
    assert (at_32["throughput"], at_32["throughput_interval"]) == (1.0, [1.0, 1.0])
    # A pass with no request of two output tokens has no TPOT: no speed, not a wrong one.
    assert at_32["stock_tpot_ms_p50"] == [40.0, None]
    assert at_32["tpot_speed"] is None and at_32["tpot_speed_interval"] is None


def test_concurrent_passes_are_not_paired_across_machines_or_from_older_reports():
    levels = {8: (100.0, 20.0)}
    reports = [
        _levels_report("stock", "stock", "a", levels),
        _levels_report("stock", "stock-2", "a", levels),
        _levels_report("kvcore", "kvcore", "b", levels),
        _levels_report("kvcore", "kvcore-2", "b", levels),
    ]
    assert paired_concurrency(reports) == {}
    older = [_report(mode, mode, {512: [0.05, 0.06]}, 0.004) for mode in ("stock", "kvcore")] * 2
    assert paired_concurrency(older) == {}
    summary = combine(older, "d", "v")
    assert "paired_processes" in summary and "paired_concurrency" not in summary
    assert summary["modes"]["stock"]["concurrent_levels"] == []


def test_combine_keeps_each_modes_levels_and_pairs_them():
    reports = []
    for label, mode, tps in (("stock", "stock", 100.0), ("kvcore", "kvcore", 90.0)) * 2:
        report = _report(mode, label, {512: [0.05]}, 0.004)
        report["concurrent_levels"] = [
            {"concurrency": 8, "output_tokens_per_s": tps, "tpot_ms_p50": 10.0}
        ]
        reports.append(report)
    summary = combine(reports, "d", "v")
    assert summary["modes"]["kvcore#2"]["concurrent_levels"] == reports[3]["concurrent_levels"]
    (row,) = summary["paired_concurrency"]["kvcore"]
    assert row["pairs"] == [["stock", "kvcore"], ["stock#2", "kvcore#2"]]
    assert row["throughput"] == 0.9 and row["tpot_speed"] == 1.0


def test_another_mode_can_stand_where_stock_does():
    """``--baseline kvcore-transfers``: a setting on top of kvcore judged against kvcore's
    own processes, hit TTFT and concurrent passes alike; stock's runs are then one mode
    among the others."""
    reports = []
    for label, mode, tps, ttft in (
        ("kvcore-transfers", "kvcore-transfers", 100.0, 0.050),
        ("kvcore-background", "kvcore-background", 120.0, 0.040),
    ) * 2:
        report = _levels_report(mode, label, "a", {32: (tps, 20.0)})
        report.update(_report(mode, label, {512: [ttft] * 3}, 0.004))
        report["machine"] = "a"
        reports.append(report)
    summary = combine(reports, "d", "v", baseline="kvcore-transfers")
    assert summary["baseline"] == "kvcore-transfers"
    assert list(summary["paired_processes"]) == ["kvcore-background"]
    (hit,) = summary["paired_processes"]["kvcore-background"]
    assert hit["speed"] == pytest.approx(1.25, abs=1e-3)
    (row,) = summary["paired_concurrency"]["kvcore-background"]
    assert row["pairs"] == [
        ["kvcore-transfers", "kvcore-background"],
        ["kvcore-transfers#2", "kvcore-background#2"],
    ]
    assert row["throughput"] == pytest.approx(1.2)
    # Against stock, the default, none of these modes has a process to pair with.
    assert "paired_processes" not in combine(reports, "d", "v")
    assert combine(reports, "d", "v")["baseline"] == "stock"
