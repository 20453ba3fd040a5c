"""vLLM's CPU offload transfer handlers with copies planned and issued by kvcore's mover.

A stock ``SingleDirectionOffloadingHandler`` turns every (block, layer) of a job into one
pointer descriptor and hands them all to one batched copy. This handler keeps its public
contract (``transfer_async`` / ``get_finished`` / ``wait`` / ``shutdown``): each job's
copies wait for the work queued on the compute stream at submission, and each job is
reported finished once. kvcore's jobs run one after another on the handler's own stream and
are reported in submission order (:class:`kvcore.streams.OrderedJobs`). A job is planned
from its block ids alone, never from device memory: per KV tensor, its pages become row
indices (:mod:`kvcore_vllm.page_rows`), and KV tensors whose pages give the same row indices
(a model's layers) share one plan and move in one submission
(:meth:`kvcore.mover.Mover.execute` over them: one gather launch or one batched DMA call;
:mod:`kvcore_vllm.job_plans`). A load staged by host region begins before it is planned:
its first DMAs into kvcore's staging buffer are queued on the handler's stream ahead of the
job's wait for the compute stream, and its scatters after that wait.

A job kvcore cannot prove it copies exactly as stock does (a canonical host layout, a page
only partly copied, a row layout it cannot express, duplicate destinations, a fallback
reason from the planner), or whose copy stock's costs less, goes whole to the stock
handler's own ``transfer_async``, the reason counted; it costs what it costs stock, plus
kvcore's decision (``scripts/vllm_pass_cost.py`` counts the calls). Stock keeps it on its
own streams and reports it through ``get_finished`` and ``wait``, which this forwards. So
does a job during which kvcore itself fails (``internal_error:<type>``, logged once per
type), after the part kvcore queued has finished; a CUDA error is raised instead
(:mod:`kvcore.internal_errors`). Jobs on other streams may end out of order (vLLM matches by id).

vLLM 0.34 hands the handler device pointers instead of GPU block ids
(:mod:`kvcore_vllm.device_pointers` reads the ids back; a job whose pointers it cannot read
goes to stock), and reports a failed copy as ``success=False``: there a CUDA error in a
kvcore job clears the pending error, waits for what kvcore queued, and reports the job
failed (counted as a ``failed`` decision).
"""

from __future__ import annotations

import functools
import logging
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from time import perf_counter
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import GPULoadStoreSpec, TransferResult

from kvcore.direction import Direction
from kvcore.internal_errors import InternalErrors, device_in_doubt
from kvcore.issuer import Issuer
from kvcore.kernels.cudart import clear_pending_error
from kvcore.metrics import Metrics
from kvcore.mover import Mover
from kvcore.planning.layers import LayerPairs
from kvcore.planning.path_policy import PathPolicy
from kvcore.planning.submissions import Submission
from kvcore.planning.vllm_rule import VLLM_RULES
from kvcore.region_staging import RegionLoad
from kvcore.stock_share import REASON as STOCK_SHARE
from kvcore.stock_share import StockShare
from kvcore.streams import NamedStreams, OrderedJobs
from kvcore_vllm.device_pointers import PointerReader
from kvcore_vllm.job_groups import describe_groups
from kvcore_vllm.job_plans import JobPlanner
from kvcore_vllm.job_segments import Segment, split_groups
from kvcore_vllm.page_rows import page_bytes
from kvcore_vllm.releases import ReleaseShape, installed_shape
from kvcore_vllm.stock_copies import StockCopies

logger = logging.getLogger("kvcore.vllm")

INTERNAL_ERRORS = InternalErrors("vLLM", logger)

# When stock's batched copy costs less than kvcore's (measured: kvcore.planning.vllm_rule).
RULES = VLLM_RULES

# Starts the line logged for each load while loads are shared with stock (``stock_share``).
AB_LOG_PREFIX = "kvcore A/B: load"

# What _take returns for a job whose copy failed and is reported so (vLLM 0.34).
_FAILED = "failed"


