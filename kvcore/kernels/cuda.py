"""The CUDA kernel set: copy engines where the host side is in runs, a UVA kernel where not.

Index tensors arrive on the CPU (plans are made there) and are uploaded through an
:class:`~kvcore.kernels.index_upload.IndexUploader`, so nothing on these paths waits
for the GPU.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvcore.kernels import KernelSet, PreparedGather, reference
from kvcore.kernels.batch_copy import (
    BatchCopyError,
    copy_pointers_batched,
    copy_runs_batched,
    copy_runs_each,
)
from kvcore.kernels.cudart import StreamCalls, device_address, stream_calls
from kvcore.kernels.index_upload import IndexUploader, KeptUpload
from kvcore.kernels.triton_kernels import triton_available
from kvcore.kernels.triton_layers import LayeredLaunch, layer_table
from kvcore.kernels.triton_rows import row_gather
from kvcore.layers import LayerPairs
from kvcore.runs import PairedRuns, Runs, slice_runs
from kvcore.staging import lease_number

if TYPE_CHECKING:
    from kvcore.staged_chunks import StagedChunk

# Below this many runs one copy_ per run costs less host time than building a batch.
_FEW_RUNS = 4
# A staged copy is cut into pieces (PathPolicy.staged_pieces) so that the device-side
# scatter (or gather) of one piece runs while the next crosses PCIe; only the last piece's
# scatter is exposed. Pieces smaller than this gain less from overlap than they cost.
_MIN_PIECE_BYTES = 8 << 20
# A prepared staged page-in of many pairs (a vLLM job: every layer's K and V) goes through
# a ring of slots of the staging buffer, one pair's chunk (a unit) a slot, so that the DMAs
# run on a second stream back to back while each unit's scatter follows its own DMA. With
# fewer units (SGLang's per-layer calls: K and V) at most one scatter would hide, behind
# a stream switch and event calls added to every layer's host time.
_OVERLAP_MIN_UNITS = 4
# The most slots a page-in's ring uses: each round issues its DMAs before its scatters, so
# a longer round issues its scatters later after their DMAs.
_OVERLAP_MAX_SLOTS = 1 << 16
# Units shorter than this cross PCIe faster than the host issues them: nothing to hide.
_OVERLAP_MIN_UNIT_BYTES = 1 << 20
# The most slots the layer ring (_LayerRing) cycles through: enough for a reload's DMAs to
# run layers ahead of a scatter held back by the model's kernels, few enough events.
_RING_MAX_SLOTS = 16
# The ring serves one layer's call (SGLang's K and V, or MLA's one buffer); a call of more
# pairs is a whole job (vLLM's every layer), which the overlapped ring or the serial path
# take as before: the layer ring was measured only on SGLang's per-layer reloads.
_RING_MOST_PAIRS = 2


def _host_side(src_words: torch.Tensor, dst_words: torch.Tensor) -> torch.Tensor:
    return src_words if src_words.device.type == "cpu" else dst_words


def copy_runs(src_words: torch.Tensor, dst_words: torch.Tensor, runs: PairedRuns) -> str | None:
    """One cudaMemcpyBatchAsync for many runs; one copy_ each for a few, or when it refuses.

    Returns the reason when the batched submission was refused and the runs went one by one.
    """
    if runs.count <= _FEW_RUNS:
        reference.copy_runs(src_words, dst_words, runs)
        return None
    try:
        copy_runs_batched(src_words, dst_words, runs.src_starts, runs.dst_starts, runs.lengths)
    except BatchCopyError as refused:
        copy_runs_each(src_words, dst_words, runs.src_starts, runs.dst_starts, runs.lengths)
        return f"batch_copy_refused:{refused.reason}"
    return None


def copy_runs_layers(pairs: LayerPairs, runs: PairedRuns) -> str | None:
    """Every pair's runs in one batched submission (a few calls of at most 256 copies).

    The pairs were checked when ``pairs`` was made and the runs' bounds by the mover, so
    only the addresses are computed here. Returns the reason when the batch was refused
    and the runs went one copy per run.
    """
    if runs.count * len(pairs) <= _FEW_RUNS:
        for src_words, dst_words in zip(pairs.src_words, pairs.dst_words, strict=True):
            reference.copy_runs(src_words, dst_words, runs)
        return None
    row_bytes = pairs.row_bytes
    bases = _bases(pairs)
    src_offsets = (runs.src_starts.numpy() * row_bytes).astype(np.uint64)
    dst_offsets = (runs.dst_starts.numpy() * row_bytes).astype(np.uint64)
    sizes = np.tile((runs.lengths.numpy() * row_bytes).astype(np.uint64), len(pairs))
    try:
        copy_pointers_batched(
            (bases[1][:, None] + dst_offsets[None, :]).ravel(),
            (bases[0][:, None] + src_offsets[None, :]).ravel(),
            sizes,
            pairs.dsts[0].device if pairs.dsts[0].device.type == "cuda" else pairs.srcs[0].device,
            host_pinned=_host_pinned(pairs),
        )
    except BatchCopyError as refused:
        for src_words, dst_words in zip(pairs.src_words, pairs.dst_words, strict=True):
            copy_runs_each(src_words, dst_words, runs.src_starts, runs.dst_starts, runs.lengths)
        return f"batch_copy_refused:{refused.reason}"
    return None


# Facts about a LayerPairs that hold as long as it lives, computed on its first use.
_BASES: weakref.WeakKeyDictionary[LayerPairs, tuple[np.ndarray, np.ndarray]] = (
    weakref.WeakKeyDictionary()
)
_PINNED: weakref.WeakKeyDictionary[LayerPairs, bool] = weakref.WeakKeyDictionary()


def _bases(pairs: LayerPairs) -> tuple[np.ndarray, np.ndarray]:
    """The pairs' source and destination addresses."""
    bases = _BASES.get(pairs)
    if bases is None:
        src, dst = (
            np.array([t.data_ptr() for t in side], dtype=np.uint64)
            for side in (pairs.src_words, pairs.dst_words)
        )
        bases = _BASES[pairs] = (src, dst)
    return bases


