"""SGLang 0.5.23 host-pool transfers through kvcore's mover: MHA, MLA and the DSA indexer.

AROUND hooks on ``load_to_device_per_layer`` and ``backup_from_device_all_layer`` of
``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost`` and ``DSAIndexerPoolHost``, for the
``layer_first``, ``page_first`` and ``page_first_direct`` host layouts
(:mod:`kvcore_sglang.host_layouts` gives each a dense row view per layer). A call is
served only when every plan it needs is decided up front and none is a fallback;
otherwise the stock method runs unchanged, once, and the reason is counted in
``METRICS.record_fallback``.

Where the indices come from (SGLang 0.5.23, ``CacheController.move_indices``): with
``direct`` both index tensors reach the pool on the CPU (SGLang brings the device
indices back itself), so those calls are served. With ``kernel`` the host indices are
moved to the GPU first and the device indices come from the device allocator, which
computes them on the GPU: no CPU copy of the device side exists, so a ``kernel`` call
whose indices are on the GPU runs stock (``sglang_indices_on_device``). kvcore never
reads a device tensor back to plan.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from kvcore.config import KVCoreConfig
from kvcore.direction import Direction
from kvcore.metrics import METRICS
from kvcore.mover import Mover, TransferPath, TransferPlan, plan, policy_from_config

from . import pool_jobs
from .host_layouts import layout_reason
from .pool_jobs import BackupJob, Job, LoadJob

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


def _call_reason(
    pool: Any, served_class: str, host_indices: Any, device_indices: Any, io_backend: str
) -> str | None:
    """Why a call must run stock before looking at its layers, or None."""
    if _class_name(pool) != served_class:
        # Subclasses (MXFP8, HiSparse...) reach here through super() with their own data.
        return "sglang_pool_class"
    reason = layout_reason(pool.layout, io_backend)
    if reason is not None:
        return reason
    for indices in (host_indices, device_indices):
        if not isinstance(indices, torch.Tensor) or indices.device.type != "cpu":
            return "sglang_indices_on_device"
        if indices.dim() != 1 or indices.dtype not in _INDEX_DTYPES:
            return "sglang_index_dtype"
    return None


def _plans(job: Job, direction: Direction, chosen_mover: Mover) -> list[TransferPlan] | str:
    """One plan, rebound to every other layer pair; or the reason the call must run stock."""
    page_in = direction is Direction.H2D
    pairs = [(host, device) if page_in else (device, host) for host, device in job.pairs]
    src_idx, dst_idx = (
        (job.host_rows, job.device_rows) if page_in else (job.device_rows, job.host_rows)
    )
    try:
        first = plan(
            pairs[0][0],
            pairs[0][1],
            src_idx,
            dst_idx,
            direction=direction,
            policy=chosen_mover.policy,
        )
        plans = [first, *(first.rebind(src, dst) for src, dst in pairs[1:])]
    except ValueError:
        # Out-of-range or duplicate indices: stock's behaviour, whatever it is, is kept.
        return "sglang_invalid_indices"
    for each in plans:
        if each.path is TransferPath.FALLBACK:
            assert each.reason is not None
            return each.reason
    return plans


def _serve(stock: Callable[[], None], job: Job | str, direction: Direction) -> None:
    chosen_mover = mover()
    decided = job if isinstance(job, str) else _plans(job, direction, chosen_mover)
    if isinstance(decided, str):
        if chosen_mover.metrics is not None:
            chosen_mover.metrics.record_fallback(decided)
        stock()
        return
    for each in decided:
        chosen_mover.execute(each)


def _make_load_hook(
    pool_class: str, holds_layer: Callable[[Any, Any, int], bool], job_of: LoadJob
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

        reason = _call_reason(pool, pool_class, host_indices, device_indices, io_backend)
        if reason is None and not is_draft and not holds_layer(pool, device_pool, layer_id):
            stock()  # a layer this pool does not hold: stock returns without copying
            return
        job = reason or job_of(
            pool, device_pool, layer_id, is_draft, host_indices, device_indices, io_backend
        )
        _serve(stock, job, Direction.H2D)

    return load_hook


def _make_backup_hook(pool_class: str, job_of: BackupJob) -> Callable[..., None]:
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

        reason = _call_reason(pool, pool_class, host_indices, device_indices, io_backend)
        job = reason or job_of(pool, device_pool, host_indices, device_indices, io_backend)
        _serve(stock, job, Direction.D2H)

    return backup_hook


_LOAD = "load_to_device_per_layer"
_BACKUP = "backup_from_device_all_layer"
# Target (as the guard names it) -> hook.
HOOKS: dict[str, Callable[..., Any]] = {
    f"{MHA_POOL}.{_LOAD}": _make_load_hook(MHA_POOL, pool_jobs.mha_holds_layer, pool_jobs.mha_load),
    f"{MHA_POOL}.{_BACKUP}": _make_backup_hook(MHA_POOL, pool_jobs.mha_backup),
    f"{MLA_POOL}.{_LOAD}": _make_load_hook(MLA_POOL, pool_jobs.mla_holds_layer, pool_jobs.mla_load),
    f"{MLA_POOL}.{_BACKUP}": _make_backup_hook(MLA_POOL, pool_jobs.mla_backup),
    f"{DSA_POOL}.{_LOAD}": _make_load_hook(DSA_POOL, pool_jobs.dsa_holds_layer, pool_jobs.dsa_load),
    f"{DSA_POOL}.{_BACKUP}": _make_backup_hook(DSA_POOL, pool_jobs.dsa_backup),
}
