"""kvcore's SGLang adapter as one object: everything its hooks read and keep.

:class:`SGLangAdapter` is built from a :class:`~kvcore.config.KVCoreConfig` when the
plugin installs (or by a test or a benchmark, for hooks of its own), and the hooks close
over it (:func:`kvcore_sglang.transfers.hooks`, :func:`kvcore_sglang.pool_warm_up.hooks`).
It holds the settings as read once, the mover, the requests and layers a reload keeps,
the moved host indices, the checked buffer pairs, the release each target plans with, the
stock bindings on pools and the warmed row sizes. Uninstalling calls :meth:`release` and
drops the object: nothing it read or kept outlives it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from kvcore.config import KVCoreConfig
from kvcore.internal_errors import InternalErrors
from kvcore.mover import Mover
from kvcore.stock_share import StockShare

from . import call_plans
from .call_memos import HostIndexMemo, LayerPairsMemo
from .device_reads import DeviceIndexReads, worth_reading
from .hook_mover import HookMover, count_request_pass
from .load_requests import LoadRequests, PoolLayers
from .release_jobs import ReleaseJobs
from .serve_or_pass import pass_limit
from .stock_binding import StockBindings

logger = logging.getLogger("kvcore")


class SGLangAdapter:
    """The state and settings behind one installation of kvcore's SGLang hooks."""

    def __init__(self, config: KVCoreConfig | None = None) -> None:
        self.config = KVCoreConfig.from_env() if config is None else config
        self.serve_rule = self.config.serve_rule
        """Whether the serve-or-pass rule decides calls (``KVCORE_SERVE_RULE``)."""
        self.stock_share = StockShare(self.config.stock_share)
        """The draws of the reloads kvcore would serve that go to stock's copy instead
        (``KVCORE_STOCK_SHARE``): an A/B of the two copies in one process."""
        self.movers = HookMover(self.config)
        self.mover: Callable[[], Mover] = self.movers.mover
        """The mover the hooks copy through, built from the configuration on first use
        (the holder's own method: every hook call asks, with no frame of the adapter's)."""
        self.load_requests = LoadRequests()
        self.pool_layers = PoolLayers()
        self.host_indices = HostIndexMemo()
        self.device_reads: DeviceIndexReads | None = (
            DeviceIndexReads() if self.config.sglang_dma_in_place else None
        )
        """The device indices read back at their move (``KVCORE_SGLANG_DMA_IN_PLACE``), so
        that paged rows can go by DMA straight into place; None where they stay unread."""
        self.layer_pairs = LayerPairsMemo()
        self.release_jobs = ReleaseJobs()
        self.internal_errors = InternalErrors("SGLang", logger)
        self.bindings = StockBindings(self.movers)
        self.warmed: dict[tuple[torch.device, int], bool] = {}
        """(device, row bytes) -> whether its warm-up moved every byte right."""
        self.warm_up_lock = threading.Lock()

    def count_request_pass(self, reason: str) -> None:
        """A whole request passed to stock, counted in the mover's metrics (what a stock
        binding on a pool counts where the mover keeps no pass tally)."""
        count_request_pass(self.mover(), reason)

    def use_mover(self, chosen: Mover | None) -> Mover | None:
        """Copy through ``chosen`` (None: one built from the configuration on next use);
        returns the one in use until now, for the caller to put back."""
        return self.movers.use(chosen)

    def indices_moved(self, controller: Any, host_indices: Any, moved: Any) -> None:
        """Remember what ``HiCacheController.move_indices`` made of the index tensors it was
        given (``moved``: its result): the CPU host indices of a copy it put on the GPU,
        and, under ``KVCORE_SGLANG_DMA_IN_PLACE``, a read of device indices it left there."""
        moved_host = moved[0] if isinstance(moved, tuple) and moved else None
        if (
            isinstance(host_indices, torch.Tensor)
            and host_indices.device.type == "cpu"
            and isinstance(moved_host, torch.Tensor)
            and moved_host is not host_indices
            and moved_host.device.type != "cpu"
        ):
            self.host_indices.remember(moved_host, host_indices)
        moved_device = moved[1] if isinstance(moved, tuple) and len(moved) > 1 else None
        dma_page_bytes = self.dma_page_bytes()
        if (
            self.device_reads is not None
            and dma_page_bytes is not None
            and worth_reading(moved_device, controller, dma_page_bytes)
            and self._rule_may_serve(controller, moved_device.numel())
        ):
            self.device_reads.start(moved_device)

    def dma_page_bytes(self) -> int | None:
        """The shortest page of one layer that goes by DMA straight into place under
        ``KVCORE_SGLANG_DMA_IN_PLACE`` (the mover's long-run bytes); None where the setting
        is off."""
        return None if self.device_reads is None else self.mover().policy.long_run_bytes

    def _rule_may_serve(self, controller: Any, tokens: int) -> bool:
        """Whether the serve-or-pass rule may serve a load or a backup of ``tokens`` tokens
        of the controller's host pool: a move does not say which it is for, and a request
        the rule passes has no use for its device indices read back."""
        pool, io_backend = controller.mem_pool_host, controller.io_backend
        return any(
            tokens >= pass_limit(self.serve_rule, op, pool, io_backend)[0]
            for op in ("load", "backup")
        )

    def call_indices(
        self, pool: Any, served_class: str, host_indices: Any, device_indices: Any, io_backend: str
    ) -> call_plans.CallIndices | str:
        """The indices a call plans from, or why it runs stock
        (:func:`kvcore_sglang.call_plans.call_indices`); a benchmark may set a stand-in of
        the same signature on the instance."""
        return call_plans.call_indices(
            pool,
            served_class,
            host_indices,
            device_indices,
            io_backend,
            self.host_indices,
            self.device_reads,
        )

    def release(self) -> None:
        """Give back every stock method bound on a pool and the mover: what uninstalling
        does once the hooks are gone, before dropping the adapter."""
        self.bindings.restore()
        self.use_mover(None)
