"""The vLLM sweep (``kvcore bench --engine vllm --sweep``) on host tensors.

vLLM's handler cannot run on a CPU, so the sweep runs kvcore's handler alone there; one
test stands a CPU-capable stock in for it (kvcore's handler with every job left to
vLLM's descriptor fill and a memmove per descriptor) to exercise the two-sided cells.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM installed (ci/install_vllm.sh)")

import numpy as np
import torch
import vllm

from benchmarks import sweep_report
from benchmarks.vllm import offload_handlers, sweep
from benchmarks.vllm.offload_handlers import kvcore_handler, runnable_stock
from benchmarks.vllm.offload_layout import job_specs
from benchmarks.vllm.sweep_pools import Pools, RequestDrawer, slice_blocks
from benchmarks.vllm.sweep_sides import Side
from kvcore import cli
from kvcore_vllm.transfers import KVCoreOffloadingHandler

pytestmark = pytest.mark.vllm

CPU = torch.device("cpu")
ROW_KEYS = {"engine", "case", "tokens", "layers", "stock_ms", "kvcore_ms", "identical"}
# One layout, one fragmentation, sizes on both sides of kvcore's 512-page rule.
SMALL = replace(
    sweep.QUICK, layouts=sweep.QUICK.layouts[:1], sizes=(1, 4, 16), jobs=(1, 2), max_repeats=2
)


def _args(tmp_path: Path, **overrides: Any) -> argparse.Namespace:
    values = {
        "quick": True,
        "json": str(tmp_path / "sweep.json"),
        "plot": None,
        "device": "cpu",
        "no_progress": True,
    }
    return argparse.Namespace(**{**values, **overrides})


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any]]:
    """The quick sweep as the CLI runs it: exit status and JSON document."""
    path = tmp_path_factory.mktemp("sweep") / "sweep.json"
    argv = ["bench", "--engine", "vllm", "--sweep", "--quick", "--device", "cpu"]
    status = cli.main([*argv, "--no-progress", "--json", str(path)])
    return status, json.loads(path.read_text())


def _layout_of(row: dict[str, Any]) -> str:
    return row["case"].split("/host-")[0]


def test_quick_sweep_has_every_size_and_moves_every_byte(quick_report):
    status, document = quick_report
    assert status == 0
    assert document["device"] == "cpu" and document["engine"] == "vllm"
    assert document["version"] == vllm.__version__
    assert all(document["pool_checks"].values()) and len(document["pool_checks"]) == 4
    rows = document["rows"]
    for row in rows:
        assert row.keys() >= ROW_KEYS and row["engine"] == "vllm" and row["identical"] is True
        extra = row["extra"]
        blocks, jobs = extra["blocks"], extra["jobs_in_flight"]
        assert row["tokens"] == blocks * sweep.BLOCK_TOKENS and row["layers"] == 32
        assert row["nbytes"] == jobs * blocks * 32 * 1024
        assert row["kvcore_ms"] > 0 and row["kvcore_host_ms"] > 0
        # vLLM's handler cannot run here: said so, never timed.
        assert math.isnan(row["stock_ms"]) and row["paths"][0].startswith("stock:not runnable")
        assert row["paired"] is None
    cells = {(_layout_of(r), r["extra"]["op"], r["extra"]["jobs_in_flight"]) for r in rows}
    assert len(cells) == 2 * 2 * 2
    for layout, op, jobs in cells:
        sizes = {
            r["extra"]["blocks"]
            for r in rows
            if (_layout_of(r), r["extra"]["op"], r["extra"]["jobs_in_flight"]) == (layout, op, jobs)
        }
        assert sizes == ({1, 4, 16, 64} if jobs == 1 else {1, 4, 16})
    assert "per-layer/32L/small-1KiB/host-50%/load/1-job" in {r["case"] for r in rows}


def test_quick_sweep_counts_the_jobs_kvcore_left_to_stock(quick_report):
    _, document = quick_report
    for row in document["rows"]:
        extra, jobs = row["extra"], row["extra"]["jobs_in_flight"]
        counted = extra["kvcore_jobs"]
        assert counted["served"] + sum(counted["stock"].values()) == counted["jobs"]
        assert counted["jobs"] == extra["repeats"] * jobs
        # 32 KiB of one tensor, or 1 KiB in 32 tensors: kvcore takes 512 pages or more.
        pages = extra["blocks"] * extra["tensors"]
        if pages >= 512:
            assert row["kvcore_served"] == jobs and row["pass_reasons"] == {}
            assert any(p.startswith("kvcore:") and "fallback" not in p for p in row["paths"])
        else:
            assert row["kvcore_served"] == 0 and row["pass_reasons"] == {"few_pages": jobs}
            assert "kvcore:stock-fallback" in row["paths"]
    served = [r for r in document["rows"] if r["kvcore_served"]]
    assert served and len(served) < len(document["rows"])


def test_the_table_shows_whole_case_names(quick_report):
    _, document = quick_report
    fields = sweep_report.SweepRow.__dataclass_fields__
    rows = [
        sweep_report.SweepRow(**{k: v for k, v in r.items() if k in fields})
        for r in document["rows"]
    ]
    table = sweep_report.format_table(rows)
    assert all(row.case in table for row in rows)


def _drop_last_page(monkeypatch: pytest.MonkeyPatch) -> None:
    """kvcore's handler loses the last page of every job of 2 blocks or more."""
    original = offload_handlers.submit

    def lossy(handler: Any, job_id: int, src: Any, dst: Any) -> bool:
        gpu_spec, cpu_spec = (src, dst) if handler.gpu_to_cpu else (dst, src)
        if not isinstance(handler, KVCoreOffloadingHandler) or len(gpu_spec.block_ids) < 2:
            return original(handler, job_id, src, dst)
        gpu_ids, cpu_ids = (np.asarray(s.block_ids)[:-1] for s in (gpu_spec, cpu_spec))
        specs = job_specs(gpu_ids, cpu_ids, gpu_to_cpu=handler.gpu_to_cpu)
        return original(handler, job_id, *specs)

    monkeypatch.setattr(offload_handlers, "submit", lossy)


