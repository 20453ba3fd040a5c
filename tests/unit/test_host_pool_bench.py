"""kvcore bench --host-pool on the CPU: the same code as on the GPU, nothing pinned."""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest

from benchmarks import host_pool
from kvcore.bench import cli

ISSUE_FIELDS = [
    "engine",
    "gib",
    "stock_ready_s",
    "kvcore_ready_s",
    "stock_full_s",
    "kvcore_full_s",
    "stock_rss_gib",
    "kvcore_rss_gib",
]


def test_a_smoke_run_builds_both_tiers_with_the_issues_fields(tmp_path, capsys):
    out = tmp_path / "host-pool.json"
    args = argparse.Namespace(pool_gib="0.04", json=str(out))
    assert host_pool.main(args) == 0
    report = json.loads(out.read_text())
    engines = [
        "vllm-0.25.1",
        "sglang",
        "sglang-pin-first",
        "vllm-shared-region",
        "vllm-region-pin-first",
    ]
    assert report["pinned"] is False and report["engines"] == engines
    printed = capsys.readouterr().out
    row, sglang_row, pin_first_row, region_row, region_pin_first_row = report["rows"]
    assert [each["engine"] for each in report["rows"]] == engines
    if importlib.util.find_spec("sglang") is None:
        for skipped in (sglang_row, pin_first_row):
            assert skipped["skipped"].startswith("ModuleNotFoundError")
        assert "sglang 0.04 GiB (0.04 in tensors): skipped" in printed
        assert "sglang-pin-first 0.04 GiB (0.04 in tensors): skipped" in printed
    if importlib.util.find_spec("vllm") is None:
        # One 32 MiB chunk: the region's whole chunks that fit 0.04 GiB.
        for skipped in (region_row, region_pin_first_row):
            assert skipped["skipped"].startswith("ModuleNotFoundError")
        assert "vllm-shared-region 0.04 GiB (0.03 in one shared region): skipped" in printed
        assert "vllm-region-pin-first 0.04 GiB (0.03 in one shared region): skipped" in printed
    assert set(ISSUE_FIELDS) <= set(row)
    blocks, page = host_pool.tier_shape(0.04)
    tensors_gib = host_pool.LAYERS * blocks * page / (1 << 30)
    assert row["tensor_bytes_gib"] == pytest.approx(tensors_gib)
    # Unpinned, stock's tensors are the exact size too; kvcore's mapping never exceeds 1%.
    assert row["stock_tier_gib"] == pytest.approx(tensors_gib)
    assert tensors_gib <= row["kvcore_tier_gib"] <= 1.01 * tensors_gib
    assert row["stock_identical"] and row["kvcore_identical"]
    # Both tiers are resident once built: every page faulted in, not merely reserved.
    for side in host_pool.SIDES:
        assert row[f"{side}_rss_gib"] >= 0.9 * tensors_gib
    assert "vllm-0.25.1 0.04 GiB" in printed


def test_tier_shape_fills_the_size_with_whole_blocks_of_every_layer():
    blocks, page = host_pool.tier_shape(16)
    assert page == 64 << 10
    assert host_pool.LAYERS * blocks * page == 16 << 30


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--host-pool", "--pool-gib", "8,-1"], "'-1' is not a size in GiB"),
        (["--pool-gib", "8"], "it applies only with --host-pool"),
        (["--host-pool", "--sweep"], "--sweep: --host-pool runs alone"),
        (["--host-engines", "sglang"], "--host-engines sglang: it applies only with --host-pool"),
        (["--host-pool", "--host-engines", "sglang,lmcache"], "'lmcache' is not an engine here"),
    ],
)
def test_bad_host_pool_options_are_refused_in_one_line(argv, problem, capsys):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run(parser.parse_args(argv)) == 2
    assert problem in capsys.readouterr().err


def test_a_side_whose_process_dies_unreported_is_an_error_not_a_hang():
    import queue

    class Dead:
        exitcode = -9

        def is_alive(self) -> bool:
            return False

    found = host_pool._result_of(Dead(), queue.Queue())
    assert found == {"error": "its process ended (exit code -9) unreported"}


def test_the_engines_asked_run_in_order_and_each_row_lands_in_the_json_at_once(
    tmp_path, monkeypatch
):
    """A run cut short (a device call's time limit) keeps every row it measured."""
    out = tmp_path / "host-pool.json"
    seen: list[list[str]] = []

    def measured(gib, pin, engine):
        if out.exists():
            seen.append([row["engine"] for row in json.loads(out.read_text())["rows"]])
        return {"engine": engine, "gib": gib, "skipped": "stand-in"}

    monkeypatch.setattr(host_pool, "measure", measured)
    monkeypatch.setattr(host_pool, "format_row", lambda row: row["engine"])
    args = argparse.Namespace(
        pool_gib="1", json=str(out), host_engines="vllm-shared-region,vllm-0.25.1"
    )
    assert host_pool.main(args) == 0
    report = json.loads(out.read_text())
    assert report["engines"] == ["vllm-0.25.1", "vllm-shared-region"] and report["complete"]
    assert seen == [["vllm-0.25.1"]]
