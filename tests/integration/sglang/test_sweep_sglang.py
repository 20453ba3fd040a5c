"""`kvcore bench --engine sglang --sweep` on the CPU: whole requests, checked bytes, its JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

import pytest
import torch

from benchmarks.sglang import sweep
from benchmarks.sglang.sweep_options import repeats_for
from kvcore_sglang import layer_loads

pytestmark = pytest.mark.sglang

SIZES = (128, 256)


def _options(**changes: Any) -> sweep.SweepOptions:
    base = sweep.SweepOptions(
        tokens=SIZES,
        kinds=("mla",),
        layers={"mha": 2, "mla": 2},
        layouts=(("layer_first", "direct", (64,)),),
        host_levels=("100%",),
        repeats=1,
        device=torch.device("cpu"),
        serve_rule=False,
    )
    return dataclasses.replace(base, **changes)


def test_every_request_size_is_timed_and_checked():
    result = sweep.run(_options())
    rows = result["rows"]
    assert sorted((row.extra["op"], row.tokens) for row in rows) == sorted(
        (op, size) for op in ("load", "backup") for size in SIZES
    )
    assert all(row.identical for row in rows)
    # With the rule off, kvcore moves every call of every request itself.
    assert all(row.kvcore_served == row.calls for row in rows)
    assert {row.calls for row in rows if row.extra["op"] == "load"} == {2}
    document = result["document"]
    assert document["device"] == "cpu" and document["engine"] == "sglang"
    for row in document["rows"]:
        for key in ("engine", "case", "tokens", "layers", "stock_ms", "kvcore_ms", "identical"):
            assert key in row
        assert row["ratio"] == pytest.approx(row["stock_ms"] / row["kvcore_ms"])


def test_the_rule_passes_small_requests_to_stock():
    rows = sweep.run(_options(serve_rule=True))["rows"]
    assert rows and all(row.kvcore_served == 0 and row.identical for row in rows)
    assert all(row.pass_reasons == {"stock_direct_small_request": 1.0} for row in rows)
    assert all("own_ms" in row.extra for row in rows)


def test_a_copy_that_leaves_rows_out_is_caught(monkeypatch, tmp_path):
    def claims_served(*args: Any, **kwargs: Any) -> None:
        return None  # says the layer was copied, copies nothing

    monkeypatch.setattr(layer_loads, "_serve_layer", claims_served)
    out = tmp_path / "sweep.json"
    args = argparse.Namespace(
        device="cpu",
        quick=True,
        json=str(out),
        plot=None,
        no_progress=True,
        rows="mla",
        layouts="layer_first/direct",
        no_rule=True,
        tokens=0,
        sizes="128",
        repeats=1,
        host_levels="100%",
    )
    assert sweep.main(args) == 1
    rows = json.loads(out.read_text())["rows"]
    loads = [row for row in rows if row["extra"]["op"] == "load"]
    assert loads and not any(row["identical"] for row in loads)


def test_gemm_interference_is_a_cuda_measurement_reported_per_cell():
    rows = sweep.run(_options(gemm=True, tokens=(128,)))["rows"]
    assert rows and not any("gemm_alone_ms" in row.extra for row in rows)
    row = rows[0]
    row.extra.update(gemm_alone_ms=10.0, gemm_with_stock_ms=12.5, gemm_with_kvcore_ms=10.0)
    assert sweep.gemm_summary([row]) == [
        f"GEMM throughput kept during {row.case} {row.tokens}: stock 80%, kvcore 100%"
    ]
    # kvcore's own paths (the rule off), where the sweep timed them.
    row.extra.update(gemm_with_own_ms=16.0)
    assert sweep.gemm_summary([row]) == [
        f"GEMM throughput kept during {row.case} {row.tokens}: stock 80%, kvcore 100%, own 62%"
    ]


def test_short_requests_get_more_repeats_on_a_gpu_and_long_ones_fewer():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert repeats_for(5, 512, cuda) == 20 and repeats_for(5, 2048, cuda) == 20
    assert repeats_for(5, 8192, cuda) == 5 and repeats_for(5, 32768, cuda) == 3
    assert repeats_for(5, 512, cpu) == 5 and repeats_for(1, 65536, cpu) == 2


def test_cells_of_several_repeats_carry_the_paired_speed():
    result = sweep.run(_options(tokens=(SIZES[0],), repeats=3))
    for row in result["rows"]:
        assert row.paired is not None and row.paired.pairs == row.extra["repeats"] >= 2
        assert row.paired.low <= row.paired.median <= row.paired.high
    for row in result["document"]["rows"]:
        assert row["paired"]["pairs"] == row["extra"]["repeats"]
