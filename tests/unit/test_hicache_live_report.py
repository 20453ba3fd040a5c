"""The live HiCache run's report without SGLang: its summary, the combine step across modes,
and how kvcore's entry point is declared where kvcore is not installed."""

from __future__ import annotations

import json
import sys
from importlib.metadata import entry_points
from typing import Any

import pytest

from benchmarks.sglang import engine_plugins, hicache_live_combine
from benchmarks.sglang.hicache_live import options_for, parse_args
from benchmarks.sglang.hicache_live_rig import CacheCounters
from benchmarks.sglang.hicache_live_serve import RequestResult
from benchmarks.sglang.hicache_live_summary import percentile, summarize

TOKEN_BYTES = 1000


def result(index: int, size: int, loaded: int, ms: float | None, **kw: Any) -> RequestResult:
    return RequestResult(
        index=index,
        conversation=index % 3,
        turn=1,
        first_turn_tokens=size,
        prompt_tokens=size + 64,
        tokens=size + 128,
        device_hit_tokens=kw.pop("device_hit", 0),
        host_hit_tokens=loaded,
        loaded_tokens=loaded,
        loadback_ms=ms,
        issue_ms=None if ms is None else ms / 10,
        **kw,
    )


def test_percentile_is_the_nearest_rank():
    assert percentile([], 0.99) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([float(v) for v in range(1, 101)], 0.99) == 99.0


def test_summary_counts_load_backs_mismatches_and_what_the_cache_did():
    counters = CacheCounters(
        evict_calls=2, evicted_tokens=900, write_through_ops=4, write_through_tokens=1200
    )
    results = [
        result(0, 512, 0, None),
        result(1, 512, 500, 2.0),
        result(2, 512, 520, 4.0),
        result(3, 8192, 8000, 10.0, mismatched_bytes=3),
        result(4, 8192, 0, None, device_hit=64, resident_mismatched_bytes=2),
        result(5, 8192, 64, 1.0, settled_mismatched_bytes=4, start_loading_ms=0.05),
    ]
    summary = summarize(results, counters, TOKEN_BYTES)
    assert summary["loadbacks"] == 4
    assert summary["issue_ms_p50"] == 0.3 and summary["start_loading_ms_p50"] == 0.05
    assert summary["loadback_ms_p50"] == 3.0 and summary["loadback_ms_p99"] == 10.0
    assert summary["mismatched_bytes"] == 5 and summary["settled_mismatched_bytes"] == 4
    assert summary["checks_failed"] == 3
    assert summary["evictions"]["device_tokens"] == 900
    assert summary["write_throughs"] == {"ops": 4, "tokens": 1200}
    small, large = summary["by_size"]
    assert small["first_turn_tokens"] == 512 and small["loadbacks"] == 2
    assert small["loadback_ms_p50"] == 3.0 and small["loaded_tokens_p50"] == 510
    assert small["gb_per_s"] == round(510 * TOKEN_BYTES / 3.0 / 1e6, 3)
    assert large["loadbacks"] == 2


def test_an_ab_run_counts_each_copy_and_compares_only_where_stock_was_drawn():
    passed = [result(i, 512, 500, 2.0 + i, copy="stock") for i in range(3)]
    summary = summarize([*passed, result(3, 512, 0, None)], CacheCounters(), TOKEN_BYTES)
    assert summary["loadback_copies"] == {"stock": 3} and "in_process_ab" not in summary
    drawn = [
        result(0, 512, 500, 2.0, copy="kvcore"),
        result(1, 512, 500, 3.0, copy="stock_share"),
        result(2, 512, 500, 5.0, copy="stock_share"),
        result(3, 8192, 8000, 9.0, copy="stock"),
    ]
    summary = summarize(drawn, CacheCounters(), TOKEN_BYTES)
    assert summary["loadback_copies"] == {"kvcore": 1, "stock": 1, "stock_share": 2}
    (row,) = summary["in_process_ab"]
    assert (row["kvcore_loadbacks"], row["stock_loadbacks"]) == (1, 2)
    assert row["ms_p50_difference"] == -2.0
    plain = summarize([result(0, 512, 500, 2.0)], CacheCounters(), TOKEN_BYTES)
    assert "loadback_copies" not in plain and "in_process_ab" not in plain


