"""kvcore's offload handler against vLLM's stock handler, on host tensors.

vLLM's copy op is compiled CUDA code, absent here; what runs on a CPU is the stock
handler's constructor and its descriptor fill (numpy pointer arithmetic). The tests
compare kvcore's copies with a per-page reference written from vLLM's documented
layout, and check that reference against the stock descriptors executed by memmove.
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM installed (ci/install_vllm.sh)")

import numpy as np
import torch
from handler_jobs import assert_tensors_are, make_job, memmove_batch, reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm_support import spec_args

from benchmarks.vllm import ab
from benchmarks.vllm.live_trace_attribution import AB_LINE
from benchmarks.vllm.offload_handlers import (
    canonical_kv_caches,
    handler_gpu_tensors,
    kvcore_handler,
    stock_handler,
    submit,
)
from benchmarks.vllm.offload_layout import Layout, fragmented_ids
from kvcore.config import KVCoreConfig
from kvcore.kernels import KernelSet, kernels_for
from kvcore.metrics import METRICS, Metrics
from kvcore.mover import Mover
from kvcore.planning import vllm_rule
from kvcore.planning.path_policy import PathPolicy
from kvcore.planning.transfer_sides import check_sides
from kvcore.streams import CpuSyncStreams
from kvcore.warm_up import WarmUp
from kvcore_vllm import handler_install, job_plans, transfers
from kvcore_vllm.handler_install import install_handlers
from kvcore_vllm.releases import installed_shape
from kvcore_vllm.spec import KVCoreCPUOffloadingSpec
from kvcore_vllm.stock_copies import StockCopies
from kvcore_vllm.transfers import KVCoreOffloadingHandler
from tests.support.manual_streams import ManualStreams
from tests.support.scripts import load_script

pytestmark = pytest.mark.vllm

# The A/B bench and the scripts built on it issue stock's descriptors through its fill
# methods over GPU block ids, which a release passing device pointers lacks.
FILLS_FROM_BLOCK_IDS = pytest.mark.skipif(
    installed_shape().device_pointers,
    reason="this vLLM fills descriptors from device pointers inside transfer_async; the A/B "
    "bench's stock fill runs on releases whose jobs carry GPU block ids",
)

# Small staging keeps the staged path's buffer tiny; long_run_bytes=1 lets few runs
# take one copy each, so copies can be counted.
SMALL = PathPolicy(staging_bytes=1 << 20)
COUNTABLE = PathPolicy(staging_bytes=1 << 20, long_run_bytes=1)


@pytest.fixture(autouse=True)
def every_job_to_kvcore(monkeypatch: pytest.MonkeyPatch) -> None:
    """The jobs here are a few pages: let kvcore take them, as it does real-sized ones; and
    where vLLM picks its Triton load kernel (a machine with a GPU), let kvcore take those
    too, unless a test turns that rule back on."""
    take_all = {
        "min_pages_per_submission": 1,
        "min_large_pages_per_submission": 1,
        "stock_kernel_loads": False,
    }
    monkeypatch.setattr(transfers, "RULES", replace(transfers.RULES, **take_all))


class RecordingMover(Mover):
    """A mover whose reference kernels log each op with the copies it issues; ``layered``
    adds ops that take every pair of a transfer in one call (as CUDA's kernel set has)."""

    def __init__(self, policy: PathPolicy, *, layered: bool = False) -> None:
        super().__init__(policy)
        self.ops: list[tuple[str, int]] = []
        self.layered = layered

    def kernels(self, device: torch.device) -> KernelSet:
        base = kernels_for(device)

        def copy_runs(src, dst, runs):
            self.ops.append(("copy_runs", runs.count))
            return base.copy_runs(src, dst, runs)

        def prepare_gather(src, dst):
            gather = base.prepare_gather(src, dst)

            def recorded(src_idx, dst_idx):
                self.ops.append(("gather", int(src_idx.numel())))
                return gather(src_idx, dst_idx)

            return recorded

        def stage_in(src, host_runs, staging, dst, dst_idx):
            self.ops.append(("stage_in", host_runs.count))
            base.stage_in(src, host_runs, staging, dst, dst_idx)

        def stage_out(src, src_idx, staging, dst, host_runs):
            self.ops.append(("stage_out", host_runs.count))
            base.stage_out(src, src_idx, staging, dst, host_runs)

        if not self.layered:
            return KernelSet("recording", copy_runs, prepare_gather, stage_in, stage_out)

        def copy_runs_layers(pairs, runs):
            self.ops.append(("copy_runs_layers", runs.count * len(pairs)))
            for src, dst in zip(pairs.src_words, pairs.dst_words, strict=True):
                base.copy_runs(src, dst, runs)

        def gather_prepared(pairs, rows):
            src_idx, dst_idx = rows
            self.ops.append(("gather_prepared", int(src_idx.numel()) * len(pairs)))
            for src, dst in zip(pairs.src_words, pairs.dst_words, strict=True):
                base.prepare_gather(src, dst)(src_idx, dst_idx)

        return KernelSet(
            "recording",
            copy_runs,
            prepare_gather,
            stage_in,
            stage_out,
            copy_runs_layers=copy_runs_layers,
            prepare_rows=lambda src_idx, dst_idx, device: (src_idx, dst_idx),
            gather_prepared=gather_prepared,
        )


def logged_handler(gpu, host, layout, gpu_to_cpu, wrap=lambda swap: swap):
    """kvcore's handler over a stock one whose copy op logs its batches (through ``wrap``),
    with its mover's ops and its fallbacks recorded."""
    stock = stock_handler(gpu, host, layout, gpu_to_cpu=gpu_to_cpu)
    issued: list[int] = []
    stock._swap_blocks_batch = wrap(memmove_batch(issued))
    metrics = Metrics()
    mover = RecordingMover(SMALL)
    return kvcore_handler(stock, mover=mover, metrics=metrics), mover, metrics, issued


def run_stock_fill(stock, groups, gpu_to_cpu):
    """The job as stock's own transfer_async copies it, its copy op one memmove per
    descriptor."""
    own = stock._swap_blocks_batch
    stock._swap_blocks_batch = memmove_batch([])
    assert submit(stock, 0, *make_job(groups, gpu_to_cpu))
    [result] = stock.get_finished()
    assert result.success
    stock._swap_blocks_batch = own


def stock_fill(stock, groups, gpu_to_cpu):
    """The job's descriptors as :class:`StockCopies` fills them (what the A/B bench issues
    as stock's): source pointers, destination pointers, sizes."""
    copies = StockCopies(stock)
    bpc = copies.blocks_per_chunk
    count = copies.max_copy_ops([len(ids) for ids, _, _ in groups])
    buffers = [np.empty(count, dtype=np.int64) for _ in range(3)]
    op = 0
    for g, (ids, chunks, first) in enumerate(groups):
        gpu_ids, cpu_ids = np.array(ids, dtype=np.int32), np.array(chunks, dtype=np.int32)
        op, _ = copies.fill_group(
            g,
            src_ids=gpu_ids if gpu_to_cpu else cpu_ids,
            dst_ids=cpu_ids if gpu_to_cpu else gpu_ids,
            pages=len(ids),
            src_skip=0 if gpu_to_cpu else first % bpc,
            dst_skip=first % bpc if gpu_to_cpu else 0,
            out=(buffers[0], buffers[1], buffers[2]),
            op_index=op,
        )
    return tuple(torch.from_numpy(b[:op]) for b in buffers)


def draw_groups(rng, layout, sizes, frag):
    """Disjoint GPU blocks and CPU chunks per group, ascending runs broken at ``frag``."""
    bpc = layout.blocks_per_chunk
    firsts = [int(rng.integers(0, 3 * bpc)) for _ in sizes]
    chunk_counts = [
        -(-(size + first % bpc) // bpc) for size, first in zip(sizes, firsts, strict=True)
    ]
    gpu_ids = fragmented_ids(sum(sizes), frag, rng) + int(rng.integers(0, 8))
    cpu_ids = fragmented_ids(sum(chunk_counts), frag, rng) + int(rng.integers(0, 8))
    if rng.random() < 0.3:
        # Scrambled order, as vLLM's stock chunk allocator hands out under churn.
        cpu_ids = rng.permutation(cpu_ids)
    groups, g_at, c_at = [], 0, 0
    for size, first, chunks in zip(sizes, firsts, chunk_counts, strict=True):
        groups.append(
            (gpu_ids[g_at : g_at + size].tolist(), cpu_ids[c_at : c_at + chunks].tolist(), first)
        )
        g_at, c_at = g_at + size, c_at + chunks
    return groups


LAYOUTS = [
    # Per-layer host tensors, pages of a few sizes, 1 or 4 GPU blocks per CPU chunk.
    Layout(page_bytes=256, tensors=3, blocks_per_chunk=1),
    Layout(page_bytes=1024, tensors=2, blocks_per_chunk=4),
    # vLLM's shared host region: every tensor's pages of a chunk in one aligned row.
    Layout(page_bytes=512, tensors=3, blocks_per_chunk=2, shared_region=True),
    Layout(page_bytes=3072, tensors=2, blocks_per_chunk=1, shared_region=True),
    # Cross-layer blocks: one tensor whose page holds every layer.
    Layout(page_bytes=4096, tensors=1, blocks_per_chunk=1, shared_region=True),
    Layout(page_bytes=2048, tensors=1, blocks_per_chunk=4),
]


def sized(layout):
    return Layout(**{**layout.__dict__, "gpu_blocks": 128, "cpu_chunks": 128})


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    layout=st.sampled_from(LAYOUTS),
    gpu_to_cpu=st.booleans(),
    sizes=st.lists(st.integers(1, 12), min_size=1, max_size=2),
    frag=st.sampled_from([0.0, 0.5, 1.0]),
    seed=st.integers(0, 2**31),
)
def test_copies_byte_identical_to_per_page_reference_and_stock_fill(
    layout, gpu_to_cpu, sizes, frag, seed
):
    layout = sized(layout)
    rng = np.random.default_rng(seed)
    gpu, host = layout.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(seed))
    groups = draw_groups(rng, layout, sizes, frag)
    stock = stock_handler(gpu, host, layout, gpu_to_cpu=gpu_to_cpu, groups=len(groups))
    expected_gpu, expected_host = reference(gpu, host, layout, groups, gpu_to_cpu)
    before_gpu, before_host = [t.clone() for t in gpu], [t.clone() for t in host]

    run_stock_fill(stock, groups, gpu_to_cpu)
    # The reference is vLLM's semantics: its own descriptors move the same bytes.
    assert all(torch.equal(a, b) for a, b in zip(gpu, expected_gpu, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(host, expected_host, strict=True))
    for live, saved in zip(gpu + host, before_gpu + before_host, strict=True):
        live.copy_(saved)

    metrics = Metrics()
    handler = kvcore_handler(stock, policy=SMALL, metrics=metrics)
    assert submit(handler, 7, *make_job(groups, gpu_to_cpu))
    [result] = handler.get_finished()
    assert (result.job_id, result.success) == (7, True)
    assert result.transfer_size == sum(sizes) * layout.page_bytes * layout.tensors
    assert metrics.snapshot()["fallbacks"] == {}
    for live, want in zip(gpu + host, expected_gpu + expected_host, strict=True):
        assert torch.equal(live, want)
    # The source side was only read.
    source = before_gpu if gpu_to_cpu else before_host
    assert all(torch.equal(a, b) for a, b in zip(gpu if gpu_to_cpu else host, source, strict=True))


@pytest.mark.parametrize("gpu_to_cpu", [True, False])
@pytest.mark.parametrize("layout", LAYOUTS[:3], ids=["per-layer", "chunks-of-4", "shared-region"])
def test_jobs_under_inference_mode_are_served_exactly(layout, gpu_to_cpu):
    """vLLM's model runner submits offload jobs under torch.inference_mode (its tests do
    too): the tensors kvcore makes from the block ids there have no version counter."""
    layout = sized(layout)
    with torch.inference_mode():
        gpu, host = layout.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(3))
        groups = draw_groups(np.random.default_rng(3), layout, [9, 4], 1.0)
        stock = stock_handler(gpu, host, layout, gpu_to_cpu=gpu_to_cpu, groups=len(groups))
        expected = reference(gpu, host, layout, groups, gpu_to_cpu)
        metrics = Metrics()
        handler = kvcore_handler(stock, policy=SMALL, metrics=metrics)
        assert submit(handler, 3, *make_job(groups, gpu_to_cpu))
        [result] = handler.get_finished()
    assert (result.job_id, result.success) == (3, True)
    assert metrics.snapshot()["fallbacks"] == {}  # kvcore copied it: no failure, no pass
    assert_tensors_are(gpu, host, expected)


