"""How many pages of a mapped range are in memory now (mincore(2); /proc would need root)."""

from __future__ import annotations

import ctypes
import mmap


def resident_pages(address: int, nbytes: int) -> tuple[int, int]:
    """(pages of ``[address, address + nbytes)`` in memory now, pages the range spans)."""
    start = address - address % mmap.PAGESIZE
    end = address + nbytes
    pages = -(-(end - start) // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    if libc.mincore(start, end - start, vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(byte & 1 for byte in vector), pages
