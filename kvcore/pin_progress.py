"""How far a host pool's background pinning has got, shared between processes.

An engine may pin its host tier in one process (a GPU worker) and hand out the tier's
slots in another (the scheduler), or in the same one. :class:`PinProgress` is the pinning
side: a 16-byte file in shared memory holding the pool's slot count and how many slots,
from the first, are pinned. :class:`PinWatch` is the handing-out side: it reads the count
without a lock (one aligned 8-byte store, read whole on every 64-bit host kvcore runs on).
The count only grows; the file goes when the pinning side closes it.
"""

from __future__ import annotations

import mmap
import os
import re
from pathlib import Path

import numpy as np

SHM_DIR = Path("/dev/shm")
_BYTES = 16  # the slot count, then the pinned prefix, as two int64
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def progress_path(key: str, directory: Path = SHM_DIR) -> Path:
    """The file holding ``key``'s progress (``key``: an engine's id and the worker's rank)."""
    if not key:
        raise ValueError("a pinning progress needs a key")
    return directory / f"kvcore-pinned-{_UNSAFE.sub('_', key)}"


class _Counts:
    """The file's two counts, mapped; :meth:`close` unmaps them."""

    def __init__(self, mapping: mmap.mmap) -> None:
        self._map: mmap.mmap | None = mapping
        self._counts = np.frombuffer(mapping, dtype=np.int64, count=2)

    @property
    def total(self) -> int:
        return int(self._counts[0])

    def close(self) -> None:
        if self._map is not None:
            del self._counts  # the array holds the mapping's buffer: it must go first
            self._map.close()
            self._map = None


class PinProgress(_Counts):
    """The pinning side: creates the file (replacing one a crashed run left) with ``total``
    slots and none pinned; :meth:`publish` raises the pinned prefix."""

    def __init__(self, key: str, total: int, directory: Path = SHM_DIR) -> None:
        if total < 0:
            raise ValueError(f"a pool of {total} slots")
        self.path = progress_path(key, directory)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, _BYTES)
            super().__init__(mmap.mmap(fd, _BYTES))
        finally:
            os.close(fd)
        self._counts[0] = total
        self._counts[1] = 0

    def publish(self, ready: int) -> None:
        """Slots ``[0, ready)`` are pinned; a count below the last one changes nothing."""
        if self._map is None:
            raise RuntimeError("the pinning progress was closed")
        if not 0 <= ready <= self.total:
            raise ValueError(f"{ready} pinned slots of {self.total}")
        if ready > self._counts[1]:
            self._counts[1] = ready

    def close(self) -> None:
        """Remove the file (a watcher that mapped it keeps reading the last count)."""
        if self._map is not None:
            super().close()
            self.path.unlink(missing_ok=True)


class PinWatch(_Counts):
    """The handing-out side, on a file :class:`PinProgress` made; :meth:`open` is None while
    there is none."""

    @classmethod
    def open(cls, key: str, directory: Path = SHM_DIR) -> PinWatch | None:
        try:
            fd = os.open(progress_path(key, directory), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            if os.fstat(fd).st_size < _BYTES:
                return None  # created, not yet sized: the next look finds it whole
            return cls(mmap.mmap(fd, _BYTES, prot=mmap.PROT_READ))
        finally:
            os.close(fd)

    @property
    def ready(self) -> int:
        """Slots ``[0, ready)`` are pinned."""
        return int(self._counts[1])