@pytest.mark.parametrize(
    ("layout", "ids", "chunks", "copies_per_tensor"),
    [
        # Consecutive on both sides: one copy per tensor instead of one per page.
        (Layout(page_bytes=256, tensors=3), list(range(10, 20)), list(range(30, 40)), [1, 1, 1]),
        # Two breaks on the GPU side: three runs.
        (
            Layout(page_bytes=256, tensors=3),
            [1, 2, 3, 7, 8, 20, 21, 22, 23, 24],
            list(range(5, 15)),
            [3, 3, 3],
        ),
        # Shared region, 4 blocks a chunk: a chunk's sub-blocks are adjacent, chunks are
        # a row (every tensor's pages) apart, so one run per chunk.
        (
            Layout(page_bytes=1024, tensors=2, blocks_per_chunk=4, shared_region=True),
            list(range(0, 8)),
            [3, 4],
            [2, 2],
        ),
        # Cross-layer blocks in the shared region: the rows are the pages, so consecutive
        # chunks are adjacent and the whole job is one copy.
        (
            Layout(page_bytes=4096, shared_region=True),
            list(range(40, 56)),
            list(range(2, 18)),
            [1],
        ),
    ],
)
def test_descriptors_merge_where_both_sides_are_consecutive(layout, ids, chunks, copies_per_tensor):
    gpu, host = layout.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(3))
    for gpu_to_cpu in (True, False):
        stock = stock_handler(gpu, host, layout, gpu_to_cpu=gpu_to_cpu)
        copies = StockCopies(stock, gpu_tensors=handler_gpu_tensors(stock))
        descriptors = copies.max_copy_ops([len(ids)])
        mover = RecordingMover(COUNTABLE)
        handler = kvcore_handler(stock, mover=mover)
        groups = [(ids, chunks, 0)]
        expected = reference(gpu, host, layout, groups, gpu_to_cpu)
        submit(handler, 1, *make_job(groups, gpu_to_cpu))
        assert [job.job_id for job in handler.get_finished()] == [1]
        assert mover.ops == [("copy_runs", n) for n in copies_per_tensor]
        assert sum(copies_per_tensor) < descriptors == len(ids) * layout.tensors
        assert_tensors_are(gpu, host, expected)


@pytest.mark.parametrize("shared_region", [False, True], ids=["own_tensors", "shared_region"])
@pytest.mark.parametrize("gpu_to_cpu", [True, False], ids=["store", "load"])
def test_every_kv_tensor_of_a_job_moves_in_one_submission(monkeypatch, shared_region, gpu_to_cpu):
    checked = []
    monkeypatch.setattr(
        job_plans, "check_sides", lambda *sides: checked.append(sides) or check_sides(*sides)
    )
    layout = Layout(
        page_bytes=512, tensors=4, gpu_blocks=64, cpu_chunks=64, shared_region=shared_region
    )
    gpu, host = layout.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(21))
    stock = stock_handler(gpu, host, layout, gpu_to_cpu=gpu_to_cpu)
    mover = RecordingMover(SMALL, layered=True)
    handler = kvcore_handler(stock, mover=mover)
    scattered = [([9, 2, 14, 5, 40, 33], [3, 11, 0, 7, 50, 21], 0)]
    one_page = [([17], [44], 0)]
    for job_id, groups in ((1, scattered), (2, one_page)):
        expected = reference(gpu, host, layout, groups, gpu_to_cpu)
        submit(handler, job_id, *make_job(groups, gpu_to_cpu))
        assert_tensors_are(gpu, host, expected)
    assert [job.job_id for job in handler.get_finished()] == [1, 2]
    # One call per job for all four tensors: a gather of 6 rows, then one copy, each tensor's.
    # A load from the shared region gathers from the staging buffer, where one DMA submission
    # put the six chunks' rows of every tensor first.
    staged = [("copy_runs", 6)] if shared_region and not gpu_to_cpu else []
    assert mover.ops == [*staged, ("gather_prepared", 6 * 4), ("copy_runs_layers", 1 * 4)]
    # The engine's buffers are checked on the first job only, the next job planned on them.
    assert len(checked) == 1