def _gpu_addresses(pairs: LayerPairs) -> dict[int, int] | None:
    """Where the GPU reaches each buffer of the pairs, by its address in this process: the
    same for device memory, the driver's mapping for pinned host memory; None where the
    driver has no mapping for one of them."""
    addresses = {}
    for view in (*pairs.src_words, *pairs.dst_words):
        pointer = view.data_ptr()
        address = pointer if view.device.type != "cpu" else device_address(pointer)
        if address is None:
            return None
        addresses[pointer] = address
    return addresses


def _host_pinned(pairs: LayerPairs) -> bool:
    """Whether every host-side buffer of the pairs is pinned (checked once per storage)."""
    pinned = _PINNED.get(pairs)
    if pinned is None:
        host = {
            t.untyped_storage().data_ptr(): t
            for t in (*pairs.srcs, *pairs.dsts)
            if t.device.type == "cpu"
        }
        pinned = all(t.is_pinned() for t in host.values())
        _PINNED[pairs] = pinned
    return pinned


@dataclass(frozen=True, eq=False)
class _DeviceRows:
    """A transfer's two indices on its device, kept for every layer of one request."""

    src_idx: torch.Tensor
    dst_idx: torch.Tensor
    uploads: tuple[KeptUpload, ...]
    """The uploads the indices came from (none for indices that were on the device)."""

    def ready(self) -> None:
        for upload in self.uploads:
            upload.order_current_stream()


@dataclass(frozen=True, eq=False)
class _StageInRows:
    """A staged page-in's prepared chunks and the upload their destination rows came from
    (none where they were on the device)."""

    chunks: reference.PreparedStageIn
    uploads: tuple[KeptUpload, ...]


class _StageInLanes:
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


