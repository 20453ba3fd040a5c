"""What one SGLang host-pool transfer call copies, per pool class and release, as a :class:`Job`.

Each builder reads the pool the way the stock method does (which host layer, which
device buffer, which indices) and returns the copies as (host layer view, device
layer) pairs sharing one pair of index tensors, or the reason the call must run
stock. Builders only look: nothing is copied here.

The MHA and MLA pools of each release differ only in what a :class:`TokenPool` row holds
(which buffers, how a layer maps, what runs stock), one row per kind and release, read
by one load and one backup; the DSA indexer's builders serve both releases.
:data:`MHA_JOBS`, :data:`MLA_JOBS` and :data:`DSA_JOBS` say which builders reproduce
which release's source (:mod:`kvcore_sglang.release_jobs` picks them by the installed
source's fingerprint).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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


LoadJob = Callable[[Any, Any, int, bool, torch.Tensor, torch.Tensor, str], Job | str]
"""(pool, device pool, layer id, is draft, host indices, device indices, io backend) -> the
copies of one layer's load, or why the call runs stock."""

BackupJob = Callable[[Any, Any, torch.Tensor, torch.Tensor, str], Job | str]
"""(pool, device pool, host indices, device indices, io backend) -> the copies of an
all-layer backup, or why the call runs stock."""


HoldsLayer = Callable[[Any, Any, int], bool]
"""(pool, device pool, layer id) -> whether stock copies anything for that target layer."""