def test_a_lost_page_fails_its_cells_and_the_exit_status(monkeypatch, tmp_path):
    monkeypatch.setattr(sweep, "QUICK", SMALL)
    _drop_last_page(monkeypatch)
    assert sweep.main(_args(tmp_path)) == 1
    rows = json.loads((tmp_path / "sweep.json").read_text())["rows"]
    assert {r["extra"]["blocks"] for r in rows} == {1, 4, 16}
    for row in rows:
        lost = row["extra"]["blocks"] >= 2
        assert row["identical"] is not lost
        # The bytes are wrong, and the handler reported the page it did not move.
        assert any("wrong bytes" in e for e in row["extra"]["errors"]) is lost
        assert any("reported" in e for e in row["extra"]["errors"]) is lost


def _stock_stand_in(stock: Any, device: torch.device) -> tuple[str, Any]:
    """kvcore's handler with every job left to vLLM's descriptor fill and a memmove each."""
    handler = kvcore_handler(runnable_stock(stock, device))
    handler._stock_is_cheaper = lambda segments: "stand_in"  # type: ignore[method-assign]
    return "stand-in", Side("stock", handler, device)


def test_two_sided_cells_alternate_the_order_and_plot(monkeypatch, tmp_path):
    monkeypatch.setattr(sweep, "QUICK", SMALL)
    monkeypatch.setattr(sweep, "stock_side", _stock_stand_in)
    order: list[str] = []
    jobs_per_request: list[int] = []
    run = Side.run

    def logged(self: Any, specs: Any, between: Any = None) -> Any:
        order.append(self.name)
        jobs_per_request.append(len(specs))
        return run(self, specs, between)

    monkeypatch.setattr(Side, "run", logged)
    plot = tmp_path / "sweep.png"
    assert sweep.main(_args(tmp_path, plot=str(plot))) == 0
    rows = json.loads((tmp_path / "sweep.json").read_text())["rows"]
    assert all(r["identical"] and r["paths"][0] == "stock:stand-in" for r in rows)
    assert all(r["stock_ms"] > 0 and math.isfinite(r["ratio"]) for r in rows)
    assert all(r["extra"]["identical_by_side"] == {"stock": True, "kvcore": True} for r in rows)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Per pass: the warm-up, then each cell's repeats, stock first on even repeats.
    expected: list[str] = []
    expected_jobs: list[int] = []
    busiest = max(jobs for _, jobs, _ in SMALL.cells("load"))
    assert busiest > 1
    for _ in SMALL.ops:
        expected += ["stock", "kvcore"]
        # The warm-up has as many jobs in flight as the busiest cell.
        expected_jobs += [busiest, busiest]
        for _, jobs, blocks in SMALL.cells("load"):
            for repeat in range(SMALL.repeats(jobs * blocks * 32 * 1024)):
                expected += ["stock", "kvcore"] if repeat % 2 == 0 else ["kvcore", "stock"]
                expected_jobs += [jobs, jobs]
    assert order == expected
    assert jobs_per_request == expected_jobs


@pytest.fixture
def pools() -> Pools:
    layout = replace(sweep.QUICK.layouts[0].layout(64), tensors=4)
    region = torch.empty(64 * layout.host_row_bytes, dtype=torch.int8)
    return Pools(layout, region, CPU, torch.Generator().manual_seed(1))


