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
tensor (:class:`kvcore_sglang.call_memos.HostIndexMemo`); a ``kernel`` call is planned
from those alone, the device indices staying on the GPU, unread
(:func:`kvcore.planning.plan_device_indexed`: staged or gather). A ``kernel`` call whose
host indices were not remembered runs stock (``sglang_indices_on_device``). kvcore never
reads a device tensor back to plan.

Which host layer and device buffer a call copies differs between SGLang releases
(0.5.22 maps layers through the device pool's layer sharding, 0.5.23 through the slot
maps its pools keep): each hook plans with the builders of the release whose recorded
fingerprint (:mod:`kvcore_sglang.guard`) the installed method's source has
(:data:`kvcore_sglang.pool_jobs.MHA_JOBS` and the like); a source none was written for
runs stock (``sglang_source_unknown``).

SGLang reloads layer by layer with the same two index tensors: the first layer's plan
(bounds, runs, path) is kept with the request
(:class:`kvcore_sglang.load_requests.LoadRequests`) and rebound to every later layer's
buffers, so a reload plans once, not once per layer. The pairs of one call (a layer's K
and V; every layer of a backup) move in one submission where they share a row size
(:meth:`kvcore.mover.Mover.execute_layers`), their checks kept per pool
(:class:`kvcore_sglang.call_memos.LayerPairsMemo`). Every hook copies through the process's
one mover (:mod:`kvcore_sglang.hook_mover`).
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvcore import serve_rule
from kvcore.config import KVCoreConfig
from kvcore.direction import Direction
from kvcore.host_run import HostRunFound, one_host_run
from kvcore.internal_errors import InternalErrors
from kvcore.layers import layer_pairs
from kvcore.mover import Mover, Submission, submissions
from kvcore.path_policy import PathPolicy, TransferPath
from kvcore.planning import (
    TransferPlan,
    plan,
    plan_device_indexed,
    plan_device_indexed_for,
    plan_for,
)
from kvcore.runs import run_count_up_to
from kvcore.stock_share import REASON as STOCK_SHARE
from kvcore.stock_share import StockShare
from kvcore.transfer_sides import CheckedSides, check_sides

from . import guard, pool_jobs
from .call_memos import HOST_INDEX_MEMO, LAYER_PAIRS
from .hook_mover import count_request_pass, mover, use_mover
from .load_requests import LayerBuffers, LoadRequest, LoadRequests, PoolLayers, layer_in, weakly
from .pool_jobs import Job, PoolJobs
from .served_layouts import layout_reason
from .stock_binding import (
    bind_backup_gate,
    bind_passing_reload,
    bypass_if_never,
    indices_moved,
    restore_bypassed,
)

_POOL_PACKAGE = "sglang.srt.mem_cache.pool_host"
MHA_POOL = f"{_POOL_PACKAGE}.mha.MHATokenToKVPoolHost"
MLA_POOL = f"{_POOL_PACKAGE}.mla.MLATokenToKVPoolHost"
DSA_POOL = f"{_POOL_PACKAGE}.dsa.DSAIndexerPoolHost"
# The index dtypes kvcore.runs.check_index accepts.
_INDEX_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})

logger = logging.getLogger("kvcore")

_CLASS_NAMES: dict[type, str] = {}


def _class_name(pool: Any) -> str:
    """The pool class's dotted name, as the hooks' targets name it (made once per class:
    every first call of a request asks)."""
    cls = type(pool)
    name = _CLASS_NAMES.get(cls)
    if name is None:
        name = _CLASS_NAMES.setdefault(cls, f"{cls.__module__}.{cls.__qualname__}")
    return name


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
        chosen_mover = mover()
        _count_pass(chosen_mover, _internal_error(chosen_mover, exc))
    return moved


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


def _plans(
    pool: Any,
    job: Job,
    direction: Direction,
    chosen_mover: Mover,
    device_opaque: bool,
) -> list[Submission] | str:
    """One plan for every layer pair, moved in one submission where the pairs allow it, else
    rebound to each pair; or the reason the call must run stock."""
    first = _first_plan(job, direction, chosen_mover, device_opaque)
    if isinstance(first, str):
        return first
    page_in = direction is Direction.H2D
    pairs = [(host, device) if page_in else (device, host) for host, device in job.pairs]
    try:
        layered = None
        if len(pairs) > 1:
            srcs, dsts = [src for src, _ in pairs], [dst for _, dst in pairs]
            layered = LAYER_PAIRS.pairs(pool, srcs, dsts)
        return submissions(first, pairs, layered)
    except ValueError:
        return "sglang_invalid_indices"