def test_tensors_one_submission_cannot_take_are_moved_one_by_one(monkeypatch):
    """Should a batch's plan not fit all its tensors, each tensor gets its own plan; a load
    begun before it was planned (KVCORE_BEGIN_REGION_LOADS: one DMA submission of its
    spans) is closed unfinished."""
    monkeypatch.setattr(
        "kvcore.planning.submissions.layers_mismatch", lambda plan, pairs: "a test says so"
    )
    layout = Layout(page_bytes=512, tensors=3, gpu_blocks=64, cpu_chunks=64, shared_region=True)
    gpu, host = layout.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(22))
    for gpu_to_cpu in (True, False):
        stock = stock_handler(gpu, host, layout, gpu_to_cpu=gpu_to_cpu)
        mover = RecordingMover(replace(SMALL, begin_region_loads=True), layered=True)
        handler = kvcore_handler(stock, mover=mover)
        groups = [([9, 2, 14, 5], [3, 11, 0, 7], 0)]
        expected = reference(gpu, host, layout, groups, gpu_to_cpu)
        submit(handler, 1, *make_job(groups, gpu_to_cpu))
        assert [job.job_id for job in handler.get_finished()] == [1]
        begun = [] if gpu_to_cpu else ["copy_runs"]
        assert [op for op, _ in mover.ops] == [*begun, "gather", "gather", "gather"]
        assert_tensors_are(gpu, host, expected)


def test_host_contiguous_gpu_scattered_load_is_staged():
    layout = Layout(page_bytes=512, tensors=2, gpu_blocks=256, cpu_chunks=64)
    gpu, host = layout.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(5))
    stock = stock_handler(gpu, host, layout, gpu_to_cpu=False)
    mover = RecordingMover(SMALL)
    handler = kvcore_handler(stock, mover=mover)
    ids = list(range(0, 240, 6))
    groups = [(ids, list(range(8, 8 + len(ids))), 0)]
    expected = reference(gpu, host, layout, groups, False)
    submit(handler, 1, *make_job(groups, False))
    assert handler.get_finished()[0].job_id == 1
    assert mover.ops == [("stage_in", 1), ("stage_in", 1)]
    assert all(torch.equal(a, b) for a, b in zip(gpu, expected[0], strict=True))


def test_jobs_wait_for_compute_and_finish_in_order_once():
    layout = Layout(page_bytes=256, tensors=2, gpu_blocks=32, cpu_chunks=32)
    gpu, host = layout.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(11))
    stock = stock_handler(gpu, host, layout, gpu_to_cpu=True)
    backend = ManualStreams()
    handler = kvcore_handler(stock, policy=SMALL, streams=backend)
    compute = backend.stream("compute")
    written = torch.randint(-128, 128, (4, 256), dtype=torch.int8)

    def model_writes_kv():
        gpu[0][0:4] = written

    backend.run_on(compute, model_writes_kv)
    jobs = {1: ([0, 1, 2, 3], [10, 11, 12, 13]), 2: ([4, 5], [20, 21]), 3: ([6], [30])}
    for job_id, (ids, chunks) in jobs.items():
        submit(handler, job_id, *make_job([(ids, chunks, 0)], True))
    assert handler.get_finished() == []
    untouched = host[0][10:14].clone()

    handler.wait({99})  # a job this handler never had
    assert torch.equal(host[0][10:14], untouched)
    handler.wait({2})
    # Waiting for job 2 ran the model's write, then jobs 1 and 2, and not job 3.
    assert torch.equal(host[0][10:14], written)
    assert backend.pending(backend.stream("store")) == 1
    assert sorted(r.job_id for r in handler.get_finished()) == [1, 2]
    assert handler.get_finished() == []
    backend.complete_all()
    assert [r.job_id for r in handler.get_finished()] == [3]
    assert handler.get_finished() == []
    assert torch.equal(host[1][30], gpu[1][6])


class _TimedEvent:
    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed_time(self, end: _TimedEvent) -> float:
        return end.ms - self.ms


def test_a_served_jobs_time_holds_its_planning_and_its_copy(monkeypatch):
    layout = Layout(page_bytes=256, tensors=2, gpu_blocks=32, cpu_chunks=32)
    gpu, host = layout.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(5))
    stock = stock_handler(gpu, host, layout, gpu_to_cpu=False)
    events = iter([0.0, 1.0, 3.0])  # compute ready, copy start, copy end (ms)

    class TimedStreams(CpuSyncStreams):
        def record(self, stream: Any) -> Any:
            return _TimedEvent(next(events))

    handler = kvcore_handler(stock, policy=SMALL, streams=TimedStreams())
    clock = iter([50.0, 50.004])  # the job handed over, then submitted (s)
    monkeypatch.setattr(transfers, "perf_counter", lambda: next(clock))
    submit(handler, 1, *make_job([([0, 1, 2, 3], [10, 11, 12, 13], 0)], False))
    (result,) = handler.get_finished()
    # 2 ms of copy after 4 ms of planning.
    assert result.job_id == 1 and result.transfer_time == pytest.approx(0.006)
    assert torch.equal(gpu[0][0:4], host[0][10:14])


def test_shutdown_drains_queued_jobs_and_releases_tensors():
    layout = Layout(page_bytes=256, gpu_blocks=8, cpu_chunks=8)
    gpu, host = layout.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(2))
    stock = stock_handler(gpu, host, layout, gpu_to_cpu=False)
    backend = ManualStreams()
    handler = kvcore_handler(stock, policy=SMALL, streams=backend)
    submit(handler, 1, *make_job([([3], [5], 0)], False))
    submit(handler, 2, *make_job([([4], [6], 0)], False))
    handler.shutdown()
    assert backend.pending() == 0
    assert torch.equal(gpu[0][3], host[0][5]) and torch.equal(gpu[0][4], host[0][6])
    assert handler.get_finished() == []
    held = ("cpu_tensors",) if installed_shape().device_pointers else ("src_tensors", "dst_tensors")
    assert all(getattr(stock, name) == [] for name in held)
    # Nor does kvcore's handler keep the engine's buffers (its checked sides hold them).
    planner = handler._planner
    assert not (planner._rows or planner._pairs or planner._checked_sides)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    layout=st.sampled_from([*LAYOUTS, Layout(page_bytes=512, tensors=2, ref_page_bytes=384)]),
    gpu_to_cpu=st.booleans(),
    sizes=st.lists(st.integers(1, 12), min_size=1, max_size=2),
    seed=st.integers(0, 2**31),
)
@FILLS_FROM_BLOCK_IDS
def test_stock_copies_fill_what_stocks_own_transfer_async_issues(layout, gpu_to_cpu, sizes, seed):
    """The descriptors the A/B bench issues as stock's are those stock's own transfer_async
    issues, on every release (0.25 fills them inside transfer_async, with no fill method)."""
    layout = sized(layout)
    gpu, host = layout.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(seed))
    groups = draw_groups(np.random.default_rng(seed), layout, sizes, 0.5)
    stock = stock_handler(gpu, host, layout, gpu_to_cpu=gpu_to_cpu, groups=len(groups))
    issued: list[tuple[list[int], list[int], list[int], bool]] = []

    def record(src, dst, sizes, is_src_access_order_any=False):
        issued.append((src.tolist(), dst.tolist(), sizes.tolist(), is_src_access_order_any))

    stock._swap_blocks_batch = record
    submit(stock, 1, *make_job(groups, gpu_to_cpu))
    [result] = stock.get_finished()
    src, dst, sizes_issued = stock_fill(stock, groups, gpu_to_cpu)
    assert issued == [(src.tolist(), dst.tolist(), sizes_issued.tolist(), not gpu_to_cpu)]
    assert result.transfer_size == int(sizes_issued.sum())


