"""Plans for a device-side index that stays on the device and is never read.

An engine may compute the device rows on the GPU (SGLang's ``kernel`` io backend does);
reading them back would synchronise the GPU. These plans validate and segment the host
side's index alone, and choose between the paths that need no device runs.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcore.direction import Direction
from kvcore.planning.host_run import HostRunFound
from kvcore.planning.path_choice import check_forced, host_runs_long
from kvcore.planning.path_policy import PathPolicy, TransferPath
from kvcore.planning.plans import TransferPlan, decided, watchable
from kvcore.planning.transfer_sides import CheckedSides, check_sides
from kvcore.repeats import duplicates_below
from kvcore.run_pieces import cut_runs
from kvcore.runs import PairedRuns, check_index, find_runs, span_and_runs_of


def plan_device_indexed(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    *,
    direction: Direction,
    policy: PathPolicy = PathPolicy(),
    force: TransferPath | None = None,
    host_cuts: np.ndarray | None = None,
) -> TransferPlan:
    """:func:`plan` for a device-side index that stays on the device and is never read.

    An engine may compute the device rows on the GPU (SGLang's ``kernel`` io backend
    does): reading them back would synchronise the GPU, so only the host side's index,
    on the CPU, is validated and segmented. Without the device side's runs the plan is
    STAGED (the host side is a few long runs: DMA plus an on-device index_copy_ or
    index_select) or GATHER; single and batched copies need both sides' runs. As in the
    engines' own kernels, the device index is not bounds- or duplicate-checked.
    ``host_cuts``: sorted host rows where a new host registration begins; no DMA of the
    plan runs across one (:func:`kvcore.runs.cut_runs`).
    """
    sides = check_sides(src, dst, Direction(direction))
    return plan_device_indexed_for(
        sides, src_idx, dst_idx, policy=policy, force=force, host_cuts=host_cuts
    )


def plan_device_indexed_for(
    sides: CheckedSides,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    *,
    policy: PathPolicy = PathPolicy(),
    force: TransferPath | None = None,
    host_found: HostRunFound | None = None,
    host_cuts: np.ndarray | None = None,
) -> TransferPlan:
    """:func:`plan_device_indexed` between buffers :func:`check_sides` has checked.
    ``host_found``: the host index as one run where the caller found it so
    (:func:`kvcore.planning.host_run.one_host_run`), used where it holds for the index;
    ``host_cuts`` as for :func:`plan_device_indexed`."""
    page_in = sides.direction is Direction.H2D
    host_idx, device_idx = (src_idx, dst_idx) if page_in else (dst_idx, src_idx)
    host, device = (sides.src, sides.dst) if page_in else (sides.dst, sides.src)
    if host_found is not None and not host_found.holds_for(host_idx):
        host_found = None
    host_idx = watchable(check_index(host_idx, "host index"))
    if not isinstance(device_idx, torch.Tensor):
        raise TypeError(f"the device index must be a torch.Tensor, got {type(device_idx).__name__}")
    dtype = device_idx.dtype
    if device_idx.dim() != 1 or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(
            f"the device index must be a 1-D integer tensor, got {device_idx.dtype} "
            f"of shape {tuple(device_idx.shape)}"
        )
    if device_idx.numel() != host_idx.numel():
        raise ValueError(
            f"the host index has {host_idx.numel()} entries but the device index "
            f"{device_idx.numel()}"
        )
    # Kernels and index_copy_ take int64; a conversion on the device is queued, not waited.
    if dtype is not torch.int64 or not device_idx.is_contiguous():
        device_idx = device_idx.to(torch.int64).contiguous()
    index_device = device_idx.device
    if index_device.type == "cpu":
        # The CUDA kernels cache uploads of CPU indices by version counter.
        device_idx = watchable(device_idx)
    # The path needs to know only whether the host runs are few (at most max_dma_runs).
    host_values = host_idx.numpy()
    if host_found is None:
        host_span, host_run_count, host_runs = span_and_runs_of(
            host_values, host.shape[0], "the host index", count_up_to=policy.max_dma_runs
        )
    else:
        host_span, host_run_count, host_runs = host_found.span, 1, host_found.runs
        if host_span > host.shape[0]:
            raise ValueError(f"the host index holds {host_span - 1}, outside [0, {host.shape[0]})")
    if host_cuts is not None:
        if host_runs is None and force is TransferPath.STAGED:
            host_runs = find_runs(host_idx)
        if host_runs is not None:
            host_runs = cut_runs(host_runs, host_cuts)
            host_run_count = host_runs.count
    if not page_in and duplicates_below(host_values, host_span):
        raise ValueError("the host index holds duplicate destinations")
    src_row_bytes = sides.row_bytes
    nbytes = host_values.size * src_row_bytes
    reason = sides.reason
    if reason is None and index_device.type != "cpu" and index_device != device.device:
        reason = "unsupported_device"
    if reason is None and force is TransferPath.FALLBACK:
        reason = "forced"
    if reason is not None:
        path = TransferPath.FALLBACK
    elif force is not None:
        if force not in (TransferPath.STAGED, TransferPath.GATHER):
            raise ValueError(f"force={force.value} needs the device side's runs")
        path = check_forced(force, _NO_RUNS, src_row_bytes, policy)
    elif host_runs_long(host_run_count, nbytes, policy) and src_row_bytes <= policy.staging_bytes:
        path = TransferPath.STAGED
    else:
        path = TransferPath.GATHER
    src_idx, dst_idx = (host_idx, device_idx) if page_in else (device_idx, host_idx)
    return decided(
        path,
        sides,
        src_idx,
        dst_idx,
        _NO_RUNS,
        host_runs,
        reason,
        policy,
        src_span=host_span if page_in else 0,
        dst_span=0 if page_in else host_span,
        device_index_opaque=True,
        index_versions=(host_idx._version, None) if page_in else (None, host_idx._version),
    )


_EMPTY = torch.empty(0, dtype=torch.int64)
_NO_RUNS = PairedRuns(_EMPTY, _EMPTY, _EMPTY, _EMPTY)
