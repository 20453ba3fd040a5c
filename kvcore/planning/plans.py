"""Plan one row transfer between host and device memory, without running it.

A transfer copies rows: ``dst[dst_idx[k]] = src[src_idx[k]]``, a row being everything
after dim 0. :func:`plan` (and :func:`plan_device_indexed`, for a device index never
read) validates the request, decides whether the bytes can be moved on kvcore's own
paths and picks the cheapest one, as a :class:`TransferPlan`. Planning reads CPU indices
only and issues no device work, so it sits apart from :mod:`kvcore.mover`, which executes
plans.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from kvcore.direction import Direction
from kvcore.planning.pair_checks import fallback_reason
from kvcore.planning.path_choice import check_forced, choose_path, rules_out_dma
from kvcore.planning.path_policy import PathPolicy, TransferPath
from kvcore.planning.staged_chunks import StagedChunk, staged_chunks
from kvcore.planning.transfer_sides import CheckedSides, check_sides, no_rows
from kvcore.repeats import duplicates_below
from kvcore.row_words import row_bytes
from kvcore.runs import (
    PairedRuns,
    Runs,
    check_index,
    find_paired_runs,
    find_runs,
    run_count_of,
    segment_values,
    span_of,
)


class StalePlanError(ValueError):
    """A plan's index tensor was written in place after planning: plan again."""


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """What :func:`plan` decided for one transfer; ``reason`` is set iff the path is FALLBACK.

    A plan keeps the caller's index tensors as ``src_idx`` and ``dst_idx`` (int64 ones
    as they are), and its runs may be views of them: a copy of both at plan time would
    add a pass over both and fresh memory their size to every plan, which engines make
    on their submit path, and a copy at execute time would cost every layer that. So
    that an index written in place after planning cannot send rows to the wrong places
    (or past the end of a buffer), the plan records the indices' version counters, which
    every in-place torch write bumps, and :meth:`check_indices` compares them: two
    integer reads where execute, execute_prepared and rebind start. Writes torch does not
    count, through a NumPy array sharing the memory, are not seen. Inference tensors
    have no counter: plans copy those. A device index of :func:`plan_device_indexed`
    is not watched: the plan never read it, and the copy reads it when it runs, as the
    engine's own kernels do.
    """

    path: TransferPath
    direction: Direction
    src: torch.Tensor
    dst: torch.Tensor
    src_idx: torch.Tensor
    dst_idx: torch.Tensor
    paired_runs_found: PairedRuns | None
    """Both sides' runs where planning segmented them; None where it decided without them
    (a GATHER whose host rows alone ruled out every DMA path): :attr:`runs` finds them."""
    host_runs_found: Runs | None
    """The host side's runs where planning segmented them; None where it only counted them
    (a GATHER plan, which never reads them): :attr:`host_runs` finds them."""
    rows: int
    row_bytes: int
    """Bytes of one source row."""
    nbytes: int
    reason: str | None = None
    policy: PathPolicy = PathPolicy()
    src_span: int = 0
    """Rows ``src`` must have at least (largest source index + 1)."""
    dst_span: int = 0
    staged_chunks: tuple[StagedChunk, ...] = ()
    """For STAGED plans: the pieces that fit the policy's staging buffer, with their host
    runs, segmented once here rather than on every layer."""
    device_index_opaque: bool = False
    """Planned by :func:`plan_device_indexed`: the device side's index was never read."""
    index_versions: tuple[int | None, int | None] = (None, None)
    """``src_idx._version`` and ``dst_idx._version`` when planned; None for one not watched."""

    def check_indices(self) -> None:
        """Raise :class:`StalePlanError` where ``src_idx`` or ``dst_idx`` was written in place
        since planning: the runs, bounds and path were decided for other values."""
        src_version, dst_version = self.index_versions
        if src_version is not None and self.src_idx._version != src_version:
            raise StalePlanError(_STALE.format(name="src_idx"))
        if dst_version is not None and self.dst_idx._version != dst_version:
            raise StalePlanError(_STALE.format(name="dst_idx"))

    @property
    def runs(self) -> PairedRuns:
        """Runs unit-stride on both sides (none for a device index never read), segmented
        on first use where planning did not."""
        found = self.paired_runs_found
        if found is None:
            found = find_paired_runs(self.src_idx, self.dst_idx)
            # A cache of what the fields already say: the plan stays what it was.
            object.__setattr__(self, "paired_runs_found", found)
        return found

    @property
    def host_runs(self) -> Runs:
        """The host side's index as runs, segmented on first use where planning did not."""
        found = self.host_runs_found
        if found is None:
            found = _host_runs_of(self.direction, self.src_idx, self.dst_idx)
            # A cache of what the fields already say: the plan stays what it was.
            object.__setattr__(self, "host_runs_found", found)
        return found

    @property
    def device(self) -> torch.device:
        """The device side: the destination of a page-in, the source of a page-out."""
        return self.dst.device if self.direction is Direction.H2D else self.src.device

    def rebind(self, src: torch.Tensor, dst: torch.Tensor) -> TransferPlan:
        """The same transfer between other buffers of the same layout, such as the next layer.

        Engines copy layer by layer with the same indices; the segmentation and the
        path choice are reused, so only the buffers are checked. Anything that could
        change the decision (devices, row size, a fallback either side) plans again.
        Raises :class:`StalePlanError` where an index was written since planning.
        """
        self.check_indices()
        same_layout = (
            self.reason is None
            and src.device == self.src.device
            and dst.device == self.dst.device
            and src.dim() > 0
            and dst.dim() > 0
            and src.shape[0] >= self.src_span
            and dst.shape[0] >= self.dst_span
            and row_bytes(src) == self.row_bytes
            and fallback_reason(src, dst) is None
        )
        if not same_layout:
            # Imported here: that module builds its plans with this one's.
            from kvcore.planning.device_indexed import plan_device_indexed

            replan = plan_device_indexed if self.device_index_opaque else plan
            return replan(
                src, dst, self.src_idx, self.dst_idx, direction=self.direction, policy=self.policy
            )
        return dataclasses.replace(self, src=src, dst=dst)

    def without_buffers(self, sides: CheckedSides | None = None) -> TransferPlan:
        """This plan with row-less stand-ins for ``src`` and ``dst`` (same devices, dtypes and
        row shapes, shared by every plan of their kind: :func:`no_rows`), for keeping the
        decision without keeping the buffers' memory alive; a caller brings the buffers
        again (:meth:`rebind`, or pairs of each layer). ``sides``: the checked buffers it
        was planned between, whose stand-ins are found once for all their plans (others
        are ignored)."""
        if sides is not None and sides.src is self.src and sides.dst is self.dst:
            src, dst = sides.stand_ins
        else:
            src, dst = no_rows(self.src), no_rows(self.dst)
        return _made(vars(self), src=src, dst=dst)

    def describe(self) -> str:
        path = self.path.value
        if self.reason is not None:
            path = f"{path} ({self.reason})"
        return (
            f"{self.direction.value} {path}: {self.rows} rows x {self.row_bytes} B"
            f" = {_format_bytes(self.nbytes)}, {self.runs.count} paired runs,"
            f" {self.host_runs.count} host runs"
        )


