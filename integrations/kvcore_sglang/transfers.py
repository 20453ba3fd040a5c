"""SGLang host-pool transfers through kvcore's mover: MHA, MLA and the DSA indexer.

AROUND hooks on ``load_to_device_per_layer`` and ``backup_from_device_all_layer`` of
``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost`` and ``DSAIndexerPoolHost``, for the
``layer_first``, ``page_first`` and ``page_first_direct`` host layouts
(:mod:`kvcore_sglang.host_layouts` gives each a dense row view per layer). A call is
served only when every plan it needs is decided up front and none is a fallback;
otherwise the stock method runs unchanged, once, and the reason is counted in
``METRICS.record_fallback``.

Where the indices come from (``HiCacheController.move_indices``): with ``direct`` both
index tensors reach the pool on the CPU (SGLang brings the device indices back itself).
With ``kernel`` (SGLang's default) the host indices are moved to the GPU there, and the
device indices are computed on the GPU by the device allocator: no CPU copy of them
exists. An AROUND hook on ``move_indices`` remembers the CPU host indices of each moved
tensor (:class:`HostIndexMemo`); a ``kernel`` call is planned from those alone, the
device indices staying on the GPU, unread (:func:`kvcore.mover.plan_device_indexed`:
staged or gather). A ``kernel`` call whose host indices were not remembered runs stock
(``sglang_indices_on_device``). kvcore never reads a device tensor back to plan.

Which host layer and device buffer a call copies differs between SGLang releases
(0.5.22 maps layers through the device pool's layer sharding, 0.5.23 through the slot
maps its pools keep): each hook plans with the builders of the release whose recorded
fingerprint (:mod:`kvcore_sglang.guard`) the installed method's source has
(:data:`kvcore_sglang.pool_jobs.MHA_JOBS` and the like); a source none was written for
runs stock (``sglang_source_unknown``).

SGLang reloads layer by layer with the same two index tensors: the first layer's plan
(bounds, runs, path) is kept (:class:`PlanMemo`) and rebound to every later layer's
buffers, so a reload plans once, not once per layer. The pairs of one call (a layer's K
and V; every layer of a backup) move in one submission where they share a row size
(:meth:`kvcore.mover.Mover.execute_layers`), their checks kept per pool
(:class:`LayerPairsMemo`).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvcore.config import KVCoreConfig
from kvcore.direction import Direction
from kvcore.layers import LayerPairs, layer_pairs
from kvcore.metrics import METRICS
from kvcore.mover import (
    Mover,
    Submission,
    TransferPath,
    TransferPlan,
    plan,
    plan_device_indexed,
    policy_from_config,
    submissions,
)

from . import guard, pool_jobs
from .pool_jobs import Job, PoolJobs
from .served_layouts import layout_reason

_POOL_PACKAGE = "sglang.srt.mem_cache.pool_host"
MHA_POOL = f"{_POOL_PACKAGE}.mha.MHATokenToKVPoolHost"
MLA_POOL = f"{_POOL_PACKAGE}.mla.MLATokenToKVPoolHost"
DSA_POOL = f"{_POOL_PACKAGE}.dsa.DSAIndexerPoolHost"
# The index dtypes kvcore.runs.check_index accepts.
_INDEX_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})

_mover: Mover | None = None
_mover_lock = threading.Lock()


def mover() -> Mover:
    """This process's mover, built from the KVCORE_* configuration on first use."""
    global _mover
    with _mover_lock:
        # SGLang's load and backup threads may both arrive first; one staging buffer only.
        if _mover is None:
            config = KVCoreConfig.from_env()
            metrics = METRICS if config.metrics else None
            _mover = Mover(policy_from_config(config), metrics=metrics)
        return _mover


def _class_name(pool: Any) -> str:
    return f"{type(pool).__module__}.{type(pool).__qualname__}"


