"""A page-in over the layer pairs of one host region, staged by whole chunks.

vLLM's CPU tier is one host region whose chunk row holds every KV tensor's pages side by
side, so one tensor's rows lie a chunk apart and each of its pages is a host run of its
own: a gather kernel that holds SMs for the whole copy, or one DMA descriptor a page. Where
the pairs' sources are such a region's views, evenly spaced
(:class:`~kvcore.planning.layers.SourceRegion`), and the plan's source rows come in runs of
that spacing (whole pages of every tensor), each run's rows of every pair lie in one span of
the region: the spans go by DMA into the staging buffer as they lie (a request's chunks are
one host run in kvcore's allocator, so one long copy where the chunk rows have no padding),
and one layered gather reads each pair's rows back out of device memory into its tensor.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvcore.kernels import KernelSet, gather_pairs
from kvcore.kernels.overlap_ring import StageInLanes, slot_ring
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
# mostly from the GPU's L2 cache, sparing the memory bandwidth the model's kernels need.
_MAX_PIECE_BYTES = 8 << 20
PIECE_EVIDENCE = "docs/bench/h100-beside-compute-vllm-2026-12-06-ring-pieces.json"
"""The runs ``_MAX_PIECE_BYTES`` and the rows' single upload are judged from (one machine)."""


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

    def stage_in(self, plan: TransferPlan, pairs: LayerPairs, kernels: KernelSet) -> str | None:
        """Copy ``plan``'s rows of every pair (:meth:`takes` holds); returns why a slower way
        was taken, if one was.

        The lease's buffer is a ring of slots: each piece of spans goes by DMA into a slot on
        a second stream, then is scattered from it on the current one, so that the next
        pieces' DMAs run while the model's kernels hold the SMs a scatter waits for."""
        region = pairs.src_region
        if region is None or not self.takes(plan, pairs):
            raise ValueError("the plan's source rows are not whole spans of one host region")
        span_rows = len(pairs) * region.spacing
        base = pairs.src_words[region.base]
        host = base.as_strided((region.rows, base.shape[1]), (base.shape[1], 1))
        starts = plan.host_runs.starts.numpy()
        per_lease = self.spans_fitting(pairs)
        slots, per_slot = ring_slots(per_lease, starts.size, span_rows * pairs.row_bytes)
        device = plan.device
        degraded = None
        spacing = region.spacing
        piece_runs = _piece_runs(starts, span_rows, slots, per_slot)
        rows_of: tuple[torch.Tensor, torch.Tensor] | None = None
        with self.staging.lease(device) as buffer:
            staged = self._views(pairs, region, buffer, per_lease)
            with slot_ring(self._lanes, device, slots) as ring:
                for piece, begin in enumerate(range(0, starts.size, per_slot)):
                    end = min(begin + per_slot, starts.size)
                    slot = piece % slots
                    with ring.filling(slot, reused=piece >= slots):
                        runs = piece_runs(piece)
                        degraded = kernels.copy_runs(host, staged.rows, runs) or degraded
                    if rows_of is None:
                        # Only the scatters read them: found once the first DMA is queued.
                        positions = _job_positions(starts.size, slots, per_slot, spacing, span_rows)
                        rows_of = _on_device(kernels, (positions, plan.dst_idx), device)
                    positions, dst_idx = rows_of
                    rows = slice(begin * spacing, end * spacing)
                    with ring.draining(slot, refilled=begin + slots * per_slot < starts.size):
                        scattered = gather_pairs(
                            kernels, staged.pairs, positions[rows], dst_idx[rows], device
                        )
                    degraded = scattered or degraded
        return degraded

    def _views(
        self, pairs: LayerPairs, region: SourceRegion, buffer: torch.Tensor, spans: int
    ) -> _Staged:
        """What one lease of ``buffer`` holding ``spans`` spans reads and writes (kept per
        pairs while the buffer is the same)."""
        like = pairs.src_words[0]
        rows = spans * len(pairs) * region.spacing
        flat = buffer[: rows * like.shape[1] * like.element_size()].view(like.dtype)
        staged_rows = flat.view(rows, like.shape[1])
        kept = self._from_staging.get(pairs)
        if kept is not None and kept.rows.data_ptr() == staged_rows.data_ptr():
            return kept
        # Every view as long as the one furthest in can be, so that all share one row count.
        length = rows - max(region.offsets)
        srcs = [staged_rows[o : o + length] for o in region.offsets]
        from_staging = layer_pairs(srcs, pairs.dst_words)
        if from_staging.reason is not None:
            raise ValueError(f"the staging buffer's pairs cannot move: {from_staging.reason}")
        staged = _Staged(staged_rows, from_staging)
        self._from_staging[pairs] = staged
        return staged


