"""The CUDA kernel set: copy engines where the host side is in runs, a UVA kernel where not.

Index tensors arrive on the CPU (plans are made there) and are uploaded through an
:class:`~kvcore.kernels.index_upload.IndexUploader`, so nothing on these paths waits
for the GPU. The copies in runs live in :mod:`~kvcore.kernels.run_copies`; a prepared
staged page-in goes through :mod:`~kvcore.kernels.layer_ring` (a call a layer) or
:mod:`~kvcore.kernels.overlap_ring` (a call a job), each with its own streams and events.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvcore.kernels import KernelSet, PreparedGather, reference
from kvcore.kernels.cudart import StreamCalls, device_address, stream_calls
from kvcore.kernels.index_upload import IndexUploader, KeptUpload
from kvcore.kernels.layer_ring import LayerRing, stage_in_ring
from kvcore.kernels.overlap_ring import (
    OVERLAP_MAX_SLOTS,
    OVERLAP_MIN_UNITS,
    AddressLanes,
    AddressRing,
    StageInLanes,
    address_ring,
    overlap_slots,
    stage_in_overlapped,
)
from kvcore.kernels.run_copies import copy_runs, copy_runs_layers, host_pinned
from kvcore.kernels.triton_kernels import triton_available
from kvcore.kernels.triton_layers import LayeredLaunch, layer_table
from kvcore.kernels.triton_rows import row_gather
from kvcore.kernels.triton_scatter import SlotScatter
from kvcore.planning.layers import LayerPairs
from kvcore.planning.path_policy import PathPolicy
from kvcore.run_pieces import slice_runs
from kvcore.runs import Runs

if TYPE_CHECKING:
    from kvcore.planning.staged_chunks import StagedChunk

# A staged copy is cut into pieces (PathPolicy.staged_pieces) so that the device-side
# scatter (or gather) of one piece runs while the next crosses PCIe; only the last piece's
# scatter is exposed. Pieces smaller than this gain less from overlap than they cost.
_MIN_PIECE_BYTES = 8 << 20
# The layer ring serves one layer's call (SGLang's K and V, or MLA's one buffer); a call of
# more pairs is a whole job (vLLM's every layer), which the overlapped ring or the serial
# path take as before: the layer ring was measured only on SGLang's per-layer reloads.
_RING_MOST_PAIRS = 2
# The layer ring's scatter runs on a high-priority stream beside the model's kernels: a
# bounded grid leaves most SMs to them and still moves a layer's rows in a small part of
# the time its DMAs take.
RING_SCATTER_CTAS = PathPolicy.ring_scatter_ctas


def _host_side(src_words: torch.Tensor, dst_words: torch.Tensor) -> torch.Tensor:
    return src_words if src_words.device.type == "cpu" else dst_words


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


@dataclass(eq=False, slots=True)
class _DeviceRows:
    """A transfer's two indices on its device, kept for every layer of one request (made
    afresh for each gather over a plan's pairs: slots, not frozen, as it is host time)."""

    src_idx: torch.Tensor
    dst_idx: torch.Tensor
    uploads: tuple[KeptUpload, ...]
    """The uploads the indices came from (none for indices that were on the device)."""

    def ready(self) -> int | None:
        """Order the current stream after the uploads; its raw handle where one was read."""
        handle = None
        for upload in self.uploads:
            handle = upload.order_current_stream(handle)
        return handle


def _prepared(rows: object) -> _DeviceRows:
    if not isinstance(rows, _DeviceRows):
        raise TypeError(f"rows must come from prepare_rows, got {type(rows).__name__}")
    return rows


@dataclass(frozen=True, eq=False)
class _StageInRows:
    """A staged page-in's prepared chunks and the upload their destination rows came from
    (none where they were on the device)."""

    chunks: reference.PreparedStageIn
    uploads: tuple[KeptUpload, ...]


