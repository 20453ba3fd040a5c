"""What a layer-by-layer SGLang reload keeps between its calls, so that later layers cost little.

SGLang reloads a prefix with one ``load_to_device_per_layer`` call per layer, every call
with the same two index tensors, back to back on its load stream. kvcore decides a request
(serve or pass, and the plan) on its first call and keeps the decision in a
:class:`LoadRequest`; every later call of the same request is recognised by the identity
and version counters of its index tensors and goes straight to stock (a pass) or to one
submission of that layer's buffers (:class:`PoolLayers`), with nothing planned again.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from kvcore.mover import PreparedLayers
from kvcore.planning.host_run import HostRunFound
from kvcore.planning.layers import LayerPairs
from kvcore.planning.path_policy import PathPolicy
from kvcore.planning.plans import TransferPlan
from kvcore.planning.transfer_sides import CheckedSides
from kvcore.runs import version_of

from .host_layouts import BlockRows

_MAX_REQUESTS = 64


def weakly(obj: Any) -> Any:
    try:
        return weakref.ref(obj)
    except TypeError:  # None, or a type without weak references: held as it is
        return obj


def _layer_key(device_pool: Any, key: Hashable) -> Hashable:
    """A host pool's entry for one device pool's layer (a pool may serve several)."""
    return (id(device_pool), key)


def _is(kept: Any, given: Any) -> bool:
    if isinstance(kept, weakref.ref):
        return kept() is given
    return kept is given


class LoadCall(NamedTuple):
    """A ``load_to_device_per_layer`` call's arguments but its layer, which every layer's call
    of one reload shares: in the order :meth:`LoadRequests.start` takes them, before the
    path policy."""

    pool: Any
    device_pool: Any
    host_indices: Any
    device_indices: Any
    io_backend: str
    is_draft: bool


@dataclass(eq=False, slots=True)
class LoadRequest:
    """One reload's decision, kept while its calls come in.

    It holds the index tensors it was decided for, so neither can be freed and its id
    reused while it is kept; with their version counters (bumped by every in-place torch
    write) identity says the indices are unchanged. The pools are held weakly.
    """

    pool: Any
    device_pool: Any
    host_indices: torch.Tensor
    host_version: int | None
    """None for an inference tensor (no counter): such a request only ever passes."""
    device_indices: torch.Tensor
    device_version: int | None
    io_backend: str
    is_draft: bool
    policy: PathPolicy
    passes: str | None = None
    """Why every call of the request goes to stock; None while kvcore serves it."""
    plan: TransferPlan | None = None
    """Planned on the first layer kvcore serves, for every layer after it."""
    call_indices: Any = None
    """The indices kvcore plans from (the adapter's CallIndices), found on the first call."""
    host_runs: HostRunFound | None = None
    """The host slots as one run where the serve-or-pass rule found them so, for the plan."""
    prepared: PreparedLayers | None = None
    """``plan`` made ready for every later layer (:meth:`kvcore.mover.Mover.prepare_layers`)."""
    pool_layers: dict[Hashable, LayerBuffers] | None = None
    """The host pool's :class:`PoolLayers` entries, for a later layer's lookup."""

    def matches(
        self,
        pool: Any,
        device_pool: Any,
        host_indices: Any,
        device_indices: Any,
        io_backend: str,
        is_draft: bool,
        policy: PathPolicy,
    ) -> bool:
        return (
            self.host_indices is host_indices
            and self.device_indices is device_indices
            and self.host_version == version_of(host_indices)
            and self.device_version == version_of(device_indices)
            and self.io_backend == io_backend
            and self.is_draft == is_draft
            and self.policy is policy
            and _is(self.pool, pool)
            and _is(self.device_pool, device_pool)
        )

    def passing_for(self, host_indices: Any, device_indices: Any) -> bool:
        """Whether a call with these index tensors belongs to this request and the request
        passes to stock: the whole cost of a later layer that passes. Identity alone
        decides: a wrong match only sends a call to stock, which is always exact."""
        return (
            self.passes is not None
            and self.host_indices is host_indices
            and self.device_indices is device_indices
        )

    def kept_layer(self, device_pool: Any, key: Hashable) -> LayerBuffers | None:
        """The layer buffers the host pool keeps under ``key`` for ``device_pool`` (the
        caller has checked ``device_pool`` is this request's)."""
        kept = self.pool_layers
        return kept.get(_layer_key(device_pool, key)) if kept is not None else None


class LoadRequests:
    """The latest :class:`LoadRequest` of each (host pool, device pool).

    Keyed per pool pair because one SGLang load interleaves several pools layer by layer
    (a model's KV pool and its DSA indexer pool, for one).
    """

    def __init__(self) -> None:
        self._latest: dict[tuple[int, int], LoadRequest] = {}
        self._lock = threading.Lock()

    def latest(self, pool: Any, device_pool: Any) -> LoadRequest | None:
        """The pools' latest request, unchecked (:meth:`LoadRequest.matches` checks): the one
        lookup a load call makes."""
        return self._latest.get((id(pool), id(device_pool)))

    def start(
        self,
        pool: Any,
        device_pool: Any,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        io_backend: str,
        is_draft: bool,
        policy: PathPolicy,
    ) -> LoadRequest:
        request = LoadRequest(
            weakly(pool),
            weakly(device_pool),
            host_indices,
            version_of(host_indices),
            device_indices,
            version_of(device_indices),
            io_backend,
            is_draft,
            policy,
        )
        with self._lock:
            if len(self._latest) >= _MAX_REQUESTS:
                self._latest.clear()
            self._latest[(id(pool), id(device_pool))] = request
        return request

    def clear(self) -> None:
        with self._lock:
            self._latest.clear()

    def __len__(self) -> int:
        return len(self._latest)


@dataclass(frozen=True, eq=False)
class LayerBuffers:
    """The buffer pairs one layer's load copies, checked once for the pool's life."""

    device_pool: Any
    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    """(host layer view, device layer) as the job builder gave them."""
    layered: LayerPairs
    """The same pairs, source first, as one submission takes them."""
    first_sides: CheckedSides
    """The first pair checked as a load's sides, which each request's plan is made for."""
    rows: BlockRows
    """The host views' geometry, which maps a request's host slots to their rows."""


def layer_in(
    layers: dict[Hashable, LayerBuffers] | None, device_pool: Any, key: Hashable
) -> LayerBuffers | None:
    """The entry of a host pool's ``layers`` (:meth:`PoolLayers.kept`) for ``device_pool``'s
    layer ``key``; None where there is none, or where it was kept for another device pool
    whose id this one reuses."""
    found = layers.get(_layer_key(device_pool, key)) if layers is not None else None
    if found is None or not _is(found.device_pool, device_pool):
        return None
    return found


class PoolLayers:
    """Per host pool, each layer's :class:`LayerBuffers` (a pool's buffers are allocated
    once, when SGLang builds it, and keep their addresses for its life).

    Held weakly per pool, so a pool SGLang drops takes its entries with it.
    """

    def __init__(self) -> None:
        self._by_pool: weakref.WeakKeyDictionary[Any, dict[Hashable, LayerBuffers]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def get(self, pool: Any, device_pool: Any, key: Hashable) -> LayerBuffers | None:
        return layer_in(self.kept(pool), device_pool, key)

    def kept(self, pool: Any) -> dict[Hashable, LayerBuffers] | None:
        """The pool's entries, keyed by :func:`_layer_key` (None: none yet)."""
        try:
            return self._by_pool.get(pool)
        except TypeError:
            return None

    def put(
        self, pool: Any, device_pool: Any, key: Hashable, buffers: LayerBuffers
    ) -> dict[Hashable, LayerBuffers] | None:
        """Keep ``buffers``; returns the pool's entries (:meth:`kept`)."""
        with self._lock:
            try:
                kept = self._by_pool.setdefault(pool, {})
            except TypeError:  # a pool without weak references: nothing is kept
                return None
            kept[_layer_key(device_pool, key)] = buffers
            return kept

    def clear(self) -> None:
        with self._lock:
            self._by_pool = weakref.WeakKeyDictionary()
