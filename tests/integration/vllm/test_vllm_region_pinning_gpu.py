"""vLLM's shared CPU tier pinned in steps with CUDA (``KVCORE_HOST_POOL_PIN_FIRST``): the
rows the manager may hand out copy exactly to the GPU while later steps register, every
row once all are in, and vLLM's cleanup unregisters every step."""

from __future__ import annotations

import contextlib
import mmap
import uuid

import pytest

pytest.importorskip("vllm", reason="needs vLLM installed (ci/install_vllm.sh)")

import torch
from vllm_support import SHARED_REGION_ONLY, shared_region

from kvcore.kernels.cudart import loaded_cudart
from kvcore.pin_progress import PinWatch, progress_path
from kvcore_vllm import region_faulting, region_pinning
from kvcore_vllm.manager import KVCoreCPUOffloadingManager

pytestmark = [pytest.mark.vllm, pytest.mark.gpu, SHARED_REGION_ONLY]

ROW = 256 * mmap.PAGESIZE  # 1 MiB chunks of 4 KiB pages
ROWS = 96


@pytest.mark.parametrize("faulted_by_steps", [False, True])
def test_pinned_rows_copy_exactly_while_the_rest_registers(monkeypatch, faulted_by_steps) -> None:
    """``faulted_by_steps``: the region built unfaulted and each step faulting its rows by
    every CPU before registering them, as kvcore's spec has it under the setting."""
    from vllm.v1.kv_offload.cpu import gpu_worker, shared_offload_region

    monkeypatch.setattr(region_pinning, "STEP_BYTES", 8 * ROW)
    faulting = contextlib.nullcontext()
    fault = None
    if faulted_by_steps:
        faulting = region_faulting.faulting_left_to_pinning(shared_offload_region)
        fault = region_faulting.fault_range(None)
    with faulting:
        region = shared_region(ROWS, ROW)
    key = f"kvcore-gpu-test-{uuid.uuid4().hex}-r0"
    failures: list[Exception] = []
    try:
        with region_pinning.pinned_in_steps(
            gpu_worker, key, 10 * ROW, failures.append, fault=fault
        ):
            gpu_worker.pin_mmap_region(region, worker_slot_only=True)
        assert failures == [] and region.is_pinned
        rows = region.base_tensor.view(ROWS, ROW)
        rows.copy_(torch.randint(-128, 128, rows.shape, dtype=torch.int8))
        watch = PinWatch.open(key)
        assert watch is not None and watch.ready >= 10
        manager = KVCoreCPUOffloadingManager(ROWS, pinned_keys=[key])
        ready = manager._get_num_free_chunks()
        assert 10 <= ready <= ROWS
        # What the manager may hand out copies exactly, one row a DMA, from pinned memory.
        device = torch.empty((ready, ROW), dtype=torch.int8, device="cuda")
        for row in range(ready):
            device[row].copy_(rows[row], non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(device.cpu(), rows[:ready])
        for _ in range(6000):
            if watch.ready == ROWS:
                break
            torch.cuda._sleep(1_000_000)
            torch.cuda.synchronize()
        assert watch.ready == ROWS and manager._get_num_free_chunks() == ROWS
        # Every row now, each a DMA of its own (one may not cross two steps' registrations).
        every = torch.empty((ROWS, ROW), dtype=torch.int8, device="cuda")
        for row in range(ROWS):
            every[row].copy_(rows[row], non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(every.cpu(), rows)
        watch.close()
        del rows
    finally:
        region.cleanup()
    assert not region.is_pinned and not progress_path(key).exists()
    # vLLM's cleanup unregistered every step and left no CUDA error behind (torch's own
    # runtime binding has no cudaGetLastError; 0 is cudaSuccess).
    runtime = loaded_cudart()
    assert runtime is not None and runtime.cudaGetLastError() == 0