class _LayerRing:
    """A device's staged page-ins across calls: a request's layers copied by the copy engine
    into a ring of staging slots on a stream of their own, each slot scattered to its rows on
    a high-priority stream, the caller's stream waiting only for the scatters.

    The model's kernels hold the SMs while a reload runs beside them; a scatter queued on the
    caller's stream behind them would hold back every later layer's DMA. Here a layer's DMA
    waits only for its slot's last scatter, and the scatter, at the device's highest stream
    priority, takes SMs as soon as any free up. A request's first call (or any call after
    another user of the staging buffer, or a new buffer) orders the DMAs after the caller's
    earlier work; its later layers read host rows that call already ordered. The copies and
    events go through the CUDA runtime directly (:class:`~kvcore.kernels.cudart.StreamCalls`):
    SGLang queues the hit's forward only once every layer's call has returned, so the ring's
    host time per layer delays the model.
    """

    def __init__(self, device: torch.device, calls: StreamCalls) -> None:
        self.calls = calls
        self.dma = torch.cuda.Stream(device=device)
        self.scatter = torch.cuda.Stream(device=device, priority=_highest_priority())
        self.dma_handle, self.scatter_handle = self.dma.cuda_stream, self.scatter.cuda_stream
        self.start, self.done = calls.event(), calls.event()
        self.filled: list[int] = []
        self.freed: list[int] = []
        self.armed: list[bool] = []
        self.cursor = 0
        self.geometry: tuple[int, int, int] = (0, 0, 0)
        """(staging address, slot bytes, slots) the slots were cut for."""
        self.views: dict[tuple[torch.dtype, int, int, int], torch.Tensor] = {}
        """Each slot's rows as a word view, by (dtype, words, slot, rows): made once."""
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

    def slot_view(
        self, staging: torch.Tensor, like: torch.Tensor, slot: int, rows: int
    ) -> torch.Tensor:
        key = (like.dtype, like.shape[1], slot, rows)
        view = self.views.get(key)
        if view is None:
            slot_rows = self.geometry[1] // (like.shape[1] * like.element_size())
            whole = reference.buffer_rows(staging, slot_rows * (slot + 1), like)
            view = whole[slot * slot_rows : slot * slot_rows + rows]
            self.views[key] = view
        return view


def _highest_priority() -> int:
    # A static method at run time, typed as an instance method in torch's stubs.
    _least, greatest = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
    return int(greatest)


