"""The layer ring: a request's staged page-ins across its per-layer calls (SGLang's
reloads), whose DMAs run layers ahead of scatters held back by the model's kernels."""

from __future__ import annotations

import weakref

import torch

from kvcore.kernels import reference
from kvcore.kernels.cudart import StreamCalls, stream_calls
from kvcore.kernels.index_upload import current_stream_handle
from kvcore.kernels.triton_scatter import SlotScatter
from kvcore.planning.layers import LayerPairs
from kvcore.staging import lease_number
from kvcore.streams import highest_priority

# The most slots the layer ring (LayerRing) cycles through: enough for a reload's DMAs to
# run layers ahead of a scatter held back by the model's kernels, few enough events.
_RING_MAX_SLOTS = 16


class LayerRing:
    """A device's staged page-ins across calls: a request's layers copied by the copy engine
    into a ring of staging slots on a stream of their own, each slot scattered to its rows on
    a high-priority stream, the caller's stream waiting only for the scatters.

    The model's kernels hold the SMs while a reload runs beside them; a scatter queued on the
    caller's stream behind them would hold back every later layer's DMA. Here a layer's DMA
    waits only for its slot's last scatter, and the scatter, at the device's highest stream
    priority, takes SMs as soon as any free up. A request's first call (or any call after
    another user of the staging buffer, or a new buffer) orders the DMAs after the caller's
    earlier work; its later layers read host rows that call already ordered. The copies and
    events go through the CUDA runtime directly (:class:`~kvcore.kernels.cudart.StreamCalls`)
    and the scatter is one launch of a compiled kernel
    (:class:`~kvcore.kernels.triton_scatter.SlotScatter`): SGLang queues the hit's forward
    only once every layer's call has returned, so the ring's host time per layer delays the
    model.
    """

    def __init__(self, device: torch.device, calls: StreamCalls) -> None:
        self.calls = calls
        self.dma = torch.cuda.Stream(device=device)
        self.scatter = torch.cuda.Stream(device=device, priority=highest_priority())
        self.dma_handle, self.scatter_handle = self.dma.cuda_stream, self.scatter.cuda_stream
        self.start, self.done = calls.event(), calls.event()
        self.filled: list[int] = []
        self.freed: list[int] = []
        self.armed: list[bool] = []
        self.cursor = 0
        self.geometry: tuple[int, int, int] = (0, 0, 0)
        """(staging address, slot bytes, slots) the slots were cut for."""
        self.views: dict[tuple[torch.dtype, int, int, int, int], list[torch.Tensor]] = {}
        """Each slot's rows of its pairs as word views, by (dtype, words, slot, rows, pairs):
        made once."""
        self.request: weakref.ref[object] | None = None
        self.lease = -1

    def shape(self, staging: torch.Tensor, slot_bytes: int, slots: int) -> bool:
        """Cut the slots for this call; whether they were cut anew (the DMAs must then wait
        for the caller's stream, which waited for every earlier scatter)."""
        geometry = (staging.data_ptr(), slot_bytes, slots)
        if geometry == self.geometry:
            return False
        self.geometry = geometry
        while len(self.filled) < slots:
            self.filled.append(self.calls.event())
            self.freed.append(self.calls.event())
        self.armed = [False] * slots
        self.cursor = 0
        self.views.clear()
        return True

    def slot_views(
        self, staging: torch.Tensor, like: torch.Tensor, slot: int, rows: int, pairs: int
    ) -> list[torch.Tensor]:
        """The first ``rows`` rows of each pair's part of ``slot``, as views like ``like``."""
        key = (like.dtype, like.shape[1], slot, rows, pairs)
        views = self.views.get(key)
        if views is None:
            pair_rows = self.geometry[1] // (pairs * like.shape[1] * like.element_size())
            first = slot * pairs * pair_rows
            whole = reference.buffer_rows(staging, first + pairs * pair_rows, like)
            views = [
                whole[first + pair * pair_rows : first + pair * pair_rows + rows]
                for pair in range(pairs)
            ]
            self.views[key] = views
        return views


