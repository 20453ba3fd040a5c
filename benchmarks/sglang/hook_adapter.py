"""The SGLang adapter a benchmark's (or a test's) direct hook calls go through.

kvcore's SGLang hooks close over an :class:`~kvcore_sglang.adapter.SGLangAdapter`. A
benchmark calls them directly (its own ``original`` in the place of SGLang's registry),
so it needs one: the installed plugin's where hooks are installed, so that its direct
calls and SGLang's calls share one state as they would in an engine, else one of its own,
built from the ``KVCORE_*`` variables on first use and handed to the plugin when the
benchmark installs it (:func:`register_transfer_hooks`). Settings a run changes (its
mover, the rule, a stand-in for the call's indices) are set on that instance and put back
afterwards, never on kvcore's modules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from kvcore.config import KVCoreConfig
from kvcore.mover import Mover
from kvcore_sglang.adapter import SGLangAdapter

_OWN: list[SGLangAdapter] = []


def bench_adapter() -> SGLangAdapter:
    """The installed plugin's adapter, else this process's own for direct hook calls."""
    from kvcore_sglang import plugin

    installed = plugin.installed_adapter()
    if installed is not None:
        return installed
    if not _OWN:
        _OWN.append(SGLangAdapter(KVCoreConfig.from_env()))
    return _OWN[0]


def drop_own_adapter() -> None:
    """Release the benchmark's own adapter (its bindings on pools, its mover); the next
    direct call builds another from the variables as they are then."""
    while _OWN:
        _OWN.pop().release()


def hook(target: str) -> Callable[..., Any]:
    """kvcore's AROUND hook for ``target`` (as the guard names it), over
    :func:`bench_adapter`."""
    from kvcore_sglang import pool_warm_up, transfers

    adapter = bench_adapter()
    return {**transfers.hooks(adapter), **pool_warm_up.hooks(adapter)}[target]


def pool_method_hook(pool_class: type, method: str) -> Callable[..., Any]:
    """kvcore's AROUND hook for ``pool_class.method``."""
    return hook(f"{pool_class.__module__}.{pool_class.__qualname__}.{method}")


def move_indices(original: Callable[..., Any], controller: Any, host: Any, device: Any) -> Any:
    """kvcore's ``HiCacheController.move_indices`` hook, as SGLang's registry calls it."""
    from kvcore_sglang.transfers import MOVE_INDICES

    return hook(MOVE_INDICES)(original, controller, host, device)


def register_transfer_hooks(config: KVCoreConfig | None = None) -> Any:
    """Install the plugin with its transfer hooks over :func:`bench_adapter`; its status."""
    from kvcore_sglang import plugin

    return plugin.register_hooks(config, with_transfers=True, adapter=bench_adapter())


@contextmanager
def serve_rule(on: bool) -> Iterator[SGLangAdapter]:
    """The adapter's serve-or-pass rule on or off inside, put back after."""
    adapter = bench_adapter()
    saved, adapter.serve_rule = adapter.serve_rule, on
    try:
        yield adapter
    finally:
        adapter.serve_rule = saved


@contextmanager
def using_mover(mover: Mover, *, rule: bool | None = None) -> Iterator[Mover]:
    """The adapter copying through ``mover`` inside (and its rule set to ``rule`` where
    given); the mover and rule in use before are put back after."""
    adapter = bench_adapter()
    saved_rule = adapter.serve_rule
    saved_mover = adapter.use_mover(mover)
    if rule is not None:
        adapter.serve_rule = rule
    try:
        yield mover
    finally:
        adapter.use_mover(saved_mover)
        adapter.serve_rule = saved_rule


@contextmanager
def call_indices_through(
    stand_in: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> Iterator[None]:
    """The adapter finding a call's indices through ``stand_in(its own finder)`` inside."""
    adapter = bench_adapter()
    had_own = "call_indices" in vars(adapter)
    saved = adapter.call_indices
    adapter.call_indices = stand_in(saved)  # type: ignore[method-assign]
    try:
        yield
    finally:
        if had_own:
            adapter.call_indices = saved  # type: ignore[method-assign]
        else:
            del adapter.call_indices