class _CudaIndexedOps:
    """The ops that take index tensors, uploading them through one ring per device."""

    def __init__(
        self,
        gather_ctas: int,
        staged_pieces: int,
        gather_ctas_to_host: int,
        short_rows: tuple[int, int] | None = None,
        ring_scatter_ctas: int = RING_SCATTER_CTAS,
    ) -> None:
        self.gather_ctas = gather_ctas
        self.gather_ctas_to_host = gather_ctas_to_host
        # (CTAs, bytes): device rows under that many bytes take that many CTAs.
        self.short_rows = short_rows
        self.staged_pieces = staged_pieces
        self._uploaders: dict[torch.device, IndexUploader] = {}
        self._scatter_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._lanes: dict[torch.device, StageInLanes] = {}
        self._address_lanes: dict[torch.device, AddressLanes] = {}
        self._rings: dict[torch.device, LayerRing] = {}
        self._slot_scatter = SlotScatter(ring_scatter_ctas)
        self.overlap_max_slots = OVERLAP_MAX_SLOTS
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

    def prepare_rows(
        self, src_idx: torch.Tensor, dst_idx: torch.Tensor, device: torch.device
    ) -> _DeviceRows:
        """Both indices on ``device`` once, for every layer of a request."""
        src_on, dst_on = src_idx.device == device, dst_idx.device == device
        if src_on and dst_on:
            return _DeviceRows(src_idx, dst_idx, ())
        uploader = self._uploader(device)
        if not (src_on or dst_on):
            kept = uploader.keep((src_idx, dst_idx))
            return _DeviceRows(kept.on_device[0], kept.on_device[1], (kept,))
        kept = uploader.keep((dst_idx,) if src_on else (src_idx,))
        if src_on:
            return _DeviceRows(src_idx, kept.on_device[0], (kept,))
        return _DeviceRows(kept.on_device[0], dst_idx, (kept,))

    def upload_rows(
        self, indices: tuple[torch.Tensor, ...], device: torch.device
    ) -> tuple[torch.Tensor, ...]:
        """``indices`` on ``device``, those on the host in one upload, ready on the current
        stream (one already there is handed back as it is: copying it out would sync)."""
        host = tuple(index for index in indices if index.device != device)
        if not host:
            return indices
        uploaded = iter(self._uploader(device).upload_all(host))
        return tuple(index if index.device == device else next(uploaded) for index in indices)

    def gather_prepared(self, pairs: LayerPairs, rows: object) -> str | None:
        """The gather for every pair, with rows from :meth:`prepare_rows`: one launch, no
        upload; one gather per pair where the launch cannot serve them."""
        prepared = _prepared(rows)
        return self._gather_between(pairs, prepared, 0, prepared.src_idx.numel())

    def gather_range(self, pairs: LayerPairs, rows: object, begin: int, end: int) -> str | None:
        """:meth:`gather_prepared` over entries ``begin`` to ``end`` of the rows, read in
        place by the layered launch (no slice of them made a piece)."""
        prepared = _prepared(rows)
        count = prepared.src_idx.numel()
        if not (0 <= begin <= end <= count == prepared.dst_idx.numel()):
            raise ValueError(f"rows {begin} to {end} lie outside {count} prepared rows")
        return self._gather_between(pairs, prepared, begin, end)

    def _gather_between(
        self, pairs: LayerPairs, rows: _DeviceRows, begin: int, end: int
    ) -> str | None:
        src_idx, dst_idx = rows.src_idx, rows.dst_idx
        # Whichever way the rows are read, the current stream waits for their upload.
        handle = rows.ready()
        launch = self._launch(pairs)
        if isinstance(launch, str):
            return self._gather_each(pairs, src_idx[begin:end], dst_idx[begin:end], launch)
        launch.offsets.order_current_stream(handle)
        launch.gather.rows_between(src_idx, dst_idx, begin, end)
        return None

    def _gather_each(
        self, pairs: LayerPairs, src_idx: torch.Tensor, dst_idx: torch.Tensor, reason: str
    ) -> str:
        degraded = None
        for src_words, dst_words in zip(pairs.src_words, pairs.dst_words, strict=True):
            degraded = self.prepare_gather(src_words, dst_words)(src_idx, dst_idx) or degraded
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
        if not host_pinned(pairs):
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
        # Sources in device memory are a staging buffer's rows (a page-in staged by region):
        # a scatter at HBM speed between DMAs, given the layer ring's scatter's CTAs.
        on_device = pairs.src_words[0].device.type != "cpu"
        ctas = self._slot_scatter.ctas if on_device else self.ctas_for(pairs.dst_words[0])
        return _TableLaunch(LayeredLaunch(table, offsets.on_device[0], ctas), offsets)

    def _scatter_stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._scatter_streams.get(device)
        if stream is None:
            stream = self._scatter_streams.setdefault(device, torch.cuda.Stream(device=device))
        return stream

    def _second_stream_index(
        self, index: torch.Tensor, device: torch.device
    ) -> tuple[torch.cuda.Stream, torch.cuda.Stream, torch.Tensor]:
        """(the current stream, the second stream of a copy in pieces, ``index`` on
        ``device``), the index uploaded on the second stream, which reads it."""
        copies = torch.cuda.current_stream(device)
        second = self._scatter_stream(device)
        # The device rows (a stage-in's destination, a stage-out's source) may still be in
        # use by work queued before this transfer.
        second.wait_stream(copies)
        with torch.cuda.stream(second):
            device_idx = self._on(index, device)
        return copies, second, device_idx

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
        copies, scatter, device_idx = self._second_stream_index(dst_idx, device)
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
        if pair_count * len(chunks.chunks) >= OVERLAP_MIN_UNITS:
            src_words = pairs.src_words[0]
            slots = overlap_slots(
                staging.numel(),
                [rows for _, _, rows in chunks.chunks],
                src_words.shape[1] * src_words.element_size(),
                pair_count,
                self.overlap_max_slots,
            )
        if slots is None:
            if pair_count > _RING_MOST_PAIRS or not stage_in_ring(
                self._rings, pairs, chunks, prepared, staging, self._slot_scatter
            ):
                reference.stage_in_prepared(pairs, chunks, staging)
        else:
            stage_in_overlapped(self._lanes, pairs, chunks, staging, *slots)

    def open_address_ring(
        self, calls: StreamCalls, device: torch.device, slots: int
    ) -> AbstractContextManager[AddressRing]:
        """A ring of ``slots`` slots whose pieces are copied by address on ``device``."""
        return address_ring(self._address_lanes, device, slots, calls)

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
        copies, gather, device_idx = self._second_stream_index(src_idx, device)
        for begin, end in pieces:
            piece = staging[begin:end]
            with torch.cuda.stream(gather):
                torch.index_select(src_words, 0, device_idx[begin:end], out=piece)
            copies.wait_stream(gather)
            reference.runs_to_staging(
                dst_words, slice_runs(host_runs, begin, end), piece, into_staging=False
            )


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
    ring_scatter_ctas: int = RING_SCATTER_CTAS,
    by_address: bool = True,
) -> KernelSet:
    """``short_rows``: (CTAs, bytes), the gather's CTAs for device rows under that many
    bytes (None: ``gather_ctas`` for every device row); ``ring_scatter_ctas``: the layer
    ring's scatter's; ``by_address``: region staging's ring by address, where a CUDA
    runtime is loaded."""
    ops = _CudaIndexedOps(
        gather_ctas, staged_pieces, gather_ctas_to_host, short_rows, ring_scatter_ctas
    )
    calls = stream_calls() if by_address else None
    short = "" if short_rows is None else f", short_rows={short_rows[0]}@<{short_rows[1]}B"
    return KernelSet(
        name=(
            f"cuda(gather_ctas={gather_ctas}, gather_ctas_to_host={gather_ctas_to_host}"
            f"{short}, ring_scatter_ctas={ring_scatter_ctas}, staged_pieces={staged_pieces})"
        ),
        copy_runs=copy_runs,
        prepare_gather=ops.prepare_gather,
        stage_in=ops.stage_in,
        stage_out=ops.stage_out,
        copy_runs_layers=copy_runs_layers,
        prepare_rows=ops.prepare_rows,
        gather_prepared=ops.gather_prepared,
        gather_range=ops.gather_range,
        # In pieces, a layer's scatters go on a second stream: stage_in orders them itself.
        prepare_stage_in=ops.prepare_stage_in if staged_pieces == 1 else None,
        stage_in_prepared=ops.stage_in_prepared if staged_pieces == 1 else None,
        upload_rows=ops.upload_rows,
        open_address_ring=(
            None if calls is None else functools.partial(ops.open_address_ring, calls)
        ),
    )