@pytest.mark.parametrize("gpu_to_cpu", [True, False])
def test_partial_pages_fall_back_to_the_stock_fill_and_copy_op_counted(gpu_to_cpu):
    # vLLM copies only a layer's unpadded bytes of each page; kvcore leaves that to stock.
    layout = Layout(page_bytes=512, tensors=2, blocks_per_chunk=2, ref_page_bytes=384)
    gpu, host = layout.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(8))
    handler, mover, metrics, issued = logged_handler(gpu, host, layout, gpu_to_cpu)
    groups = [([9, 10, 11], [4, 5], 1)]
    expected = reference(gpu, host, layout, groups, gpu_to_cpu)
    submit(handler, 4, *make_job(groups, gpu_to_cpu))
    [result] = handler.get_finished()
    assert (result.job_id, result.transfer_size) == (4, 3 * 384 * 2)
    assert metrics.snapshot()["fallbacks"] == {"partial_page": 1}
    assert issued == [3 * 2] and mover.ops == []
    assert_tensors_are(gpu, host, expected)
    # Shut down, the handler's pass tally is taken in and no longer kept by the metrics.
    submit(handler, 5, *make_job(groups, gpu_to_cpu))
    handler.wait({5})
    handler.shutdown()
    assert metrics._tallies == []
    assert metrics.snapshot()["fallbacks"] == {"partial_page": 2}


def scattered_job_then_one_run(handler, gpu, host, layout, gpu_to_cpu):
    """A scattered job (the gather's case), then one that is one run per group (one copy:
    kvcore's either way), each byte-checked; both reported finished."""
    scattered = [([9, 2, 14, 5], [3, 11, 0, 7], 0)]
    one_run = [([4, 5, 6], [8, 9, 10], 0)]
    expected = reference(gpu, host, layout, scattered, gpu_to_cpu)
    submit(handler, 1, *make_job(scattered, gpu_to_cpu))
    assert_tensors_are(gpu, host, expected)
    expected = reference(gpu, host, layout, one_run, gpu_to_cpu)
    submit(handler, 2, *make_job(one_run, gpu_to_cpu))
    assert sorted(r.job_id for r in handler.get_finished()) == [1, 2]
    assert_tensors_are(gpu, host, expected)


@pytest.mark.parametrize("gpu_to_cpu", [True, False])
def test_scattered_loads_stay_with_vllms_own_kernel_where_it_picked_it(monkeypatch, gpu_to_cpu):
    monkeypatch.setattr(transfers, "RULES", replace(transfers.RULES, stock_kernel_loads=True))
    layout = Layout(page_bytes=256, gpu_blocks=16, cpu_chunks=16)
    gpu, host = layout.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(9))
    # What vLLM's selector returns for small pinned loads: its Triton kernel, partially applied.
    handler, mover, metrics, issued = logged_handler(
        gpu, host, layout, gpu_to_cpu, wrap=functools.partial
    )
    scattered_job_then_one_run(handler, gpu, host, layout, gpu_to_cpu)
    if gpu_to_cpu:  # vLLM never gives stores to its kernel: kvcore serves both
        assert issued == [] and metrics.snapshot()["fallbacks"] == {}
        assert [op for op, *_ in mover.ops] == ["gather", "copy_runs"]
    else:
        assert issued == [4] and metrics.snapshot()["fallbacks"] == {"stock_kernel_load": 1}
        assert [op for op, *_ in mover.ops] == ["copy_runs"]


@pytest.mark.parametrize(
    ("gpu_ids", "split"),
    [([9, 2, 14, 5], False), ([2, 9, 3, 5], True)],
    ids=["ends-apart", "ends-one-run-apart"],
)
def test_a_load_surely_scattered_passes_before_its_job_is_split(monkeypatch, gpu_ids, split):
    """Where the first and last GPU ids alone show the job is not one run, the scattered
    rule passes it without splitting the job into segments; where they could be one run,
    the job is split and judged as before. Both go to stock's kernel, bytes checked."""
    monkeypatch.setattr(transfers, "RULES", replace(transfers.RULES, stock_kernel_loads=True))
    splits: list[int] = []
    split_groups = transfers.split_groups

    def counted(*args, **kwargs):
        splits.append(1)
        return split_groups(*args, **kwargs)

    monkeypatch.setattr(transfers, "split_groups", counted)
    layout = Layout(page_bytes=256, gpu_blocks=16, cpu_chunks=16)
    gpu, host = layout.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(31))
    handler, mover, metrics, issued = logged_handler(
        gpu, host, layout, False, wrap=functools.partial
    )
    job = [(gpu_ids, [3, 11, 0, 7], 0)]
    expected = reference(gpu, host, layout, job, False)
    submit(handler, 1, *make_job(job, False))
    assert [r.job_id for r in handler.get_finished()] == [1]
    assert_tensors_are(gpu, host, expected)
    assert issued == [4] and metrics.snapshot()["fallbacks"] == {"stock_kernel_load": 1}
    assert mover.ops == [] and splits == ([1] if split else [])


@pytest.mark.parametrize("gpu_to_cpu", [True, False])
def test_scattered_loads_of_the_largest_pages_over_one_tensor_stay_with_stocks_dma(
    monkeypatch, gpu_to_cpu
):
    largest = replace(transfers.RULES, stock_scattered_loads_from_page_bytes=256)
    monkeypatch.setattr(transfers, "RULES", largest)
    layout = Layout(page_bytes=256, gpu_blocks=16, cpu_chunks=16)
    gpu, host = layout.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(23))
    handler, mover, metrics, issued = logged_handler(gpu, host, layout, gpu_to_cpu)
    scattered_job_then_one_run(handler, gpu, host, layout, gpu_to_cpu)
    if gpu_to_cpu:  # stores have rules of their own: kvcore serves both here
        assert issued == [] and metrics.snapshot()["fallbacks"] == {}
        assert [op for op, *_ in mover.ops] == ["gather", "copy_runs"]
    else:
        assert issued == [4] and metrics.snapshot()["fallbacks"] == {"stock_dma_large_pages": 1}
        assert [op for op, *_ in mover.ops] == ["copy_runs"]


def test_scattered_loads_of_the_largest_pages_over_per_layer_tensors_are_kvcores(monkeypatch):
    largest = replace(transfers.RULES, stock_scattered_loads_from_page_bytes=256)
    monkeypatch.setattr(transfers, "RULES", largest)
    mover, metrics, issued = scattered_load(tensors=3, seed=29)
    assert issued == [] and metrics.snapshot()["fallbacks"] == {}
    assert [op for op, *_ in mover.ops] == ["gather"] * 3


def scattered_load(tensors: int, seed: int, wrap=lambda swap: swap):
    """One scattered load through kvcore's handler over a stock one whose copy op is
    ``wrap``'s (``functools.partial``: vLLM's Triton kernel), bytes checked; the mover,
    metrics and stock's batches."""
    layout = Layout(page_bytes=256, tensors=tensors, gpu_blocks=16, cpu_chunks=16)
    gpu, host = layout.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(seed))
    handler, mover, metrics, issued = logged_handler(gpu, host, layout, False, wrap=wrap)
    scattered = [([9, 2, 14, 5], [3, 11, 0, 7], 0)]
    expected = reference(gpu, host, layout, scattered, False)
    submit(handler, 1, *make_job(scattered, False))
    assert [r.job_id for r in handler.get_finished()] == [1]
    assert_tensors_are(gpu, host, expected)
    return mover, metrics, issued


def test_scattered_loads_over_per_layer_tensors_are_kvcores_despite_vllms_kernel(monkeypatch):
    monkeypatch.setattr(transfers, "RULES", replace(transfers.RULES, stock_kernel_loads=True))
    mover, metrics, issued = scattered_load(tensors=3, seed=19, wrap=functools.partial)
    # One plan for the three layers, which the CPU kernels gather one by one.
    assert issued == [] and metrics.snapshot()["fallbacks"] == {}
    assert [op for op, *_ in mover.ops] == ["gather"] * 3