def _copy(pools: Pools, gpu_ids: np.ndarray, cpu_ids: np.ndarray, gpu_to_cpu: bool) -> None:
    for gpu, host in zip(pools.gpu, pools.host, strict=True):
        if gpu_to_cpu:
            host[torch.from_numpy(cpu_ids)] = gpu[torch.from_numpy(gpu_ids)]
        else:
            gpu[torch.from_numpy(gpu_ids)] = host[torch.from_numpy(cpu_ids)]


@pytest.mark.parametrize("gpu_to_cpu", [True, False])
def test_pool_checks_catch_lost_pages_and_stray_writes(pools, gpu_to_cpu):
    drawer = RequestDrawer(pools.blocks, np.random.default_rng(2))
    request = drawer.draw(4, 0.5, 2, gpu_to_cpu=gpu_to_cpu)
    gpu_ids, cpu_ids = request.gpu_ids, request.cpu_ids
    destination = pools.host if gpu_to_cpu else pools.gpu
    dst_ids = cpu_ids if gpu_to_cpu else gpu_ids

    pools.prepare(request)
    _copy(pools, gpu_ids, cpu_ids, gpu_to_cpu)
    assert pools.verify(request)

    pools.prepare(request)
    _copy(pools, gpu_ids[:-1], cpu_ids[:-1], gpu_to_cpu)
    assert not pools.verify(request)

    # A write next to a destination page (inside its window), then one far from it.
    for offset, caught_by_window in ((1, True), (None, False)):
        pools.prepare(request)
        _copy(pools, gpu_ids, cpu_ids, gpu_to_cpu)
        windows = {
            row
            for job in request.jobs
            for ids in ((job.cpu_ids if gpu_to_cpu else job.gpu_ids),)
            for row in range(int(ids[0]) - 2, int(ids[-1]) + 3)
        }
        row = int(dst_ids[-1]) + 1 if offset else min(set(range(pools.blocks)) - windows)
        assert row not in dst_ids and row < pools.blocks
        destination[2][row, 5] += 1
        assert pools.verify(request) is not caught_by_window
    assert not pools.verify_all()


def test_every_request_gets_new_ids_in_disjoint_slices():
    drawer = RequestDrawer(4 * slice_blocks(8), np.random.default_rng(3))
    seen = set()
    for _ in range(200):
        request = drawer.draw(8, 0.5, 4, gpu_to_cpu=True)
        assert request.key() not in seen
        seen.add(request.key())
        for job in request.jobs:
            lo, hi = job.bounds
            for ids in (job.gpu_ids, job.cpu_ids):
                assert lo <= ids.min() and ids.max() < hi
                # round(0.5 * 7) of the 7 neighbour pairs are broken.
                assert int(np.count_nonzero(np.diff(ids) != 1)) == 4
    # A slice of 8 rows holds a 1-block job at 4 places inside its window margins, on
    # each side: 16 requests, then no new one.
    one = RequestDrawer(slice_blocks(1), np.random.default_rng(4))
    drawn = [one.draw(1, 0.0, 1, gpu_to_cpu=False) for _ in range(16)]
    assert len({r.key() for r in drawn}) == 16
    assert {(int(r.gpu_ids[0]), int(r.cpu_ids[0])) for r in drawn} == {
        (g, c) for g in range(2, 6) for c in range(2, 6)
    }
    with pytest.raises(RuntimeError, match="no new ids"):
        one.draw(1, 0.0, 1, gpu_to_cpu=False)
    with pytest.raises(ValueError, match="pool"):
        one.draw(2, 0.0, 1, gpu_to_cpu=False)


def test_cells_past_the_budget_are_skipped_and_counted(tmp_path):
    assert sweep.main(_args(tmp_path, budget_s=0.0)) == 0
    document = json.loads((tmp_path / "sweep.json").read_text())
    assert document["rows"] == [] and document["pool_checks"] == {}
    assert document["skipped_cells"] == 2 * 2 * (4 + 3)


def test_the_full_sweep_is_refused_on_a_cpu(tmp_path, capsys):
    assert sweep.main(_args(tmp_path, quick=False)) == 2
    assert "needs a GPU" in capsys.readouterr().err
    assert not (tmp_path / "sweep.json").exists()


def test_gemm_cells_are_cuda_only_and_asked_for_by_the_plan(monkeypatch, tmp_path):
    asked: list[sweep.SweepPlan] = []
    real_run = sweep.run

    def recording_run(plan, device, **kwargs):
        asked.append(plan)
        return real_run(replace(plan, gemm_min_bytes=0), device, **kwargs)

    monkeypatch.setattr(sweep, "run", recording_run)
    assert sweep.main(_args(tmp_path, gemm=True, budget_s=None)) == 0
    assert [plan.gemm for plan in asked] == [True]
    rows = json.loads((tmp_path / "sweep.json").read_text())["rows"]
    assert rows and not any("gemm_alone_ms" in row["extra"] for row in rows)
    assert sweep._parser().parse_args(["--gemm"]).gemm
