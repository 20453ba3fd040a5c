"""Index tensors -> ascending unit-stride runs.

This is the only module that segments index tensors. It accepts CPU tensors
only: a plan must never be made by reading a CUDA index tensor back, because that
would synchronise the copy stream on every layer.

Each question about an index has a tensor form, which checks the index
(:func:`check_index`), and an ``*_of`` form taking the NumPy view of an index already
checked (``check_index(index).numpy()``), for a planner that asks several questions of
one index on an engine's load path and checks it once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvcore.index_scratch import COUNTING, SCRATCH
from kvcore.repeats import duplicates_below, sorted_duplicates, stepped_duplicates

_INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


@dataclass(frozen=True, slots=True)
class Runs:
    """Runs ``[starts[i], starts[i] + lengths[i])`` in index order: maximal, unless cut
    where a host registration ends (:func:`cut_runs`)."""

    starts: torch.Tensor
    lengths: torch.Tensor

    @property
    def count(self) -> int:
        return int(self.starts.numel())

    @property
    def total(self) -> int:
        return int(self.lengths.sum()) if self.count else 0

    def as_list(self) -> list[tuple[int, int]]:
        return list(zip(self.starts.tolist(), self.lengths.tolist(), strict=True))


@dataclass(frozen=True, slots=True)
class PairedRuns:
    """Runs that are unit-stride on the source and the destination at once.

    Row ``k`` of the transfer covers ``src_starts[i] + j -> dst_starts[i] + j``
    for ``j < lengths[i]``; ``offsets[i]`` is where run ``i`` begins in the
    index tensors.
    """

    src_starts: torch.Tensor
    dst_starts: torch.Tensor
    lengths: torch.Tensor
    offsets: torch.Tensor

    @property
    def count(self) -> int:
        return int(self.lengths.numel())

    @property
    def total(self) -> int:
        return int(self.lengths.sum()) if self.count else 0

    def src_runs(self) -> Runs:
        return Runs(self.src_starts, self.lengths)

    def dst_runs(self) -> Runs:
        return Runs(self.dst_starts, self.lengths)


def check_index(index: torch.Tensor, name: str = "index") -> torch.Tensor:
    """Validate an index tensor and return it as a 1-D int64 CPU tensor.

    Raises TypeError for CUDA (or other non-CPU) tensors and non-integer dtypes,
    ValueError for anything that is not one-dimensional.
    """
    if not isinstance(index, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(index).__name__}")
    # is_cpu reads a flag; .device builds a torch.device, and this runs on every index of
    # a request's first call.
    if not index.is_cpu:
        raise TypeError(
            f"{name} is on {index.device}; kvcore plans from CPU index tensors only, "
            "because reading a device tensor back would synchronise the GPU. "
            "Pass the indices before they are moved to the device."
        )
    if index.dtype not in _INTEGER_DTYPES:
        raise TypeError(f"{name} must have an integer dtype, got {index.dtype}")
    if index.dim() != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {tuple(index.shape)}")
    # A no-op .to() still costs a dispatch, and this runs several times on a first call.
    return index if index.dtype is torch.int64 else index.to(torch.int64)


def version_of(tensor: torch.Tensor) -> int | None:
    """``tensor``'s version counter (bumped by every in-place torch write), or None for an
    inference tensor, which has none: reading its ``_version`` raises. Engines that run
    under ``torch.inference_mode`` (vLLM's model runner; SGLang with
    SGLANG_ENABLE_TORCH_INFERENCE_MODE) hand kvcore such tensors, and so does every tensor
    kvcore makes while their call is on the stack."""
    return None if tensor.is_inference() else tensor._version


def check_bounds(index: torch.Tensor, size: int, name: str = "index") -> int:
    """Raise ValueError unless every entry lies in ``[0, size)``; return the largest + 1.

    The span (0 for an empty index) is the fewest rows a buffer indexed by it needs.
    """
    return span_of(check_index(index, name).numpy(), size, name)


def span_and_run_count(
    index: torch.Tensor, size: int, name: str = "index", *, count_up_to: int | None = None
) -> tuple[int, int]:
    """:func:`check_bounds` and the number of runs :func:`find_runs` would find, in one
    pass over the differences and without building the runs (a plan that copies row by
    row decides from their number alone).

    ``count_up_to``: the caller only asks whether there are at most this many runs, so a
    count past it is any number above it, found from the index's first
    :data:`COUNT_PREFIX` entries where they hold that many breaks already: a scattered
    index of tens of thousands of entries is then differenced over a few thousand. The
    bounds always cover every entry.
    """
    return span_and_run_count_of(
        check_index(index, name).numpy(), size, name, count_up_to=count_up_to
    )


def span_and_run_count_of(
    values: np.ndarray, size: int, name: str = "index", *, count_up_to: int | None = None
) -> tuple[int, int]:
    """:func:`span_and_run_count` of a checked index's values."""
    if values.size < 2:
        return span_of(values, size, name), values.size
    run_count = _run_count(values, count_up_to)
    if run_count == 1:
        # One ascending run: its ends are its bounds.
        return _within(int(values[0]), int(values[-1]), size, name), 1
    return span_of(values, size, name), run_count


