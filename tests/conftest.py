"""Skip marked tests, with a reason, when what they need is absent."""

from __future__ import annotations

import importlib.util

import pytest
import torch

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
