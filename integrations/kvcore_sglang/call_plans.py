"""What an SGLang transfer call's indices are to kvcore, and the plans made from them.

Where the indices come from (``HiCacheController.move_indices``): with ``direct`` both
index tensors reach the pool on the CPU (SGLang brings the device indices back itself).
With ``kernel`` (SGLang's default) the host indices are moved to the GPU there, and the
device indices are computed on the GPU by the device allocator: no CPU copy of them
exists. The hooks remember the CPU host indices of each moved tensor
(:class:`kvcore_sglang.call_memos.HostIndexMemo`); a ``kernel`` call is planned from those
alone, the device indices staying on the GPU, unread
(:func:`kvcore.planning.device_indexed.plan_device_indexed`: staged or gather). A
``kernel`` call whose host indices were not remembered runs stock
(``sglang_indices_on_device``). kvcore reads a device tensor back to plan only under
``KVCORE_SGLANG_DMA_IN_PLACE`` (:mod:`kvcore_sglang.device_reads`): a call whose device
indices were read at their move is planned from both sides, and takes that plan where it
copies by DMA alone (one run, or runs batched straight into place); any other path keeps
the plan made around the device indices.

The pairs of one call (a layer's K and V; every layer of a backup) move in one
submission where they share a row size (:meth:`kvcore.mover.Mover.execute` over them), their
checks kept per pool (:class:`kvcore_sglang.call_memos.LayerPairsMemo`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvcore.direction import Direction
from kvcore.mover import Mover
from kvcore.planning.device_indexed import plan_device_indexed, plan_device_indexed_for
from kvcore.planning.host_run import HostRunFound
from kvcore.planning.path_policy import PathPolicy, TransferPath
from kvcore.planning.plans import TransferPlan, plan, plan_for
from kvcore.planning.submissions import Submission, submissions
from kvcore.planning.transfer_sides import CheckedSides
from kvcore.stepwise_pinning import crosses_step

from .call_memos import HostIndexMemo, LayerPairsMemo
from .device_reads import DeviceIndexReads
from .pool_jobs import Job
from .pool_pinning import step_ends
from .served_layouts import layout_reason
from .served_pools import class_name

# The index dtypes kvcore.runs.check_index accepts.
_INDEX_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})


@dataclass(frozen=True)
class CallIndices:
    """A call's indices as kvcore plans from them."""

    host: torch.Tensor
    """On the CPU: the call's own, or the ones ``move_indices`` was given."""
    device: torch.Tensor
    device_opaque: bool
    """The device indices are on the device: planned around, unread."""
    device_read: torch.Tensor | None = None
    """Where :attr:`device_opaque`: their host copy, read back at their move
    (``KVCORE_SGLANG_DMA_IN_PLACE``), for a plan that copies by DMA alone."""
    host_cuts: np.ndarray | None = None
    """Where the host slots run across the end of one of the pool's registrations (a pool
    pinned in steps): the slots where each registration after the first begins, at which
    the plan cuts its host runs, since no DMA may cross two."""


# The paths that move a plan's rows by DMA alone: no kernel on any stream.
DMA_PATHS = frozenset({TransferPath.SINGLE_COPY, TransferPath.BATCHED_RUNS})
STEP_CROSSED = "host_pool_step_crossed"
"""Why a call on a pool pinned in steps runs stock: its host slots run across a step's end,
a DMA cannot cross two registrations (:mod:`kvcore_sglang.pool_pinning`), and both its
indices are on the host (the ``direct`` backend), where the plan pairs their runs; with
the device indices unread (the ``kernel`` backend) the plan cuts its host runs at the
step's end instead."""


def call_indices(
    pool: Any,
    served_class: str,
    host_indices: Any,
    device_indices: Any,
    io_backend: str,
    moved: HostIndexMemo,
    reads: DeviceIndexReads | None = None,
) -> CallIndices | str:
    """The indices to plan from, or why the call must run stock before looking at its
    layers; ``moved``: the CPU host indices of the tensors ``move_indices`` moved;
    ``reads``: the device indices read back there, where any were."""
    if class_name(pool) != served_class:
        # Subclasses (MXFP8, HiSparse...) reach here through super() with their own data.
        return "sglang_pool_class"
    reason = layout_reason(pool.layout, io_backend)
    if reason is not None:
        return reason
    for indices in (host_indices, device_indices):
        if not isinstance(indices, torch.Tensor):
            return "sglang_indices_on_device"
        if indices.dim() != 1 or indices.dtype not in _INDEX_DTYPES:
            return "sglang_index_dtype"
    host = host_indices
    if host.device.type != "cpu":
        recalled = moved.recall(host) if io_backend == "kernel" else None
        if recalled is None or recalled.shape != host.shape or recalled.dtype != host.dtype:
            return "sglang_indices_on_device"
        host = recalled
    opaque = device_indices.device.type != "cpu"
    if opaque and (io_backend != "kernel" or pool.layout == "page_first_direct"):
        # page_first_direct copies whole pages named by the device indices' values.
        return "sglang_indices_on_device"
    ends = step_ends(pool)
    cuts = ends if ends is not None and crosses_step(host.numpy(), ends) else None
    if cuts is not None and io_backend == "direct":
        return STEP_CROSSED
    read = reads.recall(device_indices) if opaque and reads is not None else None
    if read is not None and (
        read.shape != device_indices.shape or read.dtype != device_indices.dtype
    ):
        read = None
    return CallIndices(host, device_indices, opaque, read, cuts)


