"""vLLM's stock offload handler on a machine without a GPU, for dry runs and tests.

kvcore's handler hands the jobs it does not copy to the stock handler's own
``transfer_async``, which pins its descriptor buffers, takes a stream from vLLM's platform
and records timing events. On a host none of these exist. :func:`run_on_host` makes one
stock handler's methods run with stand-ins for them (streams that order nothing, events
that are always complete, unpinned buffers), switched in only while one of its methods
runs; its copy op must be a host one (a memmove per descriptor).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from vllm.v1.kv_offload.cpu import gpu_worker

# The stock handler's methods that reach the platform, its events or pinned memory.
_METHODS = ("transfer_async", "get_finished", "wait", "shutdown")


class HostEvent:
    """A stream and an event of a host: copies run when issued, so all is complete."""

    def __init__(self, enable_timing: bool = False) -> None:
        del enable_timing

    def wait_stream(self, stream: object) -> None:
        del stream

    def wait_event(self, event: object) -> None:
        del event

    def record(self, stream: object = None) -> None:
        del stream

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: object) -> float:
        del end
        return 0.0


class HostPlatform:
    """What the stock handler asks of vLLM's ``current_platform``."""

    Stream = HostEvent

    @staticmethod
    def is_xpu() -> bool:
        return False

    @staticmethod
    def is_rocm() -> bool:
        return False

    @staticmethod
    def current_stream() -> HostEvent:
        return HostEvent()

    @staticmethod
    def stream(stream: object) -> contextlib.nullcontext[None]:
        del stream
        return contextlib.nullcontext()


@contextlib.contextmanager
def _host_platform() -> Iterator[None]:
    saved = gpu_worker.current_platform, gpu_worker.PIN_MEMORY, torch.Event
    gpu_worker.current_platform = HostPlatform  # type: ignore[assignment]
    gpu_worker.PIN_MEMORY = False
    torch.Event = HostEvent  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        gpu_worker.current_platform, gpu_worker.PIN_MEMORY, torch.Event = saved  # type: ignore[misc]


def _on_host(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        with _host_platform():
            return method(*args, **kwargs)

    return call


def run_on_host(handler: Any) -> Any:
    """``handler`` (a stock ``SingleDirectionOffloadingHandler`` over host tensors), its
    methods made runnable without a GPU; returned for chaining."""
    for name in _METHODS:
        setattr(handler, name, _on_host(getattr(handler, name)))
    return handler


def is_run_on_host(handler: Any) -> bool:
    return all(name in vars(handler) for name in _METHODS)


def without_host_methods(handler: Any) -> Any:
    """``handler`` with the methods :func:`run_on_host` set removed (a shallow copy of a
    handler carries them, bound to the original)."""
    for name in _METHODS:
        vars(handler).pop(name, None)
    return handler
