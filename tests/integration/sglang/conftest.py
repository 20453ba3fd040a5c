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

from benchmarks.sglang.import_stubs import install_torchvision_stub
from kvcore.mover import Mover

if importlib.util.find_spec("sglang") is not None:
    install_torchvision_stub()


@pytest.fixture(autouse=True)
def own_adapter_per_test() -> Iterator[None]:
    """Each test's direct hook calls go through an adapter of its own
    (:mod:`benchmarks.sglang.hook_adapter`), built from the environment as the test sets
    it: none is kept from another test."""
    from benchmarks.sglang.hook_adapter import drop_own_adapter

    drop_own_adapter()
    yield
    drop_own_adapter()


@pytest.fixture
def device_indices_unread() -> Iterator[None]:
    """The hooks plan every call around its device indices, left unread, as on a GPU with
    SGLang's ``kernel`` backend (the device indices are CPU tensors here)."""
    from benchmarks.sglang.sweep_sides import device_indices_unread as unread

    with unread():
        yield


@pytest.fixture
def device_indices_read() -> Iterator[None]:
    """The hooks plan every call as under ``KVCORE_SGLANG_DMA_IN_PLACE`` on a GPU with
    SGLang's ``kernel`` backend: the device indices on the device, a host copy of them
    read back at the move (the device indices are CPU tensors here, a clone their read)."""
    from benchmarks.sglang.sweep_sides import device_indices_read as read

    with read():
        yield


@pytest.fixture
def sglang_hooks(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Any]]:
    """A function that runs the plugin with KVCORE_ENABLE=sglang and applies its hooks
    (returns the status). Afterwards the plugin's own uninstall takes them back, and the
    test fails unless every target holds its original again.

    Hooks another lane registered before the test (a patched tree's import claims the
    same targets) are set aside for the test and put back after it."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from kvcore_sglang import plugin

    assert plugin.applied_status() is None, "a test left kvcore's hooks installed"
    saved_hooks = {target: list(hooks) for target, hooks in HookRegistry._hooks.items()}
    saved_patched = set(HookRegistry._patched)
    HookRegistry.reset()
    monkeypatch.setenv("KVCORE_ENABLE", "sglang")
    installed: list[str] = []

    def apply() -> Any:
        plugin.load()
        HookRegistry.apply_hooks()
        installed[:] = plugin.INSTALLATION.targets
        return plugin.applied_status()

    originals = {target: _attribute(target) for target in _every_target()}
    try:
        yield apply
    finally:
        plugin.uninstall()
        changed = [t for t, held in originals.items() if _attribute(t) is not held]
        left = [t for t in installed if HookRegistry._hooks.get(t)]
        HookRegistry.reset()
        HookRegistry._hooks.update(saved_hooks)
        HookRegistry._patched.update(saved_patched)
        assert not changed, f"uninstall left these targets changed: {changed}"
        assert not left, f"uninstall left kvcore's hooks registered on: {left}"


def _every_target() -> list[str]:
    from kvcore_sglang import host_memory, host_slots, pool_warm_up, transfers
    from kvcore_sglang.guard import HOST_KV_CACHE

    return [
        *(f"{HOST_KV_CACHE}.{name}" for name in host_slots.HOOKS),
        *host_memory.HOOKS,
        *transfers.TARGETS,
        *pool_warm_up.TARGETS,
    ]


def _attribute(target: str) -> Any:
    import pkgutil

    owner, name = target.rsplit(".", 1)
    return vars(pkgutil.resolve_name(owner)).get(name)


@pytest.fixture
def use_mover() -> Iterator[Callable[[Mover], Mover]]:
    """Have the transfer hooks copy through a test's mover (on the adapter the test's
    hooks close over); the one in use before is put back afterwards."""
    from benchmarks.sglang.hook_adapter import bench_adapter

    before: list[tuple[Any, Mover | None]] = []

    def use(chosen: Mover) -> Mover:
        adapter = bench_adapter()
        previous = adapter.use_mover(chosen)
        if not before:
            before.append((adapter, previous))
        return chosen

    yield use
    if before:
        adapter, previous = before[0]
        adapter.use_mover(previous)


@pytest.fixture
def hooks_recorded_apart() -> Iterator[None]:
    """The patched source's record of hooked targets kept apart for one test."""
    from kvcore_sglang import patched

    with patched.hooks_recorded_apart():
        yield