def plans(
    pool: Any,
    job: Job,
    direction: Direction,
    chosen_mover: Mover,
    indices: CallIndices,
    checked_pairs: LayerPairsMemo,
) -> list[Submission] | str:
    """One plan for every layer pair, moved in one submission where the pairs allow it, else
    rebound to each pair; or the reason the call must run stock. ``checked_pairs``: the
    pool's buffer pairs as checked before."""
    first = first_plan(job, direction, chosen_mover, indices)
    if isinstance(first, str):
        return first
    page_in = direction is Direction.H2D
    pairs = [(host, device) if page_in else (device, host) for host, device in job.pairs]
    try:
        layered = None
        if len(pairs) > 1:
            srcs, dsts = [src for src, _ in pairs], [dst for _, dst in pairs]
            layered = checked_pairs.pairs(pool, srcs, dsts)
        return submissions(first, pairs, layered)
    except ValueError:
        return "sglang_invalid_indices"


def first_plan(
    job: Job,
    direction: Direction,
    chosen_mover: Mover,
    indices: CallIndices,
    kept_sides: CheckedSides | None = None,
    host_runs: HostRunFound | None = None,
) -> TransferPlan | str:
    """The plan of the job's first pair, or why the call must run stock. ``indices``: the
    call's, as :func:`call_indices` found them (the job's rows come from them).
    ``kept_sides``: that pair as checked when its layer's buffers were kept, used where the
    job's first pair is those very buffers (the plan then checks only the indices).
    ``host_runs``: the host rows as one run where the rule found them so (used where they
    are the job's own)."""
    if indices.host_cuts is not None and not indices.device_opaque:
        # Both sides' runs would pair up, and the host side's are not cut.
        return STEP_CROSSED
    page_in = direction is Direction.H2D
    host, device = job.pairs[0]
    src, dst = (host, device) if page_in else (device, host)
    if kept_sides is not None and not (kept_sides.src is src and kept_sides.dst is dst):
        kept_sides = None
    policy = chosen_mover.policy
    try:
        host_cuts = _row_cuts(job, indices.host_cuts)
        by_dma = _dma_plan(job, page_in, src, dst, indices, kept_sides, policy)
        if by_dma is not None:
            first = by_dma
        else:
            src_idx, dst_idx = (
                (job.host_rows, job.device_rows) if page_in else (job.device_rows, job.host_rows)
            )
            if kept_sides is not None:
                if indices.device_opaque:
                    first = plan_device_indexed_for(
                        kept_sides,
                        src_idx,
                        dst_idx,
                        policy=policy,
                        host_found=host_runs,
                        host_cuts=host_cuts,
                    )
                else:
                    first = plan_for(kept_sides, src_idx, dst_idx, policy=policy)
            elif indices.device_opaque:
                first = plan_device_indexed(
                    src,
                    dst,
                    src_idx,
                    dst_idx,
                    direction=direction,
                    policy=policy,
                    host_cuts=host_cuts,
                )
            else:
                first = plan(src, dst, src_idx, dst_idx, direction=direction, policy=policy)
    except ValueError:
        # Out-of-range or duplicate indices: stock's behaviour, whatever it is, is kept.
        return "sglang_invalid_indices"
    return first.reason if first.path is TransferPath.FALLBACK and first.reason else first


def _row_cuts(job: Job, slot_cuts: np.ndarray | None) -> np.ndarray | None:
    """The job's host view rows where a new registration begins, from the slots where it
    does; ValueError as :meth:`kvcore.row_views.RowMap.rows_of` raises."""
    if slot_cuts is None:
        return None
    rows: np.ndarray = job.rows.slot_map.rows_of(torch.from_numpy(slot_cuts)).numpy()
    return rows


def _dma_plan(
    job: Job,
    page_in: bool,
    src: torch.Tensor,
    dst: torch.Tensor,
    indices: CallIndices,
    kept_sides: CheckedSides | None,
    policy: PathPolicy,
) -> TransferPlan | None:
    """The job planned from its device indices read back, where that plan copies by DMA
    alone; None where none were read, the host slots cross a registration's end, the job's
    device rows are not the indices themselves, or the plan would take another path.
    Raises ValueError as planning does."""
    read = indices.device_read
    # Pages by DMA pair host and device runs: the host side's are not cut at a step's end.
    if read is None or indices.host_cuts is not None or job.device_rows is not indices.device:
        return None
    src_idx, dst_idx = (job.host_rows, read) if page_in else (read, job.host_rows)
    if kept_sides is not None:
        planned = plan_for(kept_sides, src_idx, dst_idx, policy=policy)
    else:
        direction = Direction.H2D if page_in else Direction.D2H
        planned = plan(src, dst, src_idx, dst_idx, direction=direction, policy=policy)
    return planned if planned.path in DMA_PATHS else None