LoadIndices = Callable[
    [Any, torch.Tensor, torch.Tensor, str], tuple[torch.Tensor, torch.Tensor] | str
]
"""(pool, host indices, device indices, io backend) -> the (host slots, device rows) a load
copies by, as its :data:`LoadJob` takes them, or why the call runs stock: the part of a
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


# --- MHA and MLA ---------------------------------------------------------------------------

LayerMap = Callable[[Any, int, bool, tuple[Sequence[torch.Tensor], ...]], tuple[int, int] | str]
"""(pool, layer id, is draft, the pool's per-layer device buffer lists) -> the host layer and
the device buffer index a load of that layer copies between, or why the call runs stock."""

Refusal = tuple[str, Callable[[Any], object]]
"""A reason and the test of a pool whose calls run stock for it."""

LayerSharded = Callable[[Any, Any], bool]
"""(pool, device pool) -> whether stock backs the pool up layer by layer (a layer-sharded
device pool), which kvcore leaves to stock."""


@dataclass(frozen=True)
class Buffers:
    """A pool kind's host buffers and per-layer device buffer lists, by attribute name, in
    one order (K then V, or KV)."""

    hosts: tuple[str, ...]
    devices: tuple[str, ...]


MHA_BUFFERS = Buffers(("k_buffer", "v_buffer"), ("device_k_buffers", "device_v_buffers"))
MLA_BUFFERS = Buffers(("kv_buffer",), ("device_kv_buffers",))


@dataclass(frozen=True)
class TokenPool:
    """One release's MHA or MLA host pool as its transfer methods read it. What the releases
    and the two kinds do differently is held here; the load and backup built from it are
    the same for all of them."""

    buffers: Buffers
    holds_layer: HoldsLayer
    """Whether stock copies anything for a target layer."""
    layers: LayerMap
    """Which host layer and device buffer a load of a layer copies between."""
    refusals: tuple[Refusal, ...] = ()
    """Tested in order before a load or a backup reads anything else."""
    layer_sharded: LayerSharded | None = None
    """Tested by a backup after :attr:`refusals`; None: the pool backs every layer up at once."""

    def jobs(self) -> PoolJobs:
        return PoolJobs(self.holds_layer, self.load, self.backup, token_load_indices)

    def load(
        self,
        pool: Any,
        device_pool: Any,  # unread: 0.5.22's layer map reads the pool's own device pool
        layer_id: int,
        is_draft: bool,
        host_idx: torch.Tensor,
        device_idx: torch.Tensor,
        io_backend: str,  # unread: both backends copy the same rows of these pools
    ) -> Job | str:
        reason = self._refusal(pool)
        if reason is not None:
            return reason
        device_lists = tuple(getattr(pool, name) for name in self.buffers.devices)
        layers = self.layers(pool, layer_id, is_draft, device_lists)
        if isinstance(layers, str):
            return layers
        host_layer, device_layer = layers
        hosts = tuple(getattr(pool, name) for name in self.buffers.hosts)
        devices = tuple(each[device_layer] for each in device_lists)
        return _layer_job(pool, hosts, devices, host_layer, host_idx, device_idx)

    def backup(
        self,
        pool: Any,
        device_pool: Any,
        host_idx: torch.Tensor,
        device_idx: torch.Tensor,
        io_backend: str,
    ) -> Job | str:
        reason = self._refusal(pool)
        if reason is not None:
            return reason
        if self.layer_sharded is not None and self.layer_sharded(pool, device_pool):
            return "sglang_layer_shard"
        hosts = tuple(getattr(pool, name) for name in self.buffers.hosts)
        device_lists = tuple(getattr(pool, name) for name in self.buffers.devices)
        return _all_layers_job(pool, hosts, device_lists, host_idx, device_idx)

    def _refusal(self, pool: Any) -> str | None:
        for reason, refuses in self.refusals:
            if refuses(pool):
                return reason
        return None


DUMMY_POOL: Refusal = ("sglang_dummy_pool", lambda pool: pool._is_dummy)
# Stock translates DCP slots to rows (maybe_dcp_kernel_indices); not served yet.
DCP: Refusal = ("sglang_dcp", lambda pool: pool.dcp_size != 1)
SPLIT_BUFFERS: Refusal = ("sglang_split_buffers", lambda pool: pool._native_buffers is not None)


# --- SGLang 0.5.23: MHA and MLA ------------------------------------------------------------


def mha_holds_layer(pool: Any, device_pool: Any, layer_id: int) -> bool:
    return 0 <= layer_id < pool.target_layer_num


def mla_holds_layer(pool: Any, device_pool: Any, layer_id: int) -> bool:
    return pool._is_dummy or layer_id in pool._target_layer_indices


def mha_layers(
    pool: Any, layer_id: int, is_draft: bool, device_lists: tuple[Sequence[torch.Tensor], ...]
) -> tuple[int, int] | str:
    """Host layer ``L`` with device layer ``L``, for a draft layer too."""
    if not 0 <= layer_id < min(len(device_lists[0]), pool.layer_num):
        return "sglang_layer_id"
    return layer_id, layer_id


def mla_layers(
    pool: Any, layer_id: int, is_draft: bool, device_lists: tuple[Sequence[torch.Tensor], ...]
) -> tuple[int, int] | str:
    """The host layer and device buffer the pool's own maps name for the layer."""
    host_layer = pool._host_layer_by_controller.get(layer_id)
    device_layer = pool._buffer_index_by_layer.get(layer_id)
    if host_layer is None or device_layer is None or not 0 <= host_layer < pool.layer_num:
        return "sglang_layer_id"
    return host_layer, device_layer


def layer_shard_enabled(pool: Any, device_pool: Any) -> bool:
    return bool(pool._layer_shard_enabled)


# One row a pool kind: TokenPool(buffers, holds_layer, layers, refusals, layer_sharded).
MHA_0_5_23 = TokenPool(MHA_BUFFERS, mha_holds_layer, mha_layers)
MLA_0_5_23 = TokenPool(
    MLA_BUFFERS, mla_holds_layer, mla_layers, (DUMMY_POOL, DCP, SPLIT_BUFFERS), layer_shard_enabled
)


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


def holds_owned_layer(pool: Any, device_pool: Any, layer_id: int) -> bool:
    """Whether the call's device pool owns the layer: how both releases' DSA indexer pools and
    0.5.22's MHA and MLA pools decide."""
    return bool(pool._is_device_layer_owned(device_pool, layer_id))


def layers_0_5_22(
    pool: Any, layer_id: int, is_draft: bool, device_lists: tuple[Sequence[torch.Tensor], ...]
) -> tuple[int, int] | str:
    """The owned host layer of a target layer (a draft layer's own), with device layer
    ``layer_id``."""
    if any(len(each) != len(device_lists[0]) for each in device_lists):
        return "sglang_layer_count"
    if not 0 <= layer_id < len(device_lists[0]):
        return "sglang_layer_id"
    host_layer = layer_id if is_draft else pool._host_layer_index(layer_id)
    if not 0 <= host_layer < pool.layer_num:
        return "sglang_layer_id"
    return host_layer, layer_id


def device_layer_sharded_0_5_22(pool: Any, device_pool: Any) -> bool:
    return bool(pool._is_device_layer_sharded(device_pool))


MHA_0_5_22 = TokenPool(MHA_BUFFERS, holds_owned_layer, layers_0_5_22)
MLA_0_5_22 = TokenPool(
    MLA_BUFFERS, holds_owned_layer, layers_0_5_22, (DUMMY_POOL, DCP), device_layer_sharded_0_5_22
)


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


# --- builders per release ------------------------------------------------------------------

# Release -> the builders that reproduce its methods (both releases define the DSA
# indexer's transfers identically).
MHA_JOBS: dict[str, PoolJobs] = {"0.5.22": MHA_0_5_22.jobs(), "0.5.23": MHA_0_5_23.jobs()}
MLA_JOBS: dict[str, PoolJobs] = {"0.5.22": MLA_0_5_22.jobs(), "0.5.23": MLA_0_5_23.jobs()}
DSA_JOBS: dict[str, PoolJobs] = {
    release: PoolJobs(holds_owned_layer, dsa_load, dsa_backup, dsa_load_indices)
    for release in ("0.5.22", "0.5.23")
}