def shared_loads(share: float, seed: int, caplog) -> tuple[list[str], dict[str, int], list[int]]:
    """Twenty scattered loads through a handler that shares ``share`` of them with stock,
    bytes checked after each: the copies the log names per job, the fallbacks, and the
    descriptors stock's copy op got."""
    layout = Layout(page_bytes=256, tensors=2, gpu_blocks=64, cpu_chunks=64)
    gpu, host = layout.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(seed))
    stock = stock_handler(gpu, host, layout, gpu_to_cpu=False)
    issued: list[int] = []
    stock._swap_blocks_batch = memmove_batch(issued)
    metrics = Metrics()
    handler = kvcore_handler(stock, policy=SMALL, metrics=metrics, stock_share=share)
    rng = np.random.default_rng(seed)
    caplog.clear()
    with caplog.at_level("INFO", logger="kvcore.vllm"):
        for job_id in range(20):
            ids = rng.choice(64, size=6, replace=False).tolist()
            chunks = rng.choice(64, size=6, replace=False).tolist()
            job = [(ids, chunks, 0)]
            expected = reference(gpu, host, layout, job, False)
            submit(handler, job_id, *make_job(job, False))
            assert [r.job_id for r in handler.get_finished()] == [job_id]
            assert_tensors_are(gpu, host, expected)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kvcore A/B")]
    assert [line.split(",")[0] for line in lines] == [
        f"{transfers.AB_LOG_PREFIX} job {job_id}" for job_id in range(20)
    ]
    # The lines are what scripts/live_trace.py reads back.
    matches = [AB_LINE.fullmatch(line) for line in lines]
    assert all(m is not None and m.group(2) == "6" for m in matches)
    arms = [m.group(3) for m in matches if m is not None]
    return arms, metrics.snapshot()["fallbacks"], issued


def test_a_stock_share_sends_drawn_loads_to_stocks_copy_and_logs_every_load(caplog):
    arms, fallbacks, issued = shared_loads(0.5, seed=41, caplog=caplog)
    to_stock = arms.count("stock_share")
    assert set(arms) == {"kvcore", "stock_share"} and 0 < to_stock < 20
    assert fallbacks == {"stock_share": to_stock}
    # Each job stock copied went through its own copy op: 6 pages of 2 tensors.
    assert len(issued) == to_stock and set(issued) == {12}
    # The draws come from a seeded generator: the same loads get the same copies.
    again, _, _ = shared_loads(0.5, seed=41, caplog=caplog)
    assert again == arms
    everything, fallbacks, _ = shared_loads(1.0, seed=41, caplog=caplog)
    assert set(everything) == {"stock_share"} and fallbacks == {"stock_share": 20}


def test_without_a_stock_share_no_load_is_logged_or_shared(caplog):
    layout = Layout(page_bytes=256, tensors=2, gpu_blocks=16, cpu_chunks=16)
    gpu, host = layout.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(3))
    metrics = Metrics()
    load = kvcore_handler(
        stock_handler(gpu, host, layout, gpu_to_cpu=False), policy=SMALL, metrics=metrics
    )
    store = kvcore_handler(
        stock_handler(gpu, host, layout, gpu_to_cpu=True),
        policy=SMALL,
        metrics=metrics,
        stock_share=1.0,
    )
    with caplog.at_level("INFO", logger="kvcore.vllm"):
        submit(load, 1, *make_job([([3, 1], [5, 9], 0)], False))
        submit(store, 2, *make_job([([4, 2], [6, 8], 0)], True))
    assert [r.job_id for r in load.get_finished()] == [1]
    assert [r.job_id for r in store.get_finished()] == [2]
    # Stores are never shared: the share is for loads, where a request waits.
    assert not [r for r in caplog.records if "A/B" in r.getMessage()]
    assert metrics.snapshot()["fallbacks"] == {}


@pytest.mark.parametrize("gpu_to_cpu", [True, False])
def test_jobs_of_few_pages_a_submission_stay_stock(monkeypatch, gpu_to_cpu):
    few_pages = replace(transfers.RULES, min_pages_per_submission=4)
    monkeypatch.setattr(transfers, "RULES", few_pages)
    layout = Layout(page_bytes=256, tensors=2, gpu_blocks=16, cpu_chunks=16)
    gpu, host = layout.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(10))
    handler, mover, metrics, issued = logged_handler(gpu, host, layout, gpu_to_cpu)
    # Both KV tensors have one row geometry: one submission, whose pages are both tensors'.
    few = [([1], [4], 0)]  # 2 pages in 1 submission: under 4 a submission
    enough = [([7, 8], [0, 1], 0)]  # 4 pages in 1 submission
    for job_id, groups in ((1, few), (2, enough)):
        expected = reference(gpu, host, layout, groups, gpu_to_cpu)
        submit(handler, job_id, *make_job(groups, gpu_to_cpu))
        assert_tensors_are(gpu, host, expected)
    assert sorted(r.job_id for r in handler.get_finished()) == [1, 2]
    assert issued == [1 * 2] and metrics.snapshot()["fallbacks"] == {"few_pages": 1}
    # The CPU kernels have no layered ops: the mover issues the pairs one by one.
    assert [op for op, *_ in mover.ops] == ["copy_runs", "copy_runs"]


@pytest.mark.parametrize("gpu_to_cpu", [True, False])
def test_large_pages_need_more_pages_a_submission_and_their_stores_stay_stock(
    monkeypatch, gpu_to_cpu
):
    rules = replace(
        transfers.RULES,
        min_pages_per_submission=1,
        large_page_bytes=1024,
        min_large_pages_per_submission=6,
        stock_stores_from_page_bytes=1024,
    )
    monkeypatch.setattr(transfers, "RULES", rules)
    layout = Layout(page_bytes=1024, tensors=2, gpu_blocks=16, cpu_chunks=16)
    gpu, host = layout.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(12))
    handler, mover, metrics, issued = logged_handler(gpu, host, layout, gpu_to_cpu)
    few = [([1, 2], [4, 5], 0)]  # 4 pages in one submission: under 6
    enough = [([7, 8, 9], [0, 1, 2], 0)]  # 6 pages
    for job_id, groups in ((1, few), (2, enough)):
        expected = reference(gpu, host, layout, groups, gpu_to_cpu)
        submit(handler, job_id, *make_job(groups, gpu_to_cpu))
        assert_tensors_are(gpu, host, expected)
    assert sorted(r.job_id for r in handler.get_finished()) == [1, 2]
    if gpu_to_cpu:
        assert issued == [4, 6] and mover.ops == []
        assert metrics.snapshot()["fallbacks"] == {"stock_store_large_pages": 2}
    else:
        assert issued == [4] and metrics.snapshot()["fallbacks"] == {"few_pages": 1}
        assert [op for op, *_ in mover.ops] == ["copy_runs", "copy_runs"]


@pytest.mark.parametrize("gpu_to_cpu", [True, False])
def test_jobs_that_write_one_page_twice_stay_stock(gpu_to_cpu):
    layout = Layout(page_bytes=256, gpu_blocks=16, cpu_chunks=16)
    gpu, host = layout.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(12))
    handler, mover, metrics, issued = logged_handler(gpu, host, layout, gpu_to_cpu)
    # Two pages copied onto one destination page: which lands last is stock's business.
    twice = [([3, 4, 9], [6, 6, 1], 0)] if gpu_to_cpu else [([3, 3, 9], [6, 7, 1], 0)]
    submit(handler, 1, *make_job(twice, gpu_to_cpu))
    assert [r.job_id for r in handler.get_finished()] == [1]
    assert issued == [3] and mover.ops == []
    assert metrics.snapshot()["fallbacks"] == {"duplicate_destinations": 1}


def host_worker():
    """A stand-in for vLLM 0.32's worker (no expedited loads), its handlers on host tensors."""
    layout = Layout(page_bytes=256, gpu_blocks=4, cpu_chunks=4)
    gpu, host = layout.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(1))

    class Worker:
        _store_handler = stock_handler(gpu, host, layout, gpu_to_cpu=True)
        _load_handler = stock_handler(gpu, host, layout, gpu_to_cpu=False)
        kv_caches = canonical_kv_caches(_store_handler)

    return Worker()


def test_install_leaves_non_cuda_handlers_stock_and_counts_them():
    worker, metrics = host_worker(), Metrics()
    stock = worker._store_handler
    assert install_handlers(worker, KVCoreConfig(), metrics, worker.kv_caches) == []
    assert worker._store_handler is stock
    assert metrics.snapshot()["fallbacks"] == {"unsupported_device": 2}