@dataclass(frozen=True)
class _Staged:
    """The staging buffer's rows in the sources' words, and the pairs reading each pair's
    rows of a staged span (from row ``offset``) into its destination."""

    rows: torch.Tensor
    pairs: LayerPairs


def ring_slots(per_lease: int, spans: int, span_bytes: int) -> tuple[int, int]:
    """``(slots, spans a slot)`` of a lease holding ``per_lease`` spans of ``span_bytes``, for
    a page-in of ``spans`` spans: up to ``RING_SLOTS`` slots, each piece of spans from
    ``_MIN_PIECE_BYTES`` (unless a slot holds less, or the page-in is shorter) to
    ``_MAX_PIECE_BYTES`` (unless one span is longer)."""
    slots = max(1, min(RING_SLOTS, per_lease))
    most = min(per_lease // slots, max(1, _MAX_PIECE_BYTES // span_bytes))
    least = -(-_MIN_PIECE_BYTES // span_bytes)
    return slots, min(most, max(-(-spans // slots), least))


def _on_device(
    kernels: KernelSet, rows: tuple[torch.Tensor, torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A page-in's scatter rows on ``device`` in one upload for every piece: a piece's own
    would queue on the copy engine behind the next piece's DMA and hold its scatter back."""
    if kernels.upload_rows is None:
        return rows
    positions, dst_idx = kernels.upload_rows(rows, device)
    return positions, dst_idx


def _piece_runs(
    starts: np.ndarray, span_rows: int, slots: int, per_slot: int
) -> Callable[[int], PairedRuns]:
    """The DMA runs of each piece of a page-in whose spans' first region rows are
    ``starts`` (in order), piece ``p`` being spans ``p * per_slot`` on, into consecutive
    staging spans of slot ``p % slots``: one run where a span follows the previous one in
    the region within a piece. Found for every piece in one pass; each piece's are read
    out as it is issued."""
    span = np.arange(starts.size, dtype=np.int64)
    piece = span // per_slot
    opens = np.ones(starts.size, dtype=bool)
    opens[1:] = (np.diff(starts) != span_rows) | (piece[1:] != piece[:-1])
    firsts = np.flatnonzero(opens)
    lasts = np.append(firsts[1:], starts.size)
    in_piece = firsts - piece[firsts] * per_slot
    src_starts = torch.from_numpy(starts[firsts].astype(np.int64))
    dst_starts = torch.from_numpy(((piece[firsts] % slots) * per_slot + in_piece) * span_rows)
    lengths = torch.from_numpy((lasts - firsts) * span_rows)
    offsets = torch.from_numpy(in_piece * span_rows)
    bounds = np.searchsorted(piece[firsts], np.arange(piece[-1] + 2)).tolist()

    def runs(index: int) -> PairedRuns:
        at = slice(bounds[index], bounds[index + 1])
        return PairedRuns(src_starts[at], dst_starts[at], lengths[at], offsets[at])

    return runs


def _job_positions(
    spans: int, slots: int, per_slot: int, spacing: int, span_rows: int
) -> torch.Tensor:
    """The staging row, from a pair's view, of each plan row of a page-in of ``spans`` spans
    in order, span ``i`` going to slot ``(i // per_slot) % slots``."""
    span = np.arange(spans, dtype=np.int64)
    in_lease = (span // per_slot) % slots * per_slot + span % per_slot
    rows = in_lease[:, None] * span_rows + np.arange(spacing, dtype=np.int64)
    return torch.from_numpy(rows.reshape(-1))
