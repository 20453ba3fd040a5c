"""kvcore's vLLM handler with its jobs issued on a thread of their own
(``KVCORE_BACKGROUND_ISSUE``, kvcore_vllm/transfers.py): every job copied exactly and
reported once, and a job whose issuing raises there copied by stock's handler instead."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM installed (ci/install_vllm.sh)")

import numpy as np
import torch
from handler_jobs import assert_tensors_are, make_job, memmove_batch, reference

from benchmarks.vllm.offload_handlers import kvcore_handler, stock_handler, submit
from benchmarks.vllm.offload_layout import Layout
from kvcore.issuer import Issuer
from kvcore.metrics import Metrics
from kvcore.mover import Mover
from kvcore.planning.path_policy import PathPolicy
from kvcore_vllm import transfers

pytestmark = pytest.mark.vllm

LAYOUT = Layout(page_bytes=512, tensors=3, gpu_blocks=64, cpu_chunks=64, shared_region=True)
POLICY = PathPolicy(staging_bytes=1 << 20)


@pytest.fixture(autouse=True)
def every_job_to_kvcore(monkeypatch: pytest.MonkeyPatch) -> None:
    """The jobs here are a few pages: let kvcore take them, as it does real-sized ones."""
    take_all = {
        "min_pages_per_submission": 1,
        "min_large_pages_per_submission": 1,
        "stock_kernel_loads": False,
    }
    monkeypatch.setattr(transfers, "RULES", replace(transfers.RULES, **take_all))


def issued_handler(
    gpu_to_cpu: bool, seed: int
) -> tuple[Any, list[torch.Tensor], list[torch.Tensor], Metrics, Issuer]:
    gpu, host = LAYOUT.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(seed))
    stock = stock_handler(gpu, host, LAYOUT, gpu_to_cpu=gpu_to_cpu)
    stock._swap_blocks_batch = memmove_batch([])
    metrics = Metrics()
    issuer = Issuer(f"test-issued-{seed}")
    handler = kvcore_handler(
        stock, mover=Mover(POLICY, metrics=metrics), metrics=metrics, issuer=issuer
    )
    return handler, gpu, host, metrics, issuer


@pytest.mark.parametrize("gpu_to_cpu", [False, True])
def test_jobs_issued_on_the_thread_are_exact_and_reported_once(gpu_to_cpu: bool) -> None:
    handler, gpu, host, metrics, issuer = issued_handler(gpu_to_cpu, 3)
    rng = np.random.default_rng(5)
    reported: list[int] = []
    try:
        for job_id in range(12):
            count = int(rng.integers(1, 9))
            ids = rng.permutation(LAYOUT.gpu_blocks)[:count].tolist()
            chunks = rng.permutation(LAYOUT.cpu_chunks)[:count].tolist()
            groups = [(ids, chunks, 0)]
            # Each job's expectation from the tensors as the jobs before it left them.
            handler.wait(set(range(job_id)))
            expected = reference(gpu, host, LAYOUT, groups, gpu_to_cpu)
            assert submit(handler, job_id, *make_job(groups, gpu_to_cpu))
            handler.wait({job_id})
            assert_tensors_are(gpu, host, expected)
            reported += [r.job_id for r in handler.get_finished() if r.success]
        issuer.idle()
        reported += [r.job_id for r in handler.get_finished()]
    finally:
        handler.shutdown()
    assert reported == list(range(12))
    assert metrics.snapshot()["fallbacks"] == {}


def test_a_job_whose_issuing_raises_is_copied_by_stock_instead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    handler, gpu, host, metrics, issuer = issued_handler(False, 4)
    mover = handler._mover
    execute = mover.execute
    calls = {"n": 0}

    def breaks_second(*args: Any, **kwargs: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise ValueError("stale plan")
        execute(*args, **kwargs)

    monkeypatch.setattr(mover, "execute", breaks_second)
    jobs = {
        1: [([1, 2, 3], [10, 11, 12], 0)],
        2: [([20, 7, 9], [30, 3, 44], 0)],
        3: [([40, 41], [50, 51], 0)],
    }
    expected = gpu, host
    try:
        for job_id, groups in jobs.items():
            expected = reference(*expected, LAYOUT, groups, False)
            assert submit(handler, job_id, *make_job(groups, False))
        handler.wait(set(jobs))
        results = handler.get_finished()
        issuer.idle()
        results += handler.get_finished()
    finally:
        handler.shutdown()
    assert sorted(r.job_id for r in results) == [1, 2, 3]
    assert all(r.success for r in results)
    assert_tensors_are(gpu, host, expected)
    assert metrics.snapshot()["fallbacks"] == {"internal_error:ValueError": 1}


def test_jobs_submitted_under_inference_mode_are_issued_under_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM submits under torch.inference_mode, which torch keeps per thread: the thread
    issues each job under the mode it was submitted in, so a torch write into a tensor made
    under that mode (an engine's KV cache) is allowed there, as it is inline."""
    with torch.inference_mode():
        handler, gpu, host, metrics, _ = issued_handler(False, 6)
        made_under_it = torch.zeros(4)
    mover = handler._mover
    execute = mover.execute

    def writes_in_place(*args: Any, **kwargs: Any) -> None:
        made_under_it.add_(1)
        execute(*args, **kwargs)

    monkeypatch.setattr(mover, "execute", writes_in_place)
    groups = [([9, 2, 14, 5, 40], [3, 11, 0, 7, 50], 0)]
    expected = reference(gpu, host, LAYOUT, groups, False)
    with torch.inference_mode():
        assert submit(handler, 1, *make_job(groups, False))
        handler.wait({1})
        results = handler.get_finished()
    handler.shutdown()
    assert [(r.job_id, r.success) for r in results] == [(1, True)]
    assert metrics.snapshot()["fallbacks"] == {}
    assert made_under_it.tolist() == [1.0] * 4
    assert_tensors_are(gpu, host, expected)
