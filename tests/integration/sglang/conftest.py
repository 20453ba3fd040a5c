"""SGLang lane: a torchvision import stub and hook isolation between tests.

torchvision has no CPU build that matches our torch, yet SGLang imports it at module
level (its multimodal configs). When SGLang is installed and torchvision is not,
an import finder serves ``torchvision`` and its submodules as placeholder modules;
any attribute of them is a placeholder class. It is installed here, before any
test module imports SGLang, and only in that case.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvcore.bench.sglang.import_stubs import install_torchvision_stub

if importlib.util.find_spec("sglang") is not None:
    install_torchvision_stub()


@pytest.fixture
def sglang_hooks(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Any]]:
    """A function that runs the plugin with KVCORE_ENABLE=sglang and applies its hooks
    (returns the status); HostKVCache and the registry are restored afterwards."""
    from sglang.srt.mem_cache.pool_host.base import HostKVCache
    from sglang.srt.plugins.hook_registry import HookRegistry

    from kvcore_sglang import host_slots, plugin

    originals = {name: vars(HostKVCache)[name] for name in host_slots.HOOKS}
    saved_hooks = {target: list(hooks) for target, hooks in HookRegistry._hooks.items()}
    saved_patched = set(HookRegistry._patched)
    HookRegistry.reset()
    monkeypatch.setattr(plugin, "_applied", None)
    monkeypatch.setenv("KVCORE_ENABLE", "sglang")

    def apply() -> Any:
        plugin.load()
        HookRegistry.apply_hooks()
        return plugin.applied_status()

    try:
        yield apply
    finally:
        for name, function in originals.items():
            setattr(HostKVCache, name, function)
        HookRegistry.reset()
        HookRegistry._hooks.update(saved_hooks)
        HookRegistry._patched.update(saved_patched)
