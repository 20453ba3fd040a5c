"""What kvcore's SGLang plugin did to this process, and how to take it back.

SGLang has no way to unregister a hook: :class:`HookRegistry` keeps every registered
hook and, once ``apply_hooks`` has run, the wrapped attribute on its target class. An
:class:`Installation` records what it registered and what each target held before, so
:meth:`Installation.uninstall` can put back every original exactly. Where another plugin
hooked the same target, its hooks are applied again over the original without kvcore's.
Everything else kvcore keeps is held by the installation's
:class:`~kvcore_sglang.adapter.SGLangAdapter` (the settings read, the mover, the memos of
requests, layers and moved indices, the stock methods bound on pools, the warmed row
sizes), which is released and dropped with it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvcore.config import KVCoreConfig
from kvcore.engine_status import EngineStatus

if TYPE_CHECKING:
    from .adapter import SGLangAdapter

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
    adapter: SGLangAdapter | None = None
    """What the transfer hooks close over; None until hooks that need one are built."""
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

    def adapter_for(
        self, config: KVCoreConfig, chosen: SGLangAdapter | None = None
    ) -> SGLangAdapter:
        """The installation's adapter: ``chosen`` (a test's or a benchmark's), else the one
        it has, else one built from ``config`` (the plugin's hooks and a patched source's
        share it)."""
        from .adapter import SGLangAdapter

        with self._lock:
            if chosen is not None:
                self.adapter = chosen
            elif self.adapter is None:
                self.adapter = SGLangAdapter(config)
            return self.adapter

    @property
    def targets(self) -> list[str]:
        with self._lock:
            return list(self._targets)

    def uninstall(self) -> None:
        """Take back every hook this installation registered, restore each target's
        original attribute, and release and drop the adapter the hooks closed over. Safe to
        call twice."""
        from sglang.srt.plugins.hook_registry import HookRegistry

        with self._lock:
            targets, self._targets = self._targets, {}
            adapter, self.adapter = self.adapter, None
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
        if adapter is not None:
            adapter.release()


INSTALLATION = Installation()
