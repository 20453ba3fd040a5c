"""What one SGLang host-pool transfer call copies, per pool class and release, as a :class:`Job`.

Each builder reads the pool the way the stock method does (which host layer, which
device buffer, which indices) and returns the copies as (host layer view, device
layer) pairs sharing one pair of index tensors, or the reason the call must run
stock. Builders only look: nothing is copied here.

The builders follow SGLang 0.5.23's methods unless named for 0.5.22; :data:`MHA_JOBS`,
:data:`MLA_JOBS` and :data:`DSA_JOBS` say which builders reproduce which release's
source (:mod:`kvcore_sglang.transfers` picks them by the installed source's fingerprint).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .host_layouts import BlockRows, block_rows, is_paged

BufferPairs = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Job:
    """The copies one call makes: every (host layer view, device layer) pair shares the
    indices (rows of the host views, rows of the device layers)."""

    pairs: BufferPairs
    rows: BlockRows
    """The host views' geometry, which maps host slots to rows."""
    host_slots: torch.Tensor
    device_rows: torch.Tensor

    @property
    def host_rows(self) -> torch.Tensor:
        """Rows of the host slots in every host view; worked out only when a call is
        planned (a load whose plan is kept for its indices does not need them), once per
        plan. ValueError if a slot lies outside the views
        (:meth:`kvcore.row_views.RowMap.rows_of`)."""
        return self.rows.slot_map.rows_of(self.host_slots)


class LoadJob(Protocol):
    def __call__(
        self,
        pool: Any,
        device_pool: Any,
        layer_id: int,
        is_draft: bool,
        host_idx: torch.Tensor,
        device_idx: torch.Tensor,
        io_backend: str,
    ) -> Job | str: ...


class BackupJob(Protocol):
    def __call__(
        self,
        pool: Any,
        device_pool: Any,
        host_idx: torch.Tensor,
        device_idx: torch.Tensor,
        io_backend: str,
    ) -> Job | str: ...


HoldsLayer = Callable[[Any, Any, int], bool]
"""(pool, device pool, layer id) -> whether stock copies anything for that target layer."""

LoadIndices = Callable[
    [Any, torch.Tensor, torch.Tensor, str], tuple[torch.Tensor, torch.Tensor] | str
]
"""(pool, host indices, device indices, io backend) -> the (host slots, device rows) a load
copies by, as its :class:`LoadJob` takes them, or why the call runs stock: the part of a
load that depends on the request alone, so that a layer whose buffers are kept needs no
new job."""


@dataclass(frozen=True)
class PoolJobs:
    """The builders that reproduce one release's transfer methods of one pool class."""

    holds_layer: HoldsLayer
    load: LoadJob
    backup: BackupJob
    load_indices: LoadIndices


def _rows_of(
    buffers: Sequence[torch.Tensor], pool: Any, device: torch.Tensor, page_size: int
) -> list[BlockRows] | str:
    """Each host buffer as rows shaped like ``device``'s; all must share one geometry."""
    views: list[BlockRows] = []
    for buffer in buffers:
        rows = block_rows(buffer, pool.layout, pool.layer_num, page_size, device.shape[1:])
        if isinstance(rows, str):
            return rows
        views.append(rows)
    if len({rows.geometry for rows in views}) != 1:
        return "sglang_host_buffer_layout"
    return views


def _job(
    rows: BlockRows, pairs: BufferPairs, host_slots: torch.Tensor, device_rows: torch.Tensor
) -> Job:
    return Job(pairs, rows, host_slots, device_rows)


def _paged_reason(pool: Any, host_idx: torch.Tensor, device_idx: torch.Tensor) -> str | None:
    # Stock page_first_direct copies whole pages named by each page's first index.
    if pool.layout == "page_first_direct" and not is_paged(host_idx, device_idx, pool.page_size):
        return "sglang_unpaged_indices"
    return None


def token_load_indices(
    pool: Any, host_idx: torch.Tensor, device_idx: torch.Tensor, io_backend: str
) -> tuple[torch.Tensor, torch.Tensor] | str:
    """MHA and MLA loads (both releases) copy by the call's own indices, whole pages in
    page_first_direct (the check :func:`_layer_job` makes)."""
    reason = _paged_reason(pool, host_idx, device_idx)
    return reason if reason is not None else (host_idx, device_idx)