class HostIndexMemo:
    """The CPU host indices of each host-index tensor ``move_indices`` moved to the GPU.

    Held while the moved tensor lives (SGLang keeps it until the transfer is queued);
    an entry is valid only while the CPU tensor is unmodified (its version counter).
    Keyed by identity: tensors compare element-wise, so they cannot be dict keys.
    """

    def __init__(self) -> None:
        self._moved: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor, int]] = {}
        self._lock = threading.Lock()

    def remember(self, moved: torch.Tensor, on_cpu: torch.Tensor) -> None:
        key = id(moved)
        alive = weakref.ref(moved, lambda _: self._forget(key))
        with self._lock:
            self._moved[key] = (alive, on_cpu, on_cpu._version)

    def recall(self, moved: torch.Tensor) -> torch.Tensor | None:
        with self._lock:
            entry = self._moved.get(id(moved))
        if entry is None or entry[0]() is not moved or entry[1]._version != entry[2]:
            return None
        return entry[1]

    def _forget(self, key: int) -> None:
        with self._lock:
            entry = self._moved.get(key)
            if entry is not None and entry[0]() is None:
                del self._moved[key]

    def __len__(self) -> int:
        with self._lock:
            return len(self._moved)


HOST_INDEX_MEMO = HostIndexMemo()


def move_indices_hook(
    original: Callable[..., Any], controller: Any, host_indices: Any, device_indices: Any
) -> Any:
    """AROUND ``HiCacheController.move_indices``: remember host indices moved to the GPU."""
    moved = original(controller, host_indices, device_indices)
    moved_host = moved[0] if isinstance(moved, tuple) and moved else None
    if (
        isinstance(host_indices, torch.Tensor)
        and host_indices.device.type == "cpu"
        and isinstance(moved_host, torch.Tensor)
        and moved_host is not host_indices
        and moved_host.device.type != "cpu"
    ):
        HOST_INDEX_MEMO.remember(moved_host, host_indices)
    return moved


@dataclass(frozen=True, eq=False)
class _MemoEntry:
    key: tuple[Any, ...]
    plan: TransferPlan


class PlanMemo:
    """The plan of the last load served, for the next load with the same indices.

    The entry holds the index tensors it was made for, so none of them can be freed and
    its id reused while it is kept: identity plus the tensors' version counters (bumped by
    every in-place torch write) says the indices are unchanged. A device index that stays
    on the device is never read, so its values do not matter to the plan; only the
    CPU-side values the plan came from do. The pools are held weakly and the kept plan
    without its buffers, so a pool SGLang drops (and its pinned memory) is not kept alive.
    """

    def __init__(self) -> None:
        self._entry: _MemoEntry | None = None
        self._lock = threading.Lock()

    @staticmethod
    def key(pool: Any, device_pool: Any, indices: CallIndices, io_backend: str) -> tuple[Any, ...]:
        host, device = indices.host, indices.device
        pools = (_weakly(pool), _weakly(device_pool))
        return (*pools, host, host._version, device, device._version, io_backend)

    def recall(self, key: tuple[Any, ...]) -> TransferPlan | None:
        with self._lock:
            entry = self._entry
        if entry is None or not all(map(_same, entry.key, key)):
            return None
        return entry.plan

    def remember(self, key: tuple[Any, ...], plan: TransferPlan) -> None:
        detached = dataclasses.replace(plan, src=_no_rows(plan.src), dst=_no_rows(plan.dst))
        with self._lock:
            self._entry = _MemoEntry(key, detached)


def _weakly(obj: Any) -> Any:
    try:
        return weakref.ref(obj)
    except TypeError:  # None, or a type without weak references: held as it is
        return obj


def _same(kept: Any, given: Any) -> bool:
    if isinstance(kept, weakref.ref):
        given = given() if isinstance(given, weakref.ref) else given
        return given is not None and kept() is given
    return kept is given or (type(kept) in (int, str) and kept == given)


