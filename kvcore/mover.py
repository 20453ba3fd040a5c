"""Plan and execute one row transfer between host and device memory.

A transfer copies rows: ``dst[dst_idx[k]] = src[src_idx[k]]``, a row being
everything after dim 0. :func:`plan` validates the request, decides whether the
bytes can be moved on kvcore's own paths and picks the cheapest one;
:class:`Mover` executes a plan through the kernels registered for the device
side (:mod:`kvcore.kernels`) and records what it did.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch

from kvcore.config import KVCoreConfig
from kvcore.direction import Direction
from kvcore.kernels import GatherPrepared, KernelSet, PreparedGather, kernels_for
from kvcore.kernels.reference import (
    index_copy_rows,
    row_bytes,
    row_word_bytes,
    rows_as_words,
    staging_words,
)
from kvcore.metrics import Metrics
from kvcore.pair_checks import fallback_reason
from kvcore.runs import (
    PairedRuns,
    Runs,
    check_bounds,
    check_index,
    find_runs,
    has_duplicates,
    segment_transfer,
    slice_runs,
)

if TYPE_CHECKING:
    from kvcore.layers import LayerPairs

FALLBACK_REASONS = frozenset(
    {
        "dtype_mismatch",
        "row_shape_mismatch",
        "strided_rows",
        "overlapping_buffers",
        "unsupported_device",
        "forced",
    }
)


class TransferPath(str, Enum):
    SINGLE_COPY = "single_copy"
    STAGED = "staged"
    BATCHED_RUNS = "batched_runs"
    GATHER = "gather"
    FALLBACK = "fallback"


@dataclass(frozen=True)
class PathPolicy:
    """Thresholds for the path choice."""

    staging_bytes: int = 256 << 20
    """Capacity of the preallocated staging buffer per device."""
    long_run_bytes: int = 256 << 10
    """Average run size from which one copy per run (or batched DMA) reaches line rate."""
    gather_ctas: int = 8
    """CTAs (so SMs) the UVA gather kernel may occupy on CUDA."""
    max_dma_runs: int = 16
    """Most host runs a staged copy takes, one torch copy_ each (H200: ~14-45 us of host
    time a call)."""
    max_batched_runs: int = 256
    """Most runs one cudaMemcpyBatchAsync takes (H200: ~100 us for 16 runs, ~1.7 us a run
    at 256, ~0.8 us at thousands); past it the gather kernel costs less host time."""
    staged_pieces: int = 1
    """Pieces a staged copy is cut into (none under 8 MiB), the device-side scatter of one
    overlapping the DMA of the next. One piece runs on one stream with no events: on the
    H200, 97% of the ceiling for ~100 us of host time, against 98% for ~430 us in two."""

    def __post_init__(self) -> None:
        sizes = (
            self.staging_bytes,
            self.long_run_bytes,
            self.gather_ctas,
            self.max_dma_runs,
            self.max_batched_runs,
            self.staged_pieces,
        )
        if min(sizes) < 1:
            raise ValueError(f"PathPolicy sizes must be positive, got {self}")


def policy_from_config(config: KVCoreConfig) -> PathPolicy:
    """The path policy that a KVCoreConfig (KVCORE_* variables) asks for."""
    return PathPolicy(
        staging_bytes=config.staging_bytes,
        long_run_bytes=config.long_run_bytes,
        gather_ctas=config.gather_ctas,
        staged_pieces=config.staged_pieces,
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
    integer reads where execute, execute_layers and rebind start. Writes torch does not
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
    runs: PairedRuns
    host_runs: Runs
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
            replan = plan_device_indexed if self.device_index_opaque else plan
            return replan(
                src, dst, self.src_idx, self.dst_idx, direction=self.direction, policy=self.policy
            )
        return dataclasses.replace(self, src=src, dst=dst)

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
    src_idx = _watchable(check_index(src_idx, "src_idx"))
    dst_idx = _watchable(check_index(dst_idx, "dst_idx"))
    direction = _check_sides(src, dst, direction)
    found = segment_transfer(
        src_idx, dst_idx, src.shape[0], dst.shape[0], host_is_src=direction is Direction.H2D
    )
    if found.dst_has_duplicates:
        # Which source row would win is undefined: stock GPU copies would race.
        raise ValueError("dst_idx holds duplicate indices")
    runs, host_runs = found.runs, found.host_runs
    src_span, dst_span = found.src_span, found.dst_span
    rows = int(src_idx.numel())
    src_row_bytes = row_bytes(src)
    nbytes = rows * src_row_bytes

    reason = fallback_reason(src, dst)
    if reason is None and force is TransferPath.FALLBACK:
        reason = "forced"
    if reason is not None:
        path = TransferPath.FALLBACK
    elif force is not None:
        path = _check_forced(force, runs, src_row_bytes, policy)
    else:
        path = _choose_path(runs, host_runs, nbytes, policy)
    return _decided(
        path,
        direction,
        src,
        dst,
        src_idx,
        dst_idx,
        runs,
        host_runs,
        reason,
        policy,
        src_span=src_span,
        dst_span=dst_span,
        index_versions=(src_idx._version, dst_idx._version),
    )


def _decided(
    path: TransferPath,
    direction: Direction,
    src: torch.Tensor,
    dst: torch.Tensor,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    runs: PairedRuns,
    host_runs: Runs,
    reason: str | None,
    policy: PathPolicy,
    **spans_and_flags: Any,
) -> TransferPlan:
    """The plan for a chosen path; a STAGED one gets its staging-sized chunks here."""
    src_row_bytes = row_bytes(src)
    staged: tuple[StagedChunk, ...] = ()
    if path is TransferPath.STAGED:
        # Rows of no bytes (a valid transfer that moves nothing) all fit one chunk.
        staged = staged_chunks(host_runs, policy.staging_bytes // max(src_row_bytes, 1))
    rows = int(src_idx.numel())
    return TransferPlan(
        path=path,
        direction=direction,
        src=src,
        dst=dst,
        src_idx=src_idx,
        dst_idx=dst_idx,
        runs=runs,
        host_runs=host_runs,
        rows=rows,
        row_bytes=src_row_bytes,
        nbytes=rows * src_row_bytes,
        reason=reason,
        policy=policy,
        staged_chunks=staged,
        **spans_and_flags,
    )


def plan_device_indexed(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    *,
    direction: Direction,
    policy: PathPolicy = PathPolicy(),
    force: TransferPath | None = None,
) -> TransferPlan:
    """:func:`plan` for a device-side index that stays on the device and is never read.

    An engine may compute the device rows on the GPU (SGLang's ``kernel`` io backend
    does): reading them back would synchronise the GPU, so only the host side's index,
    on the CPU, is validated and segmented. Without the device side's runs the plan is
    STAGED (the host side is a few long runs: DMA plus an on-device index_copy_ or
    index_select) or GATHER; single and batched copies need both sides' runs. As in the
    engines' own kernels, the device index is not bounds- or duplicate-checked.
    """
    direction = Direction(direction)
    page_in = direction is Direction.H2D
    host_idx, device_idx = (src_idx, dst_idx) if page_in else (dst_idx, src_idx)
    host, device = (src, dst) if page_in else (dst, src)
    host_idx = _watchable(check_index(host_idx, "host index"))
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
    _check_sides(src, dst, direction)
    # Kernels and index_copy_ take int64; a conversion on the device is queued, not waited.
    device_idx = device_idx.to(torch.int64).contiguous()
    if device_idx.device.type == "cpu":
        # The CUDA kernels cache uploads of CPU indices by version counter.
        device_idx = _watchable(device_idx)
    host_span = check_bounds(host_idx, host.shape[0], "the host index")
    if not page_in and has_duplicates(host_idx):
        raise ValueError("the host index holds duplicate destinations")
    host_runs = find_runs(host_idx)
    rows = int(host_idx.numel())
    src_row_bytes = row_bytes(src)
    nbytes = rows * src_row_bytes
    reason = fallback_reason(src, dst)
    if reason is None and device_idx.device not in (device.device, torch.device("cpu")):
        reason = "unsupported_device"
    if reason is None and force is TransferPath.FALLBACK:
        reason = "forced"
    if reason is not None:
        path = TransferPath.FALLBACK
    elif force is not None:
        if force not in (TransferPath.STAGED, TransferPath.GATHER):
            raise ValueError(f"force={force.value} needs the device side's runs")
        path = _check_forced(force, _NO_RUNS, src_row_bytes, policy)
    elif _host_runs_long(host_runs, nbytes, policy) and src_row_bytes <= policy.staging_bytes:
        path = TransferPath.STAGED
    else:
        path = TransferPath.GATHER
    src_idx, dst_idx = (host_idx, device_idx) if page_in else (device_idx, host_idx)
    return _decided(
        path,
        direction,
        src,
        dst,
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


def _watchable(index: torch.Tensor) -> torch.Tensor:
    """``index``, or a copy of it where it has no version counter (an inference tensor)."""
    if not index.is_inference():
        return index
    with torch.inference_mode(False):
        return index.clone()


_EMPTY = torch.empty(0, dtype=torch.int64)
_NO_RUNS = PairedRuns(_EMPTY, _EMPTY, _EMPTY, _EMPTY)


@dataclass(frozen=True)
class StagedChunk:
    """Rows ``[begin, end)`` of a staged transfer and the host runs they read or write."""

    begin: int
    end: int
    host_runs: Runs


def staged_chunks(host_runs: Runs, chunk_rows: int) -> tuple[StagedChunk, ...]:
    """The host runs cut into chunks of at most ``chunk_rows`` rows (a staging buffer's worth)."""
    rows = host_runs.total
    if rows <= chunk_rows:
        return (StagedChunk(0, rows, host_runs),)
    bounds = [(begin, min(begin + chunk_rows, rows)) for begin in range(0, rows, chunk_rows)]
    return tuple(StagedChunk(b, e, slice_runs(host_runs, b, e)) for b, e in bounds)


def _check_sides(src: torch.Tensor, dst: torch.Tensor, direction: Direction | None) -> Direction:
    """Both sides have rows, and the direction their devices imply (or the one given)."""
    for name, tensor in (("src", src), ("dst", dst)):
        if tensor.dim() == 0:
            raise ValueError(f"{name} is a scalar; rows are indexed along dim 0")
    return _resolve_direction(src.device, dst.device, direction)


def _resolve_direction(
    src_device: torch.device, dst_device: torch.device, direction: Direction | None
) -> Direction:
    given = None if direction is None else Direction(direction)
    src_on_host = src_device.type == "cpu"
    if src_on_host != (dst_device.type == "cpu"):
        implied = Direction.H2D if src_on_host else Direction.D2H
        if given is not None and given is not implied:
            raise ValueError(
                f"{src_device} -> {dst_device} is {implied.value}, but direction={given.value}"
            )
        return implied
    if given is None:
        raise ValueError(
            f"src is on {src_device} and dst on {dst_device}: pass direction= to say which "
            "side is the host"
        )
    return given


def _choose_path(
    runs: PairedRuns, host_runs: Runs, nbytes: int, policy: PathPolicy
) -> TransferPath:
    if runs.count <= 1:
        # One run on both sides is one DMA at line rate; nothing can beat it.
        return TransferPath.SINGLE_COPY
    if runs.count <= policy.max_batched_runs and nbytes >= policy.long_run_bytes * runs.count:
        # Runs long enough that DMA engines reach line rate run by run, few enough that
        # the per-run submission cost (one batched submission on CUDA) stays small.
        return TransferPath.BATCHED_RUNS
    if _host_runs_long(host_runs, nbytes, policy) and nbytes <= policy.staging_bytes:
        # Only the host side crosses PCIe: a few long DMAs into device staging,
        # then a scatter at HBM bandwidth (>10x PCIe), which is nearly free. A copy
        # larger than the staging buffer would take one DMA and one scatter per buffer's
        # worth (H200: ~80 us of host time each, 97% of the link); the gather below takes
        # one launch whatever the size, at 92-95%.
        return TransferPath.STAGED
    # Short runs on the host: DMA would be bound by per-run submission cost,
    # while a gather kernel keeps many small UVA reads in flight.
    return TransferPath.GATHER


def _host_runs_long(host_runs: Runs, nbytes: int, policy: PathPolicy) -> bool:
    return host_runs.count <= 1 or (
        host_runs.count <= policy.max_dma_runs and nbytes >= policy.long_run_bytes * host_runs.count
    )


def _check_forced(
    force: TransferPath, runs: PairedRuns, row_size: int, policy: PathPolicy
) -> TransferPath:
    if force is TransferPath.SINGLE_COPY and runs.count > 1:
        raise ValueError(f"force=single_copy needs at most one paired run, got {runs.count}")
    if force is TransferPath.STAGED and row_size > policy.staging_bytes:
        raise ValueError(
            f"force=staged: a row of {row_size} B does not fit the "
            f"{policy.staging_bytes} B staging buffer"
        )
    return force


@dataclass(frozen=True)
class Submission:
    """One submission of an engine's call: ``plan`` over its own buffers, or over every
    pair of ``pairs`` (:meth:`Mover.execute_layers`)."""

    plan: TransferPlan
    pairs: LayerPairs | None = None


@dataclass(frozen=True, eq=False)
class PreparedLayers:
    """A plan made ready once for every layer of one request (an engine's reload comes as
    one call per layer, all with the same indices): :meth:`Mover.prepare_layers` puts its
    indices on the device where its kernels gather, so that a layer costs one launch."""

    plan: TransferPlan
    rows: object | None
    """The kernel set's prepared indices; None where each layer runs
    :meth:`Mover.execute_layers` (paths other than the gather, kernels without the op)."""
    gather: GatherPrepared | None
    fits: weakref.WeakSet[LayerPairs] = dataclasses.field(default_factory=weakref.WeakSet)
    """Pairs already found to fit the plan (:func:`layers_mismatch`)."""


class StagingBuffers:
    """One preallocated, never-grown byte buffer per device, allocated on first use.

    :meth:`lease` holds the device's buffer exclusively, so concurrent transfers
    (an engine's load and backup threads) never share it. On CUDA the lock is released
    when the copies are queued, not done, so the next lease's stream also waits on the
    GPU for the stream that used the buffer last (an event, never a host sync).
    """

    def __init__(self, capacity_bytes: int = PathPolicy.staging_bytes) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self._locks: dict[torch.device, threading.Lock] = {}
        self._last_use: dict[torch.device, torch.cuda.Event] = {}
        self._last_stream: dict[torch.device, int] = {}
        self._guard = threading.Lock()

    @property
    def bytes_reserved(self) -> int:
        with self._guard:
            return self.capacity_bytes * len(self._buffers)

    @contextmanager
    def lease(self, device: torch.device) -> Iterator[torch.Tensor]:
        with self._guard:
            lock = self._locks.setdefault(device, threading.Lock())
        with lock:
            buffer = self._buffers.get(device)
            if buffer is None:
                buffer = torch.empty(self.capacity_bytes, dtype=torch.uint8, device=device)
                with self._guard:
                    self._buffers[device] = buffer
            if device.type != "cuda":
                yield buffer
                return
            stream = torch.cuda.current_stream(device)
            last_use = self._last_use.get(device)
            if last_use is None:
                last_use = self._last_use[device] = torch.cuda.Event()
            elif self._last_stream[device] != stream.cuda_stream:
                # The same stream is ordered already; another one waits on the GPU.
                stream.wait_event(last_use)
            try:
                yield buffer
            finally:
                # One event per device serves every lease: a wait holds the record issued
                # before it, and the device lock keeps each record after the previous wait.
                last_use.record(stream)
                self._last_stream[device] = stream.cuda_stream


@dataclass(frozen=True)
class _Prepared:
    """What executing a plan again reuses: its row views in words, and its gather set up."""

    src_words: torch.Tensor
    dst_words: torch.Tensor
    gather: PreparedGather | None


class Mover:
    """Executes plans through the kernels of each plan's device side."""

    def __init__(
        self,
        policy: PathPolicy = PathPolicy(),
        *,
        metrics: Metrics | None = None,
        staging: StagingBuffers | None = None,
    ) -> None:
        self.policy = policy
        self.metrics = metrics
        self.staging = StagingBuffers(policy.staging_bytes) if staging is None else staging
        self._cuda_kernels: KernelSet | None = None
        # Per live plan: engines and benchmarks execute one plan again and again (a layer
        # at a time), and each set-up skipped is host time saved on every one of them.
        self._prepared: weakref.WeakKeyDictionary[TransferPlan, _Prepared] = (
            weakref.WeakKeyDictionary()
        )
        self._prepared_lock = threading.Lock()

    def kernels(self, device: torch.device) -> KernelSet:
        """The kernel set for ``device``; CUDA's is built on first use (it imports Triton)."""
        if device.type != "cuda":
            return kernels_for(device)
        if self._cuda_kernels is None:
            from kvcore.kernels.cuda import cuda_kernels

            self._cuda_kernels = cuda_kernels(self.policy.gather_ctas, self.policy.staged_pieces)
        return self._cuda_kernels

    def transfer(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        src_idx: torch.Tensor,
        dst_idx: torch.Tensor,
        *,
        direction: Direction | None = None,
        stock: Callable[[], None] | None = None,
        force: TransferPath | None = None,
    ) -> TransferPlan:
        """Plan and execute; returns the plan so that callers can log its path."""
        chosen = plan(
            src, dst, src_idx, dst_idx, direction=direction, policy=self.policy, force=force
        )
        self.execute(chosen, stock=stock)
        return chosen

    def execute(self, plan: TransferPlan, *, stock: Callable[[], None] | None = None) -> None:
        """Run ``plan``; a FALLBACK runs ``stock`` (the engine's own path) or, without one,
        copies the rows unchanged by torch indexing.

        Raises :class:`StalePlanError` where the plan's indices were written since planning
        (unless ``stock`` runs: it reads the engine's own), TypeError or ValueError where a
        FALLBACK without ``stock`` would need a conversion or a broadcast.
        """
        started = time.perf_counter()
        if plan.path is TransferPath.FALLBACK and stock is not None:
            stock()
        else:
            plan.check_indices()
            if plan.path is TransferPath.FALLBACK:
                index_copy_rows(plan.src, plan.dst, plan.src_idx, plan.dst_idx)
        degraded = None
        if plan.path is not TransferPath.FALLBACK and plan.rows and plan.row_bytes:
            degraded = self._copy(plan)
        seconds = time.perf_counter() - started
        if self.metrics is not None:
            direction, path = plan.direction.value, plan.path.value
            self.metrics.record_transfer(direction, path, plan.nbytes, seconds)
            for reason in (plan.reason, degraded):
                if reason is not None:
                    self.metrics.record_fallback(reason)

    def submit(self, work: Submission) -> None:
        """Run one :class:`Submission`."""
        if work.pairs is None:
            self.execute(work.plan)
        else:
            self.execute_layers(work.plan, work.pairs)

    def execute_layers(self, plan: TransferPlan, pairs: LayerPairs) -> None:
        """Run ``plan``'s rows between every pair of ``pairs``: one submission for all of
        them where the device's kernels have one, one per pair where not.

        ``plan`` is made for one pair of the same layout (engines plan the first layer).
        Raises ValueError when it does not fit the pairs, or when either says the copy must
        take the engine's stock path: the caller runs that path instead;
        :class:`StalePlanError` where the plan's indices were written since planning.
        """
        plan.check_indices()
        problem = layers_mismatch(plan, pairs)
        if problem is not None:
            raise ValueError(problem)
        started = time.perf_counter()
        degraded = None
        if plan.rows and plan.row_bytes:
            degraded = self._copy_layers(plan, pairs)
        self._record_layers(plan, pairs, time.perf_counter() - started, degraded)

    def prepare_layers(
        self, plan: TransferPlan, *, src_idx_on_device: torch.Tensor | None = None
    ) -> PreparedLayers:
        """``plan`` ready for :meth:`execute_prepared` on each layer of one request.

        ``src_idx_on_device``: the engine's own copy of ``plan.src_idx`` on the plan's
        device (SGLang moves a reload's host indices to the GPU itself), used instead of an
        upload; int64 and contiguous, else it is not used. Raises :class:`StalePlanError`
        where the plan's indices were written since planning.
        """
        plan.check_indices()
        if plan.path is TransferPath.GATHER and plan.rows and plan.row_bytes:
            kernels = self.kernels(plan.device)
            if kernels.prepare_rows is not None and kernels.gather_prepared is not None:
                src_idx = plan.src_idx
                if _same_index_on(src_idx_on_device, src_idx, plan.device):
                    assert src_idx_on_device is not None
                    src_idx = src_idx_on_device
                rows = kernels.prepare_rows(src_idx, plan.dst_idx, plan.device)
                return PreparedLayers(plan, rows, kernels.gather_prepared)
        return PreparedLayers(plan, None, None)

    def execute_prepared(self, prepared: PreparedLayers, pairs: LayerPairs) -> None:
        """:meth:`execute_layers` for one layer of a prepared request; raises as it does."""
        plan = prepared.plan
        if prepared.rows is None or prepared.gather is None:
            self.execute_layers(plan, pairs)
            return
        plan.check_indices()
        if pairs not in prepared.fits:
            problem = layers_mismatch(plan, pairs)
            if problem is not None:
                raise ValueError(problem)
            prepared.fits.add(pairs)
        started = time.perf_counter()
        degraded = prepared.gather(pairs, prepared.rows)
        self._record_layers(plan, pairs, time.perf_counter() - started, degraded)

    def _record_layers(
        self, plan: TransferPlan, pairs: LayerPairs, seconds: float, degraded: str | None
    ) -> None:
        if self.metrics is not None:
            nbytes = plan.nbytes * len(pairs)
            self.metrics.record_transfer(plan.direction.value, plan.path.value, nbytes, seconds)
            if degraded is not None:
                self.metrics.record_fallback(degraded)

    def _copy_layers(self, plan: TransferPlan, pairs: LayerPairs) -> str | None:
        kernels = self.kernels(plan.device)
        runs_path = plan.path in (TransferPath.SINGLE_COPY, TransferPath.BATCHED_RUNS)
        if runs_path and kernels.copy_runs_layers is not None:
            return kernels.copy_runs_layers(pairs, plan.runs)
        if plan.path is TransferPath.GATHER and kernels.gather_layers is not None:
            return kernels.gather_layers(pairs, plan.src_idx, plan.dst_idx)
        degraded = None
        for src_words, dst_words in zip(pairs.src_words, pairs.dst_words, strict=True):
            degraded = self._copy_words(plan, kernels, src_words, dst_words) or degraded
        return degraded

    def _copy(self, plan: TransferPlan) -> str | None:
        """Issue the plan's copies; returns why a slower way was taken, if one was."""
        kernels = self.kernels(plan.device)
        prepared = self._prepared.get(plan)
        if prepared is None:
            prepared = self._prepare(plan, kernels)
        if prepared.gather is not None:
            return prepared.gather(plan.src_idx, plan.dst_idx)
        return self._copy_words(plan, kernels, prepared.src_words, prepared.dst_words)

    def _prepare(self, plan: TransferPlan, kernels: KernelSet) -> _Prepared:
        src_words, dst_words = _word_views(plan.src, plan.dst)
        gather = None
        if plan.path is TransferPath.GATHER and kernels.prepare_gather is not None:
            gather = kernels.prepare_gather(src_words, dst_words)
        # Views of the plan's tensors, never of the plan: the entry goes when the plan does.
        prepared = _Prepared(src_words, dst_words, gather)
        with self._prepared_lock:
            self._prepared[plan] = prepared
        return prepared

    def _copy_words(
        self,
        plan: TransferPlan,
        kernels: KernelSet,
        src_words: torch.Tensor,
        dst_words: torch.Tensor,
    ) -> str | None:
        if plan.path in (TransferPath.SINGLE_COPY, TransferPath.BATCHED_RUNS):
            return kernels.copy_runs(src_words, dst_words, plan.runs)
        if plan.path is TransferPath.GATHER:
            return kernels.gather_rows(src_words, plan.src_idx, dst_words, plan.dst_idx)
        self._staged(plan, kernels, src_words, dst_words)
        return None

    def _staged(
        self,
        plan: TransferPlan,
        kernels: KernelSet,
        src_words: torch.Tensor,
        dst_words: torch.Tensor,
    ) -> None:
        chunk_rows = self.staging.capacity_bytes // plan.row_bytes
        if chunk_rows == 0:
            raise ValueError(
                f"a row of {plan.row_bytes} B does not fit the "
                f"{self.staging.capacity_bytes} B staging buffer"
            )
        page_in = plan.direction is Direction.H2D
        chunks = plan.staged_chunks
        if not chunks or chunks[0].end - chunks[0].begin > chunk_rows:
            # A mover whose staging buffer is smaller than the plan's policy assumed.
            chunks = staged_chunks(plan.host_runs, chunk_rows)
        with self.staging.lease(plan.device) as buffer:
            for chunk in chunks:
                begin, end = chunk.begin, chunk.end
                staging = staging_words(buffer, end - begin, src_words)
                if page_in:
                    kernels.stage_in(
                        src_words, chunk.host_runs, staging, dst_words, plan.dst_idx[begin:end]
                    )
                else:
                    kernels.stage_out(
                        src_words, plan.src_idx[begin:end], staging, dst_words, chunk.host_runs
                    )


def submissions(
    first: TransferPlan,
    buffers: Sequence[tuple[torch.Tensor, torch.Tensor]],
    layered: LayerPairs | None,
) -> list[Submission] | str:
    """``first`` (planned for ``buffers[0]``) for every (src, dst) pair of ``buffers``.

    One submission where ``layered`` (the same pairs, checked) takes them all, else the
    plan rebound to each pair (pairs of other row sizes, or with no ``layered``); or the
    fallback reason of the first pair that must take the engine's stock path. Rebinding
    raises ValueError where a pair is too short for the indices.
    """
    if layered is not None and layered.reason is None and layers_mismatch(first, layered) is None:
        return [Submission(first, layered)]
    # The pair ``first`` was planned on needs no second look.
    plans = [
        first if src is first.src and dst is first.dst else first.rebind(src, dst)
        for src, dst in buffers
    ]
    reason = next((each.reason for each in plans if each.reason is not None), None)
    return reason if reason is not None else [Submission(each) for each in plans]


def layers_mismatch(plan: TransferPlan, pairs: LayerPairs) -> str | None:
    """Why :meth:`Mover.execute_layers` would refuse ``plan`` for ``pairs``, or None."""
    if plan.reason is not None:
        return f"the plan falls back ({plan.reason}); run the stock path"
    if pairs.reason is not None:
        return f"the pairs cannot move in one submission ({pairs.reason}); rebind the plan to each"
    if pairs.srcs[0].device != plan.src.device or pairs.dsts[0].device != plan.dst.device:
        return (
            f"the plan copies {plan.src.device} -> {plan.dst.device}, the pairs "
            f"{pairs.srcs[0].device} -> {pairs.dsts[0].device}"
        )
    if pairs.row_bytes != plan.row_bytes:
        return f"the plan copies rows of {plan.row_bytes} B, the pairs have {pairs.row_bytes} B"
    if pairs.src_rows < plan.src_span or pairs.dst_rows < plan.dst_span:
        return (
            f"the plan needs {plan.src_span} source and {plan.dst_span} destination rows, the "
            f"shortest pair has {pairs.src_rows} and {pairs.dst_rows}"
        )
    if pairs.shared_dsts:
        written = _destination_runs(plan)
        if written is None:
            return (
                "the pairs' destinations share memory and the plan's destination rows are "
                "on the device, unread: one submission could write a byte twice"
            )
        if pairs.rows_collide(written):
            return (
                "the plan's destination rows meet in the memory the pairs' destinations "
                "share: one submission would write a byte twice"
            )
    return None


def _same_index_on(
    candidate: torch.Tensor | None, index: torch.Tensor, device: torch.device
) -> bool:
    """Whether ``candidate`` can stand for ``index`` on ``device`` (its values are the
    caller's word): the kernels' index form, as long."""
    return (
        candidate is not None
        and candidate.device == device
        and candidate.dtype == torch.int64
        and candidate.dim() == 1
        and candidate.numel() == index.numel()
        and (candidate.numel() < 2 or candidate.stride(0) == 1)
    )


def _destination_runs(plan: TransferPlan) -> Runs | None:
    """The rows ``plan`` writes, as runs; None where they are a device index never read."""
    if plan.direction is Direction.D2H:
        return plan.host_runs
    return None if plan.device_index_opaque else plan.runs.dst_runs()


def _word_views(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer row views of both sides with one word type that fits both alignments."""
    src_width = row_word_bytes(src)
    dst_width = row_word_bytes(dst)
    if src_width is None or dst_width is None:
        raise ValueError("the plan's tensors no longer have dense rows; plan again")
    width = min(src_width, dst_width)
    return rows_as_words(src, width), rows_as_words(dst, width)
