"""vLLM's CPU offloading spec with kvcore's chunk manager and transfer handlers.

The scheduler-side manager allocates host chunks contiguously; the worker is the
stock one (its host memory included), with its transfer handlers replaced by
:class:`~kvcore_vllm.transfers.KVCoreOffloadingHandler` when ``KVCORE_TRANSFERS`` is
on. Everything else is stock.
The plugin puts this class where vLLM's spec factory looks for its default spec
(the one behind ``--kv-offloading-size``); it can also be named explicitly with
``kv_connector_extra_config={"spec_name": "KVCoreCPUOffloadingSpec"}``.
"""

from __future__ import annotations

import logging

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager
from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from kvcore.config import KVCoreConfig
from kvcore.metrics import METRICS
from kvcore_vllm.handler_install import install_handlers
from kvcore_vllm.manager import KVCoreCPUOffloadingManager
from kvcore_vllm.releases import installed_shape
from kvcore_vllm.transfers import INTERNAL_ERRORS

logger = logging.getLogger("kvcore.vllm")

_SHAPE = installed_shape()
# Spec attributes -> the manager options they feed, where the spec holds them: 0.33 reports
# the tier's facts through the manager (cpu_info), 0.25 loads no policy by module path.
_OPTIONAL_OPTIONS = (("cache_policy_module_path", "cache_policy_module_path"), ("cpu_info", "info"))


class KVCoreCPUOffloadingSpec(CPUOffloadingSpec):
    """:class:`CPUOffloadingSpec` whose manager allocates host chunks contiguously and
    whose worker moves bytes through kvcore's mover."""

    # Set by the stock constructor; declared for type checkers that cannot see vLLM.
    _manager: OffloadingManager | None

    def get_manager(self) -> OffloadingManager:
        if not self._manager:
            extra = self.extra_config
            # The same keys and defaults as the stock get_manager (fingerprinted).
            options = {
                "cache_policy": self.eviction_policy,
                "enable_events": self.kv_events_config.enable_kv_cache_events,
                "store_threshold": int(extra.get("store_threshold", 0)),
                "max_tracker_size": int(extra.get("max_tracker_size", 64_000)),
            }
            for attribute, option in _OPTIONAL_OPTIONS:
                if hasattr(self, attribute):
                    options[option] = getattr(self, attribute)
            metrics = METRICS if KVCoreConfig.from_env().metrics else None
            num_chunks = getattr(self, _SHAPE.name("num_chunks"))
            self._manager = KVCoreCPUOffloadingManager(num_chunks, metrics=metrics, **options)
        return self._manager

    def create_worker(self, kv_caches: CanonicalKVCaches) -> CPUOffloadingWorker:
        # The stock worker keeps vLLM's host memory (its shared, pre-faulted, host-registered
        # region); only the handlers that copy in and out of it are kvcore's.
        worker = super().create_worker(kv_caches)
        put_handlers_in_place(worker, kv_caches)
        return worker


def put_handlers_in_place(
    worker: CPUOffloadingWorker, kv_caches: CanonicalKVCaches | None = None
) -> list[str]:
    """kvcore's transfer handlers in place of ``worker``'s stock ones when ``KVCORE_TRANSFERS``
    is on; the attributes replaced. ``kv_caches``: those the worker was built on (a release
    whose handlers hold no GPU tensors needs them). What
    :meth:`KVCoreCPUOffloadingSpec.create_worker` does to the stock worker
    (ci/vllm_upstream's GPU mode does the same to the workers vLLM's own transfer tests
    build)."""
    config = KVCoreConfig.from_env()
    if not config.transfers:
        return []
    metrics = METRICS if config.metrics else None
    try:
        return install_handlers(worker, config, metrics, kv_caches)
    except Exception as exc:
        # The worker is stock's and whole: it keeps stock's handlers.
        reason = INTERNAL_ERRORS.reason(exc)
        if metrics is not None:
            metrics.record_fallback(reason)
        return []
