"""The overlapped ring: one staged page-in of many pairs (a vLLM job) cut into units that
take slots of the staging buffer in turn, so that the DMAs run back to back while each
unit's scatter follows its own DMA."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from kvcore.kernels import reference
from kvcore.kernels.cudart import StreamCalls
from kvcore.kernels.index_upload import current_stream_handle
from kvcore.planning.layers import LayerPairs

# A prepared staged page-in of many pairs (a vLLM job: every layer's K and V) goes through
# a ring of slots of the staging buffer, one pair's chunk (a unit) a slot, so that the DMAs
# run on a second stream back to back while each unit's scatter follows its own DMA. With
# fewer units (SGLang's per-layer calls: K and V) at most one scatter would hide, behind
# a stream switch and event calls added to every layer's host time.
OVERLAP_MIN_UNITS = 4
# The most slots a page-in's ring uses: each round issues its DMAs before its scatters, so
# a longer round issues its scatters later after their DMAs.
OVERLAP_MAX_SLOTS = 1 << 16
# Units shorter than this cross PCIe faster than the host issues them: nothing to hide.
_OVERLAP_MIN_UNIT_BYTES = 1 << 20


class StageInLanes:
    """A device's second stream and events for overlapped staged page-ins: each slot of
    the staging buffer has a "filled" event (its DMA done) and a "freed" event (the
    scatter that read it done). Used only under the device's staging lease."""

    def __init__(self, device: torch.device) -> None:
        self.dma = torch.cuda.Stream(device=device)
        self.filled: list[torch.cuda.Event] = []
        self.freed: list[torch.cuda.Event] = []

    def events_for(self, slots: int) -> None:
        while len(self.filled) < slots:
            self.filled.append(torch.cuda.Event())
            self.freed.append(torch.cuda.Event())


class SlotRing:
    """Slots of a staging buffer taken in turn: what is issued under :meth:`filling` goes on
    the device's second stream, after the scatter that last read the slot; what is issued
    under :meth:`draining` goes on the current stream, after the slot's fill. Off a GPU
    both run in order, at once."""

    def __init__(self, lanes: StageInLanes | None, current: torch.cuda.Stream | None) -> None:
        self._lanes = lanes
        self._current = current

    @contextmanager
    def filling(self, slot: int, reused: bool) -> Iterator[None]:
        lanes = self._lanes
        if lanes is None:
            yield
            return
        with torch.cuda.stream(lanes.dma):
            if reused:
                lanes.dma.wait_event(lanes.freed[slot])
            yield
            lanes.filled[slot].record(lanes.dma)

    @contextmanager
    def draining(self, slot: int, refilled: bool) -> Iterator[None]:
        lanes, current = self._lanes, self._current
        if lanes is None or current is None:
            yield
            return
        current.wait_event(lanes.filled[slot])
        yield
        if refilled:
            lanes.freed[slot].record(current)


@contextmanager
def slot_ring(
    lanes_by_device: dict[torch.device, StageInLanes], device: torch.device, slots: int
) -> Iterator[SlotRing]:
    """A :class:`SlotRing` of ``slots`` slots on ``device``, joined to the current stream as
    :func:`_joined_lanes` says."""
    if device.type != "cuda":
        yield SlotRing(None, None)
        return
    with _joined_lanes(lanes_by_device, device, slots) as (lanes, current):
        yield SlotRing(lanes, current)


@contextmanager
def _joined_lanes(
    lanes_by_device: dict[torch.device, StageInLanes], device: torch.device, slots: int
) -> Iterator[tuple[StageInLanes, torch.cuda.Stream]]:
    """The device's lanes (kept in ``lanes_by_device``, made on first use) with events for
    ``slots`` slots, and the current stream: the second stream first waits for the current
    one (the engine's earlier work, an earlier lease's scatters), and the current one ends
    waiting for the second, after a failure too, so the call ends joined to it."""
    lanes = lanes_by_device.get(device)
    if lanes is None:
        lanes = lanes_by_device.setdefault(device, StageInLanes(device))
    lanes.events_for(slots)
    current = torch.cuda.current_stream(device)
    lanes.dma.wait_stream(current)
    try:
        yield lanes, current
    finally:
        # Whatever was issued, the lease's next holder waits for it: a DMA left running by
        # a failed call would otherwise write into its staging rows.
        current.wait_stream(lanes.dma)