_STALE = (
    "{name} was written in place after planning; the plan's runs, bounds and path were "
    "decided for its old values: plan again"
)


def _format_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.4g} {unit}"
        value /= 1024
    return f"{value:.4g} GiB"


def plan(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    *,
    direction: Direction | None = None,
    policy: PathPolicy = PathPolicy(),
    force: TransferPath | None = None,
) -> TransferPlan:
    """Validate a transfer and choose how to run it.

    Caller bugs raise (TypeError / ValueError); requests kvcore cannot prove it
    copies correctly come back as a FALLBACK plan with a reason, so that the
    engine's stock path runs unchanged. ``force`` picks a path for benchmarks and
    tests; it never overrides a fallback reason.
    """
    src_idx = watchable(check_index(src_idx, "src_idx"))
    dst_idx = watchable(check_index(dst_idx, "dst_idx"))
    return _plan_checked(check_sides(src, dst, direction), src_idx, dst_idx, policy, force)


def plan_for(
    sides: CheckedSides,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    *,
    policy: PathPolicy = PathPolicy(),
    force: TransferPath | None = None,
) -> TransferPlan:
    """:func:`plan` between buffers :func:`check_sides` has checked: an engine's layer
    buffers, checked once for every request that copies between them."""
    src_idx = watchable(check_index(src_idx, "src_idx"))
    dst_idx = watchable(check_index(dst_idx, "dst_idx"))
    return _plan_checked(sides, src_idx, dst_idx, policy, force)


def _plan_checked(
    sides: CheckedSides,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    policy: PathPolicy,
    force: TransferPath | None,
) -> TransferPlan:
    """:func:`plan` of indices :func:`check_index` has checked (int64, watchable): every
    question below reads their NumPy views, so neither is checked or converted again."""
    src_values, dst_values = src_idx.numpy(), dst_idx.numpy()
    if force is None:
        gather = _gather_if_host_rules_out_dma(
            sides, src_idx, dst_idx, src_values, dst_values, policy
        )
        if gather is not None:
            return gather
    found = segment_values(
        src_values,
        dst_values,
        sides.src.shape[0],
        sides.dst.shape[0],
        host_is_src=sides.direction is Direction.H2D,
    )
    if found.dst_has_duplicates:
        # Which source row would win is undefined: stock GPU copies would race.
        raise ValueError("dst_idx holds duplicate indices")
    runs, host_runs = found.runs, found.host_runs
    nbytes = src_values.size * sides.row_bytes

    reason = sides.reason
    if reason is None and force is TransferPath.FALLBACK:
        reason = "forced"
    if reason is not None:
        path = TransferPath.FALLBACK
    elif force is not None:
        path = check_forced(force, runs, sides.row_bytes, policy)
    else:
        path = choose_path(runs.count, host_runs.count, nbytes, policy)
    return decided(
        path,
        sides,
        src_idx,
        dst_idx,
        runs,
        host_runs,
        reason,
        policy,
        src_span=found.src_span,
        dst_span=found.dst_span,
        index_versions=(src_idx._version, dst_idx._version),
    )


