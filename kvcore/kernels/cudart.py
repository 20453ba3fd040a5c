"""The CUDA runtime that torch loaded, reached through ctypes for what torch does not expose
or where a binding's per-call cost matters."""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from typing import Any

# The shared-library names of the CUDA runtime that torch may have loaded, newest first.
_NAMES = ("libcudart.so.13", "libcudart.so.12")


@functools.cache
def loaded_cudart() -> ctypes.CDLL | None:
    """The CUDA runtime already in this process (never loads one), or None."""
    for name in _NAMES:
        try:
            return ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
        except OSError:
            continue
    return None


class _PointerAttributes(ctypes.Structure):
    _fields_ = (
        ("type", ctypes.c_int),
        ("device", ctypes.c_int),
        ("device_pointer", ctypes.c_void_p),
        ("host_pointer", ctypes.c_void_p),
    )


@functools.cache
def _pointer_attributes() -> Callable[[Any, int], int] | None:
    lib = loaded_cudart()
    if lib is None:
        return None
    call = lib.cudaPointerGetAttributes
    call.argtypes = (ctypes.POINTER(_PointerAttributes), ctypes.c_void_p)
    call.restype = ctypes.c_int
    return call


def device_address(pointer: int) -> int | None:
    """The address at which the GPU reaches the memory at ``pointer`` (the same for device
    memory and, on most systems, for pinned host memory), or None when no CUDA runtime is
    loaded or the runtime does not know the pointer."""
    call, lib = _pointer_attributes(), loaded_cudart()
    if call is None or lib is None:
        return None
    attributes = _PointerAttributes()
    if call(ctypes.byref(attributes), pointer) != 0:
        # Taken back, so that torch's next launch check does not report it as its own.
        lib.cudaGetLastError()
        return None
    return int(attributes.device_pointer) if attributes.device_pointer else None