def test_counters_wrap_the_cache_methods_and_still_return_their_results():
    class Evicted:
        num_tokens_evicted = 64

    class Controller:
        def write(self, device_indices, node_id=-1, flush=True):
            return None if node_id < 0 else list(device_indices)

    class Cache:
        def __init__(self) -> None:
            self.cache_controller = Controller()
            self.dropped: list[int] = []

        def _evict(self, params):
            return Evicted()

        def evict_host(self, num_tokens, component_type=None):
            return num_tokens // 2

        def _record_dropped_tokens(self, tokens, reason):
            self.dropped.append(tokens)

    cache, counters = Cache(), CacheCounters()
    counters.attach(cache)
    assert cache._evict(None).num_tokens_evicted == 64
    assert cache.evict_host(10) == 5
    cache._record_dropped_tokens(8, "write_through_unbacked_eviction")
    assert cache.cache_controller.write([1, 2, 3], node_id=4) == [1, 2, 3]
    assert cache.cache_controller.write([1, 2], node_id=-1) is None
    assert (counters.evict_calls, counters.evicted_tokens) == (1, 64)
    assert (counters.host_evict_calls, counters.host_evicted_tokens) == (1, 5)
    assert counters.dropped_tokens == 8 and cache.dropped == [8]
    assert (counters.write_through_ops, counters.write_through_tokens) == (1, 3)
    counters.reset()
    assert counters == CacheCounters()


def test_command_line_defaults_are_the_model_shaped_run():
    opts = options_for(parse_args(["--mode", "kvcore", "--json", "x.json"]))
    assert (opts.layers, opts.heads, opts.head_dim, opts.page_size) == (32, 8, 128, 64)
    assert opts.io_backend == "kernel" and opts.layout == "layer_first"
    assert opts.device_tokens == 40960 and opts.token_bytes == 128 * 1024
    small = options_for(
        parse_args(["--mode", "stock", "--json", "x", "--scale", "64", "--page-size", "4"])
    )
    assert small.device_tokens == 640 and small.trace.scale == 64
    labelled = parse_args(["--mode", "kvcore-allocator", "--json", "x", "--label", "alloc-2"])
    assert options_for(labelled).label == "alloc-2"
    with pytest.raises(SystemExit):
        parse_args(["--mode", "other", "--json", "x"])


# --- combine ---------------------------------------------------------------------------------