def _first_plan(
    job: Job,
    direction: Direction,
    chosen_mover: Mover,
    device_opaque: bool,
    kept_sides: CheckedSides | None = None,
    host_runs: HostRunFound | None = None,
) -> TransferPlan | str:
    """The plan of the job's first pair, or why the call must run stock. ``kept_sides``:
    that pair as checked when its layer's buffers were kept, used where the job's first
    pair is those very buffers (the plan then checks only the indices). ``host_runs``:
    the host rows as one run where the rule found them so (used where they are the
    job's own)."""
    page_in = direction is Direction.H2D
    host, device = job.pairs[0]
    src, dst = (host, device) if page_in else (device, host)
    try:
        src_idx, dst_idx = (
            (job.host_rows, job.device_rows) if page_in else (job.device_rows, job.host_rows)
        )
        policy = chosen_mover.policy
        if kept_sides is not None and kept_sides.src is src and kept_sides.dst is dst:
            if device_opaque:
                first = plan_device_indexed_for(
                    kept_sides, src_idx, dst_idx, policy=policy, host_found=host_runs
                )
            else:
                first = plan_for(kept_sides, src_idx, dst_idx, policy=policy)
        else:
            planner = plan_device_indexed if device_opaque else plan
            first = planner(src, dst, src_idx, dst_idx, direction=direction, policy=policy)
    except ValueError:
        # Out-of-range or duplicate indices: stock's behaviour, whatever it is, is kept.
        return "sglang_invalid_indices"
    return first.reason if first.path is TransferPath.FALLBACK and first.reason else first


def _count_pass(chosen_mover: Mover, reason: str) -> None:
    if chosen_mover.metrics is not None:
        chosen_mover.metrics.record_fallback(reason)


def _count_serve(chosen_mover: Mover) -> None:
    """A request kvcore serves (passes are counted by :func:`count_request_pass`)."""
    if chosen_mover.metrics is not None:
        chosen_mover.metrics.record_decision("serve", "rule_serves")


INTERNAL_ERRORS = InternalErrors("SGLang", logger)


def _internal_error(chosen_mover: Mover, exc: Exception) -> str:
    """The reason a failure inside kvcore sends its call to stock (counted); a CUDA error
    is re-raised (:mod:`kvcore.internal_errors`)."""
    reason = INTERNAL_ERRORS.reason(exc)
    _count_pass(chosen_mover, reason)
    return reason


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
            else _plans(pool, job, direction, chosen_mover, device_opaque)
        )
        if not isinstance(decided, str):
            for each in decided:
                chosen_mover.submit(each)
            return
    except Exception as exc:
        _internal_error(chosen_mover, exc)
        stock()
        return
    _count_pass(chosen_mover, decided)
    stock()


@functools.cache
def _installed_fingerprint(target: str) -> str | None:
    """The fingerprint of ``target``'s installed source (read once), None if unreadable."""
    try:
        return guard.fingerprint_target(target)
    except (ImportError, AttributeError, KeyError, OSError, SyntaxError):
        return None


# Target -> (the recorded fingerprints and the builders it was looked up in, what was found).
_JOBS_FOUND: dict[str, tuple[dict[str, dict[str, str]], dict[str, PoolJobs], PoolJobs | None]] = {}


def _jobs_for(target: str, by_release: dict[str, PoolJobs]) -> PoolJobs | None:
    """The builders of the release whose recorded fingerprint of ``target`` the installed
    source has; None when no release's does. Found once per target (every request's first
    call asks), again only where the recorded fingerprints or the builders are others."""
    recorded = guard.FINGERPRINTS
    found = _JOBS_FOUND.get(target)
    if found is not None and found[0] is recorded and found[1] is by_release:
        return found[2]
    jobs = _release_jobs(target, by_release, recorded)
    _JOBS_FOUND[target] = (recorded, by_release, jobs)
    return jobs


