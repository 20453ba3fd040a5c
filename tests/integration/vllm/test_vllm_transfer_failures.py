"""A failure inside kvcore's offload handler ends in vLLM's stock copy, never in vLLM.

Each test breaks one stage of a job on kvcore's paths (the serve rules, the plan, the
mover's submission before or after it copied) and checks that the job still completes
exactly as stock's would: every byte of the reference, the size stock reports, the
reason counted and logged once, and no event left behind. A CUDA error is the one
failure that is raised: the device is then in doubt.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM installed (ci/install_vllm.sh)")

import torch
from handler_jobs import assert_tensors_are, make_job, memmove_batch, reference

from benchmarks.vllm.offload_handlers import kvcore_handler, stock_handler, submit
from benchmarks.vllm.offload_layout import Layout
from kvcore.internal_errors import InternalErrors
from kvcore.metrics import Metrics
from kvcore.mover import Mover
from kvcore.planning.layers import LayerPairs
from kvcore.planning.path_policy import PathPolicy
from kvcore.planning.plans import TransferPlan
from kvcore.streams import CpuSyncStreams
from kvcore_vllm import job_plans, transfers
from kvcore_vllm.releases import installed_shape

pytestmark = pytest.mark.vllm

LAYOUT = Layout(page_bytes=256, tensors=3, blocks_per_chunk=2, gpu_blocks=32, cpu_chunks=32)
# Scattered on both sides and spread over two groups: several submissions a job.
GROUPS = [([3, 9, 4, 17, 11], [5, 1, 12], 1), ([20, 2, 30], [7, 26], 0)]


class CountingStreams(CpuSyncStreams):
    """Host streams that count the events recorded and not yet released."""

    def __init__(self) -> None:
        super().__init__()
        self.held = 0

    def record(self, stream: Any) -> Any:
        self.held += 1
        return super().record(stream)

    def release(self, event: Any) -> None:
        self.held -= 1
        super().release(event)


class BreakingMover(Mover):
    """A mover whose submissions from the ``fail_at``-th on raise ``error``, after copying
    if asked."""

    def __init__(self, error: Exception, fail_at: int = 0, after_copy: bool = False) -> None:
        super().__init__(PathPolicy(staging_bytes=1 << 20))
        self.error, self.fail_at, self.after_copy = error, fail_at, after_copy
        self.submitted = 0

    def execute(self, plan: TransferPlan, pairs: LayerPairs | None = None, **kwargs: Any) -> None:
        index = self.submitted
        self.submitted += 1
        if index >= self.fail_at and not self.after_copy:
            raise self.error
        super().execute(plan, pairs, **kwargs)
        if index >= self.fail_at:
            raise self.error


@pytest.fixture(autouse=True)
def fresh_error_log(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfers, "INTERNAL_ERRORS", InternalErrors("vLLM", transfers.logger))


def handler_over(mover: Mover, gpu_to_cpu: bool, seed: int):
    gpu, host = LAYOUT.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(seed))
    stock = stock_handler(gpu, host, LAYOUT, gpu_to_cpu=gpu_to_cpu, groups=2)
    issued: list[int] = []
    stock._swap_blocks_batch = memmove_batch(issued)
    metrics, streams = Metrics(), CountingStreams()
    handler = kvcore_handler(
        stock, mover=mover, metrics=metrics, streams=streams, stock_rules=False
    )
    return handler, (gpu, host), metrics, streams, issued


def stage_breaker(stage: str, monkeypatch: pytest.MonkeyPatch, error: Exception) -> Mover:
    """A mover, and ``monkeypatch`` set, so that the job breaks at ``stage``."""

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise error

    if stage == "rules":
        monkeypatch.setattr(transfers.KVCoreOffloadingHandler, "_stock_is_cheaper", broken)
    elif stage == "plan":
        monkeypatch.setattr(job_plans, "plan_for", broken)
    elif stage == "batches":
        monkeypatch.setattr(job_plans.JobPlanner, "batches", broken)
    elif stage == "first_submission":
        return BreakingMover(error)
    elif stage == "after_copying":
        return BreakingMover(error, after_copy=True)
    return Mover(PathPolicy(staging_bytes=1 << 20))


@pytest.mark.parametrize("gpu_to_cpu", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("stage", ["rules", "batches", "plan", "first_submission", "after_copying"])
def test_a_failure_at_any_stage_completes_the_job_as_stock_does(
    monkeypatch, caplog, stage, gpu_to_cpu
):
    error = KeyError("kvcore broke")
    mover = stage_breaker(stage, monkeypatch, error)
    handler, (gpu, host), metrics, streams, issued = handler_over(mover, gpu_to_cpu, seed=7)
    expected = reference(gpu, host, LAYOUT, GROUPS, gpu_to_cpu)
    with caplog.at_level(logging.WARNING, logger="kvcore.vllm"):
        submit(handler, 1, *make_job(GROUPS, gpu_to_cpu))
        submit(handler, 2, *make_job(GROUPS, gpu_to_cpu))
    results = handler.get_finished()
    assert [(r.job_id, r.success) for r in results] == [(1, True), (2, True)]
    pages = sum(len(ids) for ids, _, _ in GROUPS)
    assert {r.transfer_size for r in results} == {pages * LAYOUT.page_bytes * LAYOUT.tensors}
    assert_tensors_are(gpu, host, expected)
    assert issued == [pages * LAYOUT.tensors] * 2  # stock's copy op ran each job
    assert metrics.snapshot()["fallbacks"] == {"internal_error:KeyError": 2}
    assert len([r for r in caplog.records if "kvcore broke" in r.getMessage()]) == 1
    assert streams.held == 0


CUDA_ERROR = RuntimeError("CUDA error: an illegal memory access was encountered")
REPORTS_FAILURES = installed_shape().reports_failed_transfers
FAILED_DECISION = {"decision": "failed", "reason": "transfer_failed:RuntimeError", "count": 1}


@pytest.mark.skipif(REPORTS_FAILURES, reason="this vLLM reports a failed copy as success=False")
@pytest.mark.parametrize("gpu_to_cpu", [True, False], ids=["store", "load"])
def test_a_cuda_error_is_raised_and_leaves_no_job_behind(gpu_to_cpu):
    mover = BreakingMover(CUDA_ERROR)
    handler, _, metrics, streams, issued = handler_over(mover, gpu_to_cpu, seed=8)
    with pytest.raises(RuntimeError, match="CUDA error"):
        submit(handler, 1, *make_job(GROUPS, gpu_to_cpu))
    assert handler.get_finished() == [] and issued == []
    assert metrics.snapshot()["fallbacks"] == {}
    assert streams.held == 0


@pytest.mark.skipif(not REPORTS_FAILURES, reason="this vLLM raises a failed copy's error")
@pytest.mark.parametrize("gpu_to_cpu", [True, False], ids=["store", "load"])
def test_a_cuda_error_reports_the_job_failed_as_this_vllm_does(caplog, gpu_to_cpu):
    mover = BreakingMover(CUDA_ERROR)
    handler, (gpu, host), metrics, streams, issued = handler_over(mover, gpu_to_cpu, seed=8)
    before = [t.clone() for t in gpu + host]
    with caplog.at_level(logging.ERROR, logger="kvcore.vllm"):
        assert submit(handler, 1, *make_job(GROUPS, gpu_to_cpu))
    results = handler.get_finished()
    assert [(r.job_id, r.success) for r in results] == [(1, False)]
    assert handler.get_finished() == []
    # Nothing was copied, by kvcore or by stock, and the job is counted as failed.
    assert issued == [] and all(torch.equal(a, b) for a, b in zip(gpu + host, before, strict=True))
    snapshot = metrics.snapshot()
    assert snapshot["fallbacks"] == {}
    assert snapshot["decisions"] == [FAILED_DECISION]
    assert any("job 1 failed" in r.getMessage() for r in caplog.records)
    assert streams.held == 0


@pytest.mark.skipif(not REPORTS_FAILURES, reason="this vLLM raises a failed copy's error")
def test_a_job_whose_event_fails_is_reported_failed_and_the_rest_finish(monkeypatch):
    handler, _, metrics, streams, _ = handler_over(Mover(PathPolicy()), False, seed=10)
    submit(handler, 1, *make_job(GROUPS, False))
    submit(handler, 2, *make_job(GROUPS, False))
    polled = []
    query = streams.query

    def failing_once(event):
        polled.append(event)
        if len(polled) == 1:
            raise CUDA_ERROR
        return query(event)

    monkeypatch.setattr(streams, "query", failing_once)
    assert [(r.job_id, r.success) for r in handler.get_finished()] == [(1, False)]
    assert [(r.job_id, r.success) for r in handler.get_finished()] == [(2, True)]
    assert metrics.snapshot()["decisions"] == [FAILED_DECISION]
    assert streams.held == 0


def test_a_job_the_groups_do_not_cover_is_refused_plainly():
    handler, *_ = handler_over(Mover(PathPolicy()), gpu_to_cpu=True, seed=9)
    src, dst = make_job(GROUPS, True)
    dst.block_ids = dst.block_ids[:-1]  # one CPU chunk fewer than the groups need
    with pytest.raises(ValueError, match="group 1 needs 3 GPU blocks and 2 CPU chunks"):
        submit(handler, 1, src, dst)
    assert handler.get_finished() == []
