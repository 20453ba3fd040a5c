"""What a patched SGLang source calls, and the adapter's description of its patch sets.

A patched module ends with one line per target, ``Class.method =
_kvcore_hook("<target>", Class.method)`` (see patches/README.md). :func:`hook` returns
the stock method unchanged when patched mode is off, and otherwise a wrapper that runs
the plugin's own AROUND hook for that target (:data:`kvcore_sglang.host_slots.HOOKS`,
:func:`kvcore_sglang.transfers.hooks`, :func:`kvcore_sglang.pool_warm_up.hooks`, over the
installation's adapter), gated
as the plugin gates it: the targets of ``guard.TRANSFER_GROUPS`` only under
``KVCORE_TRANSFERS``, those of ``guard.HOST_MEMORY_GROUPS`` only under
``KVCORE_HOST_POOL``, those of ``guard.PINNING_GROUPS`` only under a non-zero
``KVCORE_HOST_POOL_PIN_FIRST`` (:mod:`kvcore_sglang.pool_pinning`). A release's patch set
hooks every target of the guard's groups recorded for that release (not the functions the
groups merely depend on).

Patched mode is on in a patched build unless ``KVCORE_ENABLE`` is set and leaves sglang
out (``KVCORE_ENABLE=0`` turns it off), or a ``KVCORE_*`` variable is bad (one logged line
says which). With the plugin enabled too, the plugin still registers its hooks, but every
target the patch hooked is marked patched in SGLang's HookRegistry, whose ``apply_hooks``
then leaves it alone: each hook runs once per call.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from kvcore.config import engine_config
from kvcore.patching.mode import patched_mode_enabled as engine_patched_mode
from kvcore.patching.spec import EngineSpec, PatchTarget

from . import DISTRIBUTION, ENGINE, guard

logger = logging.getLogger("kvcore.sglang")

# Set on every function the patch wrapped: the target it stands for.
PATCH_MARK = "__kvcore_patch__"

_hooked: list[str] = []


def patched_mode_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """On unless ``KVCORE_ENABLE`` is set and does not name sglang, or a variable is bad
    (:func:`kvcore.patching.mode.patched_mode_enabled`)."""
    return engine_patched_mode("SGLang", ENGINE, environ)


def hook(target: str, original: Any) -> Any:
    """What the patched module binds in place of ``original`` (the stock ``target``)."""
    try:
        if getattr(original, PATCH_MARK, None) == target:
            # Hooked already (the hook line ran twice on the same class); keep the claim.
            _claim_in_registry(target)
            return original
        implementation = _implementation(target)
        if implementation is None:
            return original
        _claim_in_registry(target)
    except Exception:
        # A failure here must leave SGLang importable and stock, never stop it.
        logger.exception("kvcore: hooking %s failed; it stays stock", target)
        return original

    @functools.wraps(original)
    def hooked(*args: Any, **kwargs: Any) -> Any:
        return implementation(original, *args, **kwargs)

    setattr(hooked, PATCH_MARK, target)
    _hooked.append(target)
    return hooked


def hooked_targets() -> tuple[str, ...]:
    """The targets the patched source hooked in this process."""
    return tuple(_hooked)


@contextlib.contextmanager
def hooks_recorded_apart() -> Iterator[None]:
    """Record the targets hooked inside the block apart from this process's record, which
    is back afterwards as it was: for a check that binds hooks by hand."""
    global _hooked
    saved, _hooked = _hooked, []
    try:
        yield
    finally:
        _hooked = saved


def _implementation(target: str) -> Callable[..., Any] | None:
    config = engine_config("SGLang")
    if config is None or not patched_mode_enabled():
        return None
    config.configure_logging()
    # Imported here: both import torch, and only a hooked target needs them.
    if target in _group_targets(guard.TRANSFER_GROUPS):
        if not config.transfers:
            return None
        from . import pool_warm_up, transfers
        from .installation import INSTALLATION

        adapter = INSTALLATION.adapter_for(config)
        return {**transfers.hooks(adapter), **pool_warm_up.hooks(adapter)}[target]
    if target in _group_targets(guard.HOST_MEMORY_GROUPS):
        if not config.host_pool:
            return None
        from . import host_memory

        return host_memory.HOOKS[target]
    if target in _group_targets(guard.PINNING_GROUPS):
        if not config.host_pool_pin_first:
            return None
        from . import pool_pinning

        return pool_pinning.hooks(config)[target]
    from . import host_slots

    return {f"{guard.HOST_KV_CACHE}.{name}": h for name, h in host_slots.HOOKS.items()}[target]


def _claim_in_registry(target: str) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    # apply_hooks skips the targets it counts as patched, whether the plugin registered
    # its hook for this target before this module was imported or registers it later.
    HookRegistry._patched.add(target)


def _group_targets(groups: Mapping[str, tuple[str, ...]]) -> tuple[str, ...]:
    return tuple(target for targets in groups.values() for target in targets)


def _targets(version: str) -> tuple[PatchTarget, ...]:
    """Every target of the plugin's groups that the guard recorded for ``version``."""
    recorded = guard.FINGERPRINTS[version]
    every = _group_targets(guard.EVERY_GROUP)
    return tuple(PatchTarget.from_dotted(t) for t in every if t in recorded)


PATCH_SPEC = EngineSpec(
    engine=ENGINE,
    package="sglang",
    distribution=DISTRIBUTION,
    hook_module=__name__,
    versions=tuple(guard.FINGERPRINTS),
    targets=_targets,
    source_changes=guard.source_changes,
)
