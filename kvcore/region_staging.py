"""A page-in over the layer pairs of one host region, staged by whole chunks.

vLLM's CPU tier is one host region whose chunk row holds every KV tensor's pages side by
side, so one tensor's rows lie a chunk apart and each of its pages is a host run of its
own: a gather kernel that holds SMs for the whole copy, or one DMA descriptor a page. Where
the pairs' sources are such a region's views, evenly spaced
(:class:`~kvcore.planning.layers.SourceRegion`), and the plan's source rows come in runs of
that spacing (whole pages of every tensor), each run's rows of every pair lie in one span of
the region: the spans go by DMA into the staging buffer as they lie (a request's chunks are
one host run in kvcore's allocator, so one long copy, the padding that aligns each chunk row
copied along), and one layered gather reads each pair's rows back out of device memory into
its tensor.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from kvcore.kernels import AddressRing, KernelSet, gather_pairs
from kvcore.kernels.overlap_ring import SlotRing, StageInLanes, slot_ring
from kvcore.planning.layers import LayerPairs, SourceRegion, layer_pairs
from kvcore.planning.plans import TransferPlan
from kvcore.runs import PairedRuns
from kvcore.staging import StagingBuffers

# Slots of the lease's ring: DMAs run up to this many pieces ahead of a scatter held back
# behind the model's long kernels (a prefill's GEMMs), so the link stays busy meanwhile.
RING_SLOTS = 8
SLOT_EVIDENCE = "docs/bench/h100-beside-compute-vllm-2026-12-06-ring-slots.json"
"""The runs ``RING_SLOTS`` is judged from (one machine)."""
# Pieces shorter than this cross PCIe in less time than a DMA's set-up and a scatter's launch.
_MIN_PIECE_BYTES = 4 << 20
# Pieces no longer than this: a scatter then reads its slot soon after its DMA wrote it,
# mostly from the GPU's L2 cache, sparing the memory bandwidth the model's kernels need;
# and no shorter, as each piece's calls hold the engine's thread inside transfer_async.
_MAX_PIECE_BYTES = 16 << 20
PIECE_EVIDENCE = "docs/bench/h100-beside-compute-vllm-2026-12-07-piece-cap-16.json"
"""The runs ``_MAX_PIECE_BYTES`` is judged from (one machine)."""
# Spans this close (a gap of at most a span's 1/_MAX_GAP_PART) go in one DMA, the gap too:
# a copy engine descriptor and a runtime call each cost more than the gap's bytes.
_MAX_GAP_PART = 8


class RegionStaging:
    """Stages page-ins by region; keeps, per pairs, the pairs that read the staging buffer."""

    def __init__(self, staging: StagingBuffers) -> None:
        self.staging = staging
        self._lanes: dict[torch.device, StageInLanes] = {}
        self._from_staging: weakref.WeakKeyDictionary[LayerPairs, _Staged] = (
            weakref.WeakKeyDictionary()
        )

    def spans_fitting(self, pairs: LayerPairs) -> int:
        """How many spans (every pair's rows of one source run) one lease holds; 0 where the
        pairs' sources are no region."""
        region = pairs.src_region
        if region is None:
            return 0
        return self.staging.capacity_bytes // (len(pairs) * region.spacing * pairs.row_bytes)

    def takes(self, plan: TransferPlan, pairs: LayerPairs) -> bool:
        """Whether :meth:`stage_in` can copy ``plan`` over ``pairs``: a region's sources, the
        plan's source rows in runs of its spacing, and a span that fits the staging buffer."""
        region = pairs.src_region
        if region is None or self.spans_fitting(pairs) < 1:
            return False
        lengths = plan.host_runs.lengths.numpy()
        return lengths.size > 0 and bool((lengths == region.spacing).all())

    def starts_of(self, src_rows: np.ndarray, pairs: LayerPairs) -> np.ndarray | None:
        """The spans' first region rows of a page-in of ``src_rows`` over ``pairs``, where
        :meth:`begin` can take it before it is planned: a region's sources, the rows whole
        pages of its spacing (runs of exactly that many rows, as :meth:`takes` asks of a plan),
        every span inside the region and one span fitting the staging buffer; else None."""
        region = pairs.src_region
        if region is None or self.spans_fitting(pairs) < 1:
            return None
        starts = _page_starts(src_rows, region.spacing)
        if starts is None:
            return None
        span_rows = len(pairs) * region.spacing
        if int(starts.min()) < 0 or int(starts.max()) + span_rows > region.rows:
            return None
        return starts

    def begin(
        self,
        starts: np.ndarray,
        dst_idx: torch.Tensor,
        pairs: LayerPairs,
        kernels: KernelSet,
        device: torch.device,
        src_idx: torch.Tensor | None = None,
    ) -> RegionLoad:
        """A page-in of the spans from region rows ``starts`` (:meth:`starts_of` of
        ``src_idx``, where given) into rows ``dst_idx`` of every pair, under way: the ring's
        first round of DMAs queued (they write the staging buffer only), the scatters left to
        :meth:`RegionLoad.finish`."""
        return RegionLoad(self, starts, dst_idx, pairs, kernels, device, src_idx)

    def stage_in(self, plan: TransferPlan, pairs: LayerPairs, kernels: KernelSet) -> str | None:
        """Copy ``plan``'s rows of every pair (:meth:`takes` holds); returns why a slower way
        was taken, if one was (:class:`RegionLoad`)."""
        if not self.takes(plan, pairs):
            raise ValueError("the plan's source rows are not whole spans of one host region")
        starts = plan.host_runs.starts.numpy()
        with self.begin(starts, plan.dst_idx, pairs, kernels, plan.device, plan.src_idx) as load:
            return load.finish(plan.dst_idx)

    def _views(
        self, pairs: LayerPairs, region: SourceRegion, buffer: torch.Tensor, rows: int
    ) -> _Staged:
        """What the first ``rows`` rows of a lease of ``buffer`` read and write (kept per
        pairs while the buffer and the rows are the same)."""
        like = pairs.src_words[0]
        kept = self._from_staging.get(pairs)
        # Checked before any view is made: each costs microseconds, on every page-in.
        if kept is not None and kept.buffer_ptr == buffer.data_ptr() and kept.rows_used == rows:
            return kept
        flat = buffer[: rows * like.shape[1] * like.element_size()].view(like.dtype)
        staged_rows = flat.view(rows, like.shape[1])
        # Every view as long as the one furthest in can be, so that all share one row count.
        length = rows - max(region.offsets)
        srcs = [staged_rows[o : o + length] for o in region.offsets]
        from_staging = layer_pairs(srcs, pairs.dst_words)
        if from_staging.reason is not None:
            raise ValueError(f"the staging buffer's pairs cannot move: {from_staging.reason}")
        staged = _Staged(staged_rows, from_staging, buffer.data_ptr(), rows)
        self._from_staging[pairs] = staged
        return staged


@dataclass(frozen=True)
class _Staged:
    """The staging buffer's rows in the sources' words, and the pairs reading each pair's
    rows of a staged span (from row ``offset``) into its destination."""

    rows: torch.Tensor
    pairs: LayerPairs
    buffer_ptr: int
    """The staging buffer they are views of, and how many of its rows they reach."""
    rows_used: int


class RegionLoad:
    """One page-in staged by region (:meth:`RegionStaging.begin`), under way.

    The lease's buffer is a ring of slots: each piece of spans goes by DMA into a slot on
    a second stream, then is scattered from it on the stream the page-in began on, so that
    the next pieces' DMAs run while the model's kernels hold the SMs a scatter waits for.
    Begun, the ring's first round of DMAs is queued, and the scatter rows' upload after the
    first of them; :meth:`finish` issues the scatters and the later DMAs. :meth:`close`
    (leaving its ``with`` too) gives the ring and the lease back, the stream it began on
    waiting for every DMA issued: called again, or after :meth:`finish`, it does nothing."""

    def __init__(
        self,
        owner: RegionStaging,
        starts: np.ndarray,
        dst_idx: torch.Tensor,
        pairs: LayerPairs,
        kernels: KernelSet,
        device: torch.device,
        src_idx: torch.Tensor | None = None,
    ) -> None:
        region = pairs.src_region
        if region is None:
            raise ValueError("the pairs' sources are no host region")
        self.pairs = pairs
        self.starts = starts
        # The source rows ``starts`` came from and their version: the same tensor, unchanged,
        # spares :meth:`copies` finding their pages again.
        self._src_idx = src_idx
        self._src_version = None if src_idx is None else src_idx._version
        self._kernels, self._device, self._dst_idx = kernels, device, dst_idx
        self._dst_version = dst_idx._version
        self._spacing = region.spacing
        span_rows = len(pairs) * region.spacing
        base = pairs.src_words[region.base]
        self._host = base.as_strided((region.rows, base.shape[1]), (base.shape[1], 1))
        capacity_rows = owner.staging.capacity_bytes // pairs.row_bytes
        stride = span_stride(starts, span_rows, capacity_rows)
        per_lease = capacity_rows // stride
        self._slots, self._per_slot = ring_slots(per_lease, starts.size, stride * pairs.row_bytes)
        self._pieces = -(-starts.size // self._per_slot)
        self.degraded: str | None = None
        self._exits = contextlib.ExitStack()
        try:
            buffer = self._exits.enter_context(owner.staging.lease(device))
            self._staged = owner._views(pairs, region, buffer, per_lease * stride)
            open_by_address = kernels.open_address_ring
            self._ring: SlotRing | AddressRing
            if open_by_address is None:
                self._ring = self._exits.enter_context(slot_ring(owner._lanes, device, self._slots))
                self._bases: tuple[int, int, int] | None = None
            else:
                self._ring = self._exits.enter_context(open_by_address(device, self._slots))
                self._bases = (self._host.data_ptr(), self._staged.rows.data_ptr(), pairs.row_bytes)
            # The first piece's runs alone before its DMA; every piece's in one pass after it.
            layout = _SpanLayout(span_rows, stride, self._per_slot)
            self._set_pieces(_piece_columns(starts[: self._per_slot], layout, 1))
            self._fill(0)
            self._set_pieces(_piece_columns(starts, layout, self._slots))
            positions = _job_positions(starts.size, layout, self._slots, region.spacing)
            # Only the scatters read them: uploaded once the first DMA is queued.
            self._rows = _on_device(kernels, (positions, dst_idx), device)
            for piece in range(1, min(self._slots, self._pieces)):
                self._fill(piece)
        except BaseException:
            self._exits.close()
            raise

    def __enter__(self) -> RegionLoad:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._exits.close()

    def copies(self, src_idx: torch.Tensor, pairs: LayerPairs) -> bool:
        """Whether this page-in copies source rows ``src_idx`` over ``pairs``: the spans it
        reads are theirs."""
        if pairs is not self.pairs:
            return False
        if src_idx is self._src_idx and src_idx._version == self._src_version:
            return True
        starts = _page_starts(src_idx.numpy(), self._spacing)
        return starts is not None and np.array_equal(starts, self.starts)

    def finish(self, dst_idx: torch.Tensor) -> str | None:
        """Scatter every piece into rows ``dst_idx`` (the caller's plan checked them, and
        that the page-in :meth:`copies` its source rows), issuing the later pieces' DMAs as
        their slots free; then :meth:`close`. Returns why a slower way was taken, if one was."""
        positions, rows = self._rows
        # The rows uploaded at the start are a copy: rewritten in place since, they are stale.
        uploaded_still = self._dst_idx._version == self._dst_version
        if not uploaded_still or (
            dst_idx is not self._dst_idx and not torch.equal(dst_idx, self._dst_idx)
        ):
            positions, rows = _on_device(self._kernels, (positions, dst_idx), self._device)
        spacing, per_slot, slots = self._spacing, self._per_slot, self._slots
        scatter = _piece_scatter(self._kernels, self._staged.pairs, positions, rows, self._device)
        with self._exits:
            for piece in range(self._pieces):
                begin = piece * per_slot
                at = (begin * spacing, min(begin + per_slot, self.starts.size) * spacing)
                refilled = piece + slots < self._pieces
                with self._ring.draining(piece % slots, refilled=refilled):
                    scattered = scatter(*at)
                self.degraded = scattered or self.degraded
                if refilled:
                    self._fill(piece + slots)
        return self.degraded

    def _set_pieces(self, columns: _PieceColumns) -> None:
        if self._bases is None:
            self._piece_runs = _piece_runs(columns)
        else:
            self._piece_copies = _piece_copies(columns, *self._bases)

    def _fill(self, piece: int) -> None:
        """Queue piece ``piece``'s DMA into its slot, after the scatter that last read it."""
        slot, reused = piece % self._slots, piece >= self._slots
        if self._bases is not None:
            cast(AddressRing, self._ring).fill(slot, reused, self._piece_copies(piece))
            return
        with cast(SlotRing, self._ring).filling(slot, reused=reused):
            copied = self._kernels.copy_runs(self._host, self._staged.rows, self._piece_runs(piece))
        self.degraded = copied or self.degraded


def ring_slots(per_lease: int, spans: int, span_bytes: int) -> tuple[int, int]:
    """``(slots, spans a slot)`` of a lease holding ``per_lease`` spans of ``span_bytes``, for
    a page-in of ``spans`` spans: up to ``RING_SLOTS`` slots, each piece of spans from
    ``_MIN_PIECE_BYTES`` (unless a slot holds less, or the page-in is shorter) to
    ``_MAX_PIECE_BYTES`` (unless one span is longer)."""
    slots = max(1, min(RING_SLOTS, per_lease))
    most = min(per_lease // slots, max(1, _MAX_PIECE_BYTES // span_bytes))
    least = -(-_MIN_PIECE_BYTES // span_bytes)
    return slots, min(most, max(-(-spans // slots), least))


def _piece_scatter(
    kernels: KernelSet,
    pairs: LayerPairs,
    positions: torch.Tensor,
    rows: torch.Tensor,
    device: torch.device,
) -> Callable[[int, int], str | None]:
    """The scatter of entries ``begin`` to ``end`` of a page-in's staging ``positions`` into
    ``rows`` of every pair: the rows prepared once and read in place where the kernel set
    can (``gather_range``), else each piece's slices through :func:`gather_pairs`."""
    gather_range = kernels.gather_range
    if kernels.prepare_rows is None or gather_range is None:
        return lambda begin, end: gather_pairs(
            kernels, pairs, positions[begin:end], rows[begin:end], device
        )
    prepared = kernels.prepare_rows(positions, rows, device)
    return lambda begin, end: gather_range(pairs, prepared, begin, end)


def _on_device(
    kernels: KernelSet, rows: tuple[torch.Tensor, torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A page-in's scatter rows on ``device`` in one upload for every piece: a piece's own
    would queue on the copy engine behind the next piece's DMA and hold its scatter back."""
    if kernels.upload_rows is None:
        return rows
    positions, dst_idx = kernels.upload_rows(rows, device)
    return positions, dst_idx


def _page_starts(rows: np.ndarray, spacing: int) -> np.ndarray | None:
    """The first of each page of ``rows``, where they are whole pages of ``spacing`` rows
    each its own run (no page right after the one before it); else None."""
    if rows.ndim != 1 or rows.size == 0 or rows.size % spacing:
        return None
    pages = rows.reshape(-1, spacing)
    # A copy: a view would follow the caller's rows if they were rewritten in place.
    starts = pages[:, 0].copy()
    if spacing > 1 and not bool((np.diff(pages, axis=1) == 1).all()):
        return None
    if starts.size > 1 and bool((starts[1:] == pages[:-1, -1] + 1).any()):
        return None
    return starts


def span_stride(starts: np.ndarray, span_rows: int, capacity_rows: int) -> int:
    """Staging rows a span of ``span_rows`` takes in a page-in of the spans from region rows
    ``starts``: the spans' most common distance where it exceeds a span by at most
    ``span_rows // _MAX_GAP_PART`` rows (padding at each chunk row's end, as vLLM aligns its
    rows), so that spans that far apart go in one DMA, the gap with them, and still fit the
    staging buffer's ``capacity_rows``; else ``span_rows``."""
    gaps = np.diff(starts) - span_rows
    gaps = gaps[(gaps > 0) & (gaps <= span_rows // _MAX_GAP_PART)]
    if gaps.size == 0:
        return span_rows
    values, counts = np.unique(gaps, return_counts=True)
    stride = span_rows + int(values[np.argmax(counts)])
    return stride if stride <= capacity_rows else span_rows


@dataclass(frozen=True)
class _SpanLayout:
    """Spans of ``span_rows`` rows, each taking ``stride`` staging rows (its chunk row's
    padding after it), ``per_slot`` of them to a ring slot."""

    span_rows: int
    stride: int
    per_slot: int


@dataclass(frozen=True)
class _PieceColumns:
    """Every piece's DMA runs in rows: source start, staging start, length and offset in the
    piece (the rows of ``runs``), piece ``p``'s being columns ``bounds[p]`` on."""

    runs: np.ndarray
    bounds: list[int]


def _piece_columns(starts: np.ndarray, layout: _SpanLayout, slots: int) -> _PieceColumns:
    """The DMA runs of each piece of a page-in whose spans' first region rows are
    ``starts`` (in order), piece ``p`` being spans ``p * per_slot`` on, into staging spans
    ``stride`` rows apart in slot ``p % slots``: one run where a span lies ``stride`` rows
    after the previous one in the region within a piece (the rows between copied too).
    Found for every piece in one pass; each piece's are read out as it is issued
    (:func:`_piece_runs`, :func:`_piece_copies`)."""
    per_slot, stride = layout.per_slot, layout.stride
    span = np.arange(starts.size, dtype=np.int64)
    piece = span // per_slot
    opens = np.ones(starts.size, dtype=bool)
    opens[1:] = (np.diff(starts) != stride) | (piece[1:] != piece[:-1])
    firsts = np.flatnonzero(opens)
    lasts = np.append(firsts[1:], starts.size)
    in_piece = firsts - piece[firsts] * per_slot
    columns = np.empty((4, firsts.size), dtype=np.int64)
    columns[0] = starts[firsts]
    columns[1] = ((piece[firsts] % slots) * per_slot + in_piece) * stride
    columns[2] = (lasts - firsts - 1) * stride + layout.span_rows
    columns[3] = in_piece * stride
    bounds = np.searchsorted(piece[firsts], np.arange(piece[-1] + 2)).tolist()
    return _PieceColumns(columns, bounds)


def _piece_runs(columns: _PieceColumns) -> Callable[[int], PairedRuns]:
    """Each piece's runs of rows, as ``KernelSet.copy_runs`` takes them."""
    # One tensor of all four columns: each conversion to torch costs microseconds.
    src_starts, dst_starts, lengths, offsets = torch.from_numpy(columns.runs)
    bounds = columns.bounds

    def runs(index: int) -> PairedRuns:
        at = slice(bounds[index], bounds[index + 1])
        return PairedRuns(src_starts[at], dst_starts[at], lengths[at], offsets[at])

    return runs


def _piece_copies(
    columns: _PieceColumns, src_base: int, dst_base: int, row_bytes: int
) -> Callable[[int], list[tuple[int, int, int]]]:
    """Each piece's runs as ``(dst, src, nbytes)`` copies by address, from host rows at
    ``src_base`` into staging rows at ``dst_base``, rows of ``row_bytes``."""
    runs = columns.runs
    copies = list(
        zip(
            (dst_base + runs[1] * row_bytes).tolist(),
            (src_base + runs[0] * row_bytes).tolist(),
            (runs[2] * row_bytes).tolist(),
            strict=True,
        )
    )
    bounds = columns.bounds
    return lambda index: copies[bounds[index] : bounds[index + 1]]


def _job_positions(spans: int, layout: _SpanLayout, slots: int, spacing: int) -> torch.Tensor:
    """The staging row, from a pair's view, of each plan row of a page-in of ``spans`` spans
    in order, span ``i`` going to slot ``(i // per_slot) % slots``."""
    per_slot = layout.per_slot
    span = np.arange(spans, dtype=np.int64)
    in_lease = (span // per_slot) % slots * per_slot + span % per_slot
    rows = in_lease[:, None] * layout.stride + np.arange(spacing, dtype=np.int64)
    return torch.from_numpy(rows.reshape(-1))
