"""Putting kvcore's offload handlers in place of a vLLM worker's stock ones.

:func:`install_handlers` builds one :class:`~kvcore_vllm.transfers.KVCoreOffloadingHandler`
per stock handler the worker holds, on one shared mover, after that mover's paths proved
on scratch rows that they move every byte right, and records each replacement for the
plugin's uninstall. A worker is equipped whole or not at all.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import Any

import torch

from kvcore.config import KVCoreConfig
from kvcore.issuer import Issuer
from kvcore.metrics import Metrics
from kvcore.mover import Mover
from kvcore.planning.path_policy import vllm_handler_policy
from kvcore.streams import CudaStreams, highest_priority
from kvcore.warm_up import warm_up
from kvcore_vllm.device_pointers import gpu_rows
from kvcore_vllm.installation import INSTALLATION
from kvcore_vllm.page_rows import page_bytes
from kvcore_vllm.releases import installed_shape
from kvcore_vllm.stock_copies import gpu_tensors_of
from kvcore_vllm.transfers import KVCoreOffloadingHandler

logger = logging.getLogger("kvcore.vllm")

# The worker attributes that hold its handlers (vLLM 0.32 has no expedited loads).
HANDLER_ATTRIBUTES = ("_store_handler", "_load_handler", "_expedited_load_handler")


def install_handlers(
    worker: Any,
    config: KVCoreConfig,
    metrics: Metrics | None = None,
    kv_caches: Any | None = None,
) -> list[str]:
    """Replace ``worker``'s stock handlers by kvcore's, recorded for the plugin's uninstall;
    returns the attributes replaced. ``kv_caches``: the ``CanonicalKVCaches`` the worker
    was built on, which a release whose handlers hold no GPU tensors (0.34) needs; without
    them such a worker stays stock (counted ``no_kv_caches``).

    Handlers whose GPU tensors are not CUDA tensors stay stock (counted). The handlers
    share one mover, so one staging buffer per GPU: its leases order the streams that
    use it on the GPU. Before any is replaced, every path of the mover runs once on
    scratch rows of the KV pages' sizes (:func:`kvcore.warm_up.warm_up`): first-use costs
    land here rather than on the first cache hits, and a path that moves a wrong byte
    leaves every handler stock (counted ``warm_up_wrong_bytes``).
    """
    shape = installed_shape()
    shared: list[torch.Tensor] | None = None
    if shape.device_pointers:
        if kv_caches is None:
            if metrics is not None:
                metrics.record_fallback("no_kv_caches")
            return []
        shared = [gpu_rows(tensor) for tensor in kv_caches.tensors]
    # The mover's own policy is the loads'; each handler plans with its direction's.
    mover = Mover(vllm_handler_policy(config, gpu_to_cpu=False), metrics=metrics)
    stocks: dict[str, tuple[Any, list[torch.Tensor]]] = {}
    for attribute in HANDLER_ATTRIBUTES:
        stock = getattr(worker, attribute, None)
        if stock is None:
            continue
        gpu_tensors = gpu_tensors_of(stock) if shared is None else shared
        if not gpu_tensors or gpu_tensors[0].device.type != "cuda":
            if metrics is not None:
                metrics.record_fallback("unsupported_device")
            continue
        stocks[attribute] = stock, gpu_tensors
    if not stocks or not _warmed_up(mover, [t for _, t in stocks.values()], metrics):
        return []
    handlers = {}
    issuers: list[Issuer] = []
    try:
        for attribute, (stock, gpu_tensors) in stocks.items():
            streams = CudaStreams(
                gpu_tensors[0].device,
                priority=handler_stream_priority(config, gpu_to_cpu=stock.gpu_to_cpu),
            )
            issuer = handler_issuer(config, attribute, gpu_tensors[0].device)
            if issuer is not None:
                issuers.append(issuer)
            handlers[attribute] = KVCoreOffloadingHandler(
                stock,
                mover=mover,
                gpu_tensors=gpu_tensors,
                shape=shape,
                streams=streams,
                compute_stream=streams.compute_stream,
                name=attribute,
                metrics=metrics,
                stock_rules=config.serve_rule,
                stock_share=config.stock_share,
                plan_policy=vllm_handler_policy(config, gpu_to_cpu=stock.gpu_to_cpu),
                issuer=issuer,
            )
    except BaseException:
        for issuer in issuers:
            issuer.close()
        raise
    # All built before any is put in place: a worker never holds some of each.
    for attribute, handler in handlers.items():
        INSTALLATION.replace_handler(worker, attribute, handler)
    return list(handlers)


def handler_issuer(config: KVCoreConfig, name: str, device: torch.device) -> Issuer | None:
    """The thread that issues a handler's jobs (``KVCORE_BACKGROUND_ISSUE``), its device
    made current there; None: they are issued inside ``transfer_async``."""
    if not config.background_issue:
        return None
    return Issuer(f"kvcore-{name}", functools.partial(torch.cuda.set_device, device))


def handler_stream_priority(config: KVCoreConfig, *, gpu_to_cpu: bool) -> int:
    """The CUDA priority of a handler's streams: the highest for loads where
    ``KVCORE_HIGH_PRIORITY_LOADS`` asks for it, else torch's default (stores: a page-out's
    kernels yield to the model's)."""
    return highest_priority() if config.high_priority_loads and not gpu_to_cpu else 0


def _warmed_up(
    mover: Mover, handler_tensors: Iterable[list[torch.Tensor]], metrics: Metrics | None
) -> bool:
    """Warm the mover up for the handlers' devices and page sizes (``handler_tensors``: each
    handler's GPU tensors); False where it is not to be trusted (wrong bytes, or the
    warm-up itself broke)."""
    sizes: dict[torch.device, set[int]] = {}
    for tensors in handler_tensors:
        for tensor in tensors:
            sizes.setdefault(tensor.device, set()).add(page_bytes(tensor))
    try:
        results = [warm_up(mover, device, pages) for device, pages in sizes.items()]
    except Exception:
        logger.exception("kvcore: warming up the transfer paths failed; vLLM's copies stay stock")
        results = []
    if results and all(result.trustworthy for result in results):
        return True
    if metrics is not None:
        metrics.record_fallback("warm_up_wrong_bytes" if results else "warm_up_failed")
    return False
