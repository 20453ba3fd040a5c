"""SGLang host-pool transfers through kvcore's mover: MHA, MLA and the DSA indexer.

AROUND hooks on ``load_to_device_per_layer`` and ``backup_from_device_all_layer`` of
``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost`` and ``DSAIndexerPoolHost``, for the
``layer_first``, ``page_first`` and ``page_first_direct`` host layouts
(:mod:`kvcore_sglang.host_layouts` gives each a dense row view per layer), and on
``HiCacheController.move_indices``, to remember the CPU host indices it moves to the GPU
(:mod:`kvcore_sglang.call_plans` plans from them). A call is served only when every plan
it needs is decided up front and none is a fallback; otherwise the stock method runs
unchanged, once, and the reason is counted in ``METRICS.record_fallback``.

The hooks close over one :class:`~kvcore_sglang.adapter.SGLangAdapter` (:func:`hooks`).
Each asks the serve-or-pass rule first (:mod:`kvcore_sglang.serve_or_pass`), plans with
the builders of the installed release (:mod:`kvcore_sglang.release_jobs`), serves a
reload layer by layer (:mod:`kvcore_sglang.layer_loads`) and copies through the adapter's
mover (:mod:`kvcore_sglang.hook_mover`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcore.direction import Direction
from kvcore.mover import Mover
from kvcore.planning import serve_rule

from . import call_plans, pool_jobs
from .adapter import SGLangAdapter
from .call_plans import CallIndices
from .hook_mover import count_request_pass
from .layer_loads import continued, later_layer_served, load_layer, passes_from_here
from .load_requests import LoadCall
from .pool_jobs import Job, PoolJobs
from .release_jobs import SOURCE_UNKNOWN
from .serve_or_pass import (
    call_rule,
    count_of,
    count_pass,
    count_serve,
    host_runs_pass,
    internal_error,
    pass_limit,
)
from .served_pools import DSA_POOL, MHA_POOL, MLA_POOL
from .stock_binding import PassLimit

MOVE_INDICES = "sglang.srt.managers.cache_controller.HiCacheController.move_indices"
_LOAD = "load_to_device_per_layer"
_BACKUP = "backup_from_device_all_layer"
_POOL_JOBS: dict[str, dict[str, PoolJobs]] = {
    MHA_POOL: pool_jobs.MHA_JOBS,
    MLA_POOL: pool_jobs.MLA_JOBS,
    DSA_POOL: pool_jobs.DSA_JOBS,
}

TARGETS: tuple[str, ...] = (
    *(f"{pool}.{method}" for pool in _POOL_JOBS for method in (_LOAD, _BACKUP)),
    MOVE_INDICES,
)
"""Every target the transfer hooks wrap, as the guard names it."""


def hooks(adapter: SGLangAdapter) -> dict[str, Callable[..., Any]]:
    """Target (as the guard names it) -> its hook, each closing over ``adapter``."""
    built: dict[str, Callable[..., Any]] = {}
    for pool_class, by_release in _POOL_JOBS.items():
        load, backup = f"{pool_class}.{_LOAD}", f"{pool_class}.{_BACKUP}"
        built[load] = _make_load_hook(adapter, pool_class, load, by_release)
        built[backup] = _make_backup_hook(adapter, pool_class, backup, by_release)
    built[MOVE_INDICES] = _make_move_indices_hook(adapter)
    return built


def _make_move_indices_hook(adapter: SGLangAdapter) -> Callable[..., Any]:
    def move_indices_hook(
        original: Callable[..., Any], controller: Any, host_indices: Any, device_indices: Any
    ) -> Any:
        """AROUND ``HiCacheController.move_indices``: remember what the move made of the
        indices (:meth:`~kvcore_sglang.adapter.SGLangAdapter.indices_moved`), and tell the
        controller's host pool's stock bindings a new transfer comes
        (:meth:`~kvcore_sglang.stock_binding.StockBindings.indices_moved`). Stock's move
        has run first; a failure of kvcore's own part after it only leaves the indices
        unremembered (their transfer then runs stock), counted."""
        moved = original(controller, host_indices, device_indices)
        try:
            host_pool = getattr(controller, "mem_pool_host", None)
            if host_pool is not None:
                adapter.bindings.indices_moved(host_pool)
            adapter.indices_moved(controller, host_indices, moved)
        except Exception as exc:
            internal_error(adapter.internal_errors, adapter.mover(), exc)
        return moved

    return move_indices_hook


def _serve(
    adapter: SGLangAdapter,
    stock: Callable[[], None],
    pool: Any,
    work: tuple[Job, CallIndices] | str,
    direction: Direction,
) -> None:
    """Copy ``work`` (a job and the indices it was built from) through the adapter's mover,
    or run stock where it is a reason to (counted) or kvcore fails (counted)."""
    chosen_mover = adapter.mover()
    try:
        decided = (
            work
            if isinstance(work, str)
            else call_plans.plans(
                pool, work[0], direction, chosen_mover, work[1], adapter.layer_pairs
            )
        )
        if not isinstance(decided, str):
            for each in decided:
                chosen_mover.execute(each.plan, each.pairs)
            return
    except Exception as exc:
        internal_error(adapter.internal_errors, chosen_mover, exc)
        stock()
        return
    count_pass(chosen_mover, decided)
    stock()


def _pass_limit_for(adapter: SGLangAdapter, op: str) -> PassLimit:
    """The rule's :data:`~kvcore_sglang.stock_binding.PassLimit` for ``op`` (``"load"`` or
    ``"backup"``), with the adapter's rule setting as it is when a binding asks."""

    def limit(pool: Any, io_backend: str) -> tuple[int, str]:
        return pass_limit(adapter.serve_rule, op, pool, io_backend)

    return limit


