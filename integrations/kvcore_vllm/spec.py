"""vLLM's CPU offloading spec with kvcore's chunk manager and transfer handlers.

The scheduler-side manager allocates host chunks contiguously; the worker is the
stock one, with its transfer handlers replaced by
:class:`~kvcore_vllm.transfers.KVCoreOffloadingHandler` when ``KVCORE_TRANSFERS`` is
on. Its host memory is stock's too, except on vLLM 0.25.1 under ``KVCORE_HOST_POOL``
(on by default): there the worker gets kvcore's mapping of the exact size instead of
torch's rounded-up pinned tensors (:mod:`kvcore_vllm.host_region`); from 0.32, an engine of
one worker has vLLM's own shared region faulted in by every usable CPU
(:mod:`kvcore_vllm.region_faulting`). Everything else is stock.
The plugin puts this class where vLLM's spec factory looks for its default spec
(the one behind ``--kv-offloading-size``); it can also be named explicitly with
``kv_connector_extra_config={"spec_name": "KVCoreCPUOffloadingSpec"}``.
"""

from __future__ import annotations

import contextlib
import logging
import time

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager
from vllm.v1.kv_offload.cpu import gpu_worker
from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from kvcore import numa
from kvcore.config import KVCoreConfig
from kvcore.host_mapping import fell_back, torch_pinned_bytes
from kvcore.host_pinning import format_bytes
from kvcore.metrics import METRICS
from kvcore_vllm.handler_install import install_handlers
from kvcore_vllm.host_region import ExactHostRegion
from kvcore_vllm.manager import KVCoreCPUOffloadingManager
from kvcore_vllm.region_faulting import (
    fault_range,
    faulted_by_a_share_of_cpus,
    faulted_by_every_cpu,
    faulting_left_to_pinning,
)
from kvcore_vllm.region_pinning import pinned_in_steps, progress_key, progress_keys
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
            config = KVCoreConfig.from_env()
            metrics = METRICS if config.metrics else None
            num_chunks = getattr(self, _SHAPE.name("num_chunks"))
            self._manager = KVCoreCPUOffloadingManager(
                num_chunks, metrics=metrics, pinned_keys=self._step_pinning_keys(config), **options
            )
        return self._manager

    def create_worker(self, kv_caches: CanonicalKVCaches) -> CPUOffloadingWorker:
        config = KVCoreConfig.from_env()
        worker = self._worker_on_exact_region(kv_caches, config) or self._stock_worker(
            kv_caches, config
        )
        put_handlers_in_place(worker, kv_caches)
        return worker

    def _region_workers(self, config: KVCoreConfig) -> int | None:
        """How many workers share this engine's CPU tier where kvcore faults it in: vLLM's
        shared region (0.32 on) under ``KVCORE_HOST_POOL``; None where kvcore leaves it."""
        parallel = getattr(getattr(self, "config", None), "parallel", None)
        workers = getattr(parallel, "world_size", None)
        if not config.host_pool or _SHAPE.worker_pins_each_tensor or not isinstance(workers, int):
            return None
        return workers if workers >= 1 else None

    def _step_pinning_keys(self, config: KVCoreConfig) -> tuple[str, ...]:
        """The names of the workers' pinning progress where they may pin the tier in steps
        (``KVCORE_HOST_POOL_PIN_FIRST``, vLLM's shared region), one a worker, else none:
        the manager reads them all, each worker writes its own."""
        workers = self._region_workers(config)
        if not config.host_pool_pin_first or workers is None:
            return ()
        return progress_keys(self, workers)

    def _stock_worker(
        self, kv_caches: CanonicalKVCaches, config: KVCoreConfig
    ) -> CPUOffloadingWorker:
        """The stock worker (from 0.32 on vLLM's own shared region); under
        ``KVCORE_HOST_POOL`` that region faulted in by many CPUs
        (:mod:`kvcore_vllm.region_faulting`): with one worker by every usable CPU first, or,
        under ``KVCORE_HOST_POOL_PIN_FIRST``, in steps as it is pinned
        (:mod:`kvcore_vllm.region_pinning`); with several, each worker's part by its share
        of the CPUs."""
        workers = self._region_workers(config)
        if workers is None:
            return super().create_worker(kv_caches)
        from vllm.v1.kv_offload.cpu import shared_offload_region

        def count(exc: Exception) -> None:
            fell_back(logger, exc, "vLLM faults its CPU tier in itself", config.metrics)

        def count_pinning(exc: Exception) -> None:
            fell_back(logger, exc, "vLLM pins its CPU tier whole itself", config.metrics)

        with contextlib.ExitStack() as stack:
            placement = numa.current_gpu_placement()
            key = progress_key(self) if config.host_pool_pin_first else None
            if key is not None and getattr(gpu_worker, "PIN_MEMORY", False):
                # Each step faults its own rows just before registering them.
                stack.enter_context(faulting_left_to_pinning(shared_offload_region))
                stack.enter_context(
                    pinned_in_steps(
                        gpu_worker,
                        key,
                        config.host_pool_pin_first,
                        count_pinning,
                        fault=fault_range(placement, workers),
                    )
                )
            elif workers > 1:
                stack.enter_context(
                    faulted_by_a_share_of_cpus(shared_offload_region, placement, workers, count)
                )
            else:
                stack.enter_context(faulted_by_every_cpu(shared_offload_region, placement, count))
            return super().create_worker(kv_caches)

    def _worker_on_exact_region(
        self, kv_caches: CanonicalKVCaches, config: KVCoreConfig
    ) -> CPUOffloadingWorker | None:
        """vLLM 0.25.1's worker on kvcore's host mapping (:class:`ExactHostRegion`), built
        as the stock ``create_worker`` builds it plus the region; None where the release or
        ``KVCORE_HOST_POOL`` leaves host memory stock, or where kvcore's mapping fails
        (logged and counted ``host_pool_stock:<type>``: the stock worker allocates)."""
        tensors = getattr(kv_caches, "tensors", None)
        if not (_SHAPE.worker_pins_each_tensor and config.host_pool and tensors):
            return None
        device = tensors[0].tensor.device
        if device.type != "cuda":
            return None  # vLLM pins the CPU tier for CUDA devices alone
        factor = getattr(self, _SHAPE.name("blocks_per_chunk"))
        blocks = getattr(self, _SHAPE.name("num_chunks"))
        region: ExactHostRegion | None = None
        started = time.perf_counter()
        try:
            pages = [tensor.page_size_bytes * factor for tensor in tensors]
            placement = numa.placement_for(numa.cuda_numa_node(device))
            region = ExactHostRegion(blocks, pages, placement=placement)
            # 0.25.1's stock create_worker, with the region its worker takes.
            worker = CPUOffloadingWorker(
                kv_caches=kv_caches,
                block_size_factor=factor,
                num_cpu_blocks=blocks,
                mmap_region=region,
            )
            if getattr(gpu_worker, "PIN_MEMORY", False) and not region.is_pinned:
                raise RuntimeError("vLLM could not register kvcore's host mapping")
        except Exception as exc:
            if region is not None:
                region.cleanup()
            fell_back(logger, exc, "vLLM allocates its CPU tier itself", config.metrics)
            return None
        logger.info(
            "kvcore: vLLM's CPU tier mapped by kvcore: %s for %d KV tensors in %.1f s "
            "(torch's pinned allocator would take %s), %s, NUMA node %s",
            format_bytes(region.total_size_bytes),
            len(pages),
            time.perf_counter() - started,
            format_bytes(sum(torch_pinned_bytes(blocks * page) for page in pages)),
            "pinned" if region.is_pinned else "not pinned",
            "default" if region.numa_node is None else region.numa_node,
        )
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