def _no_rows(tensor: torch.Tensor) -> torch.Tensor:
    """An empty tensor like ``tensor`` (device, dtype, row shape) that holds no memory of it;
    :meth:`TransferPlan.rebind` gives the plan real buffers again."""
    return torch.empty((0, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)


LOAD_PLANS = PlanMemo()


@dataclass(frozen=True)
class CallIndices:
    """A call's indices as kvcore plans from them."""

    host: torch.Tensor
    """On the CPU: the call's own, or the ones ``move_indices`` was given."""
    device: torch.Tensor
    device_opaque: bool
    """The device indices are on the device: planned around, never read."""


def _call_indices(
    pool: Any, served_class: str, host_indices: Any, device_indices: Any, io_backend: str
) -> CallIndices | str:
    """The indices to plan from, or why the call must run stock before looking at its layers."""
    if _class_name(pool) != served_class:
        # Subclasses (MXFP8, HiSparse...) reach here through super() with their own data.
        return "sglang_pool_class"
    reason = layout_reason(pool.layout, io_backend)
    if reason is not None:
        return reason
    for indices in (host_indices, device_indices):
        if not isinstance(indices, torch.Tensor):
            return "sglang_indices_on_device"
        if indices.dim() != 1 or indices.dtype not in _INDEX_DTYPES:
            return "sglang_index_dtype"
    host = host_indices
    if host.device.type != "cpu":
        recalled = HOST_INDEX_MEMO.recall(host) if io_backend == "kernel" else None
        if recalled is None or recalled.shape != host.shape or recalled.dtype != host.dtype:
            return "sglang_indices_on_device"
        host = recalled
    opaque = device_indices.device.type != "cpu"
    if opaque and (io_backend != "kernel" or pool.layout == "page_first_direct"):
        # page_first_direct copies whole pages named by the device indices' values.
        return "sglang_indices_on_device"
    return CallIndices(host, device_indices, opaque)


class LayerPairsMemo:
    """The checked buffer pairs (:class:`kvcore.layers.LayerPairs`) of a pool's calls.

    A backup copies every layer of the pool, a load one layer's K and V: the same buffers
    call after call, so each set is checked once and its launch table built once (the
    CUDA kernels keep it per LayerPairs). Entries are keyed by every view's device,
    address, dtype, shape and strides, and kept per pool, weakly: they hold views of the
    pool's buffers (so no address in a key can be reused while it is kept), never the pool,
    and go when SGLang drops the pool.
    """

    def __init__(self, per_pool: int = 1024) -> None:
        self._per_pool = per_pool
        self._by_pool: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], LayerPairs]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def pairs(self, pool: Any, srcs: list[torch.Tensor], dsts: list[torch.Tensor]) -> LayerPairs:
        key = tuple(
            (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) for t in (*srcs, *dsts)
        )
        with self._lock:
            try:
                kept = self._by_pool.setdefault(pool, {})
            except TypeError:  # a pool without weak references: checked every call
                return layer_pairs(srcs, dsts)
            found = kept.get(key)
        if found is not None:
            return found
        found = layer_pairs(srcs, dsts)
        with self._lock:
            if len(kept) >= self._per_pool:
                kept.clear()
            kept[key] = found
        return found


LAYER_PAIRS = LayerPairsMemo()


def _plans(
    pool: Any,
    job: Job,
    direction: Direction,
    chosen_mover: Mover,
    device_opaque: bool,
    memo_key: tuple[Any, ...] | None = None,
) -> list[Submission] | str:
    """One plan for every layer pair, moved in one submission where the pairs allow it, else
    rebound to each pair; or the reason the call must run stock.

    With ``memo_key``, a plan kept by :data:`LOAD_PLANS` for the same key is rebound
    instead of planning again, and a new plan is kept for the next call.
    """
    page_in = direction is Direction.H2D
    pairs = [(host, device) if page_in else (device, host) for host, device in job.pairs]
    if memo_key is not None:
        memo_key = (*memo_key, chosen_mover.policy)
    first = LOAD_PLANS.recall(memo_key) if memo_key is not None else None
    try:
        if first is None:
            src_idx, dst_idx = (
                (job.host_rows, job.device_rows) if page_in else (job.device_rows, job.host_rows)
            )
            planner = plan_device_indexed if device_opaque else plan
            first = planner(
                pairs[0][0],
                pairs[0][1],
                src_idx,
                dst_idx,
                direction=direction,
                policy=chosen_mover.policy,
            )
            if memo_key is not None and first.path is not TransferPath.FALLBACK:
                LOAD_PLANS.remember(memo_key, first)
        layered = None
        if len(pairs) > 1 and first.path is not TransferPath.FALLBACK:
            srcs, dsts = [src for src, _ in pairs], [dst for _, dst in pairs]
            layered = LAYER_PAIRS.pairs(pool, srcs, dsts)
        return submissions(first, pairs, layered)
    except ValueError:
        # Out-of-range or duplicate indices: stock's behaviour, whatever it is, is kept.
        return "sglang_invalid_indices"


def _serve(
    stock: Callable[[], None],
    pool: Any,
    job: Job | str,
    direction: Direction,
    device_opaque: bool,
    memo_key: tuple[Any, ...] | None = None,
) -> None:
    chosen_mover = mover()
    decided = (
        job
        if isinstance(job, str)
        else _plans(pool, job, direction, chosen_mover, device_opaque, memo_key)
    )
    if isinstance(decided, str):
        if chosen_mover.metrics is not None:
            chosen_mover.metrics.record_fallback(decided)
        stock()
        return
    for each in decided:
        chosen_mover.submit(each)