def _layer_job(
    pool: Any,
    host_buffers: tuple[torch.Tensor, ...],
    devices: tuple[torch.Tensor, ...],
    host_layer: int,
    host_idx: torch.Tensor,
    device_idx: torch.Tensor,
) -> Job | str:
    """One layer's copies: host layer ``host_layer`` of each host buffer with its device layer."""
    views = _paged_reason(pool, host_idx, device_idx) or _rows_of(
        host_buffers, pool, devices[0], pool.page_size
    )
    if isinstance(views, str):
        return views
    pairs = [(rows.layer(host_layer), device) for rows, device in zip(views, devices, strict=True)]
    return _job(views[0], pairs, host_idx, device_idx)


def _all_layers_job(
    pool: Any,
    host_buffers: tuple[torch.Tensor, ...],
    device_layers: tuple[Sequence[torch.Tensor], ...],
    host_idx: torch.Tensor,
    device_idx: torch.Tensor,
) -> Job | str:
    """Every layer's copies, host layer ``i`` with device layer ``i``; buffer by buffer (K of
    every layer, then V: the order of SGLang's own all-layer copies)."""
    if not all(0 < pool.layer_num == len(layers) for layers in device_layers):
        return "sglang_layer_count"
    views = _paged_reason(pool, host_idx, device_idx) or _rows_of(
        host_buffers, pool, device_layers[0][0], pool.page_size
    )
    if isinstance(views, str):
        return views
    pairs = [
        (rows.layer(i), layers[i])
        for rows, layers in zip(views, device_layers, strict=True)
        for i in range(pool.layer_num)
    ]
    return _job(views[0], pairs, host_idx, device_idx)


# --- MHA ---------------------------------------------------------------------------------


def mha_load(
    pool: Any,
    device_pool: Any,
    layer_id: int,
    is_draft: bool,
    host_idx: torch.Tensor,
    device_idx: torch.Tensor,
    io_backend: str,
) -> Job | str:
    if not 0 <= layer_id < min(len(pool.device_k_buffers), pool.layer_num):
        return "sglang_layer_id"
    devices = (pool.device_k_buffers[layer_id], pool.device_v_buffers[layer_id])
    return _layer_job(pool, (pool.k_buffer, pool.v_buffer), devices, layer_id, host_idx, device_idx)


def mha_backup(
    pool: Any, device_pool: Any, host_idx: torch.Tensor, device_idx: torch.Tensor, io_backend: str
) -> Job | str:
    devices = (pool.device_k_buffers, pool.device_v_buffers)
    return _all_layers_job(pool, (pool.k_buffer, pool.v_buffer), devices, host_idx, device_idx)


def mha_holds_layer(pool: Any, device_pool: Any, layer_id: int) -> bool:
    return 0 <= layer_id < pool.target_layer_num


# --- MLA ---------------------------------------------------------------------------------


def _mla_reason(pool: Any) -> str | None:
    if pool._is_dummy:
        return "sglang_dummy_pool"
    if pool.dcp_size != 1:
        # Stock translates DCP slots to rows (maybe_dcp_kernel_indices); not served yet.
        return "sglang_dcp"
    if pool._native_buffers is not None:
        return "sglang_split_buffers"
    return None


def mla_load(
    pool: Any,
    device_pool: Any,
    layer_id: int,
    is_draft: bool,
    host_idx: torch.Tensor,
    device_idx: torch.Tensor,
    io_backend: str,
) -> Job | str:
    reason = _mla_reason(pool)
    if reason is not None:
        return reason
    host_layer = pool._host_layer_by_controller.get(layer_id)
    device_layer = pool._buffer_index_by_layer.get(layer_id)
    if host_layer is None or device_layer is None or not 0 <= host_layer < pool.layer_num:
        return "sglang_layer_id"
    device = pool.device_kv_buffers[device_layer]
    return _layer_job(pool, (pool.kv_buffer,), (device,), host_layer, host_idx, device_idx)


def mla_backup(
    pool: Any, device_pool: Any, host_idx: torch.Tensor, device_idx: torch.Tensor, io_backend: str
) -> Job | str:
    reason = _mla_reason(pool)
    if reason is not None:
        return reason
    if pool._layer_shard_enabled:
        return "sglang_layer_shard"
    return _all_layers_job(pool, (pool.kv_buffer,), (pool.device_kv_buffers,), host_idx, device_idx)


