"""The CUDA runtime and driver that torch loaded, reached through ctypes for what torch does
not expose or where a binding's per-call cost matters."""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from typing import Any

# The shared-library names of the CUDA runtime that torch may have loaded, newest first.
_RUNTIME_NAMES = ("libcudart.so.13", "libcudart.so.12")
_DRIVER_NAME = "libcuda.so.1"
# CU_POINTER_ATTRIBUTE_DEVICE_POINTER: the query answers with one 64-bit address, a size
# that does not change between CUDA releases (cudaPointerAttributes grew in CUDA 13, and a
# struct laid out for the older one overflowed on the H200 with torch cu130).
_DEVICE_POINTER_ATTRIBUTE = 3


def _loaded(name: str) -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
    except OSError:
        return None


@functools.cache
def loaded_cudart() -> ctypes.CDLL | None:
    """The CUDA runtime already in this process (never loads one), or None."""
    for name in _RUNTIME_NAMES:
        lib = _loaded(name)
        if lib is not None:
            return lib
    return None


@functools.cache
def _pointer_attribute() -> Callable[[Any, int, int], int] | None:
    lib = _loaded(_DRIVER_NAME)
    if lib is None:
        return None
    call = lib.cuPointerGetAttribute
    call.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64)
    call.restype = ctypes.c_int
    return call


def device_address(pointer: int) -> int | None:
    """The address at which the GPU reaches the memory at ``pointer`` (the same for device
    memory and, on most systems, for pinned host memory), or None when no CUDA driver is
    loaded or the driver has no mapping for the pointer.

    A refused driver query leaves no error behind in the runtime, so torch's next launch
    check is not disturbed."""
    call = _pointer_attribute()
    if call is None or pointer <= 0:
        return None
    address = ctypes.c_uint64(0)
    if call(ctypes.byref(address), _DEVICE_POINTER_ATTRIBUTE, pointer) != 0:
        return None
    return address.value or None


class CudaCallError(RuntimeError):
    """A CUDA runtime call made through ctypes returned an error code."""

    def __init__(self, name: str, code: int) -> None:
        super().__init__(f"{name} failed with CUDA error {code}")
        self.code = code


_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction read from unified addresses
_EVENT_DISABLE_TIMING = 2


class StreamCalls:
    """Asynchronous copies and event calls on raw stream handles, a ctypes call each: on the
    copy path of every layer they cost a few microseconds where torch's own take tens
    (a tensor slice and a dispatch per copy, an Event object per record)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._memcpy = lib.cudaMemcpyAsync
        self._memcpy.argtypes = (
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        )
        self._record = lib.cudaEventRecord
        self._record.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
        self._wait = lib.cudaStreamWaitEvent
        self._wait.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
        self._create = lib.cudaEventCreateWithFlags
        self._create.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint)
        self._clear = lib.cudaGetLastError
        for call in (self._memcpy, self._record, self._wait, self._create, self._clear):
            call.restype = ctypes.c_int

    def _check(self, name: str, code: int) -> None:
        if code:
            # Leave no error for torch's next launch check to find.
            self._clear()
            raise CudaCallError(name, code)

    def event(self) -> int:
        """A new event without timing (kept for the process's life)."""
        handle = ctypes.c_void_p()
        self._check(
            "cudaEventCreateWithFlags", self._create(ctypes.byref(handle), _EVENT_DISABLE_TIMING)
        )
        return int(handle.value or 0)

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._check("cudaMemcpyAsync", self._memcpy(dst, src, nbytes, _MEMCPY_DEFAULT, stream))

    def record(self, event: int, stream: int) -> None:
        self._check("cudaEventRecord", self._record(event, stream))

    def wait(self, stream: int, event: int) -> None:
        self._check("cudaStreamWaitEvent", self._wait(stream, event, 0))


@functools.cache
def stream_calls() -> StreamCalls | None:
    """The calls on the CUDA runtime torch loaded, or None where none is loaded."""
    lib = loaded_cudart()
    return None if lib is None else StreamCalls(lib)


def clear_pending_error() -> bool:
    """Clear the error a failed call left for the next launch check to find; False where
    no CUDA runtime is loaded."""
    lib = loaded_cudart()
    if lib is None:
        return False
    lib.cudaGetLastError()
    return True