@functools.cache
def _installed_fingerprint(target: str) -> str | None:
    """The fingerprint of ``target``'s installed source (read once), None if unreadable."""
    try:
        return guard.fingerprint_target(target)
    except (ImportError, AttributeError, KeyError, OSError, SyntaxError):
        return None


def _jobs_for(target: str, by_release: dict[str, PoolJobs]) -> PoolJobs | None:
    """The builders of the release whose recorded fingerprint of ``target`` the installed
    source has; None when no release's does."""
    installed = _installed_fingerprint(target)
    if installed is None:
        return None
    for release, jobs in by_release.items():
        if guard.FINGERPRINTS.get(release, {}).get(target) == installed:
            return jobs
    return None


_SOURCE_UNKNOWN = "sglang_source_unknown"


def _make_load_hook(
    pool_class: str, target: str, by_release: dict[str, PoolJobs]
) -> Callable[..., None]:
    def load_hook(
        original: Callable[..., Any],
        pool: Any,
        device_pool: Any,
        host_indices: Any,
        device_indices: Any,
        layer_id: int,
        io_backend: str,
        *,
        is_draft: bool = False,
    ) -> None:
        def stock() -> None:
            original(
                pool,
                device_pool,
                host_indices,
                device_indices,
                layer_id,
                io_backend,
                is_draft=is_draft,
            )

        jobs = _jobs_for(target, by_release)
        indices = _call_indices(pool, pool_class, host_indices, device_indices, io_backend)
        if jobs is None:
            _serve(stock, pool, _SOURCE_UNKNOWN, Direction.H2D, False)
            return
        if isinstance(indices, str):
            _serve(stock, pool, indices, Direction.H2D, False)
            return
        if not is_draft and not jobs.holds_layer(pool, device_pool, layer_id):
            stock()  # a layer this pool does not hold: stock returns without copying
            return
        job = jobs.load(
            pool, device_pool, layer_id, is_draft, indices.host, indices.device, io_backend
        )
        memo_key = PlanMemo.key(pool, device_pool, indices, io_backend)
        _serve(stock, pool, job, Direction.H2D, indices.device_opaque, memo_key)

    return load_hook


def _make_backup_hook(
    pool_class: str, target: str, by_release: dict[str, PoolJobs]
) -> Callable[..., None]:
    def backup_hook(
        original: Callable[..., Any],
        pool: Any,
        device_pool: Any,
        host_indices: Any,
        device_indices: Any,
        io_backend: str,
    ) -> None:
        def stock() -> None:
            original(pool, device_pool, host_indices, device_indices, io_backend)

        jobs = _jobs_for(target, by_release)
        indices = _call_indices(pool, pool_class, host_indices, device_indices, io_backend)
        if jobs is None:
            _serve(stock, pool, _SOURCE_UNKNOWN, Direction.D2H, False)
            return
        if isinstance(indices, str):
            _serve(stock, pool, indices, Direction.D2H, False)
            return
        job = jobs.backup(pool, device_pool, indices.host, indices.device, io_backend)
        _serve(stock, pool, job, Direction.D2H, indices.device_opaque)

    return backup_hook


_LOAD = "load_to_device_per_layer"
_BACKUP = "backup_from_device_all_layer"


def _pool_hooks(pool_class: str, by_release: dict[str, PoolJobs]) -> dict[str, Callable[..., None]]:
    load, backup = f"{pool_class}.{_LOAD}", f"{pool_class}.{_BACKUP}"
    return {
        load: _make_load_hook(pool_class, load, by_release),
        backup: _make_backup_hook(pool_class, backup, by_release),
    }


# Target (as the guard names it) -> hook.
HOOKS: dict[str, Callable[..., Any]] = {
    **_pool_hooks(MHA_POOL, pool_jobs.MHA_JOBS),
    **_pool_hooks(MLA_POOL, pool_jobs.MLA_JOBS),
    **_pool_hooks(DSA_POOL, pool_jobs.DSA_JOBS),
    "sglang.srt.managers.cache_controller.HiCacheController.move_indices": move_indices_hook,
}
