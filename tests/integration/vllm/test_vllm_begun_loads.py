"""Loads from vLLM's shared host region begun before they are planned
(kvcore_vllm/job_plans.py, ``Mover.begin_region_load``): their first DMAs into kvcore's
staging buffer are issued before the plan, and every way the job may go after that copies
exactly what stock copies and gives the staging buffer back."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM installed (ci/install_vllm.sh)")

import torch
from handler_jobs import assert_tensors_are, make_job, memmove_batch, reference

from benchmarks.vllm.offload_handlers import kvcore_handler, stock_handler, submit
from benchmarks.vllm.offload_layout import Layout
from kvcore.internal_errors import InternalErrors
from kvcore.kernels import KernelSet, kernels_for
from kvcore.metrics import Metrics
from kvcore.mover import Mover
from kvcore.planning.path_policy import PathPolicy
from kvcore_vllm import job_plans, transfers

pytestmark = pytest.mark.vllm

LAYOUT = Layout(page_bytes=512, tensors=4, gpu_blocks=64, cpu_chunks=64, shared_region=True)
CPU = torch.device("cpu")
ON = PathPolicy(staging_bytes=1 << 20, begin_region_loads=True)
SCATTERED = [([9, 2, 14, 5, 40, 33], [3, 11, 0, 7, 50, 21], 0)]


class LoggingMover(Mover):
    """A mover on the reference kernels that logs its DMAs, its scatters and its begun loads
    into ``log``, the handler's planning logging there too."""

    def __init__(self, log: list[str], policy: PathPolicy = ON):
        super().__init__(policy, metrics=Metrics())
        self.log = log

    def kernels(self, device: torch.device) -> KernelSet:
        base = kernels_for(device)

        def copy_runs(src: Any, dst: Any, runs: Any) -> str | None:
            self.log.append("dma")
            return base.copy_runs(src, dst, runs)

        return KernelSet("logging", copy_runs, base.prepare_gather, base.stage_in, base.stage_out)

    def begin_region_load(self, *args: Any, **kwargs: Any) -> Any:
        begun = super().begin_region_load(*args, **kwargs)
        self.log.append("begun" if begun is not None else "not begun")  # after its DMAs
        return begun


def logged_plan_for(monkeypatch: pytest.MonkeyPatch, log: list[str]) -> None:
    plan_for = job_plans.plan_for

    def logged(*args: Any, **kwargs: Any) -> Any:
        log.append("planned")
        return plan_for(*args, **kwargs)

    monkeypatch.setattr(job_plans, "plan_for", logged)


def handler_over(mover: Mover, seed: int) -> tuple[Any, tuple[Any, Any], list[int]]:
    gpu, host = LAYOUT.make_tensors(CPU, torch.Generator().manual_seed(seed))
    stock = stock_handler(gpu, host, LAYOUT, gpu_to_cpu=False)
    issued: list[int] = []
    stock._swap_blocks_batch = memmove_batch(issued)
    handler = kvcore_handler(stock, mover=mover, metrics=mover.metrics, stock_rules=False)
    return handler, (gpu, host), issued


def staging_is_free(mover: Mover) -> bool:
    return not mover.staging._lock_for(CPU).locked()


def test_a_load_begins_before_it_is_planned_and_copies_what_stock_copies(monkeypatch):
    log: list[str] = []
    logged_plan_for(monkeypatch, log)
    mover = LoggingMover(log)
    handler, (gpu, host), issued = handler_over(mover, seed=31)
    expected = reference(gpu, host, LAYOUT, SCATTERED, False)
    submit(handler, 1, *make_job(SCATTERED, False))
    assert [r.job_id for r in handler.get_finished()] == [1]
    assert_tensors_are(gpu, host, expected)
    # The spans' DMA went before the plan; nothing was copied again after it.
    assert log == ["dma", "begun", "planned"]
    assert issued == [] and staging_is_free(mover)
    assert mover.metrics is not None
    transfers_done = mover.metrics.snapshot()["transfers"]
    assert [(row["direction"], row["path"]) for row in transfers_done] == [("h2d", "staged")]


def test_a_load_that_planning_sends_to_stock_gives_the_staging_buffer_back(monkeypatch):
    """Two pages onto one GPU block: found while planning, after the load began; stock copies
    the job, the begun DMAs into staging change nothing, and the next job is kvcore's."""
    log: list[str] = []
    mover = LoggingMover(log)
    handler, (gpu, host), issued = handler_over(mover, seed=32)
    twice = [([3, 3, 9], [6, 7, 1], 0)]
    expected = reference(gpu, host, LAYOUT, twice, False)
    submit(handler, 1, *make_job(twice, False))
    assert_tensors_are(gpu, host, expected)
    assert issued == [3 * LAYOUT.tensors] and log == ["dma", "begun"]
    assert staging_is_free(mover)
    expected = reference(gpu, host, LAYOUT, SCATTERED, False)
    submit(handler, 2, *make_job(SCATTERED, False))
    assert_tensors_are(gpu, host, expected)
    assert sorted(r.job_id for r in handler.get_finished()) == [1, 2]
    assert mover.metrics is not None
    assert mover.metrics.snapshot()["fallbacks"] == {"duplicate_destinations": 1}


def test_a_load_whose_planning_breaks_after_it_began_goes_to_stock(monkeypatch, caplog):
    monkeypatch.setattr(transfers, "INTERNAL_ERRORS", InternalErrors("vLLM", transfers.logger))

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise KeyError("kvcore broke")

    monkeypatch.setattr(job_plans, "plan_for", broken)
    log: list[str] = []
    mover = LoggingMover(log)
    handler, (gpu, host), issued = handler_over(mover, seed=33)
    expected = reference(gpu, host, LAYOUT, SCATTERED, False)
    with caplog.at_level(logging.WARNING, logger="kvcore.vllm"):
        submit(handler, 1, *make_job(SCATTERED, False))
    assert [(r.job_id, r.success) for r in handler.get_finished()] == [(1, True)]
    assert_tensors_are(gpu, host, expected)
    assert issued == [6 * LAYOUT.tensors] and log == ["dma", "begun"]
    assert staging_is_free(mover)
    assert mover.metrics is not None
    assert mover.metrics.snapshot()["fallbacks"] == {"internal_error:KeyError": 1}


@pytest.mark.parametrize(
    ("policy", "why"),
    [
        (PathPolicy(staging_bytes=1 << 20), "KVCORE_BEGIN_REGION_LOADS is off by default"),
        (replace(ON, stage_regions="off"), "region staging off"),
        (replace(ON, long_run_bytes=1), "one DMA a page is open"),
        (replace(ON, staging_bytes=1024), "a span does not fit the staging buffer"),
    ],
)
def test_a_load_the_plan_may_not_stage_by_region_is_not_begun(monkeypatch, policy, why):
    log: list[str] = []
    logged_plan_for(monkeypatch, log)
    mover = LoggingMover(log, policy)
    handler, (gpu, host), _ = handler_over(mover, seed=34)
    expected = reference(gpu, host, LAYOUT, SCATTERED, False)
    submit(handler, 1, *make_job(SCATTERED, False))
    assert [r.job_id for r in handler.get_finished()] == [1]
    assert_tensors_are(gpu, host, expected)
    # Nothing begun, no DMA before the plan (with the setting off, not even a try).
    assert "begun" not in log and "dma" not in log[: log.index("planned")], why
    assert staging_is_free(mover)