def ring_geometry(staging_bytes: int, pair_bytes: int, pairs: int) -> tuple[int, int, int] | None:
    """(pairs a slot holds, slot bytes, slots) for units of ``pair_bytes`` a pair: a slot
    holds a unit of every pair where two such slots fit the buffer, else of one pair; at
    most :data:`_RING_MAX_SLOTS` slots. None where not even two one-pair slots fit."""
    together = pairs if staging_bytes // (pair_bytes * pairs) >= 2 else 1
    slot_bytes = pair_bytes * together
    slots = min(staging_bytes // slot_bytes, _RING_MAX_SLOTS)
    return (together, slot_bytes, slots) if slots >= 2 else None


def stage_in_ring(
    rings: dict[torch.device, LayerRing],
    pairs: LayerPairs,
    chunks: reference.PreparedStageIn,
    request: object,
    staging: torch.Tensor,
    scatter_rows: SlotScatter,
) -> bool:
    """One call of a request through the device's :class:`LayerRing` in ``rings``; False
    (nothing issued) where fewer than two slots of the call's largest unit fit the buffer,
    the pairs' rows differ in size, or no CUDA runtime is reachable. ``request`` is the
    prepared page-in every call of the request passes: a later layer's call of the same
    request reads host rows its first call already ordered after the caller's stream.

    Where two slots of them fit, a slot holds a chunk of every pair (K and V), so a chunk
    costs one wait for the slot, the pairs' DMAs, one event and one scatter launch
    (``scatter_rows``; an ``index_copy_`` a pair where it refuses the rows)."""
    calls = stream_calls()
    src_words = pairs.src_words[0]
    row_bytes = src_words.shape[1] * src_words.element_size()
    if calls is None or any(s.shape[1] * s.element_size() != row_bytes for s in pairs.src_words):
        return False
    pair_bytes = max(rows for _, _, rows in chunks.chunks) * row_bytes
    geometry = ring_geometry(staging.numel(), pair_bytes, len(pairs.src_words))
    if geometry is None:
        return False
    together, slot_bytes, slots = geometry
    device = staging.device
    ring = rings.get(device)
    if ring is None:
        ring = rings.setdefault(device, LayerRing(device, calls))
    current = current_stream_handle(device, device.index)
    lease = lease_number(staging)
    later_layer = ring.request is not None and ring.request() is request and ring.lease == lease - 1
    fresh = ring.shape(staging, slot_bytes, slots)
    ring.request, ring.lease = weakref.ref(request), lease
    dma, scatter = ring.dma_handle, ring.scatter_handle
    calls.record(ring.start, current)
    if fresh or not later_layer:
        calls.wait(dma, ring.start)
        for _, rows_on_device, _ in chunks.chunks:
            rows_on_device.record_stream(ring.scatter)
    calls.wait(scatter, ring.start)
    base = staging.data_ptr()
    hosts = [src.data_ptr() for src in pairs.src_words]
    groups = [
        (hosts[first : first + together], pairs.dst_words[first : first + together])
        for first in range(0, len(hosts), together)
    ]
    completed = False
    try:
        for host_runs, rows_on_device, rows in chunks.chunks:
            for group_hosts, group_dsts in groups:
                slot = ring.cursor
                ring.cursor = (slot + 1) % slots
                if ring.armed[slot]:
                    calls.wait(dma, ring.freed[slot])
                into = base + slot * slot_bytes
                for host in group_hosts:
                    at = into
                    for start, length in host_runs:
                        calls.copy(at, host + start * row_bytes, length * row_bytes, dma)
                        at += length * row_bytes
                    into += pair_bytes
                calls.record(ring.filled[slot], dma)
                calls.wait(scatter, ring.filled[slot])
                staged = ring.slot_views(staging, src_words, slot, rows, together)
                _scatter(ring, scatter_rows, staged, group_dsts, rows_on_device)
                calls.record(ring.freed[slot], scatter)
                ring.armed[slot] = True
        completed = True
    finally:
        # The caller's stream goes on after every scatter issued: the engine's per-layer
        # event after this call covers them, and the buffer's next lease (kept after the
        # caller's stream) covers the DMAs they waited for. A failed call may have left a
        # DMA with no scatter after it: the caller waits for that too, and the next call
        # orders its DMAs afresh.
        calls.record(ring.done, scatter)
        calls.wait(current, ring.done)
        if not completed:
            calls.record(ring.done, dma)
            calls.wait(current, ring.done)
            ring.request = None
    return True


def _scatter(
    ring: LayerRing,
    scatter_rows: SlotScatter,
    staged: list[torch.Tensor],
    dsts: tuple[torch.Tensor, ...],
    rows_on_device: torch.Tensor,
) -> None:
    if not scatter_rows(ring.scatter, ring.scatter_handle, staged, dsts, rows_on_device):
        with torch.cuda.stream(ring.scatter):
            for rows_staged, dst_words in zip(staged, dsts, strict=True):
                dst_words.index_copy_(0, rows_on_device, rows_staged)
