"""Buffer pairs of one layout that move together with one plan: a model's layers.

Engines copy the same rows of every layer: vLLM's offload handler one job over all its
KV tensors, SGLang's backups all layers at once. :func:`layer_pairs` checks the pairs
once (the checks :meth:`TransferPlan.rebind` would repeat per layer and per transfer)
and keeps their row views, so :meth:`Mover.execute` can issue one submission for
all of them where the device's kernels have one (a single gather launch, one batched
DMA call) and one per pair where not.

The pairs' destinations must not share rows with each other, nor with another pair's
source: with one submission the order in which two pairs write (or one writes and
another reads) the same byte is undefined, where the engine's own loop over its layers
has the last write win. :func:`layer_pairs` refuses pairs that would collide whatever
the indices. Destinations that share memory at whole-row offsets stay allowed: vLLM's
shared host region interleaves its layers' pages, and the row views of its layers
overlap, while the rows a plan writes do not; :meth:`LayerPairs.rows_collide` checks a
plan's destination rows against them.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvcore.planning.pair_checks import check_pair
from kvcore.row_words import row_bytes, rows_as_words
from kvcore.runs import Runs


@dataclass(frozen=True)
class SourceRegion:
    """Sources that are row views of one host region, ``spacing`` rows apart: sorted, their
    first rows are the region's rows ``0, spacing, 2 * spacing, ...``."""

    offsets: tuple[int, ...]
    """Each pair's source's first row, in rows from the region's first."""
    spacing: int
    rows: int
    """Rows of the region the sources reach together."""
    base: int
    """The pair whose source starts the region (offset 0)."""


@dataclass(frozen=True, eq=False)
class LayerPairs:
    """Pairs ``(srcs[i], dsts[i])`` with one row size, one source and one destination device."""

    srcs: tuple[torch.Tensor, ...]
    dsts: tuple[torch.Tensor, ...]
    src_words: tuple[torch.Tensor, ...]
    """``[rows, words]`` integer views of ``srcs``, all of one word type (empty when
    ``reason`` is set)."""
    dst_words: tuple[torch.Tensor, ...]
    src_rows: int
    """Rows of the shortest source: a plan whose source span exceeds it cannot run."""
    dst_rows: int
    row_bytes: int
    reason: str | None
    """Why some pair cannot move on kvcore's paths (a fallback reason), or why the pairs
    cannot move in one submission (``overlapping_buffers``: two destinations share rows
    whatever the indices, or one pair's destination shares memory with another's source),
    or None."""
    shared_dsts: tuple[np.ndarray, ...] = ()
    """Destinations that share memory at whole-row offsets, one group per region: each
    group's offsets in rows from its first, ascending and distinct. Empty where every
    destination has memory of its own, so that no plan needs a look at its rows."""
    src_region: SourceRegion | None = None
    """Where the sources are row views of one host region, evenly spaced (vLLM's CPU tier:
    a chunk row holds every tensor's pages side by side): a run of ``spacing`` source rows
    of every pair then lies in one span of the region's rows, which a page-in may copy whole
    (:mod:`kvcore.region_staging`). None otherwise."""
    fitted_kind: list[tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor], int]] = field(
        default_factory=list, repr=False
    )
    """The buffers (held weakly) and row size of the plans these pairs were last found to
    fit, at most one entry: what :meth:`kvcore.mover.Mover.execute_prepared` keeps of
    :func:`kvcore.planning.submissions.layers_mismatch` across requests (kept here, so
    that it goes with the pairs and no reused id can name it)."""

    def __len__(self) -> int:
        return len(self.srcs)

    @property
    def word_bytes(self) -> int:
        return self.src_words[0].element_size() if self.src_words else 0

    def rows_collide(self, dst_runs: Runs) -> bool:
        """Whether writing the destination rows ``dst_runs`` (no row twice) into every
        destination writes some byte twice, where destinations share memory."""
        if not self.shared_dsts or dst_runs.count == 0:
            return False
        starts = dst_runs.starts.numpy()
        ends = starts + dst_runs.lengths.numpy()
        if not bool((starts[1:] > starts[:-1]).all()):
            # Disjoint runs end in the order they start: both sort apart.
            starts, ends = np.sort(starts), np.sort(ends)
        return any(_shifted_rows_collide(starts, ends, offsets) for offsets in self.shared_dsts)


def layer_pairs(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor]) -> LayerPairs:
    """Check the pairs once: a caller error raises, a layout kvcore cannot move sets ``reason``."""
    srcs, dsts = tuple(srcs), tuple(dsts)
    if not srcs or len(srcs) != len(dsts):
        raise ValueError(
            f"need as many sources as destinations, at least one: {len(srcs)}, {len(dsts)}"
        )
    for side, name in ((srcs, "sources"), (dsts, "destinations")):
        if len({t.device for t in side}) > 1:
            raise ValueError(
                f"the {name} are on several devices: {sorted({str(t.device) for t in side})}"
            )
        if any(t.dim() == 0 for t in side):
            raise ValueError(f"one of the {name} is a scalar; rows are indexed along dim 0")
    reason, width = None, 8
    for src, dst in zip(srcs, dsts, strict=True):
        reason, pair_width = check_pair(src, dst)
        if reason is not None:
            break
        width = min(width, pair_width)
    if reason is None and len({row_bytes(t) for t in srcs}) > 1:
        reason = "row_shape_mismatch"
    shared_dsts: tuple[np.ndarray, ...] = ()
    if reason is None:
        reason, shared_dsts = _shared_destinations(srcs, dsts, row_bytes(srcs[0]))
    src_words: tuple[torch.Tensor, ...] = ()
    dst_words: tuple[torch.Tensor, ...] = ()
    if reason is None:
        # One word type for every view, so that one kernel launch serves every pair.
        src_words = tuple(rows_as_words(t, width) for t in srcs)
        dst_words = tuple(rows_as_words(t, width) for t in dsts)
    return LayerPairs(
        srcs=srcs,
        dsts=dsts,
        src_words=src_words,
        dst_words=dst_words,
        src_rows=min(t.shape[0] for t in srcs),
        dst_rows=min(t.shape[0] for t in dsts),
        row_bytes=row_bytes(srcs[0]),
        reason=reason,
        shared_dsts=shared_dsts,
        src_region=_source_region(srcs) if reason is None and len(srcs) > 1 else None,
    )