def overlap_slots(
    staging_bytes: int,
    chunk_rows: Sequence[int],
    row_bytes: int,
    pairs: int,
    most: int = _OVERLAP_MAX_SLOTS,
) -> tuple[int, int] | None:
    """``(rows, count)`` of the slots a staging buffer of ``staging_bytes`` holds for a
    page-in of ``pairs`` pairs of ``row_bytes`` rows in chunks of ``chunk_rows`` (a unit is
    one pair's chunk, a slot as many rows as the longest; never more slots than units or
    ``most``). None where the units should go in turn on one stream: fewer than
    ``_OVERLAP_MIN_UNITS``, shorter than ``_OVERLAP_MIN_UNIT_BYTES`` on average, or fewer
    than two slots fit."""
    units = pairs * len(chunk_rows)
    if units < _OVERLAP_MIN_UNITS:
        return None
    if sum(chunk_rows) * row_bytes < _OVERLAP_MIN_UNIT_BYTES * len(chunk_rows):
        return None
    slot_rows = max(chunk_rows)
    count = min(staging_bytes // (slot_rows * row_bytes), units, most)
    return (slot_rows, count) if count >= 2 else None


class _CudaIndexedOps:
    """The ops that take index tensors, uploading them through one ring per device."""

    def __init__(
        self,
        gather_ctas: int,
        staged_pieces: int,
        gather_ctas_to_host: int,
        short_rows: tuple[int, int] | None = None,
    ) -> None:
        self.gather_ctas = gather_ctas
        self.gather_ctas_to_host = gather_ctas_to_host
        # (CTAs, bytes): device rows under that many bytes take that many CTAs.
        self.short_rows = short_rows
        self.staged_pieces = staged_pieces
        self._uploaders: dict[torch.device, IndexUploader] = {}
        self._scatter_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._lanes: dict[torch.device, _StageInLanes] = {}
        self._rings: dict[torch.device, _LayerRing] = {}
        self.overlap_max_slots = _OVERLAP_MAX_SLOTS
        self._launches: weakref.WeakKeyDictionary[LayerPairs, _TableLaunch | str] = (
            weakref.WeakKeyDictionary()
        )

    def _on(self, index: torch.Tensor, device: torch.device) -> torch.Tensor:
        if index.device == device:
            return index
        return self._uploader(device).upload(index)

    def _both_on(
        self, first: torch.Tensor, second: torch.Tensor, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if first.device == device or second.device == device:
            return self._on(first, device), self._on(second, device)
        on_device = self._uploader(device).upload_all((first, second))
        return on_device[0], on_device[1]

    def ctas_for(self, dst_words: torch.Tensor) -> int:
        """The gather's CTAs for a copy into ``dst_words``: by the side it writes, and on
        the device by the length of its rows."""
        if dst_words.device.type == "cpu":
            return self.gather_ctas_to_host
        short = self.short_rows
        if short is not None and dst_words.shape[-1] * dst_words.element_size() < short[1]:
            return short[0]
        return self.gather_ctas

    def _uploader(self, device: torch.device) -> IndexUploader:
        uploader = self._uploaders.get(device)
        if uploader is None:
            uploader = self._uploaders.setdefault(device, IndexUploader(device))
        return uploader

    def gather_rows(
        self,
        src_words: torch.Tensor,
        src_idx: torch.Tensor,
        dst_words: torch.Tensor,
        dst_idx: torch.Tensor,
    ) -> str | None:
        return self.prepare_gather(src_words, dst_words)(src_idx, dst_idx)

    def prepare_gather(self, src_words: torch.Tensor, dst_words: torch.Tensor) -> PreparedGather:
        """The UVA gather between these views, checked once; the reference gather, with
        the reason, where the kernel cannot run."""
        host = _host_side(src_words, dst_words)
        reason = None
        if not triton_available():
            reason = "gather_kernel_unavailable:triton"
        elif host.device.type == "cpu" and not host.is_pinned():
            reason = "gather_kernel_unavailable:pageable_host"
        if reason is not None:
            return functools.partial(_reference_gather, src_words, dst_words, reason)
        launch = row_gather(src_words, dst_words)
        device = launch.device
        ctas = self.ctas_for(dst_words)

        def gather(src_idx: torch.Tensor, dst_idx: torch.Tensor) -> str | None:
            src_on_device, dst_on_device = self._both_on(src_idx, dst_idx, device)
            launch(src_on_device, dst_on_device, ctas=ctas)
            return None

        return gather

    def gather_layers(
        self, pairs: LayerPairs, src_idx: torch.Tensor, dst_idx: torch.Tensor
    ) -> str | None:
        """One launch for every pair; one gather per pair where the launch cannot serve them."""
        launch = self._launch(pairs)
        if isinstance(launch, str):
            return self._gather_each(pairs, src_idx, dst_idx, launch)
        src_on, dst_on = self._both_on(src_idx, dst_idx, launch.gather.device)
        launch.offsets.order_current_stream()
        launch.gather(src_on, dst_on)
        return None

    def prepare_rows(
        self, src_idx: torch.Tensor, dst_idx: torch.Tensor, device: torch.device
    ) -> _DeviceRows:
        """Both indices on ``device`` once, for every layer of a request."""
        on_device = [index.device == device for index in (src_idx, dst_idx)]
        if all(on_device):
            return _DeviceRows(src_idx, dst_idx, ())
        uploader = self._uploader(device)
        if not any(on_device):
            kept = uploader.keep((src_idx, dst_idx))
            return _DeviceRows(kept.on_device[0], kept.on_device[1], (kept,))
        kept = uploader.keep((dst_idx,) if on_device[0] else (src_idx,))
        if on_device[0]:
            return _DeviceRows(src_idx, kept.on_device[0], (kept,))
        return _DeviceRows(kept.on_device[0], dst_idx, (kept,))

    def gather_prepared(self, pairs: LayerPairs, rows: object) -> str | None:
        """:meth:`gather_layers` with rows from :meth:`prepare_rows`: one launch, no upload."""
        if not isinstance(rows, _DeviceRows):
            raise TypeError(f"rows must come from prepare_rows, got {type(rows).__name__}")
        launch = self._launch(pairs)
        if isinstance(launch, str):
            return self._gather_each(pairs, rows.src_idx, rows.dst_idx, launch)
        rows.ready()
        launch.offsets.order_current_stream()
        launch.gather(rows.src_idx, rows.dst_idx)
        return None

    def _gather_each(
        self, pairs: LayerPairs, src_idx: torch.Tensor, dst_idx: torch.Tensor, reason: str
    ) -> str:
        degraded = None
        for src_words, dst_words in zip(pairs.src_words, pairs.dst_words, strict=True):
            degraded = self.gather_rows(src_words, src_idx, dst_words, dst_idx) or degraded
        return degraded or reason

    def _launch(self, pairs: LayerPairs) -> _TableLaunch | str:
        """The pairs' layered launch, or why one launch cannot serve them (kept per pairs)."""
        launch = self._launches.get(pairs)
        if launch is not None:
            return launch
        launch = self._new_launch(pairs)
        self._launches[pairs] = launch
        return launch

    def _new_launch(self, pairs: LayerPairs) -> _TableLaunch | str:
        if not triton_available():
            return "gather_kernel_unavailable:triton"
        if not _host_pinned(pairs):
            return "gather_kernel_unavailable:pageable_host"
        addresses = _gpu_addresses(pairs)
        if addresses is None:
            return "gather_layers_unavailable:host_pointer"
        try:
            table = layer_table(pairs.src_words, pairs.dst_words, lambda t: addresses[t.data_ptr()])
        except ValueError:
            # Pairs of different row pitches: one launch per pair serves them.
            return "gather_layers_unavailable:layout"
        # The offsets stay on the device for the table's life; their upload is ordered
        # before each stream's first launch.
        offsets = self._uploader(table.device).keep((table.offsets,))
        ctas = self.ctas_for(pairs.dst_words[0])
        return _TableLaunch(LayeredLaunch(table, offsets.on_device[0], ctas), offsets)

    def _scatter_stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._scatter_streams.get(device)
        if stream is None:
            stream = self._scatter_streams.setdefault(device, torch.cuda.Stream(device=device))
        return stream

    def stage_in(
        self,
        src_words: torch.Tensor,
        host_runs: Runs,
        staging: torch.Tensor,
        dst_words: torch.Tensor,
        dst_idx: torch.Tensor,
    ) -> None:
        """DMA piece by piece into staging; each piece's scatter overlaps the next DMA."""
        device = dst_words.device
        pieces = staging_pieces(staging.shape[0], staging, self.staged_pieces)
        if len(pieces) == 1:
            # All on the current stream: no second stream to order, so no events.
            device_idx = self._on(dst_idx, device)
            reference.runs_to_staging(src_words, host_runs, staging, into_staging=True)
            dst_words.index_copy_(0, device_idx, staging)
            return
        copies = torch.cuda.current_stream(device)
        scatter = self._scatter_stream(device)
        # The destination may still be in use by work queued before this transfer.
        scatter.wait_stream(copies)
        with torch.cuda.stream(scatter):
            device_idx = self._on(dst_idx, device)
        for begin, end in pieces:
            piece = staging[begin:end]
            reference.runs_to_staging(
                src_words, slice_runs(host_runs, begin, end), piece, into_staging=True
            )
            scatter.wait_stream(copies)
            with torch.cuda.stream(scatter):
                dst_words.index_copy_(0, device_idx[begin:end], piece)
        copies.wait_stream(scatter)

    def prepare_stage_in(
        self, chunks: Sequence[StagedChunk], dst_idx: torch.Tensor, device: torch.device
    ) -> _StageInRows:
        """A staged page-in's chunks, their destination rows on ``device`` once (uploaded
        where they are not there), for every layer of a request."""
        if dst_idx.device == device:
            return _StageInRows(reference.prepare_stage_in(chunks, dst_idx, device), ())
        kept = self._uploader(device).keep((dst_idx,))
        prepared = reference.prepare_stage_in(chunks, kept.on_device[0], device)
        return _StageInRows(prepared, (kept,))

    def stage_in_prepared(self, pairs: LayerPairs, prepared: object, staging: torch.Tensor) -> None:
        """:meth:`stage_in` of every pair with chunks from :meth:`prepare_stage_in`: one
        piece each; through a ring of slots (:func:`overlap_slots`) where the units are
        many and long, else all on the current stream."""
        if not isinstance(prepared, _StageInRows):
            raise TypeError(
                f"prepared must come from prepare_stage_in, got {type(prepared).__name__}"
            )
        for upload in prepared.uploads:
            upload.order_current_stream()
        chunks = prepared.chunks
        pair_count = len(pairs.src_words)
        slots = None
        # An SGLang layer (one or two pairs) leaves here, for no more host time than this.
        if pair_count * len(chunks.chunks) >= _OVERLAP_MIN_UNITS:
            src_words = pairs.src_words[0]
            slots = overlap_slots(
                staging.numel(),
                [rows for _, _, rows in chunks.chunks],
                src_words.shape[1] * src_words.element_size(),
                pair_count,
                self.overlap_max_slots,
            )
        if slots is None:
            if pair_count > _RING_MOST_PAIRS or not self._stage_in_ring(pairs, prepared, staging):
                reference.stage_in_prepared(pairs, chunks, staging)
        else:
            self._stage_in_overlapped(pairs, chunks, staging, *slots)

    def _stage_in_ring(
        self, pairs: LayerPairs, prepared: _StageInRows, staging: torch.Tensor
    ) -> bool:
        """One call of a request through the device's :class:`_LayerRing`; False (nothing
        issued) where fewer than two slots of the call's largest unit fit the buffer, the
        pairs' rows differ in size, or no CUDA runtime is reachable."""
        calls = stream_calls()
        chunks = prepared.chunks
        src_words = pairs.src_words[0]
        row_bytes = src_words.shape[1] * src_words.element_size()
        if calls is None or any(
            s.shape[1] * s.element_size() != row_bytes for s in pairs.src_words
        ):
            return False
        slot_rows = max(rows for _, _, rows in chunks.chunks)
        slot_bytes = slot_rows * row_bytes
        slots = min(staging.numel() // slot_bytes, _RING_MAX_SLOTS)
        if slots < 2:
            return False
        device = staging.device
        ring = self._rings.get(device)
        if ring is None:
            ring = self._rings.setdefault(device, _LayerRing(device, calls))
        current = torch.cuda.current_stream(device).cuda_stream
        lease = lease_number(staging)
        later_layer = (
            ring.request is not None and ring.request() is prepared and ring.lease == lease - 1
        )
        fresh = ring.shape(staging, slot_bytes, slots)
        ring.request, ring.lease = weakref.ref(prepared), lease
        dma, scatter = ring.dma_handle, ring.scatter_handle
        calls.record(ring.start, current)
        if fresh or not later_layer:
            calls.wait(dma, ring.start)
            for _, rows_on_device, _ in chunks.chunks:
                rows_on_device.record_stream(ring.scatter)
        calls.wait(scatter, ring.start)
        base = staging.data_ptr()
        completed = False
        try:
            with torch.cuda.stream(ring.scatter):
                for src, dst_words in zip(pairs.src_words, pairs.dst_words, strict=True):
                    host = src.data_ptr()
                    for host_runs, rows_on_device, rows in chunks.chunks:
                        slot = ring.cursor
                        ring.cursor = (slot + 1) % slots
                        if ring.armed[slot]:
                            calls.wait(dma, ring.freed[slot])
                        into = base + slot * slot_bytes
                        for start, length in host_runs:
                            calls.copy(into, host + start * row_bytes, length * row_bytes, dma)
                            into += length * row_bytes
                        calls.record(ring.filled[slot], dma)
                        calls.wait(scatter, ring.filled[slot])
                        staged = ring.slot_view(staging, src, slot, rows)
                        dst_words.index_copy_(0, rows_on_device, staged)
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

    def _stage_in_overlapped(
        self,
        pairs: LayerPairs,
        prepared: reference.PreparedStageIn,
        staging: torch.Tensor,
        slot_rows: int,
        slots: int,
    ) -> None:
        """Every pair's chunks through a ring of ``slots`` slots, in rounds of one unit a
        slot: a round's DMAs on the device's second stream (each after the previous
        round's scatter from its slot), then its scatters on the current stream (each
        after its own DMA). The second stream first waits for the current one (the
        engine's earlier work, an earlier lease's scatters), and the current one ends
        waiting for the second (after a failure too): the call ends joined to it."""
        device = staging.device
        lanes = self._lanes.get(device)
        if lanes is None:
            lanes = self._lanes.setdefault(device, _StageInLanes(device))
        lanes.events_for(slots)
        filled, freed = lanes.filled, lanes.freed
        total = len(pairs.src_words) * len(prepared.chunks)
        # Made one by one as their DMAs are issued: the first DMA waits for one unit's
        # set-up, not for every unit's.
        units = _staged_units(pairs, prepared, staging, slot_rows, slots)
        current = torch.cuda.current_stream(device)
        dma = lanes.dma
        dma.wait_stream(current)
        try:
            for start in range(0, total, slots):
                batch: list[_Unit] = []
                with torch.cuda.stream(dma):
                    # The range first: zip stops on it without drawing a unit too many.
                    for slot, unit in zip(range(slots), units, strict=False):
                        if start:
                            dma.wait_event(freed[slot])
                        reference.listed_runs_to_staging(
                            unit[0], unit[1], unit[2], into_staging=True
                        )
                        filled[slot].record(dma)
                        batch.append(unit)
                refilled = start + slots < total
                for slot, (_, _, staged, dst_words, rows_on_device) in enumerate(batch):
                    current.wait_event(filled[slot])
                    dst_words.index_copy_(0, rows_on_device, staged)
                    if refilled:
                        freed[slot].record(current)
        finally:
            # Whatever was issued, the lease's next holder waits for it: a DMA left
            # running by a failed call would otherwise write into its staging rows.
            current.wait_stream(dma)

    def stage_out(
        self,
        src_words: torch.Tensor,
        src_idx: torch.Tensor,
        staging: torch.Tensor,
        dst_words: torch.Tensor,
        host_runs: Runs,
    ) -> None:
        """Gather piece by piece into staging; each piece's DMA overlaps the next gather."""
        device = src_words.device
        pieces = staging_pieces(staging.shape[0], staging, self.staged_pieces)
        if len(pieces) == 1:
            device_idx = self._on(src_idx, device)
            torch.index_select(src_words, 0, device_idx, out=staging)
            reference.runs_to_staging(dst_words, host_runs, staging, into_staging=False)
            return
        copies = torch.cuda.current_stream(device)
        gather = self._scatter_stream(device)
        gather.wait_stream(copies)
        with torch.cuda.stream(gather):
            device_idx = self._on(src_idx, device)
        for begin, end in pieces:
            piece = staging[begin:end]
            with torch.cuda.stream(gather):
                torch.index_select(src_words, 0, device_idx[begin:end], out=piece)
            copies.wait_stream(gather)
            reference.runs_to_staging(
                dst_words, slice_runs(host_runs, begin, end), piece, into_staging=False
            )


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


@dataclass(frozen=True, eq=False)
class _TableLaunch:
    gather: LayeredLaunch
    offsets: KeptUpload


def _reference_gather(
    src_words: torch.Tensor,
    dst_words: torch.Tensor,
    reason: str,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
) -> str:
    reference.gather_rows(src_words, src_idx, dst_words, dst_idx)
    return reason


def staging_pieces(rows: int, staging: torch.Tensor, most: int) -> list[tuple[int, int]]:
    """Row ranges of a staged copy: up to ``most``, none under ``_MIN_PIECE_BYTES``."""
    row_size = staging.shape[1] * staging.element_size() if staging.dim() == 2 else 1
    pieces = max(1, min(most, rows * row_size // _MIN_PIECE_BYTES))
    step = -(-rows // pieces)
    return [(begin, min(begin + step, rows)) for begin in range(0, rows, step)]


def cuda_kernels(
    gather_ctas: int,
    staged_pieces: int,
    gather_ctas_to_host: int,
    *,
    short_rows: tuple[int, int] | None = None,
) -> KernelSet:
    """``short_rows``: (CTAs, bytes), the gather's CTAs for device rows under that many
    bytes (None: ``gather_ctas`` for every device row)."""
    ops = _CudaIndexedOps(gather_ctas, staged_pieces, gather_ctas_to_host, short_rows)
    short = "" if short_rows is None else f", short_rows={short_rows[0]}@<{short_rows[1]}B"
    return KernelSet(
        name=(
            f"cuda(gather_ctas={gather_ctas}, gather_ctas_to_host={gather_ctas_to_host}"
            f"{short}, staged_pieces={staged_pieces})"
        ),
        copy_runs=copy_runs,
        gather_rows=ops.gather_rows,
        stage_in=ops.stage_in,
        stage_out=ops.stage_out,
        copy_runs_layers=copy_runs_layers,
        gather_layers=ops.gather_layers,
        prepare_gather=ops.prepare_gather,
        prepare_rows=ops.prepare_rows,
        gather_prepared=ops.gather_prepared,
        # In pieces, a layer's scatters go on a second stream: stage_in orders them itself.
        prepare_stage_in=ops.prepare_stage_in if staged_pieces == 1 else None,
        stage_in_prepared=ops.stage_in_prepared if staged_pieces == 1 else None,
    )