def _release_jobs(
    target: str, by_release: dict[str, PoolJobs], recorded: dict[str, dict[str, str]]
) -> PoolJobs | None:
    installed = _installed_fingerprint(target)
    if installed is None:
        return None
    for release, jobs in by_release.items():
        if recorded.get(release, {}).get(target) == installed:
            return jobs
    return None


_SOURCE_UNKNOWN = "sglang_source_unknown"


def serve_rule_enabled() -> bool:
    """Whether the serve-or-pass rule applies (``KVCORE_SERVE_RULE``, read once)."""
    return _settings().serve_rule


@functools.cache
def stock_share() -> StockShare:
    """The draws of the reloads kvcore would serve that go to stock's copy instead
    (``KVCORE_STOCK_SHARE``, read once): an A/B of the two copies in one process."""
    return StockShare(_settings().stock_share)


@functools.cache
def _settings() -> KVCoreConfig:
    return KVCoreConfig.from_env()


# The pool classes kvcore serves, by the kind the rule's rows name.
_POOL_KINDS = {MHA_POOL: "mha", MLA_POOL: "mla", DSA_POOL: "dsa"}


def _pool_kind(pool: Any) -> str:
    """The rule's name for the pool's kind; "" for any other class (rows for any pool)."""
    return _POOL_KINDS.get(_class_name(pool), "")


def _call_rule(op: str, pool: Any, io_backend: str) -> serve_rule.SGLangRule | None:
    """The rule's row for this call, looked up once per call: None where the rule is off,
    the pool lacks a layout or page size (the checks that follow say why such a pool runs
    stock), or no row matches (kvcore serves)."""
    if not serve_rule_enabled():
        return None
    layout, page_size = getattr(pool, "layout", None), getattr(pool, "page_size", None)
    if not isinstance(layout, str) or not isinstance(page_size, int):
        return None
    return serve_rule.sglang_rule(op, io_backend, layout, page_size, pool=_pool_kind(pool))


LOAD_REQUESTS = LoadRequests()
POOL_LAYERS = PoolLayers()


def forget() -> None:
    """Drop everything the transfer hooks keep (the mover, the memos of requests, layers
    and moved indices) and give back every stock method bound on a pool: what
    :class:`kvcore_sglang.installation.Installation` does once the hooks are gone."""
    restore_bypassed()
    LOAD_REQUESTS.clear()
    POOL_LAYERS.clear()
    LAYER_PAIRS.clear()
    HOST_INDEX_MEMO.clear()
    _JOBS_FOUND.clear()
    INTERNAL_ERRORS.forget()
    use_mover(None)


def _start_load(
    chosen_mover: Mover,
    jobs: PoolJobs | None,
    rule: serve_rule.SGLangRule | None,
    pool_class: str,
    pool: Any,
    device_pool: Any,
    host_indices: Any,
    device_indices: Any,
    io_backend: str,
    is_draft: bool,
) -> LoadRequest | str:
    """Decide a new reload on its first call: a request kvcore serves, or why it passes.

    The rule comes first (it reads the pool's layout and the request's size, nothing
    else), so a request that passes costs a lookup; a row that tells few long host runs
    from scattered slots then reads the host indices once. A request is kept only when its
    index tensors are tensors (their identity names it); its pass is counted once, here.
    """
    indices: CallIndices | str | None = None
    host_runs: HostRunFound | None = None
    tokens = _count_of(host_indices)
    reason = None if rule is None else rule.decision(tokens)
    if reason is None and _inference_indices(host_indices, device_indices):
        reason = INFERENCE_INDICES
    if reason is None:
        if jobs is None:
            reason = _SOURCE_UNKNOWN
        else:
            indices = _call_indices(pool, pool_class, host_indices, device_indices, io_backend)
            if isinstance(indices, str):
                reason = indices
            else:
                reason, host_runs = _host_runs_pass(rule, tokens, indices.host, chosen_mover.policy)
    if reason is None and stock_share().drawn():
        reason = STOCK_SHARE
    if reason is None:
        _count_serve(chosen_mover)
    else:
        count_request_pass(chosen_mover, reason)
    if not (isinstance(host_indices, torch.Tensor) and isinstance(device_indices, torch.Tensor)):
        return reason or "sglang_indices_on_device"
    request = LOAD_REQUESTS.start(
        pool, device_pool, host_indices, device_indices, io_backend, is_draft, chosen_mover.policy
    )
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


