from __future__ import annotations

import argparse
import json

import torch

from kvcore.bench import suite, suite_options
from kvcore.planning.path_policy import TransferPath


def test_quick_report_has_every_path_identical_and_the_documented_shape(tmp_path) -> None:
    parser = argparse.ArgumentParser()
    suite_options.add_arguments(parser)
    out = tmp_path / "report.json"
    args = parser.parse_args(
        ["--quick", "--tokens", "512", "--rows", "mla-1152B", "--no-progress", "--json", str(out)]
    )
    opts = suite_options.options_for(args)
    opts = suite_options.BenchOptions(
        **{**opts.__dict__, "allocator_slots": 1 << 14, "allocator_ops": 300}
    )
    report = suite.run(opts, progress=False)
    assert set(report) >= {"device", "ceiling_gbps", "results", "allocator"}
    assert report["page_out_host_syncs"] is None  # only countable on CUDA
    assert any("both-directions-at-once" in r["scenario"] for r in report["results"])
    layered = [r for r in report["results"] if "32-layers" in r["scenario"]]
    # Each direction: every layer in one submission, and one submission per layer.
    assert len(layered) == 4
    assert {r["path"].split(" x32 ")[1] for r in layered} == {"in one submission", "one per layer"}
    assert report["device"] == "cpu"
    paths = {r["path"].split(" ")[0] for r in report["results"]}
    for path in TransferPath:
        assert f"kvcore:{path.value}" in paths
    assert all(r["identical"] for r in report["results"])
    for r in report["results"]:
        assert {"scenario", "path", "bytes", "gbps", "identical"} <= set(r)
    auto = [r for r in report["results"] if r["path"].endswith("(auto)")]
    # The first plan and the same plan again are reported apart.
    assert auto and all(r["plan_us"] > 0 and r["plan_warm_us"] > 0 for r in auto)
    # Queued host time only where it was measured: the auto paths.
    assert all(("submit_queued_us" in r) == (r in auto) for r in report["results"])
    assert all(r["submit_queued_us"] > 0 for r in auto)
    alloc = report["allocator"]
    assert alloc["kvcore"]["one_run_fraction"] >= alloc["stock"]["one_run_fraction"]
    assert alloc["same_outcomes"]["value"] == 1.0
    assert "kvcore" in suite.format_table(report)
    json.dumps(report)


def test_scattered_layout_moves_the_asked_share_of_chunks() -> None:
    gen = torch.Generator().manual_seed(0)
    rows, unit = 64 * 32, 64
    for share in (0.0, 0.5, 1.0):
        slots = suite.scattered_layout(rows, share, unit, gen)
        assert slots.numel() == rows and torch.unique(slots).numel() == rows
        pages = slots.view(-1, unit)[:, 0] // unit
        moved = int((pages != torch.arange(rows // unit)).sum())
        assert moved == round(share * (rows // unit))