def _source_region(srcs: tuple[torch.Tensor, ...]) -> SourceRegion | None:
    """:attr:`LayerPairs.src_region` of checked sources (dense rows of one size)."""
    if srcs[0].device.type != "cpu" or not all(t.is_contiguous() for t in srcs):
        return None
    storage = srcs[0].untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() != storage for t in srcs):
        return None
    size = row_bytes(srcs[0])
    starts = np.array([t.data_ptr() for t in srcs], dtype=np.int64)
    shifts = starts - starts.min()
    if size == 0 or bool((shifts % size).any()):
        return None
    offsets = shifts // size
    spacing = int(np.sort(offsets)[1])
    if spacing == 0 or not np.array_equal(np.sort(offsets), np.arange(len(srcs)) * spacing):
        return None
    rows = max(o + t.shape[0] for o, t in zip(offsets.tolist(), srcs, strict=True))
    return SourceRegion(tuple(offsets.tolist()), spacing, rows, int(np.argmin(offsets)))


def _shared_destinations(
    srcs: tuple[torch.Tensor, ...], dsts: tuple[torch.Tensor, ...], row_size: int
) -> tuple[str | None, tuple[np.ndarray, ...]]:
    """``overlapping_buffers`` where pairs (each checked: dense rows of ``row_size`` bytes)
    collide whatever the indices; else :attr:`LayerPairs.shared_dsts`."""
    count = len(dsts)
    device, start, end = _extents((*dsts, *srcs))
    dst_device, dst_start, dst_end = device[:count], start[:count], end[:count]
    # A pair's own source was checked with it; another pair's may not meet it at all.
    meets_source = (
        (dst_device[:, None] == device[None, count:])
        & (dst_start[:, None] < end[None, count:])
        & (start[None, count:] < dst_end[:, None])
    )
    np.fill_diagonal(meets_source, False)
    if bool(meets_source.any()):
        return "overlapping_buffers", ()
    groups: list[np.ndarray] = []
    for on_device in np.unique(dst_device):
        ordered = np.flatnonzero(dst_device == on_device)
        ordered = ordered[np.argsort(dst_start[ordered], kind="stable")]
        # Sweep the extents in address order: each group is a region where they overlap.
        group, reach = [int(ordered[0])], int(dst_end[ordered[0]])
        for each in (*ordered[1:].tolist(), None):
            if each is not None and int(dst_start[each]) < reach:
                group.append(each)
                reach = max(reach, int(dst_end[each]))
                continue
            if len(group) > 1:
                offsets = dst_start[group] - dst_start[group[0]]
                if bool((offsets % row_size).any()) or bool((np.diff(offsets) == 0).any()):
                    # Rows that meet part-way, or one destination twice: every plan collides.
                    return "overlapping_buffers", ()
                groups.append(offsets // row_size)
            if each is not None:
                group, reach = [each], int(dst_end[each])
    return None, tuple(groups)


def _extents(tensors: tuple[torch.Tensor, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each dense tensor's device (as a number), first byte and end; an empty tensor gets
    a device number of its own, so that it meets nothing."""
    numbers = {device: n for n, device in enumerate(dict.fromkeys(t.device for t in tensors))}
    device = np.array([numbers[t.device] for t in tensors], dtype=np.int64)
    start = np.array([t.data_ptr() for t in tensors], dtype=np.int64)
    size = np.array([t.numel() * t.element_size() for t in tensors], dtype=np.int64)
    empty = size == 0
    # Negative numbers are no device: an empty tensor is alone on one of its own.
    device[empty] = -1 - np.flatnonzero(empty)
    return device, start, start + size


def _shifted_rows_collide(starts: np.ndarray, ends: np.ndarray, offsets: np.ndarray) -> bool:
    """Whether rows ``[starts[k], ends[k])`` (ascending, disjoint), written at each of
    ``offsets`` (ascending, distinct), meet."""
    nearest = int(np.diff(offsets).min())
    farthest = int(offsets[-1] - offsets[0])
    # Rows written at two offsets meet only where they lie ``nearest`` to ``farthest``
    # apart: runs farther apart than that never do, and a cluster of closer runs that
    # spans at most ``nearest`` rows cannot meet itself. vLLM's pages are such clusters.
    breaks = np.flatnonzero(starts[1:] - ends[:-1] >= farthest) + 1
    firsts = np.concatenate(([0], breaks))
    lasts = np.concatenate((breaks - 1, [starts.size - 1]))
    if bool((ends[lasts] - starts[firsts] <= nearest).all()):
        return False
    begins = np.sort((offsets[:, None] + starts[None, :]).ravel())
    stops = np.sort((offsets[:, None] + ends[None, :]).ravel())
    # As in runs._duplicate_destinations: some row lies in two intervals iff one starts
    # before the interval ending next has ended.
    return bool((begins[1:] < stops[:-1]).any())
