"""An SGLang reload, layer by layer: decided on its first call, then one launch a layer.

SGLang reloads layer by layer with the same two index tensors: the first layer's plan
(bounds, runs, path) is kept with the request
(:class:`kvcore_sglang.load_requests.LoadRequests`) and rebound to every later layer's
buffers, so a reload plans once, not once per layer. A layer whose buffers this pool has
shown before (:class:`kvcore_sglang.load_requests.PoolLayers`) is served with nothing
decided again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvcore.direction import Direction
from kvcore.mover import Mover
from kvcore.planning import serve_rule
from kvcore.planning.host_run import HostRunFound
from kvcore.planning.layers import layer_pairs
from kvcore.planning.submissions import submissions
from kvcore.planning.transfer_sides import check_sides
from kvcore.stock_share import REASON as STOCK_SHARE

from . import call_plans
from .call_plans import CallIndices
from .hook_mover import count_request_pass
from .load_requests import (
    LayerBuffers,
    LoadCall,
    LoadRequest,
    LoadRequests,
    PoolLayers,
    layer_in,
    weakly,
)
from .pool_jobs import Job, PoolJobs
from .release_jobs import SOURCE_UNKNOWN
from .serve_or_pass import count_of, count_pass, count_serve, host_runs_pass, internal_error

if TYPE_CHECKING:
    from .adapter import SGLangAdapter


def _start_load(
    adapter: SGLangAdapter,
    chosen_mover: Mover,
    jobs: PoolJobs | None,
    rule: serve_rule.SGLangRule | None,
    pool_class: str,
    call: LoadCall,
) -> LoadRequest | str:
    """Decide a new reload on its first call: a request kvcore serves, or why it passes.

    The rule comes first (it reads the pool's layout and the request's size, nothing
    else), so a request that passes costs a lookup; a row that tells few long host runs
    from scattered slots then reads the host indices once. A request is kept only when its
    index tensors are tensors (their identity names it); its pass is counted once, here.
    """
    host_indices, device_indices = call.host_indices, call.device_indices
    indices: CallIndices | str | None = None
    host_runs: HostRunFound | None = None
    tokens = count_of(host_indices)
    reason = None if rule is None else rule.decision(tokens)
    if reason is None and _inference_indices(host_indices, device_indices):
        reason = INFERENCE_INDICES
    if reason is None:
        if jobs is None:
            reason = SOURCE_UNKNOWN
        else:
            indices = adapter.call_indices(
                call.pool, pool_class, host_indices, device_indices, call.io_backend
            )
            if isinstance(indices, str):
                reason = indices
            else:
                reason, host_runs = host_runs_pass(rule, tokens, indices.host, chosen_mover.policy)
    if reason is None and adapter.stock_share.drawn():
        reason = STOCK_SHARE
    if reason is None:
        count_serve(chosen_mover)
    else:
        count_request_pass(chosen_mover, reason)
    if not (isinstance(host_indices, torch.Tensor) and isinstance(device_indices, torch.Tensor)):
        return reason or "sglang_indices_on_device"
    request = adapter.load_requests.start(*call, chosen_mover.policy)
    request.passes = reason
    request.call_indices = indices
    request.host_runs = host_runs
    return request


INFERENCE_INDICES = "sglang_inference_indices"
"""Why a reload whose index tensors are inference tensors passes: with no version counter,
a write between its layers could not be seen, and its later layers would copy old rows."""


def _inference_indices(host_indices: Any, device_indices: Any) -> bool:
    return (isinstance(host_indices, torch.Tensor) and host_indices.is_inference()) or (
        isinstance(device_indices, torch.Tensor) and device_indices.is_inference()
    )


def _kept_layer_job(
    jobs: PoolJobs, request: LoadRequest, pool: Any, buffers: LayerBuffers, indices: CallIndices
) -> Job | str:
    """The job of a layer whose buffers are kept: the request's indices as the pool's load
    takes them, with the buffers its builder gave when they were kept (a pool's buffers
    and layer map are fixed for its life, so the builder would give them again)."""
    found = jobs.load_indices(pool, indices.host, indices.device, request.io_backend)
    if isinstance(found, str):
        return found
    return Job(buffers.pairs, buffers.rows, *found)


def _layer_buffers(
    pool_layers: PoolLayers,
    jobs: PoolJobs,
    request: LoadRequest,
    pool: Any,
    device_pool: Any,
    layer_id: int,
    indices: CallIndices,
) -> tuple[LayerBuffers, Job | None] | str:
    """The layer's checked buffers (kept per pool), and the job when one had to be built.
    The pool's entries are looked up once per request and kept with it, for its later
    layers (:meth:`LoadRequest.kept_layer`)."""
    key = (layer_id, request.is_draft)
    layers = request.pool_layers
    if layers is None:
        layers = request.pool_layers = pool_layers.kept(pool)
    kept = layer_in(layers, device_pool, key)
    if kept is not None:
        return kept, None
    job = jobs.load(
        pool,
        device_pool,
        layer_id,
        request.is_draft,
        indices.host,
        indices.device,
        request.io_backend,
    )
    if isinstance(job, str):
        return job
    layered = layer_pairs([host for host, _ in job.pairs], [dev for _, dev in job.pairs])
    host, device = job.pairs[0]
    sides = check_sides(host, device, Direction.H2D)
    buffers = LayerBuffers(weakly(device_pool), job.pairs, layered, sides, job.rows)
    request.pool_layers = pool_layers.put(pool, device_pool, key, buffers)
    return buffers, job


def _moved_host_rows(request: LoadRequest, indices: CallIndices) -> torch.Tensor | None:
    """The host indices as SGLang moved them to the GPU, where they are the plan's source
    rows themselves (the layer_first views' rows are the host slots): the request's
    prepared rows then need no upload of their own."""
    plan = request.plan
    moved = request.host_indices
    if plan is None or not indices.device_opaque or moved.device.type == "cpu":
        return None
    return moved if plan.src_idx is indices.host else None


def _serve_layer(
    pool_layers: PoolLayers,
    chosen_mover: Mover,
    jobs: PoolJobs,
    request: LoadRequest,
    call: LoadCall,
    layer_id: int,
    indices: CallIndices,
) -> str | None:
    """Copy one layer of a served reload; returns why the call must run stock instead."""
    pool = call.pool
    found = _layer_buffers(pool_layers, jobs, request, pool, call.device_pool, layer_id, indices)
    if isinstance(found, str):
        return found
    buffers, job = found
    if request.plan is None:
        planned_from = job or _kept_layer_job(jobs, request, pool, buffers, indices)
        if isinstance(planned_from, str):
            return planned_from
        first = call_plans.first_plan(
            planned_from,
            Direction.H2D,
            chosen_mover,
            indices,
            buffers.first_sides,
            request.host_runs,
        )
        if isinstance(first, str):
            request.passes = first
            return first
        # Kept without its buffers (each layer brings its own), so that a request kept after
        # SGLang drops a pool does not keep the pool's memory.
        request.plan = first.without_buffers(buffers.first_sides)
    if buffers.layered.reason is None:
        if request.prepared is None:
            request.prepared = chosen_mover.prepare_layers(
                request.plan, src_idx_on_device=_moved_host_rows(request, indices)
            )
        try:
            chosen_mover.execute_prepared(request.prepared, buffers.layered)
            return None
        except ValueError:
            pass  # rebinding below raises again where the indices were written (StalePlanError)
    work = submissions(request.plan, buffers.pairs, None)
    if isinstance(work, str):
        return work
    for each in work:
        chosen_mover.execute(each.plan, each.pairs)
    return None


def load_layer(
    adapter: SGLangAdapter,
    jobs: PoolJobs | None,
    rule: serve_rule.SGLangRule | None,
    pool_class: str,
    call: LoadCall,
    layer_id: int,
    request: LoadRequest | None,
) -> bool:
    """Move layer ``layer_id`` of a reload on kvcore's paths; False when the call must run
    stock (the request passes, this layer cannot be served, or kvcore failed: counted).
    ``rule``: the rule's row for the call (:func:`~kvcore_sglang.serve_or_pass.call_rule`),
    which a new request is decided by; ``request``: the request the call continues
    (:meth:`LoadRequest.matches` said so), None for a new one."""
    chosen_mover = adapter.mover()
    try:
        if request is None:
            started = _start_load(adapter, chosen_mover, jobs, rule, pool_class, call)
            if isinstance(started, str):
                return False
            request = started
        if request.passes is not None or jobs is None:
            return False
        if not call.is_draft and not jobs.holds_layer(call.pool, call.device_pool, layer_id):
            return False  # a layer this pool does not hold: stock returns without copying
        reason = _serve_layer(
            adapter.pool_layers, chosen_mover, jobs, request, call, layer_id, request.call_indices
        )
    except Exception as exc:
        reason = internal_error(adapter.internal_errors, chosen_mover, exc)
        if request is not None:
            request.passes = reason
        return False
    if reason is not None:
        count_pass(chosen_mover, reason)
    return reason is None


def continued(
    adapter: SGLangAdapter,
    latest: LoadRequest | None,
    pool: Any,
    device_pool: Any,
    host_indices: Any,
    device_indices: Any,
    io_backend: str,
    is_draft: bool,
) -> LoadRequest | None:
    """``latest`` (the pools' latest request) where kvcore serves it and the call continues
    it; None otherwise. Asked once per call: a request that passes is recognised by
    :meth:`LoadRequest.passing_for` alone, and no other call can continue it (a call that
    matches it has its index tensors, so passing_for sends it to stock)."""
    if latest is None or latest.passes is not None:
        return None
    if latest.matches(
        pool,
        device_pool,
        host_indices,
        device_indices,
        io_backend,
        is_draft,
        adapter.mover().policy,
    ):
        return latest
    return None


def later_layer_served(
    adapter: SGLangAdapter, request: LoadRequest, device_pool: Any, layer_id: int, is_draft: bool
) -> bool:
    """A later layer of ``request`` (one the call continues, :func:`continued`) where
    kvcore serves it and this pool has shown the layer's buffers before: one launch, nothing
    decided again. False for any other call (the full path decides it), and where kvcore
    fails (counted; the request then passes)."""
    if request.prepared is None:
        return False
    chosen_mover = adapter.mover()
    buffers = request.kept_layer(device_pool, (layer_id, is_draft))
    if buffers is None or buffers.layered.reason is not None:
        return False
    try:
        chosen_mover.execute_prepared(request.prepared, buffers.layered)
    except Exception as exc:
        request.passes = internal_error(adapter.internal_errors, chosen_mover, exc)
        return False
    return True


def passes_from_here(load_requests: LoadRequests, call: LoadCall) -> bool:
    """Whether the reload ``call``'s index tensors name passes to stock from this call on."""
    latest = load_requests.latest(call.pool, call.device_pool)
    return latest is not None and latest.passing_for(call.host_indices, call.device_indices)
