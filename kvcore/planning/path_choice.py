"""Which of kvcore's paths moves a planned transfer, from its runs, its size and the policy.

:mod:`kvcore.planning.plans` segments the indices; this module only decides from what the
segmentation found, so that every planner (both sides' runs known, or the host's alone)
applies one rule.
"""

from __future__ import annotations

from kvcore.planning.path_policy import PathPolicy, TransferPath
from kvcore.runs import PairedRuns


def choose_path(
    paired_run_count: int, host_run_count: int, nbytes: int, policy: PathPolicy
) -> TransferPath:
    """The path for a transfer with these runs: both sides' (``paired_run_count``) and the
    host side's own."""
    if paired_run_count <= 1:
        # One run on both sides is one DMA at line rate; nothing can beat it.
        return TransferPath.SINGLE_COPY
    if (
        paired_run_count <= policy.max_batched_runs
        and nbytes >= policy.long_run_bytes * paired_run_count
    ):
        # Runs long enough that DMA engines reach line rate run by run, few enough that
        # the per-run submission cost (one batched submission on CUDA) stays small.
        return TransferPath.BATCHED_RUNS
    if host_runs_long(host_run_count, nbytes, policy) and nbytes <= policy.staging_bytes:
        # Only the host side crosses PCIe: a few long DMAs into device staging,
        # then a scatter at HBM bandwidth (>10x PCIe), which is nearly free. A copy
        # larger than the staging buffer would take one DMA and one scatter per buffer's
        # worth, each with its host time; the gather below takes one launch whatever the
        # size, for a few percent less of the link (docs/lab/benchmarks.md).
        return TransferPath.STAGED
    # Short runs on the host: DMA would be bound by per-run submission cost,
    # while a gather kernel keeps many small UVA reads in flight.
    return TransferPath.GATHER


def host_runs_long(run_count: int, nbytes: int, policy: PathPolicy) -> bool:
    """Whether the host side is few runs, each long enough for a DMA at line rate."""
    return run_count <= 1 or (
        run_count <= policy.max_dma_runs and nbytes >= policy.long_run_bytes * run_count
    )


def rules_out_dma(host_run_count: int, nbytes: int, policy: PathPolicy) -> bool:
    """Whether :func:`choose_path` picks GATHER whatever the other side's rows. Both sides'
    runs are at least the host side's (a break on either side splits them), and a larger
    paired count only closes paths (single and batched copies), so the gather is certain
    exactly when it is chosen for paired runs no more than the host's: a few short host
    runs rule DMA out as surely as many do. ``host_run_count`` may be any number past
    ``max_dma_runs`` and ``max_batched_runs`` once it is past both."""
    return choose_path(host_run_count, host_run_count, nbytes, policy) is TransferPath.GATHER


def check_forced(
    force: TransferPath, runs: PairedRuns, row_size: int, policy: PathPolicy
) -> TransferPath:
    """``force`` where the transfer allows it; ValueError otherwise."""
    if force is TransferPath.SINGLE_COPY and runs.count > 1:
        raise ValueError(f"force=single_copy needs at most one paired run, got {runs.count}")
    if force is TransferPath.STAGED and row_size > policy.staging_bytes:
        raise ValueError(
            f"force=staged: a row of {row_size} B does not fit the "
            f"{policy.staging_bytes} B staging buffer"
        )
    return force
