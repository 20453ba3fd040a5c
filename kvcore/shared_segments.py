"""Shared memory at one address, backed by several memfd files, so that threads fault it in
side by side.

The kernel puts a shared-memory page into its file's page cache under that file's lock, so
threads faulting one shared mapping in (an anonymous ``MAP_SHARED`` mapping is one such
file) queue behind each other; vLLM 0.33 splits its CPU tier over up to 32 files for this
reason. :func:`segmented_shared` reserves one range of addresses and maps a fresh memfd file
into each equal part of it: one contiguous, shared, zero-filled range to the caller (a
forked child sees it, as it sees an anonymous shared mapping), as many files to the kernel
as there are segments. A registration with CUDA may span the parts, as vLLM's does.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_SEGMENTS = 32
SEGMENT_FLOOR = 1 << 30
"""No segment smaller than this: below it one file faults fast enough, and each file is a
mapping of its own (the kernel's count of mappings per process is finite)."""

_PROT_NONE = 0
_MAP_FIXED = 0x10
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_MAP_FAILED = ctypes.c_void_p(-1).value


def segment_count(nbytes: int) -> int:
    """How many files a shared range of ``nbytes`` is spread over."""
    return max(1, min(MAX_SEGMENTS, nbytes // SEGMENT_FLOOR))


@dataclass
class SegmentedShared:
    """A shared range of memory over several files. :attr:`buffer` is the range as a
    writable buffer (``torch.frombuffer`` keeps it alive); the range is unmapped once the
    buffer is collected, or at :meth:`release`."""

    buffer: ctypes.Array[ctypes.c_char]
    address: int
    nbytes: int
    segments: int
    _unmap: weakref.finalize

    def release(self) -> None:
        """Unmap the range now; only where nothing views it any more."""
        self._unmap()


def _libc() -> tuple[Callable[..., Any], Callable[..., Any]]:
    libc = ctypes.CDLL(None, use_errno=True)
    mmap_call, munmap_call = libc.mmap, libc.munmap
    mmap_call.restype = ctypes.c_void_p
    mmap_call.argtypes = (
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    )
    munmap_call.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    return mmap_call, munmap_call


def segmented_shared(nbytes: int, segments: int) -> SegmentedShared:
    """``nbytes`` of zero-filled shared memory at one address, over ``segments`` memfd files
    of equal share (page-rounded; the last takes the rest). Raises OSError where the kernel
    refuses a step, with nothing left mapped."""
    if nbytes <= 0 or segments <= 0:
        raise ValueError(f"needs positive bytes and segments, got {nbytes} and {segments}")
    libc_mmap, munmap = _libc()
    reserve = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
    base = libc_mmap(None, nbytes, _PROT_NONE, reserve, -1, 0)
    if base in (None, _MAP_FAILED):
        raise OSError(ctypes.get_errno(), f"reserving {nbytes} bytes of addresses")
    step = -(-nbytes // segments // mmap.PAGESIZE) * mmap.PAGESIZE
    try:
        for offset in range(0, nbytes, step):
            _map_segment(libc_mmap, base + offset, min(step, nbytes - offset))
    except BaseException:
        munmap(base, nbytes)
        raise
    buffer = (ctypes.c_char * nbytes).from_address(base)
    unmap = weakref.finalize(buffer, munmap, base, nbytes)
    return SegmentedShared(buffer, base, nbytes, -(-nbytes // step), unmap)


def _map_segment(libc_mmap: Callable[..., Any], address: int, length: int) -> None:
    fd = os.memfd_create("kvcore-host-pool")
    try:
        os.ftruncate(fd, length)
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        placed = libc_mmap(address, length, prot, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
    finally:
        os.close(fd)  # the mapping keeps the file
    if placed != address:
        raise OSError(ctypes.get_errno(), f"mapping a {length}-byte file at {address:#x}")