def _installed_on_fake_cuda(monkeypatch, config: KVCoreConfig) -> dict[str, dict[str, Any]]:
    """The arguments each of kvcore's handlers was built with, installed by ``config`` on a
    worker whose tensors pass for CUDA ones (the top CUDA priority taken as -5)."""
    worker = host_worker()
    on_cuda = SimpleNamespace(device=SimpleNamespace(type="cuda"))
    monkeypatch.setattr(handler_install, "gpu_tensors_of", lambda stock: [on_cuda])
    monkeypatch.setattr(handler_install, "gpu_rows", lambda tensor: on_cuda)
    monkeypatch.setattr(handler_install, "_warmed_up", lambda *args: True)
    monkeypatch.setattr(handler_install, "highest_priority", lambda: -5)
    monkeypatch.setattr(
        handler_install,
        "CudaStreams",
        lambda device, priority: SimpleNamespace(compute_stream=None, priority=priority),
    )
    monkeypatch.setattr(handler_install.INSTALLATION, "replace_handler", lambda *args: None)
    built: dict[str, dict[str, Any]] = {}

    def record(stock: Any, **kwargs: Any) -> dict[str, Any]:
        return built.setdefault(kwargs["name"], kwargs)

    monkeypatch.setattr(handler_install, "KVCoreOffloadingHandler", record)
    installed = install_handlers(worker, config, Metrics(), worker.kv_caches)
    assert installed == ["_store_handler", "_load_handler"]
    return built


@pytest.mark.parametrize(("high", "load_priority"), [(True, -5), (False, 0)])
def test_loads_run_on_streams_of_the_top_priority_unless_turned_off(
    monkeypatch, high, load_priority
):
    built = _installed_on_fake_cuda(monkeypatch, KVCoreConfig(high_priority_loads=high))
    assert built["_load_handler"]["streams"].priority == load_priority
    assert built["_store_handler"]["streams"].priority == 0


@pytest.mark.parametrize("background", [True, False])
def test_each_handler_gets_a_thread_of_its_own_only_where_asked(monkeypatch, background):
    built = _installed_on_fake_cuda(monkeypatch, KVCoreConfig(background_issue=background))
    issuers = [built[name]["issuer"] for name in ("_store_handler", "_load_handler")]
    try:
        assert [issuer is not None for issuer in issuers] == [background, background]
        assert not background or issuers[0] is not issuers[1]
    finally:
        for issuer in issuers:
            if issuer is not None:
                issuer.close()


def test_install_plans_stores_by_dma_from_16_kib_and_loads_from_32_kib(monkeypatch):
    """Each handler gets its direction's planning thresholds; the mover keeps the loads'."""
    for name in ("KVCORE_LONG_RUN_BYTES", "KVCORE_MAX_BATCHED_RUNS"):
        monkeypatch.delenv(name, raising=False)
    built = _installed_on_fake_cuda(monkeypatch, KVCoreConfig())
    store, load = built["_store_handler"], built["_load_handler"]
    assert store["plan_policy"].long_run_bytes == 16 << 10
    assert load["plan_policy"].long_run_bytes == load["mover"].policy.long_run_bytes == 32 << 10
    assert store["mover"] is load["mover"]


@pytest.mark.parametrize("transfers", ["0", "1"])
def test_spec_installs_handlers_when_transfers_are_on(monkeypatch, transfers):
    worker = host_worker()
    monkeypatch.setattr(CPUOffloadingSpec, "create_worker", lambda self, kv_caches: worker)
    monkeypatch.delenv("KVCORE_METRICS", raising=False)
    monkeypatch.setenv("KVCORE_TRANSFERS", transfers)
    spec = KVCoreCPUOffloadingSpec(*spec_args({"cpu_bytes_to_use": 1 << 20}))
    before = METRICS.snapshot()["fallbacks"].get("unsupported_device", 0)
    assert spec.create_worker(worker.kv_caches) is worker
    # Host tensors here: an install declines both handlers, and says so.
    declined = 2 if transfers == "1" else 0
    assert METRICS.snapshot()["fallbacks"].get("unsupported_device", 0) == before + declined


def test_a_worker_kvcore_fails_to_equip_keeps_every_stock_handler(monkeypatch):
    worker = host_worker()
    stocks = (worker._store_handler, worker._load_handler)
    monkeypatch.setattr(CPUOffloadingSpec, "create_worker", lambda self, kv_caches: worker)
    monkeypatch.delenv("KVCORE_METRICS", raising=False)
    monkeypatch.setenv("KVCORE_TRANSFERS", "1")
    # Both look like CUDA handlers, and the second of kvcore's fails to build.
    monkeypatch.setattr(handler_install, "_warmed_up", lambda *args: True)
    gpu = [t.as_subclass(_CudaLooking) for t in handler_gpu_tensors(worker._store_handler)]
    if worker.kv_caches is None:
        monkeypatch.setattr(handler_install, "gpu_tensors_of", lambda stock: gpu)
    else:
        monkeypatch.setattr(
            handler_install, "gpu_rows", lambda tensor: tensor.tensor.as_subclass(_CudaLooking)
        )
    built = []

    def handler(stock, **options):
        if built:
            raise KeyError("kvcore broke")
        built.append(stock)
        return object()

    monkeypatch.setattr(handler_install, "KVCoreOffloadingHandler", handler)
    monkeypatch.setattr(handler_install, "highest_priority", lambda: -5)
    monkeypatch.setattr(
        handler_install,
        "CudaStreams",
        lambda device, priority: SimpleNamespace(compute_stream=None),
    )
    before = METRICS.snapshot()["fallbacks"].get("internal_error:KeyError", 0)
    spec = KVCoreCPUOffloadingSpec(*spec_args({"cpu_bytes_to_use": 1 << 20}))
    assert spec.create_worker(worker.kv_caches) is worker
    assert (worker._store_handler, worker._load_handler) == stocks and len(built) == 1
    assert METRICS.snapshot()["fallbacks"]["internal_error:KeyError"] == before + 1