class KVCoreOffloadingHandler:
    """Drop-in for one stock ``SingleDirectionOffloadingHandler`` (GPU->CPU or CPU->GPU).

    ``stock`` is the handler this one replaces: its tensors, block geometry and layer
    references are read once, and the jobs kvcore does not copy itself are handed to
    it. ``streams`` supplies the handler's stream (named ``name``) and events;
    ``compute_stream`` returns the stream whose queued work a job must wait for.
    ``stock_rules=False`` turns off the rules that leave jobs to stock because stock's
    copy would cost less (:meth:`_stock_is_cheaper`), so that benchmarks can measure
    kvcore's own paths on those jobs; correctness fallbacks always apply.
    ``stock_share`` (loads only): that share of the loads kvcore would serve go to stock
    instead (counted ``stock_share``), drawn per job from a generator seeded with
    ``ab_seed``, and every load is logged with the copy it got (:data:`AB_LOG_PREFIX`):
    an A/B of the two copies in one engine process, which its requests' timings
    are matched to afterwards.
    ``shape``: the vLLM release's (the installed one's by default); where it passes
    device pointers, ``gpu_tensors`` are the GPU KV tensors as int8 rows
    (:func:`kvcore_vllm.device_pointers.gpu_rows`), which its stock handler lacks.
    ``plan_policy``: the thresholds its jobs are planned with (the mover's by default).
    """

    def __init__(
        self,
        stock: Any,
        *,
        mover: Mover,
        gpu_tensors: Sequence[torch.Tensor] | None = None,
        shape: ReleaseShape | None = None,
        streams: NamedStreams,
        compute_stream: Callable[[], Any],
        name: str,
        metrics: Metrics | None = None,
        stock_rules: bool = True,
        stock_share: float = 0.0,
        ab_seed: int = 0,
        plan_policy: PathPolicy | None = None,
        issuer: Issuer | None = None,
    ) -> None:
        self._shape = installed_shape() if shape is None else shape
        self._stock = StockCopies(stock, self._shape, gpu_tensors)
        # Bound once: every job passes through them (vLLM never swaps a handler's methods).
        self._stock_transfer_async: Callable[[int, Any, Any], bool] = stock.transfer_async
        self._stock_get_finished: Callable[[], list[TransferResult]] = stock.get_finished
        self._stock_wait: Callable[[set[int]], None] = stock.wait
        self.gpu_to_cpu: bool = self._stock.gpu_to_cpu
        self.direction = Direction.D2H if self.gpu_to_cpu else Direction.H2D
        self.blocks_per_chunk: int = self._stock.blocks_per_chunk
        self._mover = mover
        self._plan_policy = mover.policy if plan_policy is None else plan_policy
        self._jobs = OrderedJobs(streams, name, compute_stream, issuer)
        self._queued = self._jobs.queued
        self._issuer = issuer
        # Where jobs are issued on the issuer's thread, each one's arguments until it is
        # reported: a job whose issuing raises there goes to stock with them.
        self._handed: dict[int, tuple[Any, Any]] = {}
        # A pass is counted with no call: the metrics take the tally in when they are read.
        self._metrics = metrics
        self._passes: defaultdict[str, int] = (
            defaultdict(int) if metrics is None else metrics.fallback_tally()
        )
        self._stock_rules = stock_rules
        self._stock_share = StockShare(0.0 if self.gpu_to_cpu else stock_share, ab_seed)
        self._groups, rows = describe_groups(self._stock, self.blocks_per_chunk)
        self._planner = JobPlanner(
            self._groups,
            rows,
            self.direction,
            self._plan_policy,
            # Where loads may begin unplanned (KVCORE_BEGIN_REGION_LOADS): no call otherwise.
            # Not with an issuer: a begun load's DMAs would wait for its thread to be idle.
            self._begin_load
            if mover.policy.begin_region_loads and not self.gpu_to_cpu and issuer is None
            else None,
        )
        self._page_bytes = max(page_bytes(t) for t in self._stock.gpu_tensors)
        self._max_tensors = max(
            len({ref.tensor_idx for ref in refs}) for refs in self._stock.layer_refs_per_group
        )
        # vLLM picks its Triton swap kernel (a functools.partial) for small pinned loads.
        self._stock_loads_by_kernel = not self.gpu_to_cpu and isinstance(
            self._stock.copy_op, functools.partial
        )
        self._glance_reason, self._glance_blocks = self._stock_is_cheaper_at_a_glance()
        self._scattered_reason = self._scattered_load_reason()
        # Over one KV tensor, every group copyable, a job's GPU ids can show it scattered.
        self._scattered_at_a_glance = (
            self._stock_rules
            and self._scattered_reason is not None
            and self._max_tensors == 1
            and not any(isinstance(g, str) for g in self._groups)
        )
        self._pointers = (
            PointerReader(
                self._stock.gpu_tensors,
                [[ref.tensor_idx for ref in refs] for refs in self._stock.layer_refs_per_group],
            )
            if self._shape.device_pointers
            else None
        )
        self._failed: list[int] = []
        """Jobs whose copy failed, to be reported so (releases that report failures)."""

    @property
    def gpu_tensors(self) -> list[torch.Tensor]:
        """The GPU KV tensors this handler copies to or from, as int8 rows."""
        return self._stock.gpu_tensors

    @property
    def layer_refs_per_group(self) -> list[list[Any]]:
        """The stock handler's layer references, per KV cache group."""
        return self._stock.layer_refs_per_group

    def transfer_async(self, job_id: int, first: Any, second: Any) -> bool:
        """Queue job ``job_id``. ``first, second`` are what the release's worker passes: the
        source and destination specs, or (0.34) the connector's ``DevicePointers`` and the
        CPU spec; a job kvcore does not copy goes to the stock handler with the same."""
        # The GPU blocks it copies, read without a pass over its ids or a call of kvcore's.
        if self._pointers is None:
            blocks = len((first if self.gpu_to_cpu else second).block_ids)
        else:
            blocks = sum(first.group_block_counts)
        if blocks < self._glance_blocks:
            reason = self._glance_reason
        else:
            reason = self._take(job_id, first, second)
        if self._stock_share.share:
            logger.info(
                "%s job %d, %d blocks: %s", AB_LOG_PREFIX, job_id, blocks, reason or "kvcore"
            )
        if reason is not None and reason != _FAILED:
            self._passes[reason] += 1
            self._stock_transfer_async(job_id, first, second)
        return True

    def _take(self, job_id: int, first: Any, second: Any) -> str | None:
        """Queue the job on kvcore's paths; the reason it goes to stock instead, if any
        (:data:`_FAILED` for a job that failed and is reported so)."""
        handed_over = perf_counter()
        if self._pointers is not None:
            read = self._pointers.read(first)
            if isinstance(read, str):
                return read
            gpu_ids, group_sizes, block_indices = read.gpu_ids, read.group_sizes, read.block_indices
            cpu_ids = np.asarray(second.block_ids)
        else:
            gpu_spec, cpu_spec = (first, second) if self.gpu_to_cpu else (second, first)
            if not isinstance(gpu_spec, GPULoadStoreSpec):
                raise TypeError(f"the GPU side of job {job_id} is a {type(gpu_spec).__name__}")
            gpu_ids, cpu_ids = np.asarray(gpu_spec.block_ids), np.asarray(cpu_spec.block_ids)
            group_sizes, block_indices = gpu_spec.group_sizes, gpu_spec.block_indices
        if self._scattered_at_a_glance and _surely_scattered(gpu_ids, group_sizes):
            return self._scattered_reason
        segments = split_groups(gpu_ids, cpu_ids, group_sizes, block_indices, self.blocks_per_chunk)
        try:
            reason = self._serve(job_id, segments, handed_over)
            if reason is None and self._issuer is not None:
                self._handed[job_id] = (first, second)
            return reason
        except Exception as exc:
            if self._shape.reports_failed_transfers and device_in_doubt(exc):
                return self._fail(job_id, exc)
            reason = INTERNAL_ERRORS.reason(exc)
            # Part of the job may be queued on kvcore's stream; stock's copy runs on
            # stock's streams, so it must not finish (and the pages be reused) first.
            self._jobs.settle()
            return reason

    def _fail(self, job_id: int, exc: Exception) -> str:
        """Report job ``job_id`` failed, as the release's own handler reports a failed copy:
        the pending CUDA error cleared, what kvcore queued of it waited for."""
        clear_pending_error()
        logger.error(
            "kvcore: the %s copy of job %d failed (%s); vLLM is told it failed",
            self.direction.value,
            job_id,
            exc,
        )
        try:
            self._jobs.settle()
        except RuntimeError:
            clear_pending_error()
            logger.exception("kvcore: waiting for the rest of failed job %d failed", job_id)
        self._failed.append(job_id)
        if self._metrics is not None:
            self._metrics.record_decision("failed", f"transfer_failed:{type(exc).__name__}")
        return _FAILED

    def _stock_is_cheaper_at_a_glance(self) -> tuple[str | None, int]:
        """The stock-is-cheaper rule that a job's block count alone decides, read once: jobs
        of fewer blocks than the count returned go to stock for the reason returned, before
        any work on their ids (a comparison and a count per job)."""
        if not self._stock_rules:
            return None, 0
        # Whole jobs of these pages: decided here alone, so _stock_is_cheaper never sees them.
        if self.gpu_to_cpu and RULES.store_passes(self._page_bytes):
            return "stock_store_large_pages", sys.maxsize
        dma_from = self._plan_policy.long_run_bytes
        if self.gpu_to_cpu and RULES.gathered_store_passes(self._page_bytes, dma_from):
            return "stock_gather_beside_compute", sys.maxsize
        if not self._max_tensors:
            return "few_pages", sys.maxsize
        # blocks * tensors < min_pages, as a block count.
        return "few_pages", -(-RULES.min_pages(self._page_bytes) // self._max_tensors)

    def _scattered_load_reason(self) -> str | None:
        """Why stock's copy of this handler's scattered loads over one KV tensor costs less,
        if it does: vLLM's Triton kernel where it picked that, its batched DMA where pages
        are large."""
        if self.gpu_to_cpu:
            return None
        if RULES.stock_kernel_loads and self._stock_loads_by_kernel:
            return "stock_kernel_load"
        if RULES.scattered_load_passes(self._page_bytes):
            return "stock_dma_large_pages"
        return None

    def _serve(self, job_id: int, segments: list[Segment], handed_over: float) -> str | None:
        """Submit the job on kvcore's paths; the reason it goes to stock instead, if any.
        ``handed_over``: the job's arrival (``perf_counter``); its reported time runs
        from there, so that it holds kvcore's planning (stock's holds its copy only, not
        the building of its descriptors, a NumPy pass per KV tensor)."""
        reason = self._unsupported_group(segments)
        if reason is None:
            reason = self._stock_is_cheaper(segments)
        if reason is None and self._stock_share.drawn():
            reason = STOCK_SHARE
        if reason is not None:
            return reason
        planned = self._planner.plan(segments)
        if planned.reason is not None:
            return planned.reason
        begun = planned.begun
        try:
            nbytes = sum(s.pages * self._planner.group(s).page_bytes for s in segments)
            planned_s = perf_counter() - handed_over
            self._jobs.submit(job_id, nbytes, lambda: self._execute(planned.work, begun), planned_s)
        finally:
            if begun is not None:
                begun.close()
        return None

    def _begin_load(
        self, src_idx: torch.Tensor, dst_idx: torch.Tensor, pairs: LayerPairs
    ) -> RegionLoad | None:
        """The load begun before it is planned (:meth:`kvcore.mover.Mover.begin_region_load`),
        on the jobs' stream ahead of the job's wait for the compute stream: its DMAs write the
        staging buffer only, and its scatters, issued with the job, come after that wait."""
        return self._jobs.ahead(
            lambda: self._mover.begin_region_load(src_idx, dst_idx, pairs, self._plan_policy)
        )

    def _unsupported_group(self, segments: list[Segment]) -> str | None:
        for segment in segments:
            described = self._groups[segment.group]
            if isinstance(described, str):
                return described
        return None

    def _stock_is_cheaper(self, segments: list[Segment]) -> str | None:
        """Why stock's own copy costs less for this job, judged from the block ids alone.

        kvcore's handler spends a few hundred microseconds of host time per submission (one
        per batch of KV tensors with one row geometry, even a single DMA), stock's one
        batched copy about a microsecond per page in the driver; so kvcore takes a job only
        where it saves the driver more than it spends.
        vLLM's Triton load kernel has no per-page host cost, and over one KV tensor (a
        cross-layer layout) it moves pages as fast as kvcore's gather: there kvcore takes
        those loads only where they are one run per group (a single DMA). Over a model's
        per-layer tensors kvcore's one launch for every layer wins (the vLLM A/B in
        docs/lab/benchmarks.md), so it keeps them. Large pages: stock's batched DMA is near the
        link, so stores of them stay stock, loads need more pages a submission, and scattered
        loads over one KV tensor of the largest pages stay stock too
        (:class:`kvcore.planning.vllm_rule.VLLMRules` holds the thresholds and their evidence).
        """
        if not self._stock_rules:
            return None
        if self.gpu_to_cpu and RULES.store_passes(self._page_bytes):
            return "stock_store_large_pages"
        batches = self._planner.batches(segments)
        reason = self._stock_loads_scattered_pages(batches, segments)
        if reason is not None:
            return reason
        pages = sum(s.pages * len(self._planner.group(s).tensors) for s in segments)
        if pages < RULES.min_pages(self._page_bytes) * len(batches):
            return "few_pages"
        return None

    def _stock_loads_scattered_pages(
        self, batches: dict[tuple[Any, ...], list[int]], segments: list[Segment]
    ) -> str | None:
        """:meth:`_scattered_load_reason` where this load is over one KV tensor and not one
        run per group."""
        reason = self._scattered_reason
        if reason is None or any(len(tensors) > 1 for tensors in batches.values()):
            return None
        return None if all(s.one_run() for s in segments) else reason

    def _execute(self, work: list[Submission], begun: RegionLoad | None) -> None:
        for each in work:
            self._mover.execute(each.plan, each.pairs, begun=begun)

    def get_finished(self) -> list[TransferResult]:
        """Jobs whose copies have finished, each reported once: kvcore's in submission order,
        then those it handed to the stock handler, in stock's order. Where the release
        reports failures, jobs that failed come first, as ``success=False``."""
        results = self._failed_results() if self._failed else []
        if not self._queued:
            return results + self._stock_get_finished()
        if self._shape.reports_failed_transfers:
            reported = self._finished_or_failed()
        else:
            reported = self._jobs.finished(_succeeded)
        if self._issuer is not None:
            for result in reported:
                self._handed.pop(result.job_id, None)
            self._retry_failed_issues()
            if self._failed:
                reported += self._failed_results()
        return results + reported + self._stock_get_finished()

    def _retry_failed_issues(self) -> None:
        """The jobs whose issuing raised on the issuer's thread go to stock with their own
        arguments, as a job that fails inside :meth:`transfer_async` does; where the release
        reports failures and the device is in doubt, they are reported failed."""
        failed = self._jobs.take_failed()
        if not failed:
            return
        # What they issued before raising runs first: stock's copies must come after it.
        self._jobs.settle()
        for job_id, exc in failed:
            first, second = self._handed.pop(job_id)
            if not isinstance(exc, Exception):
                raise exc
            if self._shape.reports_failed_transfers and device_in_doubt(exc):
                self._fail(job_id, exc)
                continue
            self._passes[INTERNAL_ERRORS.reason(exc)] += 1
            self._stock_transfer_async(job_id, first, second)

    def _failed_results(self) -> list[TransferResult]:
        failed, self._failed = self._failed, []
        return [TransferResult(job_id=job_id, success=False) for job_id in failed]

    def _finished_or_failed(self) -> list[TransferResult]:
        """The finished jobs; where asking the oldest one's event raises a CUDA error, that
        job is reported failed, as 0.34's own handler does."""
        try:
            return self._jobs.finished(_succeeded)
        except RuntimeError as exc:
            if not device_in_doubt(exc):
                raise
            clear_pending_error()
            job_id = self._jobs.drop_oldest()
            logger.error("kvcore: job %d failed while its copy was polled (%s)", job_id, exc)
            if self._metrics is not None:
                self._metrics.record_decision("failed", f"transfer_failed:{type(exc).__name__}")
            return [TransferResult(job_id=job_id, success=False)]

    def wait(self, job_ids: set[int]) -> None:
        """Block until the named jobs of this handler have finished; others are ignored.
        Where the release reports failures, a job that fails meanwhile is logged here and
        reported by :meth:`get_finished`."""
        if self._queued:
            try:
                self._jobs.wait(job_ids)
            except RuntimeError as exc:
                if not (self._shape.reports_failed_transfers and device_in_doubt(exc)):
                    raise
                clear_pending_error()
                logger.error("kvcore: a job failed while it was waited for (%s)", exc)
        if self._issuer is not None:
            # A named job whose issuing raised is stock's from here: waited for below.
            self._retry_failed_issues()
        self._stock_wait(job_ids)

    def shutdown(self) -> None:
        """Wait for every job, then release this handler's and the stock handler's resources."""
        error: Exception | None = None
        queued = len(self._jobs)
        try:
            self._jobs.drain()
        except Exception as exc:
            logger.exception(
                "kvcore: a transfer failed with %d queued; dropping those after it", queued
            )
            error = exc
        if self._issuer is not None:
            for job_id, raised in self._jobs.take_failed():
                logger.error("kvcore: issuing job %d failed at shutdown (%s)", job_id, raised)
            self._issuer.close()
            self._handed.clear()
        self._planner.clear()
        self._stock.shutdown()
        if self._metrics is not None:
            self._metrics.release_tally(self._passes)
        if error is not None:
            raise error


def _surely_scattered(gpu_ids: np.ndarray, group_sizes: Sequence[int]) -> bool:
    """Whether a one-group job's GPU blocks are surely not one run, from its first and last
    id alone: a job passed for that then costs no split into segments (a loop of NumPy
    calls, tens of microseconds beside a copy of well under a millisecond)."""
    return (
        len(group_sizes) == 1
        and len(gpu_ids) > 1
        and int(gpu_ids[-1]) - int(gpu_ids[0]) != len(gpu_ids) - 1
    )


def _succeeded(job_id: int, nbytes: int, seconds: float | None) -> TransferResult:
    return TransferResult(job_id=job_id, success=True, transfer_size=nbytes, transfer_time=seconds)