def _make_load_hook(
    adapter: SGLangAdapter, pool_class: str, target: str, by_release: dict[str, PoolJobs]
) -> Callable[..., None]:
    load_pass_limit = _pass_limit_for(adapter, "load")

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
        latest = adapter.load_requests.latest(pool, device_pool)
        request = continued(
            adapter, latest, pool, device_pool, host_indices, device_indices, io_backend, is_draft
        )
        if request is not None and later_layer_served(
            adapter, request, device_pool, layer_id, is_draft
        ):
            return
        # A later layer of a request that passes costs the first check alone (none at all
        # once its binding is on the pool).
        if latest is None or not latest.passing_for(host_indices, device_indices):
            rule = call_rule(adapter.serve_rule, "load", pool, io_backend)
            # Built only for a call that goes on to be decided: on every later layer it would
            # cost several plain calls' time.
            call = LoadCall(pool, device_pool, host_indices, device_indices, io_backend, is_draft)
            if adapter.bindings.bypass_if_never(original, pool, _LOAD, rule, io_backend):
                pass
            elif load_layer(
                adapter,
                adapter.release_jobs.jobs_for(target, by_release),
                rule,
                pool_class,
                call,
                layer_id,
                request,
            ):
                return
            elif passes_from_here(adapter.load_requests, call):
                adapter.bindings.bind_passing_reload(
                    load_hook,
                    original,
                    pool,
                    _LOAD,
                    host_indices,
                    device_indices,
                    load_pass_limit,
                    adapter.count_request_pass,
                )
        original(
            pool,
            device_pool,
            host_indices,
            device_indices,
            layer_id,
            io_backend,
            is_draft=is_draft,
        )

    return load_hook


def _make_backup_hook(
    adapter: SGLangAdapter, pool_class: str, target: str, by_release: dict[str, PoolJobs]
) -> Callable[..., None]:
    backup_pass_limit = _pass_limit_for(adapter, "backup")

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

        rule = call_rule(adapter.serve_rule, "backup", pool, io_backend)
        if adapter.bindings.bypass_if_never(original, pool, _BACKUP, rule, io_backend):
            stock()
            return
        chosen_mover = adapter.mover()
        tokens = count_of(host_indices)
        reason = None if rule is None else rule.decision(tokens)
        if reason is not None:
            count_request_pass(chosen_mover, reason)
            adapter.bindings.bind_backup_gate(
                backup_hook,
                original,
                pool,
                _BACKUP,
                backup_pass_limit,
                adapter.count_request_pass,
            )
            stock()
            return
        try:
            work = _backup_work(
                adapter.call_indices(pool, pool_class, host_indices, device_indices, io_backend),
                adapter.release_jobs.jobs_for(target, by_release),
                rule,
                tokens,
                chosen_mover,
                pool,
                device_pool,
                io_backend,
            )
        except Exception as exc:
            # Finding the indices (a device read's wait among them) or the job failed.
            internal_error(adapter.internal_errors, chosen_mover, exc)
            stock()
            return
        if work is None:
            stock()
            return
        _serve(adapter, stock, pool, work, Direction.D2H)

    return backup_hook


def _backup_work(
    indices: CallIndices | str,
    jobs: PoolJobs | None,
    rule: serve_rule.SGLangRule | None,
    tokens: int,
    chosen_mover: Mover,
    pool: Any,
    device_pool: Any,
    io_backend: str,
) -> tuple[Job, CallIndices] | str | None:
    """What a backup the rule did not pass by size copies: its job and indices, the reason it
    runs stock (counted by :func:`_serve`), or None where the rule passes its host slots
    (counted here)."""
    if jobs is None:
        return SOURCE_UNKNOWN
    if isinstance(indices, str):
        return indices
    passes, _ = host_runs_pass(rule, tokens, indices.host, chosen_mover.policy)
    if passes is not None:
        count_request_pass(chosen_mover, passes)
        return None
    count_serve(chosen_mover)
    job = jobs.backup(pool, device_pool, indices.host, indices.device, io_backend)
    return job if isinstance(job, str) else (job, indices)
