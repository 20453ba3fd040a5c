"""The staging buffers a staged copy moves its rows through, one per device.

:class:`StagingBuffers` allocates each device's buffer once and leases it to one
transfer at a time, ordering the streams that share it on the GPU. It sits apart from
:mod:`kvcore.mover` because it is state with its own locking, shared by every mover
given it, and its lease is the one part of a staged copy that is not a kernel call.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvcore.path_policy import PathPolicy


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
        self._guard = threading.Lock()

    @property
    def bytes_reserved(self) -> int:
        with self._guard:
            return self.capacity_bytes * len(self._buffers)

    @contextmanager
    def lease(self, device: torch.device) -> Iterator[torch.Tensor]:
        with self._guard:
            lock = self._locks.setdefault(device, threading.Lock())
        with lock:
            buffer = self._buffers.get(device)
            if buffer is None:
                buffer = torch.empty(self.capacity_bytes, dtype=torch.uint8, device=device)
                with self._guard:
                    self._buffers[device] = buffer
            if device.type != "cuda":
                yield buffer
                return
            stream = torch.cuda.current_stream(device)
            last_use = self._last_use.get(device)
            if last_use is None:
                last_use = self._last_use[device] = torch.cuda.Event()
            elif self._last_stream[device] != stream.cuda_stream:
                # The same stream is ordered already; another one waits on the GPU.
                stream.wait_event(last_use)
            try:
                yield buffer
            finally:
                # One event per device serves every lease: a wait holds the record issued
                # before it, and the device lock keeps each record after the previous wait.
                last_use.record(stream)
                self._last_stream[device] = stream.cuda_stream
