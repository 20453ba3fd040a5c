"""The staging buffers a staged copy moves its rows through, one per device.

:class:`StagingBuffers` allocates each device's buffer once and leases it to one
transfer at a time, ordering the streams that share it on the GPU. It sits apart from
:mod:`kvcore.mover` because it is state with its own locking, shared by every mover
given it, and its lease is the one part of a staged copy that is not a kernel call.
"""

from __future__ import annotations

import threading
from types import TracebackType

import torch

from kvcore.planning.path_policy import PathPolicy

_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_MAX_KEPT_STREAMS = 64
_LEASE_NUMBER = "_kvcore_lease_number"


def lease_number(buffer: torch.Tensor) -> int:
    """How many leases of ``buffer``'s device were taken up to and including the one that
    handed it out: a user that keeps copies in flight across its leases (a ring of staging
    slots) tells from a gap that another user held the buffer in between."""
    return int(buffer.__dict__.get(_LEASE_NUMBER, 0))


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
        self._lease_numbers: dict[torch.device, int] = {}
        # (device index, raw handle) -> the Stream object for it (torch never frees its
        # pool's streams; a handle reused by a new external stream names that stream).
        self._streams: dict[tuple[int, int], torch.cuda.Stream] = {}
        self._guard = threading.Lock()

    @property
    def bytes_reserved(self) -> int:
        with self._guard:
            return self.capacity_bytes * len(self._buffers)

    def lease(self, device: torch.device) -> _Lease:
        """A context manager holding ``device``'s buffer (a flat uint8 tensor) while open."""
        return _Lease(self, device)

    def _lock_for(self, device: torch.device) -> threading.Lock:
        lock = self._locks.get(device)
        if lock is None:
            with self._guard:
                lock = self._locks.setdefault(device, threading.Lock())
        return lock

    def _buffer_for(self, device: torch.device) -> torch.Tensor:
        """The device's buffer, allocated on first use; called with the device's lock held."""
        buffer = self._buffers.get(device)
        if buffer is None:
            # Never an inference tensor, whatever mode the first lease comes in: one could
            # not be written outside inference mode, and every later copy would fail.
            with torch.inference_mode(False):
                buffer = torch.empty(self.capacity_bytes, dtype=torch.uint8, device=device)
            with self._guard:
                self._buffers[device] = buffer
        return buffer

    def _current_stream(self, device: torch.device) -> tuple[torch.cuda.Stream, int]:
        """The current stream on ``device`` and its raw handle; the Stream object is built
        once per handle (a few microseconds on every lease otherwise)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        if _current_raw_stream is None:
            stream = torch.cuda.current_stream(device)
            return stream, int(stream.cuda_stream)
        handle = int(_current_raw_stream(index))
        kept = self._streams.get((index, handle))
        if kept is None:
            kept = torch.cuda.current_stream(device)
            if len(self._streams) >= _MAX_KEPT_STREAMS:
                self._streams.clear()
            self._streams[(index, handle)] = kept
        return kept, handle


class _Lease:
    """One lease of a device's staging buffer (:meth:`StagingBuffers.lease`): a class
    rather than a generator, as it is entered on every layer of a staged reload.

    On CUDA the stream that takes the buffer waits on the GPU for the stream that used it
    last, where that is another one; one event per device serves every lease: a wait
    holds the record issued before it, and the device lock keeps each record after the
    previous wait.
    """

    __slots__ = ("_buffers", "_device", "_handle", "_lock", "_stream")

    def __init__(self, buffers: StagingBuffers, device: torch.device) -> None:
        self._buffers = buffers
        self._device = device
        self._lock = buffers._lock_for(device)
        self._stream: torch.cuda.Stream | None = None
        self._handle = 0

    def __enter__(self) -> torch.Tensor:
        self._lock.acquire()
        try:
            owner, device = self._buffers, self._device
            buffer = owner._buffer_for(device)
            number = owner._lease_numbers.get(device, 0) + 1
            owner._lease_numbers[device] = number
            buffer.__dict__[_LEASE_NUMBER] = number
            if device.type == "cuda":
                stream, handle = owner._current_stream(device)
                last_use = owner._last_use.get(device)
                if last_use is None:
                    owner._last_use[device] = torch.cuda.Event()
                elif owner._last_stream[device] != handle:
                    # The same stream is ordered already; another one waits on the GPU.
                    stream.wait_event(last_use)
                self._stream, self._handle = stream, handle
        except BaseException:
            self._lock.release()
            raise
        return buffer

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            stream = self._stream
            if stream is not None:
                owner, device = self._buffers, self._device
                owner._last_use[device].record(stream)
                owner._last_stream[device] = self._handle
        finally:
            self._lock.release()
