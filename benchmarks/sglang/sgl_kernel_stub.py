"""A stand-in for ``sgl_kernel`` where its wheel is absent, so that SGLang's CUDA modules import.

Every name it serves raises :class:`StockNotRunnable` when called: a stock path that needs
sgl-kernel's ops reports itself not runnable, with the reason, and SGLang's JIT kernels
still run. Apart from the A/B (:mod:`benchmarks.sglang.ab`) because the sweep, the soak,
the host-cost bench and the live HiCache run install it the same way.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from benchmarks.sglang.import_stubs import PackageStub, StubType

SGL_KERNEL_MISSING = "sgl_kernel is not installed (the 373 MB sglang-kernel wheel is not carried)"


class StockNotRunnable(RuntimeError):
    """A stock SGLang op this machine does not have."""


class _Missing(StubType):
    """Anything sgl_kernel exports: calling it raises :class:`StockNotRunnable`."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise StockNotRunnable(f"{cls.__qualname__}: {SGL_KERNEL_MISSING}")


class _SglKernelStub(PackageStub):
    """Serves ``sgl_kernel`` and its submodules; every name in them is a :class:`_Missing`.

    SGLang imports sgl_kernel names at module level on CUDA, some without a fallback.
    """

    def __init__(self) -> None:
        super().__init__("sgl_kernel", _Missing)


def install_sgl_kernel_stub() -> bool:
    """Let SGLang's CUDA modules import without sgl-kernel; True if the stub is in place.

    Its ops (``sgl_kernel.kvcacheio.transfer_*`` among them) raise :class:`StockNotRunnable`
    when called; SGLang's JIT kernels do not need it and still run. SGLang's probe for
    ``get_device_accessible_ptr`` also checks ``torch.ops.sgl_kernel``, which stays empty,
    so its pointer tables use the raw host addresses, as CUDA's unified addressing allows.
    """
    if any(isinstance(finder, _SglKernelStub) for finder in sys.meta_path):
        return True
    if importlib.util.find_spec("sgl_kernel") is not None:
        return False
    sys.meta_path.append(_SglKernelStub())
    return True


def sgl_kernel_stubbed() -> bool:
    """Whether kvcore's stand-in serves ``sgl_kernel`` here (its ops then raise)."""
    return any(isinstance(finder, _SglKernelStub) for finder in sys.meta_path)
