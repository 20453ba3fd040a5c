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
