"""CPU index tensors to the GPU without a host sync and without allocating pinned memory.

Uploading from pageable memory blocks the host; ``pin_memory()`` per upload goes
through cudaHostAlloc whenever the caching host allocator has no free block,
which can stall a submission for milliseconds. Instead, a ring
of pinned slots is allocated once, and uploads run on a stream of their own so
that reusing a slot waits only for an earlier (tiny) upload, never for the bulk
copies queued on the copy streams. The consuming stream waits on the upload's
event.

Engines copy layer by layer with the same indices, so the last few uploads are
kept: the same CPU tensor, unmodified since (its version counter says so), is
uploaded once per transfer, not once per layer. A stream that has waited for an upload
once needs no second wait: the later layers it runs are queued after the first wait.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from kvcore.runs import version_of

_CacheKey = tuple[tuple[int, int, int, int], ...]

# Private but long-standing (Triton and inductor read streams through it); absent in CPU
# builds, where nothing here runs.
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


@dataclass
class _Upload:
    """One cached upload."""

    # Kept alive so that their addresses, part of the cache key, are not reused.
    indices: tuple[torch.Tensor, ...]
    # Views of one device block.
    on_device: tuple[torch.Tensor, ...]
    done: torch.cuda.Event
    # Streams (raw handles) that already wait for ``done`` and hold the block.
    ordered: set[int]


@dataclass(eq=False, slots=True)
class KeptUpload:
    """Indices on the device for as long as the holder keeps this: a request's rows, used
    by each of its layers, or a launch table's offsets, used for the table's life."""

    on_device: tuple[torch.Tensor, ...]
    _done: torch.cuda.Event
    _ordered: set[int]
    _device: torch.device
    _device_index: int

    def order_current_stream(self, handle: int | None = None) -> int:
        """Make work issued next on the current stream wait for the upload (once a stream);
        returns the current stream's raw handle. ``handle``: that handle, where the caller
        already has it (one query a launch, not one an upload)."""
        if handle is None:
            handle = current_stream_handle(self._device, self._device_index)
        if handle in self._ordered:
            return handle
        consumer = torch.cuda.current_stream(self._device)
        consumer.wait_event(self._done)
        self.on_device[0].record_stream(consumer)
        self._ordered.add(handle)
        return handle


def current_stream_handle(device: torch.device, device_index: int | None) -> int:
    """The current stream's raw handle on ``device`` (``device_index``: its index, None where
    unknown), without building a Stream object (a few µs a call, on every layer of a
    transfer) where torch offers that."""
    if _current_raw_stream is None or device_index is None:
        return int(torch.cuda.current_stream(device).cuda_stream)
    return int(_current_raw_stream(device_index))


def cache_key(indices: tuple[torch.Tensor, ...]) -> _CacheKey | None:
    """What names an upload of ``indices`` while their values are unchanged: memory, length,
    stride and version counter of each; None where one has no counter (an inference tensor
    may have been written in place unseen), so its upload is never reused."""
    key = []
    for index in indices:
        version = version_of(index)
        if version is None:
            return None
        key.append((index.data_ptr(), version, index.numel(), index.stride(0)))
    return tuple(key)


class IndexUploader:
    """A bounded pinned ring of ``slots`` x ``slot_entries`` int64 indices on one device."""

    def __init__(
        self,
        device: torch.device,
        *,
        slots: int = 16,
        slot_entries: int = 1 << 18,
        cached: int = 8,
    ) -> None:
        if slots < 1 or slot_entries < 1:
            raise ValueError(f"slots and slot_entries must be positive: {slots}, {slot_entries}")
        self.device = device
        self._device_index = torch.cuda._get_device_index(device, optional=True)
        self.slot_entries = slot_entries
        # Never an inference tensor, whatever mode the first upload comes in: the ring is
        # written on every upload, and one could not be written outside inference mode.
        with torch.inference_mode(False):
            self._host = torch.empty(slots, slot_entries, dtype=torch.int64).pin_memory()
        self._done: list[torch.cuda.Event | None] = [None] * slots
        self._next = 0
        self._stream = torch.cuda.Stream(device=device)
        self._lock = threading.Lock()
        self._cached = cached
        self._recent: OrderedDict[_CacheKey, _Upload] = OrderedDict()

    @property
    def pinned_bytes(self) -> int:
        return self._host.numel() * self._host.element_size()

    def upload(self, index: torch.Tensor) -> torch.Tensor:
        """``index`` on the device, ready for work issued afterwards on the current stream."""
        return self.upload_all((index,))[0]

    def upload_all(self, indices: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Several indices in one copy (a gather's source and destination rows): one slot,
        one transfer and one event instead of one each."""
        return self._uploaded(indices).on_device

    def keep(self, indices: tuple[torch.Tensor, ...]) -> KeptUpload:
        """:meth:`upload_all`, held by the caller: ready on the current stream now, and on
        another one after :meth:`KeptUpload.order_current_stream`."""
        upload = self._uploaded(indices)
        return KeptUpload(
            upload.on_device, upload.done, upload.ordered, self.device, self._device_index
        )

    def _uploaded(self, indices: tuple[torch.Tensor, ...]) -> _Upload:
        key = cache_key(indices)
        hit = None
        if key is not None:
            with self._lock:
                hit = self._recent.get(key)
                if hit is not None:
                    self._recent.move_to_end(key)
        if hit is not None:
            handle = current_stream_handle(self.device, self._device_index)
            if handle not in hit.ordered:
                consumer = torch.cuda.current_stream(self.device)
                consumer.wait_event(hit.done)
                # The views share one block: recording one keeps all of them alive.
                hit.on_device[0].record_stream(consumer)
                with self._lock:
                    hit.ordered.add(handle)
            return hit
        consumer = torch.cuda.current_stream(self.device)
        out, done = self._upload(indices, consumer)
        on_device = (out,) if len(indices) == 1 else out.split([i.numel() for i in indices])
        upload = _Upload(indices, on_device, done, {consumer.cuda_stream})
        if key is not None:
            with self._lock:
                self._recent[key] = upload
                while len(self._recent) > self._cached:
                    self._recent.popitem(last=False)
        return upload

    def _upload(
        self, indices: tuple[torch.Tensor, ...], consumer: torch.cuda.Stream
    ) -> tuple[torch.Tensor, torch.cuda.Event]:
        n = sum(i.numel() for i in indices)
        if n > self.slot_entries:
            # Larger than a slot: rare, and correct through torch's own pinned path.
            joined = torch.cat([i.reshape(-1).to(torch.int64) for i in indices])
            out = joined.pin_memory().to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(consumer)
            return out, done
        with self._lock:
            slot = self._next
            self._next = (slot + 1) % len(self._done)
            earlier = self._done[slot]
            if earlier is not None:
                earlier.synchronize()
            staged = self._host[slot, :n]
            at = 0
            for index in indices:
                staged[at : at + index.numel()].copy_(index)
                at += index.numel()
            # Allocated from the upload stream's pool, so no pending work of another
            # stream can still be using this memory when the upload writes it.
            with torch.cuda.stream(self._stream):
                out = torch.empty(n, dtype=torch.int64, device=self.device)
                out.copy_(staged, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._stream)
            self._done[slot] = done
        consumer.wait_event(done)
        # Keep the memory from being reused until the consumer's work on it is done.
        out.record_stream(consumer)
        return out, done
