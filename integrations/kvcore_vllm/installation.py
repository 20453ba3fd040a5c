"""What kvcore's vLLM adapter did to this process, and how to take it back.

The plugin changes vLLM in two places: entries of the spec factory's registry (kvcore's
loader behind the default spec name, and under its own name) and, when transfers are on,
the handler attributes of each offloading worker kvcore's spec builds. An
:class:`Installation` makes those changes and records what each target held before, so
that :meth:`Installation.uninstall` puts every original back, the same object. It also
holds what the adapter remembers for the process: activation's decision and the targets a
patched source hooked. :meth:`Installation.set_aside` gives a test the state of a process
that never loaded the plugin.

Only the standard library and kvcore's torch-free modules are imported here: the plugin
module imports this one before vLLM may be imported.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from kvcore.engine_status import EngineStatus

_ABSENT = object()
_TRANSFERS_MODULE = "kvcore_vllm.transfers"


@dataclass(frozen=True)
class _FactoryEntry:
    """One registry name kvcore pointed at its loader, and what the name held before."""

    registry: MutableMapping[str, Any]
    name: str
    original: Any


@dataclass(frozen=True)
class _WorkerHandler:
    """One worker attribute kvcore put its handler in, and the handler it held before.

    Both are held weakly where their classes allow it: a worker vLLM has shut down, its KV
    tensors with it, must not be kept alive for an uninstall that may never come."""

    worker: Callable[[], Any]
    attribute: str
    original: Callable[[], Any]


@dataclass
class _Record:
    decided: EngineStatus | None = None
    factory: dict[str, _FactoryEntry] = field(default_factory=dict)
    handlers: list[_WorkerHandler] = field(default_factory=list)
    hooked: list[str] = field(default_factory=list)


def _held(obj: Any) -> Callable[[], Any]:
    """A weak reference to ``obj``, or a strong one where its class allows no weak
    references: recording what kvcore replaced must never fail the engine's call."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


class Installation:
    """The changes kvcore's vLLM adapter made in this process and what it decided."""

    def __init__(self) -> None:
        self._record = _Record()
        # Reentrant: set_aside uninstalls while holding it.
        self._lock = threading.RLock()

    @property
    def decided(self) -> EngineStatus | None:
        """What activation decided in this process; None before it runs (vLLM may load
        the plugin more than once, and only the first enabled decision counts)."""
        return self._record.decided

    def decide(self, status: EngineStatus) -> None:
        with self._lock:
            self._record.decided = status

    def point_factory_entry(self, name: str, loader: Callable[[], type], *, replace: bool) -> None:
        """Point the spec factory's ``name`` at ``loader``: always where ``replace``,
        otherwise only where ``name`` is free. What it held before kvcore first changed it
        is what :meth:`uninstall` puts back."""
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        registry = OffloadingSpecFactory._registry
        with self._lock:
            if name in registry and not replace:
                return
            if name not in self._record.factory:
                found = registry.get(name, _ABSENT)
                self._record.factory[name] = _FactoryEntry(registry, name, found)
            registry[name] = loader

    def replace_handler(self, worker: Any, attribute: str, handler: Any) -> None:
        """Put ``handler`` in ``worker.attribute``, remembering the handler it replaces."""
        original = getattr(worker, attribute)
        with self._lock:
            entry = _WorkerHandler(_held(worker), attribute, _held(original))
            self._record.handlers.append(entry)
        setattr(worker, attribute, handler)

    def note_hooked(self, target: str) -> None:
        """Record that a patched vLLM source hooked ``target``."""
        with self._lock:
            self._record.hooked.append(target)

    @property
    def hooked(self) -> tuple[str, ...]:
        """The targets a patched source hooked in this process."""
        with self._lock:
            return tuple(self._record.hooked)

    def uninstall(self) -> None:
        """Put back every factory entry and worker handler kvcore replaced, each the object
        it held before, and forget the decision, the hooked targets and the logged internal
        errors: the process is as one that never loaded the plugin. A worker vLLM already
        built must be idle (its jobs reported): jobs queued in kvcore's handler are reported
        by that handler only. Safe to call twice."""
        with self._lock:
            record, self._record = self._record, _Record()
        for entry in record.factory.values():
            if entry.original is _ABSENT:
                entry.registry.pop(entry.name, None)
            else:
                entry.registry[entry.name] = entry.original
        # Latest first: a worker built twice over gets the handler it held first.
        for replaced in reversed(record.handlers):
            worker, original = replaced.worker(), replaced.original()
            if worker is not None and original is not None:
                setattr(worker, replaced.attribute, original)
        # Loaded only where a spec built handlers; importing it would import torch and vLLM.
        transfers = sys.modules.get(_TRANSFERS_MODULE)
        if transfers is not None:
            transfers.INTERNAL_ERRORS.forget()

    @contextmanager
    def set_aside(self) -> Iterator[None]:
        """Inside, this installation is empty, as in a process that never loaded the plugin;
        on leaving, what was installed inside is uninstalled and what was recorded before is
        back. For tests, which share one process."""
        with self._lock:
            saved, self._record = self._record, _Record()
        try:
            yield
        finally:
            with self._lock:
                self.uninstall()
                self._record = saved


INSTALLATION = Installation()