def _gather_if_host_rules_out_dma(
    sides: CheckedSides,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    src_values: np.ndarray,
    dst_values: np.ndarray,
    policy: PathPolicy,
) -> TransferPlan | None:
    """The GATHER plan of a transfer whose host rows alone rule out every DMA path, from
    their run count (found on a prefix where it is large), both sides' bounds and the
    destination's duplicates; None where the host rows leave a DMA path open, for
    :func:`plan` to segment both sides as usual.

    Both sides' runs cost more than the rest of a first call on the engine's load path,
    and a gather never reads them: they are found only if asked for (:attr:`TransferPlan.runs`).
    """
    rows = src_values.size
    if sides.reason is not None or rows < 2 or rows != dst_values.size:
        return None
    # Counted before any bounds pass: where a DMA path stays open, plan() segments (and
    # bounds) both sides anyway.
    host_run_count = run_count_of(
        src_values if sides.direction is Direction.H2D else dst_values,
        max(policy.max_dma_runs, policy.max_batched_runs),
    )
    if not rules_out_dma(host_run_count, rows * sides.row_bytes, policy):
        return None
    src_span = span_of(src_values, sides.src.shape[0], "src_idx")
    dst_span = span_of(dst_values, sides.dst.shape[0], "dst_idx")
    if duplicates_below(dst_values, dst_span):
        raise ValueError("dst_idx holds duplicate indices")
    return decided(
        TransferPath.GATHER,
        sides,
        src_idx,
        dst_idx,
        None,
        None,
        None,
        policy,
        src_span=src_span,
        dst_span=dst_span,
        index_versions=(src_idx._version, dst_idx._version),
    )


def decided(
    path: TransferPath,
    sides: CheckedSides,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    runs: PairedRuns | None,
    host_runs: Runs | None,
    reason: str | None,
    policy: PathPolicy,
    *,
    src_span: int,
    dst_span: int,
    index_versions: tuple[int | None, int | None],
    device_index_opaque: bool = False,
) -> TransferPlan:
    """The plan for a chosen path between ``sides``; a STAGED one gets its staging-sized
    chunks here."""
    src_row_bytes = sides.row_bytes
    staged: tuple[StagedChunk, ...] = ()
    rows = int(src_idx.numel())
    if path is TransferPath.STAGED:
        if host_runs is None:
            host_runs = _host_runs_of(sides.direction, src_idx, dst_idx)
        # Rows of no bytes (a valid transfer that moves nothing) all fit one chunk.
        staged = staged_chunks(host_runs, policy.staging_bytes // max(src_row_bytes, 1), rows)
    return _made(
        {},
        path=path,
        direction=sides.direction,
        src=sides.src,
        dst=sides.dst,
        src_idx=src_idx,
        dst_idx=dst_idx,
        paired_runs_found=runs,
        host_runs_found=host_runs,
        rows=rows,
        row_bytes=src_row_bytes,
        nbytes=rows * src_row_bytes,
        reason=reason,
        policy=policy,
        src_span=src_span,
        dst_span=dst_span,
        staged_chunks=staged,
        device_index_opaque=device_index_opaque,
        index_versions=index_versions,
    )


_PLAN_FIELDS = frozenset(field.name for field in dataclasses.fields(TransferPlan))


def _made(fields: dict[str, object], **more: object) -> TransferPlan:
    """A plan of ``fields`` and ``more``, every field named: the frozen dataclass's
    ``__init__`` sets each field through ``object.__setattr__``, several microseconds on a
    request's first call, where a plan is made and then kept without its buffers."""
    made = object.__new__(TransferPlan)
    values = vars(made)
    values.update(fields, **more)
    if values.keys() != _PLAN_FIELDS:
        raise TypeError(f"a TransferPlan needs its fields: {sorted(_PLAN_FIELDS ^ values.keys())}")
    return made


def _host_runs_of(direction: Direction, src_idx: torch.Tensor, dst_idx: torch.Tensor) -> Runs:
    """The runs of a transfer's host-side index: the source of a page-in, else the
    destination."""
    return find_runs(src_idx if direction is Direction.H2D else dst_idx)


def watchable(index: torch.Tensor) -> torch.Tensor:
    """``index``, or a copy of it where it has no version counter (an inference tensor)."""
    if not index.is_inference():
        return index
    with torch.inference_mode(False):
        return index.clone()