class AddressLanes:
    """A device's second stream and events for rings whose pieces are copied by address,
    every copy, wait and record a call of the CUDA runtime (:class:`StreamCalls`)."""

    def __init__(self, device: torch.device, calls: StreamCalls) -> None:
        self.calls = calls
        self.dma = torch.cuda.Stream(device=device)
        self.dma_handle = int(self.dma.cuda_stream)
        self.joined = calls.event()
        self.filled: list[int] = []
        self.freed: list[int] = []

    def events_for(self, slots: int) -> None:
        while len(self.filled) < slots:
            self.filled.append(self.calls.event())
            self.freed.append(self.calls.event())


class AddressRing:
    """:class:`SlotRing`'s order, its pieces given as copies by address: :meth:`fill` issues
    a piece's copies on the second stream after the scatter that last read the slot, and
    what is issued under :meth:`draining` goes on the current stream after the slot's fill.

    A few µs of host time a piece where SlotRing's torch calls take tens (a stream switch,
    an Event object a record, a tensor slice and a dispatch a copy): a staged load of many
    pieces is issued whole in its ``transfer_async``, so each piece's host time holds the
    engine's thread, and where it exceeds the piece's time on the link the DMAs wait for the
    host."""

    def __init__(self, lanes: AddressLanes, current: int) -> None:
        self._lanes = lanes
        self._current = current

    def fill(self, slot: int, reused: bool, copies: Sequence[tuple[int, int, int]]) -> None:
        """Copy each ``(dst, src, nbytes)`` into slot ``slot``, after the scatter that last
        read it where the slot is ``reused``."""
        lanes = self._lanes
        calls, dma = lanes.calls, lanes.dma_handle
        if reused:
            calls.wait(dma, lanes.freed[slot])
        for dst, src, nbytes in copies:
            calls.copy(dst, src, nbytes, dma)
        calls.record(lanes.filled[slot], dma)

    @contextmanager
    def draining(self, slot: int, refilled: bool) -> Iterator[None]:
        lanes, current = self._lanes, self._current
        lanes.calls.wait(current, lanes.filled[slot])
        yield
        if refilled:
            lanes.calls.record(lanes.freed[slot], current)


@contextmanager
def address_ring(
    lanes_by_device: dict[torch.device, AddressLanes],
    device: torch.device,
    slots: int,
    calls: StreamCalls,
) -> Iterator[AddressRing]:
    """An :class:`AddressRing` of ``slots`` slots on ``device`` (its lanes kept in
    ``lanes_by_device``, made on first use), joined to the current stream as
    :func:`_joined_lanes` says."""
    lanes = lanes_by_device.get(device)
    if lanes is None:
        lanes = lanes_by_device.setdefault(device, AddressLanes(device, calls))
    lanes.events_for(slots)
    current = current_stream_handle(device, device.index)
    calls.record(lanes.joined, current)
    calls.wait(lanes.dma_handle, lanes.joined)
    try:
        yield AddressRing(lanes, current)
    finally:
        # As _joined_lanes: the lease's next holder waits for every DMA issued, a failed
        # call's too.
        calls.record(lanes.joined, lanes.dma_handle)
        calls.wait(current, lanes.joined)