def span_and_runs_of(
    values: np.ndarray, size: int, name: str, *, count_up_to: int
) -> tuple[int, int, Runs | None]:
    """:func:`span_and_run_count_of` of a checked index's values, and its runs where there
    are at most ``count_up_to`` (None past it), found from the differences the count took:
    a plan that stages few host runs needs them, and the index is not differenced twice."""
    if values.size < 2:
        span = span_of(values, size, name)
        return span, values.size, _one_run(values) if values.size else no_runs()
    run_count = _run_count(values, count_up_to)
    if run_count == 1:
        span, run = span_and_one_run(values, size, name)
        return span, 1, run
    span = span_of(values, size, name)
    if run_count > count_up_to:
        return span, run_count, None
    # _run_count differenced every entry (a count within the limit reads the whole index),
    # and span_of left the per-thread scratch alone.
    breaks = SCRATCH.arrays(values.size - 1)[2]
    (starts,), lengths, _ = _runs_at(breaks, values)
    return span, run_count, Runs(starts, lengths)


def span_and_one_run(values: np.ndarray, size: int, name: str) -> tuple[int, Runs]:
    """:func:`span_and_runs_of` of a checked index's values (two or more) already counted as
    one run: its ends are its bounds, so nothing is read again."""
    return _within(int(values[0]), int(values[-1]), size, name), _one_run(values)


def _one_run(values: np.ndarray) -> Runs:
    # From NumPy: torch.tensor of a Python list costs about twice as much, on a first call.
    return Runs(
        torch.from_numpy(values[:1].astype(np.int64)),
        torch.from_numpy(np.full(1, values.size, dtype=np.int64)),
    )


def no_runs() -> Runs:
    """Runs over no rows."""
    empty = torch.empty(0, dtype=torch.int64)
    return Runs(empty, empty.clone())


def run_count_up_to(index: torch.Tensor, limit: int) -> int:
    """The number of runs :func:`find_runs` would find where it is at most ``limit``; past
    it, any number above ``limit`` (read from a prefix, as :func:`span_and_run_count`
    does). No bounds are checked."""
    return run_count_of(check_index(index).numpy(), limit)


def run_count_of(values: np.ndarray, limit: int) -> int:
    """:func:`run_count_up_to` of a checked index's values."""
    return values.size if values.size < 2 else _run_count(values, limit)


def _run_count(values: np.ndarray, count_up_to: int | None) -> int:
    """Runs of ``values`` (two entries or more), exact up to ``count_up_to`` (None: exact)."""
    steps, _, breaks, _, _ = SCRATCH.arrays(values.size - 1)
    last = values.size - 1
    # A prefix pays where it can spare most of the index: below twice its length, the
    # second pass's calls cost more than the differences it spares. Ends a whole run
    # apart (what one run has, and a staged plan's host slots mostly are) skip it: the
    # prefix would find no break, and the rest would be read anyway.
    whole = count_up_to is None or last <= 2 * COUNT_PREFIX or values[last] - values[0] == last
    head = last if whole else COUNT_PREFIX
    _steps_and_breaks(values[: head + 1], steps[:head], breaks[:head])
    run_count = int(np.count_nonzero(breaks[:head])) + 1
    # A count of one stays exact whatever the limit: callers take its ends as its bounds.
    if head < last and run_count <= max(count_up_to or 0, 1):
        _steps_and_breaks(values[head:], steps[head:], breaks[head:])
        run_count += int(np.count_nonzero(breaks[head:]))
    return run_count


COUNT_PREFIX = 4096
"""Differences :func:`span_and_run_count` looks at first when asked for a bounded count of
an index of more than twice as many entries."""


def span_of(values: np.ndarray, size: int, name: str = "index") -> int:
    """:func:`check_bounds` of a checked index's values: ``max + 1`` of int64 ``values`` that
    all lie in ``[0, size)``, else ValueError."""
    if values.size == 0:
        return 0
    # Read as unsigned, a negative entry is past any size: one pass checks both ends (the
    # ufunc's own reduce, without ndarray.max's Python-level wrapper).
    high = int(np.maximum.reduce(values.view(np.uint64)))
    if high < size:
        return high + 1
    return _within(int(values.min()), int(values.max()), size, name)