def mla_holds_layer(pool: Any, device_pool: Any, layer_id: int) -> bool:
    return pool._is_dummy or layer_id in pool._target_layer_indices


# --- DSA indexer -------------------------------------------------------------------------


def dsa_load_indices(
    pool: Any, host_idx: torch.Tensor, device_idx: torch.Tensor, io_backend: str
) -> tuple[torch.Tensor, torch.Tensor] | str:
    """A DSA indexer load copies by page: :func:`_dsa_pages`."""
    return _dsa_pages(pool, io_backend, host_idx, device_idx)


def _dsa_pages(
    pool: Any, io_backend: str, host_idx: torch.Tensor, device_idx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | str:
    """Stock's page indices (the first index of each page-sized group, // page_size), or
    why the call runs stock."""
    if pool._is_dummy:
        return "sglang_dummy_pool"
    if io_backend == "kernel" and pool.indexer_page_stride_size % 8:
        # Stock has no copy for this pair and raises.
        return "sglang_io_backend"
    page = pool.page_size
    if host_idx.numel() % page or device_idx.numel() % page:
        return "sglang_unaligned_indices"
    if host_idx.numel() == 0:
        return host_idx, device_idx
    return (
        host_idx.reshape(-1, page)[:, 0].to(torch.int64) // page,
        device_idx.reshape(-1, page)[:, 0].to(torch.int64) // page,
    )


def _dsa_rows(pool: Any, device: torch.Tensor) -> BlockRows | str:
    # Each index page is one row; a page_first_direct "page" of index pages holds one.
    views = _rows_of((pool.index_k_with_scale_buffer,), pool, device, 1)
    return views if isinstance(views, str) else views[0]


def dsa_load(
    pool: Any,
    device_pool: Any,
    layer_id: int,
    is_draft: bool,
    host_idx: torch.Tensor,
    device_idx: torch.Tensor,
    io_backend: str,
) -> Job | str:
    pages = _dsa_pages(pool, io_backend, host_idx, device_idx)
    if isinstance(pages, str):
        return pages
    if is_draft:
        host_layer, device_layer = pool._draft_host_layer(layer_id), 0
    else:
        host_layer, device_layer = pool._host_layer_index(layer_id), layer_id
    devices = device_pool.index_k_with_scale_buffer
    if not (0 <= host_layer < pool.layer_num and 0 <= device_layer < len(devices)):
        return "sglang_layer_id"
    device = devices[device_layer]
    rows = _dsa_rows(pool, device)
    if isinstance(rows, str):
        return rows
    return _job(rows, [(rows.layer(host_layer), device)], *pages)


def dsa_backup(
    pool: Any, device_pool: Any, host_idx: torch.Tensor, device_idx: torch.Tensor, io_backend: str
) -> Job | str:
    pages = _dsa_pages(pool, io_backend, host_idx, device_idx)
    if isinstance(pages, str):
        return pages
    if pool._is_device_layer_sharded(device_pool):
        return "sglang_layer_shard"
    devices = pool.packed_device_index_buffers
    if not 0 < pool.layer_num == len(devices):
        return "sglang_layer_count"
    rows = _dsa_rows(pool, devices[0])
    if isinstance(rows, str):
        return rows
    pairs = [(rows.layer(i), device) for i, device in enumerate(devices)]
    return _job(rows, pairs, *pages)


def dsa_holds_layer(pool: Any, device_pool: Any, layer_id: int) -> bool:
    return bool(pool._is_device_layer_owned(device_pool, layer_id))


# --- SGLang 0.5.22: MHA and MLA ------------------------------------------------------------
#
# 0.5.22's MHA and MLA host pools keep their device pool and map layers through its layer
# sharding (``HostKVCache._device_owned_layer_range``): a target layer is copied only when
# ``_is_device_layer_owned(device_pool, layer)`` (the call's device pool), into or out of
# host layer ``_host_layer_index(layer)`` (the layer less the first owned one, from the
# pool's own device pool); an MTP draft layer skips the sharding (host layer = layer). The
# device buffer is always ``device_*_buffers[layer]``: a layer-sharded device pool keeps
# its per-layer list index-aligned (unowned layers hold empty placeholders). Without
# sharding all of this is 0.5.23's identity mapping. The all-layer backups copy device
# layer ``i`` to host layer ``i`` for every host layer, as 0.5.23's do; MLA's switches
# to a per-layer loop on a layer-sharded device pool, which kvcore leaves to stock.


def holds_layer_0_5_22(pool: Any, device_pool: Any, layer_id: int) -> bool:
    return bool(pool._is_device_layer_owned(device_pool, layer_id))


def _host_layer_0_5_22(pool: Any, layer_id: int, is_draft: bool) -> int:
    return layer_id if is_draft else pool._host_layer_index(layer_id)


def _layer_ids_0_5_22(
    pool: Any, layer_id: int, is_draft: bool, devices: Sequence[torch.Tensor]
) -> int | str:
    """The host layer a load of ``layer_id`` copies from, or why the call runs stock."""
    if not 0 <= layer_id < len(devices):
        return "sglang_layer_id"
    host_layer = _host_layer_0_5_22(pool, layer_id, is_draft)
    if not 0 <= host_layer < pool.layer_num:
        return "sglang_layer_id"
    return host_layer


def mha_load_0_5_22(
    pool: Any,
    device_pool: Any,
    layer_id: int,
    is_draft: bool,
    host_idx: torch.Tensor,
    device_idx: torch.Tensor,
    io_backend: str,
) -> Job | str:
    if len(pool.device_k_buffers) != len(pool.device_v_buffers):
        return "sglang_layer_count"
    host_layer = _layer_ids_0_5_22(pool, layer_id, is_draft, pool.device_k_buffers)
    if isinstance(host_layer, str):
        return host_layer
    devices = (pool.device_k_buffers[layer_id], pool.device_v_buffers[layer_id])
    hosts = (pool.k_buffer, pool.v_buffer)
    return _layer_job(pool, hosts, devices, host_layer, host_idx, device_idx)


def _mla_reason_0_5_22(pool: Any) -> str | None:
    if pool._is_dummy:
        return "sglang_dummy_pool"
    if pool.dcp_size != 1:
        return "sglang_dcp"
    return None


def mla_load_0_5_22(
    pool: Any,
    device_pool: Any,
    layer_id: int,
    is_draft: bool,
    host_idx: torch.Tensor,
    device_idx: torch.Tensor,
    io_backend: str,
) -> Job | str:
    reason = _mla_reason_0_5_22(pool)
    if reason is not None:
        return reason
    host_layer = _layer_ids_0_5_22(pool, layer_id, is_draft, pool.device_kv_buffers)
    if isinstance(host_layer, str):
        return host_layer
    device = pool.device_kv_buffers[layer_id]
    return _layer_job(pool, (pool.kv_buffer,), (device,), host_layer, host_idx, device_idx)


def mla_backup_0_5_22(
    pool: Any, device_pool: Any, host_idx: torch.Tensor, device_idx: torch.Tensor, io_backend: str
) -> Job | str:
    reason = _mla_reason_0_5_22(pool)
    if reason is not None:
        return reason
    if pool._is_device_layer_sharded(device_pool):
        return "sglang_layer_shard"
    return _all_layers_job(pool, (pool.kv_buffer,), (pool.device_kv_buffers,), host_idx, device_idx)


# --- builders per release ------------------------------------------------------------------

# Release -> the builders that reproduce its methods (0.5.22's MHA backup copies what
# 0.5.23's does; both releases define the DSA indexer's transfers identically).
MHA_JOBS: dict[str, PoolJobs] = {
    "0.5.22": PoolJobs(holds_layer_0_5_22, mha_load_0_5_22, mha_backup, token_load_indices),
    "0.5.23": PoolJobs(mha_holds_layer, mha_load, mha_backup, token_load_indices),
}
MLA_JOBS: dict[str, PoolJobs] = {
    "0.5.22": PoolJobs(holds_layer_0_5_22, mla_load_0_5_22, mla_backup_0_5_22, token_load_indices),
    "0.5.23": PoolJobs(mla_holds_layer, mla_load, mla_backup, token_load_indices),
}
DSA_JOBS: dict[str, PoolJobs] = {
    release: PoolJobs(dsa_holds_layer, dsa_load, dsa_backup, dsa_load_indices)
    for release in ("0.5.22", "0.5.23")
}
