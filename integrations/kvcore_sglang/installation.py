"""What kvcore's SGLang plugin did to this process, and how to take it back.

SGLang has no way to unregister a hook: :class:`HookRegistry` keeps every registered
hook and, once ``apply_hooks`` has run, the wrapped attribute on its target class. An
:class:`Installation` records what it registered and what each target held before, so
:meth:`Installation.uninstall` can put back every original exactly. Where another plugin
hooked the same target, its hooks are applied again over the original without kvcore's.
Everything else kvcore keeps (the mover, the memos of requests, layers and moved indices,
the stock methods bound on pools, the warmed row sizes) is dropped with it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvcore.engine_status import EngineStatus

_MISSING = object()


@dataclass
class _Target:
    """One hooked target: the attribute's owner, its name, and what it held before."""

    owner: Any
    name: str
    original: Any
    hook: Callable[..., Any]


@dataclass
class Installation:
    """The hooks kvcore registered with SGLang in this process and the state behind them."""

    status: EngineStatus | None = None
    """The status of the installed hooks; None while nothing is installed."""
    _targets: dict[str, _Target] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def register(self, target: str, hook: Callable[..., Any]) -> None:
        """Register ``hook`` AROUND ``target`` with SGLang's registry, remembering what the
        target holds now (its class attribute, before any ``apply_hooks``)."""
        import pkgutil

        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        owner_path, name = target.rsplit(".", 1)
        owner = pkgutil.resolve_name(owner_path)
        original = vars(owner).get(name, _MISSING) if isinstance(owner, type) else _MISSING
        if original is _MISSING:
            original = getattr(owner, name, _MISSING)
        with self._lock:
            self._targets[target] = _Target(owner, name, original, hook)
        HookRegistry.register(target, hook, HookType.AROUND)

    @property
    def targets(self) -> list[str]:
        with self._lock:
            return list(self._targets)

    def uninstall(self) -> None:
        """Take back every hook this installation registered, restore each target's
        original attribute, and drop the state the hooks kept. Safe to call twice."""
        from sglang.srt.plugins.hook_registry import HookRegistry

        from . import pool_warm_up, transfers

        with self._lock:
            targets, self._targets = self._targets, {}
            self.status = None
        shared = False
        for target, entry in targets.items():
            others = [h for h in HookRegistry._hooks.get(target, []) if h[1] is not entry.hook]
            if others:
                HookRegistry._hooks[target] = others
            else:
                HookRegistry._hooks.pop(target, None)
            if target not in HookRegistry._patched:
                continue  # registered, never applied: the attribute is still the original
            HookRegistry._patched.discard(target)
            if entry.original is _MISSING:
                delattr(entry.owner, entry.name)
            else:
                setattr(entry.owner, entry.name, entry.original)
            shared = shared or bool(others)
        if shared:
            # Another plugin's hooks on a target stay, applied again around the original.
            HookRegistry.apply_hooks()
        transfers.forget()
        pool_warm_up.forget()


INSTALLATION = Installation()