def _within(low: int, high: int, size: int, name: str) -> int:
    """``high + 1`` where ``[low, high]`` lies in ``[0, size)``; else ValueError."""
    if low < 0 or high >= size:
        bad = low if low < 0 else high
        raise ValueError(f"{name} holds {bad}, outside [0, {size})")
    return high + 1


def has_duplicates(index: torch.Tensor) -> bool:
    values = check_index(index).numpy()
    if values.size < 2:
        return False
    if int(values.min()) < 0:
        return sorted_duplicates(values)
    return duplicates_below(values, int(values.max()) + 1)


def has_duplicates_below(index: torch.Tensor, span: int) -> bool:
    """:func:`has_duplicates` for an index already bounds-checked: every entry lies in
    ``[0, span)`` (``span`` as :func:`check_bounds` returns it), so no pass looks for
    its ends again."""
    return duplicates_below(check_index(index).numpy(), span)


# Rows per run from which duplicates are looked for between runs rather than row by row:
# within a run the rows step by one, so two rows can only collide across runs, and
# sorting the runs' intervals is cheaper than marking every row.
_ROWS_PER_RUN_FOR_INTERVALS = 8


def _duplicate_destinations(
    values: np.ndarray,
    steps: np.ndarray,
    breaks: np.ndarray,
    span: int,
    paired: Runs,
    own: Runs | None,
) -> bool:
    """Duplicates in ``values``, the destination rows, looked for between runs where runs
    are long: the paired runs' destination side (``paired``), else the destination's own
    runs (``own`` where already found); row by row otherwise. ``steps`` and ``breaks`` are
    the destination's own."""
    most_runs = values.size // _ROWS_PER_RUN_FOR_INTERVALS
    runs = paired
    if runs.count > most_runs:
        if own is None and int(np.count_nonzero(breaks)) + 1 <= most_runs:
            # Scattered source rows into whole destination pages: the paired runs are
            # single rows, the destination's own runs are pages.
            own = _own_runs(values, breaks, paired)
        if own is None or own.count > most_runs:
            return stepped_duplicates(values, steps, span)
        runs = own
    starts = runs.starts.numpy()
    begins = np.sort(starts)
    ends = np.sort(starts + runs.lengths.numpy())
    # Some row lies in two runs iff, with starts and ends sorted apart, some run starts
    # before the run ending next has ended: at that start two runs are open.
    return bool((begins[1:] < ends[:-1]).any())


