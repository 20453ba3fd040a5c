"""kvcore's offload handler on a real GPU: its event reuse keeps vLLM's ordering."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs vLLM installed (ci/install_vllm.sh)")

import torch

from benchmarks.vllm.offload_handlers import kvcore_handler, runnable_stock, stock_handler
from benchmarks.vllm.offload_layout import Layout, fragmented_ids, job_specs
from kvcore.streams import CudaStreams

pytestmark = [pytest.mark.vllm, pytest.mark.gpu]

SPIN_CYCLES = 200_000_000


def test_a_released_event_recorded_again_leaves_the_earlier_wait_in_place() -> None:
    device = torch.device("cuda")
    streams = CudaStreams(device)
    producer, copies, elsewhere = (streams.stream(name) for name in ("compute", "copy", "idle"))
    source = torch.zeros(1 << 20, dtype=torch.int32, device=device)
    seen = torch.empty_like(source)
    with torch.cuda.stream(producer):
        torch.cuda._sleep(SPIN_CYCLES)
        source.fill_(7)
    ready = streams.record(producer)
    streams.wait_event(copies, ready)
    streams.release(ready)
    # The same event, recorded again on an idle stream, completes at once.
    again = streams.record(elsewhere)
    assert again is ready
    streams.run_on(copies, lambda: seen.copy_(source))
    torch.cuda.synchronize()
    assert bool((seen == 7).all())


@pytest.mark.parametrize("stock_rules", [True, False], ids=["with-stock-rules", "kvcore-only"])
@pytest.mark.parametrize("gpu_to_cpu", [True, False], ids=["store", "load"])
def test_jobs_copy_their_pages_and_reuse_three_events(gpu_to_cpu: bool, stock_rules: bool) -> None:
    device = torch.device("cuda")
    pages = 600
    layout = Layout(page_bytes=4096, gpu_blocks=3 * pages, cpu_chunks=3 * pages)
    gpu, host = layout.make_tensors(device, torch.Generator().manual_seed(1))
    gpu_before, host_before = gpu[0].clone(), host[0].clone()
    # Jobs left to stock run vLLM's compiled copy op, or the same driver call where it is absent.
    stock = runnable_stock(stock_handler(gpu, host, layout, gpu_to_cpu=gpu_to_cpu), device)
    handler = kvcore_handler(stock, stock_rules=stock_rules)
    rng = np.random.default_rng(2)
    copied_gpu: set[int] = set()
    copied_cpu: set[int] = set()
    for job_id in range(4):
        gpu_ids = fragmented_ids(pages // 4, 0.5, rng) + job_id * (pages // 2)
        cpu_ids = fragmented_ids(pages // 4, 0.5, rng) + job_id * (pages // 2) + 1
        assert handler.transfer_async(job_id, *job_specs(gpu_ids, cpu_ids, gpu_to_cpu=gpu_to_cpu))
        handler.wait({job_id})
        assert [r.job_id for r in handler.get_finished()] == [job_id]
        g, c = torch.from_numpy(gpu_ids).cuda(), torch.from_numpy(cpu_ids)
        if gpu_to_cpu:
            assert torch.equal(host[0][c], gpu_before[g].cpu())
        else:
            assert torch.equal(gpu[0][g].cpu(), host_before[c])
        copied_gpu.update(gpu_ids.tolist())
        copied_cpu.update(cpu_ids.tolist())
    # Pages no job named are untouched.
    untouched_gpu = torch.tensor(sorted(set(range(layout.gpu_blocks)) - copied_gpu)).cuda()
    untouched_cpu = torch.tensor(sorted(set(range(layout.cpu_chunks)) - copied_cpu))
    assert torch.equal(gpu[0][untouched_gpu], gpu_before[untouched_gpu])
    assert torch.equal(host[0][untouched_cpu], host_before[untouched_cpu])
    # Each job kvcore copies records three events, but the compute stream's goes back as soon
    # as the copy stream waits on it and is recorded again as the job's start: two events
    # serve every job. With the rules, these 150-page jobs go whole to stock's handler,
    # which uses its own events.
    assert len(handler._jobs._streams._free) == (0 if stock_rules else 2)
    handler.shutdown()


@pytest.mark.parametrize("gpu_to_cpu", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("block_size_factor", [1, 3])
def test_jobs_built_under_inference_mode_are_kvcores_and_exact(
    gpu_to_cpu: bool, block_size_factor: int
) -> None:
    """vLLM's model runner (and vLLM's own GPU-worker tests) build the KV caches and submit
    jobs under torch.inference_mode: every tensor kvcore makes there, its layered launch
    table among them, has no version counter. Every job must still be kvcore's, exact."""
    from kvcore.metrics import Metrics
    from kvcore_vllm.transfers import INTERNAL_ERRORS

    device = torch.device("cuda")
    layout = Layout(
        page_bytes=512, tensors=4, blocks_per_chunk=block_size_factor, gpu_blocks=64, cpu_chunks=64
    )
    rng = np.random.default_rng(block_size_factor)
    metrics = Metrics()
    with torch.inference_mode():
        gpu, host = layout.make_tensors(device, torch.Generator().manual_seed(3))
        assert gpu[0].is_inference()
        stock = runnable_stock(stock_handler(gpu, host, layout, gpu_to_cpu=gpu_to_cpu), device)
        handler = kvcore_handler(stock, stock_rules=False, metrics=metrics)
        for job_id in range(3):
            gpu_ids = rng.permutation(layout.gpu_blocks)[: 3 * block_size_factor]
            cpu_ids = rng.permutation(layout.cpu_chunks)[:3]
            subs = (cpu_ids[:, None] * block_size_factor + np.arange(block_size_factor)).ravel()
            sources = [
                t.reshape(-1, layout.page_bytes).cpu() for t in (gpu if gpu_to_cpu else host)
            ]
            targets_before = [
                t.reshape(-1, layout.page_bytes).cpu() for t in (host if gpu_to_cpu else gpu)
            ]
            assert handler.transfer_async(
                job_id, *job_specs(gpu_ids, cpu_ids, gpu_to_cpu=gpu_to_cpu)
            )
            handler.wait({job_id})
            assert [r.job_id for r in handler.get_finished()] == [job_id]
            read, written = (gpu_ids, subs) if gpu_to_cpu else (subs, gpu_ids)
            for t, target in enumerate(host if gpu_to_cpu else gpu):
                want = targets_before[t].clone()
                want[torch.from_numpy(written)] = sources[t][torch.from_numpy(read)]
                # Written rows hold their sources; every other row is as it was.
                assert torch.equal(target.reshape(-1, layout.page_bytes).cpu(), want)
        handler.shutdown()
    assert metrics.snapshot()["fallbacks"] == {}, INTERNAL_ERRORS.seen()