def _host_runs_pass(
    rule: serve_rule.SGLangRule | None, tokens: int, host: torch.Tensor, policy: PathPolicy
) -> tuple[str | None, HostRunFound | None]:
    """Why the call's ``rule`` passes a request with these host slots (on the CPU), or
    None: few long runs are what kvcore's planner moves by DMA, holding no SMs, and what
    stock's kernel copies fastest; the same slots in another order are as scattered as
    any (a permutation of one span, for one). With it, for a request it serves whose
    slots are one run, that run for the plan (its ends say its bounds: no second read)."""
    if rule is None or not rule.reads_host_runs:
        return None, None
    limit = policy.max_dma_runs
    count = run_count_up_to(host, limit)
    reason = rule.host_decision(tokens, count <= limit)
    if reason is not None or count != 1 or host.numel() < 2:
        return reason, None
    try:
        return None, one_host_run(host)
    except ValueError:
        return None, None  # a negative slot: the plan refuses the request, as it always did


def _count_of(indices: Any) -> int:
    """Entries of an index tensor wherever it lives (no device read), 0 for anything else."""
    return int(indices.numel()) if isinstance(indices, torch.Tensor) else 0


def _load_job(
    jobs: PoolJobs,
    request: LoadRequest,
    pool: Any,
    device_pool: Any,
    layer_id: int,
    indices: CallIndices,
) -> Job | str:
    return jobs.load(
        pool,
        device_pool,
        layer_id,
        request.is_draft,
        indices.host,
        indices.device,
        request.io_backend,
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
        layers = request.pool_layers = POOL_LAYERS.kept(pool)
    kept = layer_in(layers, device_pool, key)
    if kept is not None:
        return kept, None
    job = _load_job(jobs, request, pool, device_pool, layer_id, indices)
    if isinstance(job, str):
        return job
    layered = layer_pairs([host for host, _ in job.pairs], [dev for _, dev in job.pairs])
    host, device = job.pairs[0]
    sides = check_sides(host, device, Direction.H2D)
    buffers = LayerBuffers(weakly(device_pool), job.pairs, layered, sides, job.rows)
    request.pool_layers = POOL_LAYERS.put(pool, device_pool, key, buffers)
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
    chosen_mover: Mover,
    jobs: PoolJobs,
    request: LoadRequest,
    pool: Any,
    device_pool: Any,
    layer_id: int,
    indices: CallIndices,
) -> str | None:
    """Copy one layer of a served reload; returns why the call must run stock instead."""
    found = _layer_buffers(jobs, request, pool, device_pool, layer_id, indices)
    if isinstance(found, str):
        return found
    buffers, job = found
    if request.plan is None:
        planned_from = job or _kept_layer_job(jobs, request, pool, buffers, indices)
        if isinstance(planned_from, str):
            return planned_from
        first = _first_plan(
            planned_from,
            Direction.H2D,
            chosen_mover,
            indices.device_opaque,
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
        chosen_mover.submit(each)
    return None


def _load_layer(
    jobs: PoolJobs | None,
    rule: serve_rule.SGLangRule | None,
    pool_class: str,
    pool: Any,
    device_pool: Any,
    host_indices: Any,
    device_indices: Any,
    layer_id: int,
    io_backend: str,
    is_draft: bool,
    request: LoadRequest | None,
) -> bool:
    """Move one layer of a reload on kvcore's paths; False when the call must run stock
    (the request passes, this layer cannot be served, or kvcore failed: counted).
    ``rule``: the rule's row for the call (:func:`_call_rule`), which a new request is
    decided by; ``request``: the request the call continues (:meth:`LoadRequest.matches`
    said so), None for a new one."""
    chosen_mover = mover()
    try:
        if request is None:
            started = _start_load(
                chosen_mover,
                jobs,
                rule,
                pool_class,
                pool,
                device_pool,
                host_indices,
                device_indices,
                io_backend,
                is_draft,
            )
            if isinstance(started, str):
                return False
            request = started
        if request.passes is not None or jobs is None:
            return False
        if not is_draft and not jobs.holds_layer(pool, device_pool, layer_id):
            return False  # a layer this pool does not hold: stock returns without copying
        reason = _serve_layer(
            chosen_mover, jobs, request, pool, device_pool, layer_id, request.call_indices
        )
    except Exception as exc:
        reason = _internal_error(chosen_mover, exc)
        if request is not None:
            request.passes = reason
        return False
    if reason is not None:
        _count_pass(chosen_mover, reason)
    return reason is None


def _continued(
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
        pool, device_pool, host_indices, device_indices, io_backend, is_draft, mover().policy
    ):
        return latest
    return None


def _later_layer_served(
    request: LoadRequest, device_pool: Any, layer_id: int, is_draft: bool
) -> bool:
    """A later layer of ``request`` (one the call continues, :func:`_continued`) where
    kvcore serves it and this pool has shown the layer's buffers before: one launch, nothing
    decided again. False for any other call (the full path decides it), and where kvcore
    fails (counted; the request then passes)."""
    if request.prepared is None:
        return False
    chosen_mover = mover()
    buffers = request.kept_layer(device_pool, (layer_id, is_draft))
    if buffers is None or buffers.layered.reason is not None:
        return False
    try:
        chosen_mover.execute_prepared(request.prepared, buffers.layered)
    except Exception as exc:
        request.passes = _internal_error(chosen_mover, exc)
        return False
    return True


def _pass_limit(op: str, pool: Any, io_backend: str) -> tuple[int, str]:
    """(the fewest tokens the rule's row for the pool's ``op`` with ``io_backend`` may serve,
    its reason to pass below that): what a pool's binding for passing calls keeps
    (:mod:`~kvcore_sglang.stock_binding`); ``(0, "")`` where the hook must decide every call
    (the rule is off, or no row matches)."""
    row = _call_rule(op, pool, io_backend)
    if row is None:
        return 0, ""
    lowest = row.serves_from
    return (sys.maxsize if lowest is None else lowest), row.reason


def _load_pass_limit(pool: Any, io_backend: str) -> tuple[int, str]:
    return _pass_limit("load", pool, io_backend)


def _backup_pass_limit(pool: Any, io_backend: str) -> tuple[int, str]:
    return _pass_limit("backup", pool, io_backend)


def _count_request_pass(reason: str) -> None:
    count_request_pass(mover(), reason)


def _passes_from_here(pool: Any, device_pool: Any, host_indices: Any, device_indices: Any) -> bool:
    """Whether the reload these index tensors name passes to stock from this call on."""
    latest = LOAD_REQUESTS.latest(pool, device_pool)
    return latest is not None and latest.passing_for(host_indices, device_indices)


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
        latest = LOAD_REQUESTS.latest(pool, device_pool)
        request = _continued(
            latest, pool, device_pool, host_indices, device_indices, io_backend, is_draft
        )
        if request is not None and _later_layer_served(request, device_pool, layer_id, is_draft):
            return
        # A later layer of a request that passes costs the first check alone (none at all
        # once its binding is on the pool).
        if latest is None or not latest.passing_for(host_indices, device_indices):
            rule = _call_rule("load", pool, io_backend)
            if bypass_if_never(original, pool, _LOAD, rule, io_backend):
                pass
            elif _load_layer(
                _jobs_for(target, by_release),
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
            elif _passes_from_here(pool, device_pool, host_indices, device_indices):
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

        rule = _call_rule("backup", pool, io_backend)
        if bypass_if_never(original, pool, _BACKUP, rule, io_backend):
            stock()
            return
        tokens = _count_of(host_indices)
        reason = None if rule is None else rule.decision(tokens)
        if reason is not None:
            count_request_pass(mover(), reason)
            bind_backup_gate(
                backup_hook, original, pool, _BACKUP, _backup_pass_limit, _count_request_pass
            )
            stock()
            return
        jobs = _jobs_for(target, by_release)
        indices = _call_indices(pool, pool_class, host_indices, device_indices, io_backend)
        if jobs is None:
            _serve(stock, pool, _SOURCE_UNKNOWN, Direction.D2H, False)
            return
        if isinstance(indices, str):
            _serve(stock, pool, indices, Direction.D2H, False)
            return
        passes, _ = _host_runs_pass(rule, tokens, indices.host, mover().policy)
        if passes is not None:
            count_request_pass(mover(), passes)
            stock()
            return
        _count_serve(mover())
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
