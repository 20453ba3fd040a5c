"""kvcore.kernels.cudart against the real CUDA runtime: an error a failed call leaves behind."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvcore.kernels import cudart

pytestmark = pytest.mark.gpu

_INVALID_VALUE = 1  # cudaErrorInvalidValue: not sticky, the context stays usable


def _fail_a_runtime_call(lib: ctypes.CDLL) -> int:
    """A memset of a null device pointer: refused, leaving the error pending."""
    lib.cudaMemset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
    lib.cudaMemset.restype = ctypes.c_int
    return int(lib.cudaMemset(None, 0, 16))


def test_a_pending_error_is_cleared_and_the_device_keeps_working():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.cuda.init()
    lib = cudart.loaded_cudart()
    assert lib is not None, "torch's CUDA runtime should be loaded once CUDA is initialised"
    assert _fail_a_runtime_call(lib) == _INVALID_VALUE
    lib.cudaPeekAtLastError.restype = ctypes.c_int
    assert lib.cudaPeekAtLastError() == _INVALID_VALUE
    assert cudart.clear_pending_error()
    assert lib.cudaPeekAtLastError() == 0
    data = torch.arange(1024, device="cuda", dtype=torch.float32)
    assert float(data.sum()) == 1023 * 1024 / 2