@pytest.mark.parametrize("background", ["0", "1"], ids=["inline", "issuer_thread"])
@pytest.mark.parametrize("shared_region", [False, True], ids=["own_tensors", "shared_region"])
@pytest.mark.parametrize("gpu_to_cpu", [True, False], ids=["store", "load"])
def test_mla_sized_blocks_store_by_dma_into_place_and_load_through_the_gather(
    monkeypatch: pytest.MonkeyPatch, gpu_to_cpu: bool, shared_region: bool, background: str
) -> None:
    """The default policies and rules: 18 KiB blocks (MLA's) store by DMA into place and
    load through kvcore's gather, staged by region from a shared CPU region; all exact,
    every other page kept, the jobs issued inside transfer_async or on the handler's
    thread (KVCORE_BACKGROUND_ISSUE)."""
    from kvcore.metrics import Metrics

    monkeypatch.setenv("KVCORE_BACKGROUND_ISSUE", background)
    device = torch.device("cuda")
    layout = Layout(
        page_bytes=18 << 10,
        tensors=4,
        gpu_blocks=512,
        cpu_chunks=512,
        shared_region=shared_region,
    )
    gpu, host = layout.make_tensors(device, torch.Generator().manual_seed(5))
    before = [t.cpu() for t in (host if gpu_to_cpu else gpu)]
    sources = [t.cpu() for t in (gpu if gpu_to_cpu else host)]
    stock = runnable_stock(stock_handler(gpu, host, layout, gpu_to_cpu=gpu_to_cpu), device)
    metrics = Metrics()
    handler = kvcore_handler(stock, metrics=metrics)
    rng = np.random.default_rng(6)
    gpu_ids = rng.permutation(layout.gpu_blocks)[:200]
    cpu_ids = np.sort(rng.permutation(layout.cpu_chunks)[:200])
    assert handler.transfer_async(0, *job_specs(gpu_ids, cpu_ids, gpu_to_cpu=gpu_to_cpu))
    handler.wait({0})
    assert [r.job_id for r in handler.get_finished()] == [0]
    read, written = (gpu_ids, cpu_ids) if gpu_to_cpu else (cpu_ids, gpu_ids)
    for t, target in enumerate(host if gpu_to_cpu else gpu):
        want = before[t].clone()
        want[torch.from_numpy(written)] = sources[t][torch.from_numpy(read)]
        assert torch.equal(target.cpu(), want)
    handler.shutdown()
    snapshot = metrics.snapshot()
    assert snapshot["fallbacks"] == {}
    paths = [row["path"] for row in snapshot["transfers"]]
    load = "staged" if shared_region else "gather"
    assert paths == (["batched_runs"] if gpu_to_cpu else [load])