def overlap_slots(
    staging_bytes: int,
    chunk_rows: Sequence[int],
    row_bytes: int,
    pairs: int,
    most: int = OVERLAP_MAX_SLOTS,
) -> tuple[int, int] | None:
    """``(rows, count)`` of the slots a staging buffer of ``staging_bytes`` holds for a
    page-in of ``pairs`` pairs of ``row_bytes`` rows in chunks of ``chunk_rows`` (a unit is
    one pair's chunk, a slot as many rows as the longest; never more slots than units or
    ``most``). None where the units should go in turn on one stream: fewer than
    ``OVERLAP_MIN_UNITS``, shorter than ``_OVERLAP_MIN_UNIT_BYTES`` on average, or fewer
    than two slots fit."""
    units = pairs * len(chunk_rows)
    if units < OVERLAP_MIN_UNITS:
        return None
    if sum(chunk_rows) * row_bytes < _OVERLAP_MIN_UNIT_BYTES * len(chunk_rows):
        return None
    slot_rows = max(chunk_rows)
    count = min(staging_bytes // (slot_rows * row_bytes), units, most)
    return (slot_rows, count) if count >= 2 else None


def stage_in_overlapped(
    lanes_by_device: dict[torch.device, StageInLanes],
    pairs: LayerPairs,
    prepared: reference.PreparedStageIn,
    staging: torch.Tensor,
    slot_rows: int,
    slots: int,
) -> None:
    """Every pair's chunks through a ring of ``slots`` slots, in rounds of one unit a
    slot: a round's DMAs on the device's second stream (each after the previous
    round's scatter from its slot), then its scatters on the current stream (each
    after its own DMA), the streams joined as :func:`_joined_lanes` says."""
    total = len(pairs.src_words) * len(prepared.chunks)
    # Made one by one as their DMAs are issued: the first DMA waits for one unit's
    # set-up, not for every unit's.
    units = _staged_units(pairs, prepared, staging, slot_rows, slots)
    with _joined_lanes(lanes_by_device, staging.device, slots) as (lanes, current):
        dma, filled, freed = lanes.dma, lanes.filled, lanes.freed
        for start in range(0, total, slots):
            batch: list[_Unit] = []
            with torch.cuda.stream(dma):
                # The range first: zip stops on it without drawing a unit too many.
                for slot, unit in zip(range(slots), units, strict=False):
                    if start:
                        dma.wait_event(freed[slot])
                    reference.listed_runs_to_staging(unit[0], unit[1], unit[2], into_staging=True)
                    filled[slot].record(dma)
                    batch.append(unit)
            refilled = start + slots < total
            for slot, (_, _, staged, dst_words, rows_on_device) in enumerate(batch):
                current.wait_event(filled[slot])
                dst_words.index_copy_(0, rows_on_device, staged)
                if refilled:
                    freed[slot].record(current)


_Unit = tuple[torch.Tensor, tuple[tuple[int, int], ...], torch.Tensor, torch.Tensor, torch.Tensor]


def _staged_units(
    pairs: LayerPairs,
    prepared: reference.PreparedStageIn,
    staging: torch.Tensor,
    slot_rows: int,
    slots: int,
) -> Iterator[_Unit]:
    """Each (pair, chunk) of a page-in in order: its host words, host runs, staging rows
    (in slot ``unit % slots`` of ``slot_rows`` rows), destination words and rows."""
    unit = 0
    chunks = prepared.chunks
    rows_of: dict[tuple[torch.dtype, int], torch.Tensor] = {}
    for src_words, dst_words in zip(pairs.src_words, pairs.dst_words, strict=True):
        words = src_words.shape[1]
        typed = rows_of.get((src_words.dtype, words))
        if typed is None:
            # The buffer as rows of this pair's words: a unit's staging rows are one slice.
            typed = reference.buffer_rows(staging, slot_rows * slots, src_words)
            rows_of[(src_words.dtype, words)] = typed
        for host_runs, rows_on_device, rows in chunks:
            begin = unit % slots * slot_rows
            yield src_words, host_runs, typed[begin : begin + rows], dst_words, rows_on_device
            unit += 1
