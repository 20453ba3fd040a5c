"""Getting host memory ready to pin: the locked-memory limit, and its pages faulted in fast.

Registering host memory with the GPU driver (cudaHostRegister) faults in every page it
has not yet touched, on the one calling thread, at a few GiB/s; the registration itself
runs an order of magnitude faster. :func:`populate` faults the pages in first, from
several threads at once (the kernel does the work, without the GIL), so that the
registration that follows only pins. It changes no byte: a range that already holds
data keeps it. :func:`check_memlock` refuses a size the process may not lock, naming
the limit and the fix.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import mmap
import os
import resource
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np
import torch

from kvcore import numa

logger = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
# madvise(2) advice that faults a range in writable without writing it (Linux 5.14+).
MADV_POPULATE_WRITE = 23


class PinnedMemoryError(RuntimeError):
    """Host memory could not be pinned (memlock limit, registration failure, no CUDA)."""


def format_bytes(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit that keeps it >= 1, e.g. ``1.5 GiB``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{nbytes} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


class HostRegistrar(Protocol):
    """Pins and unpins ranges of existing host memory (cudaHostRegister and its inverse)."""

    def register(self, ptr: int, nbytes: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...


class CudaHostRegistrar:
    """cudaHostRegister / cudaHostUnregister through torch's CUDA runtime bindings."""

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise PinnedMemoryError("pinning host memory needs CUDA; pass pin=False without a GPU")
        self._cudart = torch.cuda.cudart()

    def register(self, ptr: int, nbytes: int) -> None:
        self._check(self._cudart.cudaHostRegister(ptr, nbytes, 0), f"cudaHostRegister({nbytes})")

    def unregister(self, ptr: int) -> None:
        self._check(self._cudart.cudaHostUnregister(ptr), "cudaHostUnregister")

    def _check(self, err: object, call: str) -> None:
        if err != self._cudart.cudaError.success:
            from kvcore.kernels.cudart import clear_pending_error

            reason = self._cudart.cudaGetErrorString(err)
            # The runtime keeps the failure as its last error: torch's next launch check
            # would report it as its own, in the engine's code, after kvcore moved on.
            clear_pending_error()
            raise PinnedMemoryError(f"{call} failed: {reason}")


def check_memlock(nbytes: int) -> None:
    """Refuse to pin ``nbytes`` above the soft RLIMIT_MEMLOCK, naming the limit and the fix.

    Root may lock past the limit, but CUDA registration can still hit it, so for
    root this only warns.
    """
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or nbytes <= soft:
        return
    message = (
        f"cannot pin {nbytes} bytes ({format_bytes(nbytes)}) of host memory: the locked-memory "
        f"limit RLIMIT_MEMLOCK is {soft} bytes ({format_bytes(soft)}; `ulimit -l` shows "
        f"{soft // 1024} KiB). Raise it with `ulimit -l unlimited` in the launching shell, "
        "`--ulimit memlock=-1` for docker, LimitMEMLOCK=infinity for systemd, or a memlock "
        "line in /etc/security/limits.conf; or ask for less host memory."
    )
    if os.geteuid() == 0:
        logger.warning("%s (running as root, trying anyway)", message)
        return
    raise PinnedMemoryError(message)


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0))


@functools.cache
def _libc_madvise() -> Callable[[int, int, int], int]:
    call = ctypes.CDLL(None, use_errno=True).madvise
    call.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    call.restype = ctypes.c_int
    return call


class _Populate:
    """MADV_POPULATE_WRITE until the kernel refuses it once (before Linux 5.14), then
    touching."""

    def __init__(self) -> None:
        self.refused = False

    def __call__(self, start: int, end: int) -> None:
        if not self.refused:
            aligned = start - start % PAGE
            if _libc_madvise()(aligned, end - aligned, MADV_POPULATE_WRITE) == 0:
                return
            code = ctypes.get_errno()
            if code in (errno.EINVAL, errno.ENOSYS):
                self.refused = True
                logger.info(
                    "MADV_POPULATE_WRITE refused (%s); pages are faulted in by touching them",
                    errno.errorcode[code],
                )
        _touch(start, end - start)


_POPULATE = _Populate()


def _touch(address: int, nbytes: int) -> None:
    """Fault in every page of the range by rewriting one byte of it with itself."""
    array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))
    array[:1] = array[:1]
    firsts = array[-address % PAGE :: PAGE]
    firsts[...] = firsts.copy()


def populate(
    address: int, nbytes: int, threads: int, *, cpus: Collection[int] | None = None
) -> None:
    """Fault in every page of ``[address, address + nbytes)`` from ``threads`` threads,
    changing no byte. With ``cpus``, the threads run only there (so that first touch
    places the pages on those CPUs' node); the caller's own affinity stays."""
    if nbytes <= 0:
        return
    start = address - address % PAGE
    end = address + nbytes
    pages = -(-(end - start) // PAGE)
    threads = max(1, min(threads, pages))
    bounds = [start + PAGE * (pages * i // threads) for i in range(threads + 1)]
    bounds[0], bounds[-1] = address, end

    def fault(i: int) -> None:
        if bounds[i + 1] > bounds[i]:
            _POPULATE(bounds[i], bounds[i + 1])

    if threads == 1 and cpus is None:
        fault(0)
        return
    with ThreadPoolExecutor(
        threads,
        thread_name_prefix="kvcore-prefault",
        initializer=numa.restrict_thread_to,
        initargs=(cpus or (),),
    ) as pool:
        list(pool.map(fault, range(threads)))
