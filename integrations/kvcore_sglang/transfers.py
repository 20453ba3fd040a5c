"""SGLang host-pool transfers through kvcore's mover: MHA, MLA and the DSA indexer.

AROUND hooks on ``load_to_device_per_layer`` and ``backup_from_device_all_layer`` of
``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost`` and ``DSAIndexerPoolHost``, for the
``layer_first``, ``page_first`` and ``page_first_direct`` host layouts
(:mod:`kvcore_sglang.host_layouts` gives each a dense row view per layer), and on
``HiCacheController.move_indices``, to remember the CPU host indices it moves to the GPU
(:mod:`kvcore_sglang.call_plans` plans from them). A call is served only when every plan
it needs is decided up front and none is a fallback; otherwise the stock method runs
unchanged, once, and the reason is counted in ``METRICS.record_fallback``.

Each hook asks the serve-or-pass rule first (:mod:`kvcore_sglang.serve_or_pass`), plans
with the builders of the installed release (:mod:`kvcore_sglang.release_jobs`), serves a
reload layer by layer (:mod:`kvcore_sglang.layer_loads`) and copies through the
process's one mover (:mod:`kvcore_sglang.hook_mover`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvcore.direction import Direction

# The state these modules keep, and call_plans.call_indices, are read on their modules at
# call time: a stand-in for one (a test's, a benchmark's) then reaches every reader.
from . import call_plans, layer_loads, pool_jobs, release_jobs, serve_or_pass
from .call_memos import HOST_INDEX_MEMO, LAYER_PAIRS
from .hook_mover import count_request_pass, mover, use_mover
from .layer_loads import continued, later_layer_served, load_layer, passes_from_here
from .pool_jobs import Job, PoolJobs
from .release_jobs import SOURCE_UNKNOWN, jobs_for
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
from .stock_binding import (
    bind_backup_gate,
    bind_passing_reload,
    bypass_if_never,
    indices_moved,
    restore_bypassed,
)


def move_indices_hook(
    original: Callable[..., Any], controller: Any, host_indices: Any, device_indices: Any
) -> Any:
    """AROUND ``HiCacheController.move_indices``: remember host indices moved to the GPU,
    and tell the controller's host pool's stock bindings a new transfer comes
    (:func:`~kvcore_sglang.stock_binding.indices_moved`).
    Stock's move has run first; a failure of kvcore's own part after it only leaves the
    indices unremembered (their transfer then runs stock), counted."""
    moved = original(controller, host_indices, device_indices)
    moved_host = moved[0] if isinstance(moved, tuple) and moved else None
    try:
        host_pool = getattr(controller, "mem_pool_host", None)
        if host_pool is not None:
            indices_moved(host_pool)
        if (
            isinstance(host_indices, torch.Tensor)
            and host_indices.device.type == "cpu"
            and isinstance(moved_host, torch.Tensor)
            and moved_host is not host_indices
            and moved_host.device.type != "cpu"
        ):
            HOST_INDEX_MEMO.remember(moved_host, host_indices)
    except Exception as exc:
        internal_error(mover(), exc)
    return moved


def _serve(
    stock: Callable[[], None],
    pool: Any,
    job: Job | str,
    direction: Direction,
    device_opaque: bool,
) -> None:
    chosen_mover = mover()
    try:
        decided = (
            job
            if isinstance(job, str)
            else call_plans.plans(pool, job, direction, chosen_mover, device_opaque)
        )
        if not isinstance(decided, str):
            for each in decided:
                chosen_mover.submit(each)
            return
    except Exception as exc:
        internal_error(chosen_mover, exc)
        stock()
        return
    count_pass(chosen_mover, decided)
    stock()


def forget() -> None:
    """Drop everything the transfer hooks keep (the mover, the memos of requests, layers
    and moved indices, the settings read) and give back every stock method bound on a pool: what
    :class:`kvcore_sglang.installation.Installation` does once the hooks are gone."""
    restore_bypassed()
    layer_loads.LOAD_REQUESTS.clear()
    layer_loads.POOL_LAYERS.clear()
    LAYER_PAIRS.clear()
    HOST_INDEX_MEMO.clear()
    release_jobs.JOBS_FOUND.clear()
    serve_or_pass.INTERNAL_ERRORS.forget()
    serve_or_pass.forget_settings()
    use_mover(None)


def _load_pass_limit(pool: Any, io_backend: str) -> tuple[int, str]:
    return pass_limit("load", pool, io_backend)


def _backup_pass_limit(pool: Any, io_backend: str) -> tuple[int, str]:
    return pass_limit("backup", pool, io_backend)


def _count_request_pass(reason: str) -> None:
    count_request_pass(mover(), reason)


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
        latest = layer_loads.LOAD_REQUESTS.latest(pool, device_pool)
        request = continued(
            latest, pool, device_pool, host_indices, device_indices, io_backend, is_draft
        )
        if request is not None and later_layer_served(request, device_pool, layer_id, is_draft):
            return
        # A later layer of a request that passes costs the first check alone (none at all
        # once its binding is on the pool).
        if latest is None or not latest.passing_for(host_indices, device_indices):
            rule = call_rule("load", pool, io_backend)
            if bypass_if_never(original, pool, _LOAD, rule, io_backend):
                pass
            elif load_layer(
                jobs_for(target, by_release),
                rule,
                pool_class,
                pool,
                device_pool,
                host_indices,
                device_indices,
                layer_id,
                io_backend,
                is_draft,
                request,
            ):
                return
            elif passes_from_here(pool, device_pool, host_indices, device_indices):
                bind_passing_reload(
                    load_hook,
                    original,
                    pool,
                    _LOAD,
                    host_indices,
                    device_indices,
                    _load_pass_limit,
                    _count_request_pass,
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

        rule = call_rule("backup", pool, io_backend)
        if bypass_if_never(original, pool, _BACKUP, rule, io_backend):
            stock()
            return
        tokens = count_of(host_indices)
        reason = None if rule is None else rule.decision(tokens)
        if reason is not None:
            count_request_pass(mover(), reason)
            bind_backup_gate(
                backup_hook, original, pool, _BACKUP, _backup_pass_limit, _count_request_pass
            )
            stock()
            return
        jobs = jobs_for(target, by_release)
        indices = call_plans.call_indices(
            pool, pool_class, host_indices, device_indices, io_backend
        )
        if jobs is None:
            _serve(stock, pool, SOURCE_UNKNOWN, Direction.D2H, False)
            return
        if isinstance(indices, str):
            _serve(stock, pool, indices, Direction.D2H, False)
            return
        passes, _ = host_runs_pass(rule, tokens, indices.host, mover().policy)
        if passes is not None:
            count_request_pass(mover(), passes)
            stock()
            return
        count_serve(mover())
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
