"""Skip marked tests, with a reason, when what they need is absent; kernels registered for
one test only."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator

import pytest
import torch

from kvcore import kernels

_REQUIREMENTS = {
    "gpu": (lambda: torch.cuda.is_available(), "needs a CUDA device"),
    "sglang": (lambda: importlib.util.find_spec("sglang") is not None, "needs SGLang installed"),
    "vllm": (lambda: importlib.util.find_spec("vllm") is not None, "needs vLLM installed"),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    present = {name: check() for name, (check, _) in _REQUIREMENTS.items()}
    for item in items:
        for name, (_, reason) in _REQUIREMENTS.items():
            if item.get_closest_marker(name) and not present[name]:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def swap_kernels() -> Iterator[Callable[..., None]]:
    """``swap_kernels(device_type, entry)`` registers ``entry`` for the test (None: no entry,
    the reference set serves the type); every type it touched gets its entry back after."""
    saved: dict[str, kernels.KernelSet | kernels.KernelFactory | None] = {}

    def swap(device_type: str, entry: kernels.KernelSet | kernels.KernelFactory | None) -> None:
        removed = kernels.unregister_kernels(device_type)
        saved.setdefault(device_type, removed)
        if entry is not None:
            kernels.register_kernels(device_type, entry)

    yield swap
    for device_type, entry in saved.items():
        kernels.unregister_kernels(device_type)
        if entry is not None:
            kernels.register_kernels(device_type, entry)