@pytest.mark.parametrize("background", ["0", "1"], ids=["inline", "issuer_thread"])
@pytest.mark.parametrize("begun", ["1", "0"], ids=["begun", "planned_first"])
@pytest.mark.parametrize("by_address", ["0", "1"], ids=["torch_ring", "address_ring"])
def test_begun_loads_queued_back_to_back_land_after_the_compute_streams_writes(
    monkeypatch: pytest.MonkeyPatch, begun: str, by_address: str, background: str
) -> None:
    """Loads from a shared CPU region, begun before they are planned (their first DMAs ahead
    of the job's wait for the compute stream) or not, through either ring: four jobs queued
    without a wait, while the
    compute stream, held up, writes each job's destination pages last before the jobs. Every
    page ends with the loaded bytes (each scatter after the compute stream's write, each
    job's DMAs after the previous job's scatters read the staging slots), and every other
    page keeps its bytes; so too with the jobs issued on the handler's thread (which begins
    no load before planning)."""
    from kvcore.metrics import Metrics

    monkeypatch.setenv("KVCORE_BEGIN_REGION_LOADS", begun)
    monkeypatch.setenv("KVCORE_ADDRESS_RING", by_address)
    monkeypatch.setenv("KVCORE_BACKGROUND_ISSUE", background)
    device = torch.device("cuda")
    layout = Layout(
        page_bytes=18 << 10, tensors=4, gpu_blocks=512, cpu_chunks=512, shared_region=True
    )
    gpu, host = layout.make_tensors(device, torch.Generator().manual_seed(8))
    metrics = Metrics()
    stock = runnable_stock(stock_handler(gpu, host, layout, gpu_to_cpu=False), device)
    # Without the rules: jobs this short (100 pages) would go to stock as few_pages.
    handler = kvcore_handler(stock, metrics=metrics, stock_rules=False)
    rng = np.random.default_rng(9)
    gpu_order, cpu_order = rng.permutation(layout.gpu_blocks), rng.permutation(layout.cpu_chunks)
    jobs = [
        (gpu_order[i * 100 : (i + 1) * 100], cpu_order[i * 100 : (i + 1) * 100]) for i in range(4)
    ]
    want = [t.clone() for t in gpu]
    for gpu_ids, cpu_ids in jobs:
        for t, target in enumerate(want):
            target[torch.from_numpy(gpu_ids).cuda()] = host[t][torch.from_numpy(cpu_ids)].cuda()
    written = torch.from_numpy(np.concatenate([g for g, _ in jobs])).cuda()
    torch.cuda._sleep(SPIN_CYCLES)
    for tensor in gpu:
        tensor[written] = 0
    for job_id, (gpu_ids, cpu_ids) in enumerate(jobs):
        assert handler.transfer_async(job_id, *job_specs(gpu_ids, cpu_ids, gpu_to_cpu=False))
    handler.wait(set(range(4)))
    assert sorted(r.job_id for r in handler.get_finished()) == [0, 1, 2, 3]
    for got, expected in zip(gpu, want, strict=True):
        assert torch.equal(got, expected)
    handler.shutdown()
    snapshot = metrics.snapshot()
    assert snapshot["fallbacks"] == {}
    assert [row["path"] for row in snapshot["transfers"]] == ["staged"]
