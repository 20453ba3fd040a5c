"""SGLang 0.5.23 host-pool transfers through kvcore's mover (MHA and MLA, ``layer_first``).

Four AROUND hooks: ``load_to_device_per_layer`` and ``backup_from_device_all_layer`` of
``MHATokenToKVPoolHost`` and ``MLATokenToKVPoolHost``. A call is served only when every
plan it needs is decided up front and none is a fallback; otherwise the stock method
runs unchanged, once, and the reason is counted in ``METRICS.record_fallback``.

Where the indices come from (SGLang 0.5.23, ``CacheController.move_indices``): with the
``kernel`` io backend the host indices are moved to the GPU (``.to(device,
non_blocking=True)``) before the L2 transfer engine calls the pool, and the device
indices come from the device allocator, already on the GPU; with ``direct`` and
``layer_first`` the host indices are sorted on the CPU and SGLang itself brings the
device indices to the CPU. kvcore plans from CPU indices only and never reads a device
tensor back, so a call whose indices are not both on the CPU runs stock
(``sglang_indices_on_device``): in a CUDA deployment that is every ``kernel`` call
until the CPU copies are kept where SGLang moves them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvcore.config import KVCoreConfig
from kvcore.direction import Direction
from kvcore.metrics import METRICS
from kvcore.mover import Mover, TransferPath, TransferPlan, plan, policy_from_config

_POOL_PACKAGE = "sglang.srt.mem_cache.pool_host"
MHA_POOL = f"{_POOL_PACKAGE}.mha.MHATokenToKVPoolHost"
MLA_POOL = f"{_POOL_PACKAGE}.mla.MLATokenToKVPoolHost"
SERVED_LAYOUT = "layer_first"
SERVED_IO_BACKENDS = frozenset({"kernel", "direct"})
# The index dtypes kvcore.runs.check_index accepts.
_INDEX_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})

# (source layer, destination layer) for every layer one call moves; all share its indices.
LayerPairs = list[tuple[torch.Tensor, torch.Tensor]]

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
    if pool.layout != SERVED_LAYOUT:
        return f"sglang_layout_{pool.layout}"
    if io_backend not in SERVED_IO_BACKENDS:
        return "sglang_io_backend"
    for indices in (host_indices, device_indices):
        if not isinstance(indices, torch.Tensor) or indices.device.type != "cpu":
            return "sglang_indices_on_device"
        if indices.dim() != 1 or indices.dtype not in _INDEX_DTYPES:
            return "sglang_index_dtype"
    return None


def _plans(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    direction: Direction,
    chosen_mover: Mover,
) -> list[TransferPlan] | str:
    """One plan, rebound to every other layer pair; or the reason the call must run stock."""
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


def _serve(
    stock: Callable[[], None],
    reason: str | None,
    pairs: LayerPairs | None,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    direction: Direction,
) -> None:
    chosen_mover = mover()
    if reason is None:
        assert pairs
        decided = _plans(pairs, src_idx, dst_idx, direction, chosen_mover)
        if isinstance(decided, list):
            for each in decided:
                chosen_mover.execute(each)
            return
        reason = decided
    if chosen_mover.metrics is not None:
        chosen_mover.metrics.record_fallback(reason)
    stock()


def _mha_load_pairs(pool: Any, layer_id: int) -> LayerPairs | str:
    if not 0 <= layer_id < min(len(pool.device_k_buffers), pool.layer_num):
        return "sglang_layer_id"
    return [
        (pool.k_buffer[layer_id], pool.device_k_buffers[layer_id]),
        (pool.v_buffer[layer_id], pool.device_v_buffers[layer_id]),
    ]


def _mha_backup_pairs(pool: Any) -> LayerPairs | str:
    device = (*pool.device_k_buffers, *pool.device_v_buffers)
    host = (*pool.k_data_refs, *pool.v_data_refs)
    if len(device) != len(host) or len(pool.k_data_refs) != len(pool.device_k_buffers):
        return "sglang_layer_count"
    return list(zip(device, host, strict=True))


def _mla_reason(pool: Any) -> str | None:
    if pool._is_dummy:
        return "sglang_dummy_pool"
    if pool.dcp_size != 1:
        # Stock translates DCP slots to rows (maybe_dcp_kernel_indices); not served yet.
        return "sglang_dcp"
    if pool._native_buffers is not None:
        return "sglang_split_buffers"
    return None


def _mla_load_pairs(pool: Any, layer_id: int) -> LayerPairs | str:
    reason = _mla_reason(pool)
    if reason is not None:
        return reason
    host_layer = pool._host_layer_by_controller.get(layer_id)
    device_layer = pool._buffer_index_by_layer.get(layer_id)
    if host_layer is None or device_layer is None:
        return "sglang_layer_id"
    return [(pool.kv_buffer[host_layer], pool.device_kv_buffers[device_layer])]


def _mla_backup_pairs(pool: Any) -> LayerPairs | str:
    reason = _mla_reason(pool)
    if reason is not None:
        return reason
    if pool._layer_shard_enabled:
        return "sglang_layer_shard"
    if len(pool.device_kv_buffers) != len(pool.data_refs):
        return "sglang_layer_count"
    return list(zip(pool.device_kv_buffers, pool.data_refs, strict=True))


def _split(pairs: LayerPairs | str) -> tuple[str | None, LayerPairs | None]:
    return (pairs, None) if isinstance(pairs, str) else (None, pairs)


def _make_load_hook(
    pool_class: str,
    holds_layer: Callable[[Any, int], bool],
    pairs_of: Callable[[Any, int], Any],
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
        if reason is None and not is_draft and not holds_layer(pool, layer_id):
            stock()  # a layer this pool does not hold: stock returns without copying
            return
        reason, pairs = _split(reason or pairs_of(pool, layer_id))
        _serve(stock, reason, pairs, host_indices, device_indices, Direction.H2D)

    return load_hook


def _make_backup_hook(pool_class: str, pairs_of: Callable[[Any], Any]) -> Callable[..., None]:
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
        reason, pairs = _split(reason or pairs_of(pool))
        _serve(stock, reason, pairs, device_indices, host_indices, Direction.D2H)

    return backup_hook


def _mha_holds_layer(pool: Any, layer_id: int) -> bool:
    return 0 <= layer_id < pool.target_layer_num


def _mla_holds_layer(pool: Any, layer_id: int) -> bool:
    return pool._is_dummy or layer_id in pool._target_layer_indices


mha_load_hook = _make_load_hook(MHA_POOL, _mha_holds_layer, _mha_load_pairs)
mla_load_hook = _make_load_hook(MLA_POOL, _mla_holds_layer, _mla_load_pairs)
mha_backup_hook = _make_backup_hook(MHA_POOL, _mha_backup_pairs)
mla_backup_hook = _make_backup_hook(MLA_POOL, _mla_backup_pairs)


# Target (as the guard names it) -> hook.
HOOKS: dict[str, Callable[..., Any]] = {
    f"{MHA_POOL}.load_to_device_per_layer": mha_load_hook,
    f"{MHA_POOL}.backup_from_device_all_layer": mha_backup_hook,
    f"{MLA_POOL}.load_to_device_per_layer": mla_load_hook,
    f"{MLA_POOL}.backup_from_device_all_layer": mla_backup_hook,
}