class _CudaLooking(torch.Tensor):
    """A host tensor whose device reads as CUDA, for install decisions made on a CPU."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


@FILLS_FROM_BLOCK_IDS
def test_bench_ab_dry_run_on_cpu_checks_bytes():
    rows = ab.ab("cpu", [256], [0.5], job_bytes=8 << 10, repeats=1)
    assert {(r["direction"], r["path"]) for r in rows} == {
        (d, p) for d in ("d2h", "h2d") for p in ("per_block_copy", "kvcore", "kvcore_own")
    }
    assert all(r["bytes_ok"] and r["pages"] == 32 and r["seconds"] > 0 for r in rows)
    # Handlers report their submission's host time; the per-descriptor loop has none.
    assert all((r["submit_us"] is None) == (r["path"] == "per_block_copy") for r in rows)


@FILLS_FROM_BLOCK_IDS
def test_host_profile_script_dry_run_on_cpu(capsys):
    module = load_script("vllm_host_profile")
    argv = ["--page-kib", "1", "--job-mib", "1", "--tensors", "2", "--jobs", "3", "--profile", "5"]
    assert module.main([*argv, "--load", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "cpu: 512 pages of 1 KiB x 2 tensors, 50% fragmented, load" in out
    assert "kvcore transfer_async:" in out and "plan " in out and "Ordered by" in out


def test_job_window_runs_both_handlers_on_the_live_layout_and_checks_every_job(tmp_path):
    module = load_script("vllm_job_window")
    out = tmp_path / "window.json"
    argv = ["--tokens", "16,512", "--jobs", "3", "--tensors", "2", "--page-kib", "4"]
    assert module.main([*argv, "--gpu-blocks", "64", "--idle-ms", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["tokens"] for row in rows] == [16, 512]
    for row in rows:
        assert row["jobs_with_wrong_bytes"] == {"stock": 0, "kvcore": 0}
        assert row["bytes"] == row["tokens"] // 16 * 4096 * 2 and row["idle_ms"] == 1.0
    # Every job either took a kvcore path or passed to stock; 32 scattered pages gather.
    first_paths, first_passes = rows[0]["kvcore_paths"], rows[0]["kvcore_passes"]
    assert sum(first_paths.values()) + sum(first_passes.values()) == 3
    assert rows[1]["kvcore_paths"] == {"gather": 3}


def test_job_window_counts_a_job_whose_pages_did_not_arrive(tmp_path, monkeypatch):
    module = load_script("vllm_job_window")
    poison, run = module._poisoned, module._run
    last: dict[str, Any] = {}

    def remembered(gpu, gpu_ids):
        last.update(gpu=gpu, gpu_ids=gpu_ids)
        poison(gpu, gpu_ids)

    def lost_by_kvcore(handler, specs, job_id):
        timed = run(handler, specs, job_id)
        if isinstance(handler, KVCoreOffloadingHandler):
            poison(last["gpu"], last["gpu_ids"])
        return timed

    monkeypatch.setattr(module, "_poisoned", remembered)
    monkeypatch.setattr(module, "_run", lost_by_kvcore)
    out = tmp_path / "window.json"
    argv = ["--tokens", "512", "--jobs", "2", "--tensors", "2", "--page-kib", "4"]
    assert module.main([*argv, "--gpu-blocks", "64", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["jobs_with_wrong_bytes"] == {"stock": 0, "kvcore": 2}


def test_host_profile_timing_keeps_keyword_arguments():
    # The handler passes some steps keywords (_submit's descriptors): timing must not drop them.
    class Steps:
        def step(self, value, *, scale=1):
            return value * scale

    steps = Steps()
    seconds = load_script("vllm_host_profile")._timed_steps(steps, ("step",))
    assert steps.step(3, scale=7) == 21 and steps.step(2) == 2
    assert len(seconds["step"]) == 2 and all(s >= 0 for s in seconds["step"])


def test_handlers_are_installed_only_after_a_warm_up_that_moved_every_byte_right(monkeypatch):
    worker = host_worker()
    stocks = [handler_gpu_tensors(worker._store_handler), handler_gpu_tensors(worker._load_handler)]
    metrics = Metrics()
    assert handler_install._warmed_up(Mover(SMALL, metrics=metrics), stocks, metrics)
    assert metrics.snapshot()["fallbacks"] == {} and metrics.snapshot()["transfers"] == []

    def wrong(mover, device, pages):
        assert (device.type, set(pages)) == ("cpu", {256})
        return WarmUp(warmed=["h2d/staged/256B"], wrong=["d2h/gather/256B"])

    monkeypatch.setattr(handler_install, "warm_up", wrong)
    assert not handler_install._warmed_up(Mover(SMALL), stocks, metrics)

    def broken(mover, device, pages):
        raise RuntimeError("no staging buffer")

    monkeypatch.setattr(handler_install, "warm_up", broken)
    assert not handler_install._warmed_up(Mover(SMALL), stocks, metrics)
    assert metrics.snapshot()["fallbacks"] == {"warm_up_wrong_bytes": 1, "warm_up_failed": 1}


def test_the_kernel_load_rule_switch_hands_those_loads_to_kvcore():
    # The autouse fixture turned the rule off: one KV tensor, yet kvcore's gather.
    mover, metrics, issued = scattered_load(tensors=1, seed=23, wrap=functools.partial)
    assert issued == [] and metrics.snapshot()["fallbacks"] == {}
    assert [op for op, *_ in mover.ops] == ["gather"]


@pytest.mark.parametrize("gpu_to_cpu", [True, False])
def test_a_job_too_small_for_kvcore_goes_to_stock_before_any_work_on_its_ids(
    monkeypatch, gpu_to_cpu
):
    monkeypatch.setattr(transfers, "RULES", replace(transfers.RULES, min_pages_per_submission=8))

    def no_split(*args, **kwargs):
        raise AssertionError("a job the block count decides needs no split")

    monkeypatch.setattr(transfers, "split_groups", no_split)
    layout = Layout(page_bytes=256, tensors=2, gpu_blocks=16, cpu_chunks=16)
    gpu, host = layout.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(13))
    handler, mover, metrics, issued = logged_handler(gpu, host, layout, gpu_to_cpu)
    groups = [([3, 9, 4], [5, 1, 12], 0)]  # 3 blocks x 2 tensors: under 8 pages
    expected = reference(gpu, host, layout, groups, gpu_to_cpu)
    submit(handler, 1, *make_job(groups, gpu_to_cpu))
    handler.wait({1})
    assert [(r.job_id, r.transfer_size) for r in handler.get_finished()] == [(1, 3 * 2 * 256)]
    assert issued == [6] and mover.ops == []
    assert metrics.snapshot()["fallbacks"] == {"few_pages": 1}
    assert_tensors_are(gpu, host, expected)


class UncalledMetrics(Metrics):
    """Metrics that a passed job must not call into: its reason goes to a tally."""

    def record_fallback(self, reason: str) -> None:
        raise AssertionError(f"a pass ({reason}) called into the metrics")

    def record_pass(self, reason: str) -> None:
        raise AssertionError(f"a pass ({reason}) called into the metrics")


@pytest.mark.parametrize("gpu_to_cpu", [True, False])
def test_each_passed_job_is_counted_once_with_no_call_into_the_metrics(monkeypatch, gpu_to_cpu):
    monkeypatch.setattr(transfers, "RULES", replace(transfers.RULES, min_pages_per_submission=4))
    layout = Layout(page_bytes=256, tensors=2, gpu_blocks=16, cpu_chunks=16)
    gpu, host = layout.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(14))
    stock = stock_handler(gpu, host, layout, gpu_to_cpu=gpu_to_cpu)
    stock._swap_blocks_batch = memmove_batch([])
    metrics = UncalledMetrics()
    handler = kvcore_handler(stock, mover=RecordingMover(SMALL), metrics=metrics)
    for job_id in range(1, 8):
        submit(handler, job_id, *make_job([([job_id], [job_id + 8], 0)], gpu_to_cpu))
        if job_id % 3 == 0:
            assert metrics.snapshot()["fallbacks"] == {"few_pages": job_id}
    # A served job counts nothing; the passed ones are each counted once, however often read.
    submit(handler, 8, *make_job([([9, 10], [0, 1], 0)], gpu_to_cpu))
    assert sorted(r.job_id for r in handler.get_finished()) == list(range(1, 9))
    assert metrics.snapshot()["fallbacks"] == {"few_pages": 7}
    assert metrics.snapshot()["fallbacks"] == {"few_pages": 7}


def test_with_no_job_of_its_own_the_handler_leaves_its_queue_alone(monkeypatch):
    monkeypatch.setattr(transfers, "RULES", replace(transfers.RULES, min_pages_per_submission=4))
    layout = Layout(page_bytes=256, tensors=2, gpu_blocks=16, cpu_chunks=16)
    gpu, host = layout.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(15))
    stock = stock_handler(gpu, host, layout, gpu_to_cpu=True)
    stock._swap_blocks_batch = memmove_batch([])
    backend = ManualStreams()
    handler = kvcore_handler(stock, mover=RecordingMover(SMALL), streams=backend)
    passed, served = [([1], [4], 0)], [([7, 8], [0, 1], 0)]

    def untouched(*args, **kwargs):
        raise AssertionError("the handler read its job queue with no job in it")

    with monkeypatch.context() as patched:
        for name in ("finished", "wait", "__len__", "__iter__"):
            patched.setattr(transfers.OrderedJobs, name, untouched)
        assert handler.get_finished() == []
        submit(handler, 1, *make_job(passed, True))
        handler.wait({1})
        assert [r.job_id for r in handler.get_finished()] == [1]
        assert handler.get_finished() == []
    # With a job of kvcore's queued, its queue is read: its finished jobs come first, in
    # submission order, then stock's.
    submit(handler, 2, *make_job(served, True))
    submit(handler, 3, *make_job(passed, True))
    assert [r.job_id for r in handler.get_finished()] == [3]
    submit(handler, 4, *make_job(served, True))
    submit(handler, 5, *make_job(passed, True))
    backend.complete_all()
    assert [r.job_id for r in handler.get_finished()] == [2, 4, 5]
    assert handler.get_finished() == []


@pytest.mark.parametrize("tensors", [2, 3])
@pytest.mark.parametrize("min_pages", [4, 5, 6])
def test_the_block_count_a_job_passes_under_is_the_page_rule_read_once(
    monkeypatch, tensors, min_pages
):
    monkeypatch.setattr(
        transfers, "RULES", replace(transfers.RULES, min_pages_per_submission=min_pages)
    )
    split: list[int] = []

    def recording_split(gpu_ids, *args):
        split.append(len(gpu_ids))
        return transfers_split(gpu_ids, *args)

    transfers_split = transfers.split_groups
    monkeypatch.setattr(transfers, "split_groups", recording_split)
    layout = Layout(page_bytes=256, tensors=tensors, gpu_blocks=16, cpu_chunks=16)
    gpu, host = layout.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(16))
    handler, _, metrics, _ = logged_handler(gpu, host, layout, True)
    for blocks in range(1, 5):
        ids = list(range(blocks))
        submit(handler, blocks, *make_job([(ids, [c + 8 for c in ids], 0)], True))
    # One submission holds every tensor's pages: a job passes exactly where they are too few.
    assert split == [b for b in range(1, 5) if b * tensors >= min_pages]
    passed = sum(1 for b in range(1, 5) if b * tensors < min_pages)
    assert metrics.snapshot()["fallbacks"] == ({"few_pages": passed} if passed else {})


def test_pass_cost_script_counts_kvcores_calls_beyond_stocks_on_cpu(monkeypatch, capsys):
    monkeypatch.setattr(transfers, "RULES", vllm_rule.VLLM_RULES)
    module = load_script("vllm_pass_cost")
    assert module.main(["--jobs", "20", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    # A warm-up, a profiled round and two timed rounds of 20 jobs.
    assert "every job passed to stock by kvcore (few_pages: 80)" in out
    assert "whole job" in out and "kvcore's calls beyond stock's, per job:" in out
    stock, kvcore, _ = module.sides(
        torch.device("cpu"), tensors=2, page_bytes=1024, gpu_to_cpu=False
    )
    module.measure(stock, kvcore, jobs=10, rounds=1)
    # A passed job costs kvcore its own three methods and the length of the block ids; a
    # get_finished with nothing in flight, its own method.
    extra = {p: kvcore.calls_per_job(p) - stock.calls_per_job(p) for p in module.PHASES}
    assert extra == {"transfer_async": 2, "wait": 1, "get_finished": 1, "idle get_finished": 1}
    kvcore.handler.shutdown()


def _gathered_stores_pass_from_512_bytes(monkeypatch) -> Layout:
    rules = replace(
        transfers.RULES,
        min_pages_per_submission=1,
        stock_gathered_stores_from_page_bytes=512,
        stock_stores_from_page_bytes=None,
    )
    monkeypatch.setattr(transfers, "RULES", rules)
    return Layout(page_bytes=1024, tensors=2, gpu_blocks=16, cpu_chunks=16)


def test_stores_kvcore_would_gather_stay_stock_unless_their_pages_go_by_dma(monkeypatch):
    gpu_to_cpu = True
    layout = _gathered_stores_pass_from_512_bytes(monkeypatch)
    gpu, host = layout.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(14))
    scattered = [([9, 3, 12], [0, 5, 2], 0)]
    # SMALL's runs go by DMA from 256 KiB: kvcore would gather these 1 KiB pages.
    handler, mover, metrics, issued = logged_handler(gpu, host, layout, gpu_to_cpu)
    expected = reference(gpu, host, layout, scattered, gpu_to_cpu)
    submit(handler, 1, *make_job(scattered, gpu_to_cpu))
    assert_tensors_are(gpu, host, expected)
    assert [r.job_id for r in handler.get_finished()] == [1]
    assert issued == [6] and mover.ops == []
    assert metrics.snapshot()["fallbacks"] == {"stock_gather_beside_compute": 1}
    # Runs of 1 KiB and more by DMA into place: kvcore copies them.
    stock = stock_handler(gpu, host, layout, gpu_to_cpu=gpu_to_cpu)
    dma = RecordingMover(replace(SMALL, long_run_bytes=1024))
    counted = Metrics()
    served = kvcore_handler(stock, mover=dma, metrics=counted)
    again = [([4, 14, 6], [7, 1, 11], 0)]
    expected = reference(gpu, host, layout, again, gpu_to_cpu)
    submit(served, 2, *make_job(again, gpu_to_cpu))
    assert_tensors_are(gpu, host, expected)
    assert [r.job_id for r in served.get_finished()] == [2]
    assert dma.ops and counted.snapshot()["fallbacks"] == {}


def test_loads_kvcore_would_gather_are_kvcores_under_the_store_rule(monkeypatch):
    layout = _gathered_stores_pass_from_512_bytes(monkeypatch)
    gpu, host = layout.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(15))
    scattered = [([9, 3, 12], [0, 5, 2], 0)]
    handler, mover, metrics, issued = logged_handler(gpu, host, layout, gpu_to_cpu=False)
    expected = reference(gpu, host, layout, scattered, False)
    submit(handler, 1, *make_job(scattered, False))
    assert_tensors_are(gpu, host, expected)
    assert [r.job_id for r in handler.get_finished()] == [1]
    assert issued == [] and mover.ops
    assert metrics.snapshot()["fallbacks"] == {}


@pytest.mark.parametrize("gpu_to_cpu", [True, False], ids=["store", "load"])
def test_mla_sized_blocks_store_by_dma_into_place_and_load_by_gather(monkeypatch, gpu_to_cpu):
    """Under the default settings and rules, 18 KiB blocks (MLA's) are kvcore's both ways:
    stores planned by DMA into place (from 16 KiB), loads by the gather (DMA from 32 KiB)."""
    for name in ("KVCORE_LONG_RUN_BYTES", "KVCORE_MAX_BATCHED_RUNS"):
        monkeypatch.delenv(name, raising=False)
    layout = Layout(page_bytes=18 << 10, tensors=2, gpu_blocks=640, cpu_chunks=640)
    gpu, host = layout.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(16))
    rng = np.random.default_rng(16)
    job = [(rng.permutation(640)[:300].tolist(), sorted(rng.permutation(640)[:300].tolist()), 0)]
    expected = reference(gpu, host, layout, job, gpu_to_cpu)
    metrics = Metrics()
    handler = kvcore_handler(
        stock_handler(gpu, host, layout, gpu_to_cpu=gpu_to_cpu), metrics=metrics
    )
    submit(handler, 1, *make_job(job, gpu_to_cpu))
    assert_tensors_are(gpu, host, expected)
    assert [r.job_id for r in handler.get_finished()] == [1]
    snapshot = metrics.snapshot()
    assert snapshot["fallbacks"] == {}
    assert [row["path"] for row in snapshot["transfers"]] == (
        ["batched_runs"] if gpu_to_cpu else ["gather"]
    )


@pytest.mark.parametrize("stage_regions", ["off", "gather", "all"])
@pytest.mark.parametrize(
    ("layout", "unstaged"),
    [
        # MLA's 18 KiB blocks: five tensors' pages leave each chunk row padded to 4 KiB.
        (
            Layout(
                page_bytes=18 << 10, tensors=5, gpu_blocks=64, cpu_chunks=64, shared_region=True
            ),
            "gather",
        ),
        (
            Layout(
                page_bytes=32 << 10, tensors=4, gpu_blocks=64, cpu_chunks=64, shared_region=True
            ),
            "batched_runs",
        ),
        (Layout(page_bytes=4096, tensors=3, blocks_per_chunk=2, shared_region=True), "gather"),
    ],
    ids=["mla-18k-padded", "mha-32k", "two-blocks-a-chunk"],
)
def test_loads_from_the_shared_region_go_staged_by_region_under_the_setting(
    monkeypatch, layout, unstaged, stage_regions
):
    """``KVCORE_STAGE_REGIONS``: a load job of whole chunks is staged by region (every
    tensor's pages of its chunks in one copy, then scattered), byte for byte what stock
    copies, in place of the gather (``gather``, the default) or of either path (``all``);
    ``off``, it keeps the gather or one DMA a page."""
    for name in ("KVCORE_LONG_RUN_BYTES", "KVCORE_MAX_BATCHED_RUNS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVCORE_STAGE_REGIONS", stage_regions)
    gpu, host = layout.make_tensors(torch.device("cpu"), torch.Generator().manual_seed(45))
    rng = np.random.default_rng(45)
    chunks = layout.cpu_chunks // 2
    gpu_ids = rng.permutation(layout.gpu_blocks)[: chunks * layout.blocks_per_chunk].tolist()
    job = [(gpu_ids, list(range(3, 3 + chunks)), 0)]
    expected = reference(gpu, host, layout, job, False)
    metrics = Metrics()
    handler = kvcore_handler(
        stock_handler(gpu, host, layout, gpu_to_cpu=False), metrics=metrics, stock_rules=False
    )
    submit(handler, 1, *make_job(job, False))
    assert_tensors_are(gpu, host, expected)
    assert [r.job_id for r in handler.get_finished()] == [1]
    snapshot = metrics.snapshot()
    assert snapshot["fallbacks"] == {}
    paths = [row["path"] for row in snapshot["transfers"]]
    staged = stage_regions == "all" or (stage_regions == "gather" and unstaged == "gather")
    assert paths == ["staged" if staged else unstaged]