def report(mode: str, times: dict[int, float | None], mismatches: int = 0) -> dict[str, Any]:
    requests = [
        result(index, 512 if index < 2 else 32000, 500 if ms else 0, ms).to_dict()
        for index, ms in times.items()
    ]
    loads = [r["loadback_ms"] for r in requests if r["loadback_ms"] is not None]
    return {
        "mode": mode,
        "device": "NVIDIA H200",
        "version": "0.5.23",
        "layout": "layer_first",
        "io_backend": "kernel",
        "geometry": {"layers": 32},
        "trace": {"seed": 0},
        "prepared": {"plugins": {"patched_targets": ["a", "b"] if mode == "kvcore" else []}},
        "summary": {
            "loadback_ms_p50": sorted(loads)[len(loads) // 2],
            "loadback_ms_p99": max(loads),
            "loadbacks": len(loads),
            "loaded_tokens": 500 * len(loads),
            "mismatched_bytes": mismatches,
            "checks_failed": int(mismatches > 0),
            "requests": len(requests),
            "evictions": {"device_tokens": 10},
            "write_throughs": {"tokens": 20},
        },
        "requests": requests,
        "kvcore_counters": {"transfers": []} if mode == "kvcore" else None,
    }


def test_combine_gives_each_mode_and_the_ratio_per_size_over_requests_loaded_in_both():
    stock = report("stock", {0: 2.0, 1: 4.0, 2: 40.0, 3: 60.0})
    kvcore = report("kvcore", {0: 1.0, 1: 2.0, 2: 30.0, 3: None})
    summary = hicache_live_combine.combine([stock, kvcore])
    assert summary["engine"] == "sglang" and summary["device"] == "NVIDIA H200"
    assert summary["version"] == "0.5.23"
    assert summary["modes"]["stock"]["mismatches"] == 0
    assert summary["modes"]["kvcore"]["patched_targets"] == 2
    assert summary["modes"]["kvcore"]["counters"] == {"transfers": []}
    small, large = summary["by_size"]
    assert (small["stock_ms_p50"], small["kvcore_ms_p50"], small["ratio"]) == (3.0, 1.5, 0.5)
    assert large["loadbacks"] == 1 and large["ratio"] == 0.75
    assert summary["all_checks_passed"]
    assert not summary["same_hits"], "request 3 loaded in one mode only"


def test_combine_sets_every_other_run_against_stock_with_both_runs_issue_times():
    stock = report("stock", {0: 2.0, 1: 4.0, 2: 40.0})
    kvcore = report("kvcore", {0: 3.0, 1: 5.0, 2: 40.0})
    again = {**report("stock", {0: 2.5, 1: 4.5, 2: 42.0}), "label": "stock-2"}
    allocator = {**report("kvcore-allocator", {0: 4.0, 1: 4.0, 2: 44.0})}
    summary = hicache_live_combine.combine([stock, kvcore, again, allocator])
    assert set(summary["modes"]) == {"stock", "kvcore", "stock-2", "kvcore-allocator"}
    small = summary["by_size"][0]
    assert (small["stock_issue_ms_p50"], small["kvcore_issue_ms_p50"]) == (0.3, 0.4)
    assert set(summary["against_stock"]) == {"stock-2", "kvcore-allocator"}
    drift_small, drift_large = summary["against_stock"]["stock-2"]
    assert (drift_small["stock_ms_p50"], drift_small["stock-2_ms_p50"]) == (3.0, 3.5)
    assert drift_small["stock-2_issue_ms_p50"] == 0.35 and drift_large["ratio"] == 1.05
    assert summary["against_stock"]["kvcore-allocator"][1]["ratio"] == 1.1


def test_combine_pairs_processes_of_stock_and_kvcore_in_the_order_they_ran():
    runs = []
    for n, (stock_ms, kvcore_ms) in enumerate(((2.0, 3.0), (4.0, 2.0), (3.0, 6.0)), start=1):
        suffix = "" if n == 1 else f"-{n}"
        # Request 1 loaded back in one kvcore process only: left out of every process.
        kvcore_times = {0: kvcore_ms, 1: None if n == 2 else 9.0, 2: 40.0}
        runs.append({**report("stock", {0: stock_ms, 1: 1.0, 2: 40.0}), "label": f"stock{suffix}"})
        runs.append({**report("kvcore", kvcore_times), "label": f"kvcore{suffix}"})
    summary = hicache_live_combine.combine(runs)
    small, large = summary["paired_processes"]
    assert small["processes"] == 3 and small["loadbacks"] == 1
    assert (small["stock_ms_p50"], small["kvcore_ms_p50"]) == ([2.0, 4.0, 3.0], [3.0, 2.0, 6.0])
    # Pair ratios 2/3, 2 and 1/2: their median, not the ratio of the modes' medians (1.0).
    assert small["speed"] == round(2 / 3, 3)
    assert small["speed_low"] <= small["speed"] <= small["speed_high"]
    assert small["stock_spread"] == 2.0
    assert large["speed"] == 1.0 and large["stock_spread"] == 1.0
    assert "paired_processes" not in hicache_live_combine.combine(runs[:3])


def test_combine_main_writes_the_summary_and_fails_on_a_mismatch_or_a_missing_mode(
    tmp_path, capsys
):
    paths = []
    for mode, mismatches in (("stock", 0), ("kvcore", 0)):
        path = tmp_path / f"live-{mode}.json"
        path.write_text(json.dumps(report(mode, {0: 2.0, 2: 40.0}, mismatches)))
        paths.append(str(path))
    out = tmp_path / "sub" / "h200-live-sglang.json"
    assert hicache_live_combine.main([*paths, "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["same_hits"] and written["missing"] == []
    assert set(written["modes"]) == {"stock", "kvcore"}
    assert "ratio" in capsys.readouterr().out
    (tmp_path / "live-kvcore.json").unlink()
    assert hicache_live_combine.main([*paths, "--out", str(out)]) == 1
    assert json.loads(out.read_text())["missing"] == [paths[1]]
    assert "by_size" not in json.loads(out.read_text())
    bad = tmp_path / "live-kvcore.json"
    bad.write_text(json.dumps(report("kvcore", {0: 2.0, 2: 40.0}, mismatches=1)))
    assert hicache_live_combine.main([*paths, "--out", str(out)]) == 1


# --- the entry point ---------------------------------------------------------------------------


def test_kvcore_entry_point_is_declared_where_no_distribution_declares_it(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(engine_plugins, "entry_points", lambda group: [])
    folder = engine_plugins.declare_kvcore_entry_point()
    assert folder is not None and sys.path[0] == folder
    declared = [ep for ep in entry_points(group=engine_plugins.GROUP) if ep.name == "kvcore"]
    assert engine_plugins.KVCORE_ENTRY in {ep.value for ep in declared}
    monkeypatch.undo()
    monkeypatch.setattr(sys, "path", [folder, *sys.path])
    assert engine_plugins.declare_kvcore_entry_point() is None
    assert engine_plugins.MODE_ENV["kvcore"] == {
        "KVCORE_ENABLE": "sglang",
        "KVCORE_TRANSFERS": None,
        "KVCORE_STOCK_SHARE": None,
    }
    assert engine_plugins.MODE_ENV["kvcore-allocator"]["KVCORE_TRANSFERS"] == "0"
    # Only the A/B mode shares load-backs with stock; every other mode unsets the share.
    shares = {mode: env["KVCORE_STOCK_SHARE"] for mode, env in engine_plugins.MODE_ENV.items()}
    assert {mode: share for mode, share in shares.items() if share} == {"kvcore-ab": "0.5"}
