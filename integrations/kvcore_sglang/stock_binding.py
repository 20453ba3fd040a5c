"""Stock's method bound on an SGLang pool where the serve-or-pass rule passes its calls.

A pool whose calls the rule passes whatever their size (SGLang's ``kernel`` loads at page
size 64, for one) gets stock's method as an instance attribute, so that SGLang's later
calls reach stock with no kvcore frame at all. A pool whose loads pass at some sizes only
gets, once a reload passes, a binding for that reload's later layers
(:meth:`StockBindings.bind_passing_reload`): one frame that compares the index tensors
and calls stock, instead of the whole hook on every layer. A new reload that the rule
passes by its size alone is decided and counted there too; any other goes back to the
hook. Where SGLang's cache controller moves each transfer's indices first (kvcore's
``move_indices`` hook tells :meth:`StockBindings.indices_moved`), a passing reload's later
layers get stock's method itself, no frame at all, until the next move. A pool whose
backups pass below some size gets a gate for them
(:meth:`StockBindings.bind_backup_gate`), deciding each backup by its size alone.
:meth:`StockBindings.restore` takes every such binding back when the hooks go. Apart from
the hooks because it is state of its own (the bound pools, weakly) and acts on the pool,
not on a copy.
"""

from __future__ import annotations

import logging
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

from kvcore.planning import serve_rule

from .hook_mover import HookMover, count_request_pass

logger = logging.getLogger("kvcore")


def _outermost(pool: Any, method: str, original: Callable[..., Any]) -> bool:
    """Whether kvcore's hook is the outermost layer of the pool class's method, so that
    binding ``original`` on the pool skips nothing but kvcore: the class attribute is
    ``original`` itself, or a wrapper of it (SGLang's HookRegistry and kvcore's patched
    source both wrap with functools.wraps). Another plugin's hook around kvcore's would be
    skipped by the binding, so then there is none."""
    bound = getattr(type(pool), method, None)
    return bound is original or getattr(bound, "__wrapped__", None) is original


PassLimit = Callable[[Any, str], tuple[int, str]]
"""``(pool, io_backend)``: the fewest tokens from which the serve-or-pass rule may serve
the pool's loads with that io backend, and its reason to pass below; ``(0, "")`` where
kvcore's hook must decide every reload."""


def _limit_or_hook(pass_limit: PassLimit, pool: Any, io_backend: str) -> tuple[int, str]:
    """``pass_limit``'s answer, asked once per pool and io backend; where asking fails,
    ``(0, "")``: every call then goes to kvcore's hook, which counts its own failures and
    runs stock."""
    try:
        return pass_limit(pool, io_backend)
    except Exception:
        logger.exception("kvcore: the serve-or-pass rule's size for %s failed", io_backend)
        return 0, ""


def _passes_by_size(
    movers: HookMover, pass_limit: PassLimit, count_pass: Callable[[str], None]
) -> Callable[[Any, str, Any], bool]:
    """A binding's size check, ``(pool, io_backend, host_indices) -> bool``: True where the
    rule passes a call of that many tokens, the pass counted as kvcore's hook counts it (in
    the mover's :attr:`~kvcore_sglang.hook_mover.HookMover.pass_counts`, else
    ``count_pass``); False where the hook must decide the call. ``pass_limit`` is asked once
    per io backend: a pool's layout, page size and kind are fixed, and so is the rule's
    setting in an engine's life."""
    limits: dict[str, tuple[int, str]] = {}

    def passes(pool: Any, io_backend: str, host: Any) -> bool:
        limit = limits.get(io_backend)
        if limit is None:
            limit = limits[io_backend] = _limit_or_hook(pass_limit, pool, io_backend)
        serves_from, reason = limit
        try:
            tokens = host.numel()
        except AttributeError:  # not a tensor: the hook decides
            return False
        if tokens >= serves_from:
            return False
        counts = movers.pass_counts
        if counts is None:
            count_pass(reason)
        else:
            counts[reason] += 1
        return True

    return passes


class _Passing:
    """One pool's state for its passing reloads, read by its binding on every new reload."""

    __slots__ = ("device", "host", "later_layer", "method", "moved_first", "skipping")

    def __init__(self, method: str, moved_first: bool) -> None:
        self.method = method
        self.host: Any = None
        self.device: Any = None
        """The index tensors of the pool's latest passing reload, until the next reload."""
        self.moved_first = moved_first
        """Whether SGLang's controller moves the indices of each of the pool's transfers
        first (:func:`indices_moved`)."""
        self.skipping = False
        """Whether stock's method itself is bound on the pool now."""
        self.later_layer: Callable[..., Any] | None = None


