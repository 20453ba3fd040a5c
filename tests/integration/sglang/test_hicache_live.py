"""The live HiCache driver run whole on the CPU, SGLang's machinery underneath.

Each run is its own process, as scripts/sglang_hicache_live.sh runs each mode: loading
SGLang's plugins patches its classes for the life of the process. The process runs
``hicache_cpu.py``: the driver's command line inside two stand-ins for what the CPU lacks
(unpinned host pools; a torch copy for sgl_kernel's ``transfer_kv_direct``), the
``direct`` io backend and a model shrunk to 3 layers of 2 heads x 8, page 4, the trace
scaled down 64 times.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang", reason="needs SGLang installed")

from benchmarks.sglang.hicache_live_combine import combine

pytestmark = pytest.mark.sglang

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
TINY = [
    "--device", "cpu", "--io-backend", "direct", "--layers", "3", "--kv-heads", "2",
    "--head-dim", "8", "--page-size", "4", "--scale", "64", "--conversations", "14",
    "--turns", "3", "--seconds", "120",
]  # fmt: skip


def run_driver(
    tmp: Path, mode: str, *flags: str, env: dict[str, str] | None = None, flip: bool = False
) -> tuple[int, dict[str, Any], str]:
    """The driver's exit status, its report and its output."""
    out = tmp / f"live-{mode}.json"
    first = ["--flip-one-byte"] if flip else []
    child_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "integrations"), str(HERE)]),
        **(env or {}),
    }
    # Every plugin SGLang finds is loaded, as in the engine.
    child_env.pop("SGLANG_PLUGINS", None)
    command = [sys.executable, str(HERE / "hicache_cpu.py"), *first, "--mode", mode]
    done = subprocess.run(
        [*command, "--json", str(out), *TINY, *flags],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    report = json.loads(out.read_text()) if out.is_file() else {}
    return done.returncode, report, done.stdout + done.stderr


@pytest.fixture(scope="module")
def both_modes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("hicache_live")
    reports = {}
    for mode, env in (("stock", None), ("kvcore", {"KVCORE_SERVE_RULE": "0"})):
        rc, report, output = run_driver(tmp, mode, env=env)
        assert rc == 0, output[-4000:]
        reports[mode] = report
    return reports


def test_stock_trace_loads_back_from_host_and_every_byte_matches(both_modes):
    report = both_modes["stock"]
    summary = report["summary"]
    assert report["cache"]["host_pool"] == "MHATokenToKVPoolHost"
    assert report["cache"]["io_backend"] == "direct"
    # SGLang's Python radix tree unless asked (its bundled Rust one panics on the GPU image).
    assert report["cache"]["tree_core"] == "python"
    assert report["prepared"]["plugins"]["patched_targets"] == []
    assert report["warmup"]["failed_checks"] == 0
    assert not summary["cut_short"] and summary["requests"] == summary["trace_requests"] == 42
    assert summary["checks_failed"] == 0 and summary["mismatched_bytes"] == 0
    assert summary["settled_mismatched_bytes"] == 0
    # The small device pool evicts; later turns come back from the host tier.
    assert summary["evictions"]["device_tokens"] > 0
    assert summary["write_throughs"]["tokens"] > 0
    later = [r for r in report["requests"] if r["turn"] > 0]
    from_host = [r for r in later if r["loaded_tokens"] > 0]
    assert len(from_host) > len(later) // 2
    assert summary["host_hit_tokens"] > summary["device_hit_tokens"]
    assert all(r["loadback_ms"] > 0 for r in from_host)
    assert report["kvcore_counters"] is None


def test_kvcore_serves_the_same_trace_through_its_hooks(both_modes):
    report = both_modes["kvcore"]
    plugins = report["prepared"]["plugins"]
    assert plugins["plugin_applied"] and plugins["env"]["KVCORE_TRANSFERS"] is None
    assert any(
        t.endswith("MHATokenToKVPoolHost.load_to_device_per_layer")
        for t in plugins["patched_targets"]
    )
    assert report["summary"]["checks_failed"] == 0 and report["summary"]["mismatched_bytes"] == 0
    counters = report["kvcore_counters"]
    directions = {t["direction"] for t in counters["transfers"]}
    assert {"h2d", "d2h"} <= directions, counters


def test_combined_summary_pairs_the_modes(both_modes):
    summary = combine([both_modes["stock"], both_modes["kvcore"]])
    assert summary["engine"] == "sglang" and summary["device"] == "cpu"
    assert summary["same_hits"] and summary["all_checks_passed"]
    assert set(summary["modes"]) == {"stock", "kvcore"}
    assert summary["modes"]["kvcore"]["counters"]["transfers"]
    sizes = [row["first_turn_tokens"] for row in summary["by_size"]]
    assert sizes == sorted(sizes) and len(sizes) >= 5
    assert all(row["ratio"] > 0 for row in summary["by_size"])
    assert all(row["kvcore_issue_ms_p50"] > 0 for row in summary["by_size"])
    for mode in ("stock", "kvcore"):
        state = summary["modes"][mode]["process_state"]
        assert state["before_trace"]["python_call_us"] > 0
        assert not state["after_trace"]["tracer"]


def test_one_flipped_byte_in_a_load_back_is_found(tmp_path):
    rc, report, output = run_driver(tmp_path, "stock", "--no-warmup", flip=True)
    assert rc == 1, output[-4000:]
    first_load = next(r for r in report["requests"] if r["loadback_ms"] is not None)
    assert first_load["mismatched_bytes"] == 1 and not first_load["check_passed"]
    assert first_load["settled_mismatched_bytes"] == 1
    assert report["summary"]["checks_failed"] >= 1


def test_an_ab_run_shares_its_load_backs_and_compares_the_copies_in_one_process(tmp_path):
    rc, report, output = run_driver(tmp_path, "kvcore-ab", env={"KVCORE_SERVE_RULE": "0"})
    assert rc == 0, output[-4000:]
    assert report["prepared"]["plugins"]["env"]["KVCORE_STOCK_SHARE"] == "0.5"
    summary = report["summary"]
    assert summary["checks_failed"] == 0 and summary["mismatched_bytes"] == 0
    loads = [r for r in report["requests"] if r["loadback_ms"] is not None]
    assert {r["copy"] for r in loads} == {"kvcore", "stock_share"}
    assert summary["loadback_copies"] == {
        copy: sum(r["copy"] == copy for r in loads) for copy in ("kvcore", "stock_share")
    }
    assert all(r["copy"] is None for r in report["requests"] if r["loadback_ms"] is None)
    # The warm-up's load-backs draw too, so the counter holds at least the trace's.
    shared = sum(r["copy"] == "stock_share" for r in loads)
    assert report["kvcore_counters"]["fallbacks"]["stock_share"] >= shared
    rows = summary["in_process_ab"]
    assert rows
    for row in rows:
        size = [r for r in loads if r["first_turn_tokens"] == row["first_turn_tokens"]]
        assert row["kvcore_loadbacks"] == sum(r["copy"] == "kvcore" for r in size)
        assert row["stock_loadbacks"] == sum(r["copy"] == "stock_share" for r in size)
        low, high = row["ms_difference_interval"]
        assert low <= high
    assert combine([report])["modes"]["kvcore-ab"]["in_process_ab"] == rows