# numpy does the segmentation: each torch op on a small CPU tensor costs several
# microseconds of dispatch, numpy a fraction of that, and the views are zero-copy.
# Each result array is written in place: a plan of scattered rows has a run per row, and
# every fresh temporary of that size costs page faults on first touch.
def _segment(n: int, breaks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Offsets and lengths of the runs for ``breaks``, the positions ``p - 1`` where a run
    starts at ``p``."""
    offsets = np.empty(breaks.size + 1, dtype=np.int64)
    offsets[0] = 0
    np.add(breaks, 1, out=offsets[1:])
    lengths = np.empty(offsets.size, dtype=np.int64)
    np.subtract(offsets[1:], offsets[:-1], out=lengths[:-1])
    lengths[-1] = n - offsets[-1]
    return offsets, lengths


def _runs_at(
    breaks: np.ndarray, *sides: np.ndarray
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Each side's run starts, the run lengths and offsets, for ``breaks[p]`` saying that
    position ``p + 1`` starts a run. Where every position does, the sides themselves are
    the starts (no copy) and the lengths and offsets are shared counting tensors."""
    n = sides[0].size
    if int(np.count_nonzero(breaks)) == n - 1:
        lengths, offsets = COUNTING.ones_and_arange(n)
        return [torch.from_numpy(side) for side in sides], lengths, offsets
    # ``breaks`` is one-dimensional: its nonzero() is flatnonzero's, without the wrappers.
    at, run_lengths = _segment(n, breaks.nonzero()[0])
    starts = [torch.from_numpy(side[at]) for side in sides]
    return starts, torch.from_numpy(run_lengths), torch.from_numpy(at)


def find_runs(index: torch.Tensor) -> Runs:
    """Split ``index`` into maximal ascending unit-stride runs, in order."""
    index = check_index(index)
    if index.numel() == 0:
        return no_runs()
    values = index.numpy()
    steps, _, breaks, _, _ = SCRATCH.arrays(values.size - 1)
    _steps_and_breaks(values, steps, breaks)
    (starts,), lengths, _ = _runs_at(breaks, values)
    return Runs(starts, lengths)


def find_paired_runs(src_index: torch.Tensor, dst_index: torch.Tensor) -> PairedRuns:
    """Runs that are unit-stride on both sides: a break on either side splits."""
    src_index = check_index(src_index, "src_index")
    dst_index = check_index(dst_index, "dst_index")
    if src_index.numel() != dst_index.numel():
        raise ValueError(
            f"src_index has {src_index.numel()} entries but dst_index has {dst_index.numel()}"
        )
    if src_index.numel() == 0:
        empty = torch.empty(0, dtype=torch.int64)
        return PairedRuns(empty, empty.clone(), empty.clone(), empty.clone())
    return _paired_runs(src_index.numpy(), dst_index.numpy()).runs


@dataclass(frozen=True, slots=True)
class _Paired:
    """Paired runs and what finding them left in the per-thread scratch (valid until the
    thread's next segmentation)."""

    runs: PairedRuns
    src_breaks: np.ndarray
    dst_breaks: np.ndarray
    dst_steps: np.ndarray


def _paired_runs(src: np.ndarray, dst: np.ndarray) -> _Paired:
    """Runs of two non-empty index arrays of one length, split where either side breaks."""
    src_steps, dst_steps, src_breaks, dst_breaks, either = SCRATCH.arrays(src.size - 1)
    _steps_and_breaks(src, src_steps, src_breaks)
    _steps_and_breaks(dst, dst_steps, dst_breaks)
    np.logical_or(src_breaks, dst_breaks, out=either)
    (src_starts, dst_starts), lengths, offsets = _runs_at(either, src, dst)
    return _Paired(
        PairedRuns(src_starts, dst_starts, lengths, offsets), src_breaks, dst_breaks, dst_steps
    )


def _steps_and_breaks(values: np.ndarray, steps: np.ndarray, breaks: np.ndarray) -> None:
    """``steps = np.diff(values)`` and ``breaks = steps != 1``, into the given arrays."""
    np.subtract(values[1:], values[:-1], out=steps)
    np.not_equal(steps, 1, out=breaks)


@dataclass(frozen=True, slots=True)
class TransferSegmentation:
    """Everything a plan needs from its two index tensors, found in one pass over each."""

    runs: PairedRuns
    host_runs: Runs
    src_span: int
    dst_span: int
    dst_has_duplicates: bool


def segment_transfer(
    src_index: torch.Tensor,
    dst_index: torch.Tensor,
    src_size: int,
    dst_size: int,
    *,
    host_is_src: bool,
) -> TransferSegmentation:
    """Bounds, duplicate destinations, paired runs and host runs of one transfer.

    The same as :func:`check_bounds` on each side, :func:`has_duplicates` on the
    destination, :func:`find_paired_runs` and :func:`find_runs` on the host side, but
    each index is differenced once: a layer's plan is on the engine's submit path.
    """
    src = check_index(src_index, "src_idx").numpy()
    dst = check_index(dst_index, "dst_idx").numpy()
    return segment_values(src, dst, src_size, dst_size, host_is_src=host_is_src)


def segment_values(
    src: np.ndarray, dst: np.ndarray, src_size: int, dst_size: int, *, host_is_src: bool
) -> TransferSegmentation:
    """:func:`segment_transfer` of two checked indices' values."""
    if src.size != dst.size:
        raise ValueError(f"src_idx has {src.size} entries but dst_idx has {dst.size}")
    src_span = span_of(src, src_size, "src_idx")
    dst_span = span_of(dst, dst_size, "dst_idx")
    if src.size == 0:
        empty = torch.empty(0, dtype=torch.int64)
        runs = PairedRuns(empty, empty.clone(), empty.clone(), empty.clone())
        return TransferSegmentation(runs, Runs(empty.clone(), empty.clone()), 0, 0, False)
    paired = _paired_runs(src, dst)
    src_side, dst_side = paired.runs.src_runs(), paired.runs.dst_runs()
    if host_is_src:
        host_runs = _own_runs(src, paired.src_breaks, src_side)
    else:
        host_runs = _own_runs(dst, paired.dst_breaks, dst_side)
    return TransferSegmentation(
        paired.runs,
        host_runs,
        src_span,
        dst_span,
        _duplicate_destinations(
            dst,
            paired.dst_steps,
            paired.dst_breaks,
            dst_span,
            dst_side,
            None if host_is_src else host_runs,
        ),
    )


def _own_runs(values: np.ndarray, breaks: np.ndarray, paired: Runs) -> Runs:
    """One side's own runs, from its ``breaks`` and its side of the paired runs: those
    themselves where the side breaks wherever either side does (a superset by
    construction), so scattered rows are not segmented twice."""
    if int(np.count_nonzero(breaks)) == paired.count - 1:
        return paired
    (starts,), lengths, _ = _runs_at(breaks, values)
    return Runs(starts, lengths)