def _bind_later_layers(pool: Any, state: _Passing, original: Callable[..., Any]) -> None:
    """For the rest of the passing reload just decided: stock's method itself where a move
    comes before the pool's next reload (which takes it off again), else the checking
    binding. A reload on such a pool with no move before it (none in SGLang 0.5.23's load
    path; the hook only marks the pool its cache controller names) would run stock unasked:
    exact, but neither decided nor counted."""
    if state.moved_first:
        pool.__dict__[state.method] = types.MethodType(original, pool)
        state.skipping = True
    else:
        pool.__dict__[state.method] = state.later_layer


class StockBindings:
    """The stock bindings one adapter set on SGLang's pools, counted in its mover's
    metrics (``movers``)."""

    def __init__(self, movers: HookMover) -> None:
        self._movers = movers
        # Pool -> the methods kvcore gave back to stock on that pool (instance attributes).
        self.bypassed: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
        # Pool -> the methods bound for the later layers of a reload that passes.
        self.passing: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
        # Pool -> its state for passing reloads (:class:`_Passing`).
        self._passing_state: weakref.WeakKeyDictionary[Any, _Passing] = weakref.WeakKeyDictionary()
        # Pools kvcore's move_indices hook saw moved before any of their reloads passed.
        self._moved_first: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lock = threading.Lock()

    def bypass_if_never(
        self,
        original: Callable[..., Any],
        pool: Any,
        method: str,
        rule: serve_rule.SGLangRule | None,
        io_backend: str,
    ) -> bool:
        """Where the call's ``rule`` never serves (whatever the size), bind stock's method on
        the pool itself, so that SGLang's later calls reach stock with no kvcore frame at all
        (only where kvcore's hook is the outermost layer of the method, so the binding skips
        no other plugin's hook); True when the call should run stock now.

        SGLang's cache controller calls a pool with one io backend for its life; a call with
        another one also lands in stock, which is always exact. :meth:`restore` takes the
        bindings back.
        """
        if rule is None or not rule.never:
            return False
        if method in self.bypassed.get(pool, ()):
            return True  # bound already, yet called through the class: decided, counted
        if _outermost(pool, method, original):
            try:
                setattr(pool, method, types.MethodType(original, pool))
                with self._lock:
                    self.bypassed.setdefault(pool, set()).add(method)
            except (AttributeError, TypeError):  # a pool that takes no attributes: per call
                pass
        count_request_pass(self._movers.mover(), rule.reason)
        logger.info(
            "kvcore: %s.%s with io backend %s, layout %s, page size %d runs SGLang's stock "
            "copy (%s)",
            type(pool).__name__,
            method,
            io_backend,
            pool.layout,
            pool.page_size,
            rule.reason,
        )
        return True

    def bind_passing_reload(
        self,
        hook: Callable[..., Any],
        original: Callable[..., Any],
        pool: Any,
        method: str,
        host_indices: Any,
        device_indices: Any,
        pass_limit: PassLimit,
        count_pass: Callable[[str], None],
    ) -> None:
        """Bind, on the pool, the later layers of a reload that passes (its first call was
        decided and counted): a call with the reload's two index tensors runs stock at once.
        Any other call is a new reload: where the rule passes it by its size alone
        (``pass_limit``, asked once per io backend), the binding counts the pass (in the
        mover's :attr:`~kvcore_sglang.hook_mover.HookMover.pass_counts`, else
        ``count_pass``) and answers it and its later layers; otherwise the binding takes
        itself off and the call goes to ``hook`` (kvcore's AROUND hook, ``original`` as the
        stock method it wraps) to be decided in full. Where the pool's reloads come after a
        move (:meth:`indices_moved`), a passing reload's later layers get stock's method
        itself instead, no frame at all.

        Only where kvcore's hook is the outermost layer of the method (another plugin's hook
        would be skipped otherwise) and the pool takes attributes. Identity alone decides: a
        wrong match only sends a call to stock, which is always exact. The binding holds the two
        tensors until the next reload comes, as the pool's latest request does.
        """
        if not _outermost(pool, method, original):
            return
        state = self._passing_state.get(pool)
        if state is None:
            passes = _passes_by_size(self._movers, pass_limit, count_pass)
            state = self._new_passing(hook, original, pool, method, passes)
            if state is None:
                return
        state.host, state.device = host_indices, device_indices
        _bind_later_layers(pool, state, original)

    def indices_moved(self, pool: Any) -> None:
        """SGLang's cache controller moved the indices of its next transfer on ``pool`` (kvcore's
        ``move_indices`` hook says so, before stock's layers could run): from now on a passing
        reload on the pool may bind stock's method itself for its later layers, and one that did
        goes back to its checking binding, so that the next reload reaches kvcore to be decided.
        That binding still holds the last passing reload's index tensors: a later layer of it
        (were a move to come in its midst) still runs stock, counted once."""
        try:
            state = self._passing_state.get(pool)
            if state is None:
                self._moved_first.add(pool)
                return
        except TypeError:  # a pool that takes no weak reference: its passes keep the hook
            return
        state.moved_first = True
        if state.skipping:
            state.skipping = False
            pool.__dict__[state.method] = state.later_layer

    def _new_passing(
        self,
        hook: Callable[..., Any],
        original: Callable[..., Any],
        pool: Any,
        method: str,
        passes: Callable[[Any, str, Any], bool],
    ) -> _Passing | None:
        """The pool's state for passing reloads and its checking binding, made once per pool;
        None for a pool that takes no attributes. The binding holds the pool weakly, so that
        the bindings keep no pool alive."""
        try:
            pool_ref = weakref.ref(pool)
        except TypeError:
            return None
        state = _Passing(method, pool in self._moved_first)

        def later_layer(
            device_pool: Any,
            host: Any,
            device: Any,
            layer_id: int,
            io_backend: str,
            *,
            is_draft: bool = False,
        ) -> Any:
            bound = pool_ref()
            if host is not state.host or device is not state.device:
                if not passes(bound, io_backend, host):
                    state.host = state.device = None
                    if bound.__dict__.get(method) is later_layer:
                        del bound.__dict__[method]
                    return hook(
                        original,
                        bound,
                        device_pool,
                        host,
                        device,
                        layer_id,
                        io_backend,
                        is_draft=is_draft,
                    )
                state.host, state.device = host, device
                if state.moved_first:
                    bound.__dict__[method] = types.MethodType(original, bound)
                    state.skipping = True
            if is_draft:
                return original(
                    bound, device_pool, host, device, layer_id, io_backend, is_draft=True
                )
            return original(bound, device_pool, host, device, layer_id, io_backend)

        state.later_layer = later_layer
        try:
            setattr(pool, method, later_layer)
        except (AttributeError, TypeError):  # a pool that takes no attributes: the hook decides
            return None
        with self._lock:
            self.passing.setdefault(pool, set()).add(method)
            self._passing_state[pool] = state
        return state

    def bind_backup_gate(
        self,
        hook: Callable[..., Any],
        original: Callable[..., Any],
        pool: Any,
        method: str,
        pass_limit: PassLimit,
        count_pass: Callable[[str], None],
    ) -> None:
        """Where a backup passed by its size (decided and counted by ``hook``), bind on the pool
        a gate for its later backups, each a request of its own: one of fewer tokens than the
        rule serves from (``pass_limit``, asked once per io backend) runs stock at once, counted
        as the hook counts it (in the mover's
        :attr:`~kvcore_sglang.hook_mover.HookMover.pass_counts`, else ``count_pass``); any
        other goes to ``hook``, which decides it in full, and the gate stays. Once per pool,
        only where kvcore's hook is the outermost layer of the method and the pool takes
        attributes; the gate holds the pool weakly."""
        if method in self.passing.get(pool, ()) or not _outermost(pool, method, original):
            return
        try:
            pool_ref = weakref.ref(pool)
        except TypeError:
            return
        passes = _passes_by_size(self._movers, pass_limit, count_pass)

        def gate(device_pool: Any, host: Any, device: Any, io_backend: str) -> Any:
            bound = pool_ref()
            if passes(bound, io_backend, host):
                return original(bound, device_pool, host, device, io_backend)
            return hook(original, bound, device_pool, host, device, io_backend)

        try:
            setattr(pool, method, gate)
        except (AttributeError, TypeError):  # a pool that takes no attributes: the hook decides
            return
        with self._lock:
            self.passing.setdefault(pool, set()).add(method)

    def restore(self) -> None:
        """Take back every stock binding these methods set on a pool."""
        with self._lock:
            pools = [*self.bypassed.items(), *self.passing.items()]
            self.bypassed.clear()
            self.passing.clear()
            self._passing_state.clear()
            self._moved_first.clear()
        for pool, methods in pools:
            for method in methods:
                pool.__dict__.pop(method, None)
