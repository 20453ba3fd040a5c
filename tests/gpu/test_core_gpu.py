"""The core's transfer paths, registered host buffers and ordered copy jobs on a real GPU."""

from __future__ import annotations

import pytest
import torch

from kvcore.bench.host_buffers import allocate_host_buffer
from kvcore.direction import Direction
from kvcore.metrics import Metrics
from kvcore.mover import Mover
from kvcore.planning.device_indexed import plan_device_indexed
from kvcore.planning.path_policy import PathPolicy, TransferPath
from kvcore.planning.plans import plan
from kvcore.streams import CudaStreams, OrderedJobs

pytestmark = pytest.mark.gpu

ROW_SHAPES = {
    "mla-1152B": ((1, 576), torch.bfloat16),
    "mha-4KiB": ((2, 8, 128), torch.bfloat16),
    "mha-16KiB-fp16": ((2, 8, 512), torch.float16),
    "fp8-1KiB": ((1024,), torch.uint8),
    "dsa-page": ((64 * 132,), torch.uint8),
}
LAYOUTS = ("one-run", "host-run-device-scattered", "long-runs", "scattered")


def _random(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    numel = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel,), dtype=torch.uint8, device=device)
    return raw.view(dtype).view(shape)


def _pinned_rows(rows: int, row_shape: tuple[int, ...], dtype: torch.dtype):
    elem = torch.empty(0, dtype=dtype).element_size()
    buffer = allocate_host_buffer(rows * torch.Size(row_shape).numel() * elem, pin=True)
    host = buffer.tensor.view(dtype).view(rows, *row_shape)
    host.copy_(_random((rows, *row_shape), dtype, "cpu"))
    return buffer, host


def _layout(
    name: str, n: int, pool: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(host index, device index) for one of LAYOUTS."""
    if name == "one-run":
        return torch.arange(5, 5 + n), torch.arange(7, 7 + n)
    if name == "host-run-device-scattered":
        return torch.arange(3, 3 + n), torch.randperm(pool, generator=gen)[:n]
    if name == "long-runs":
        chunk = 128
        order = torch.randperm(pool // chunk, generator=gen)[: n // chunk]
        host = (order[:, None] * chunk + torch.arange(chunk)).flatten()
        order = torch.randperm(pool // chunk, generator=gen)[: n // chunk]
        return host, (order[:, None] * chunk + torch.arange(chunk)).flatten()
    return (
        torch.randperm(pool, generator=gen)[:n],
        torch.randperm(pool, generator=gen)[:n],
    )


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1).view(torch.uint8).cpu()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("row_kind", ROW_SHAPES)
@pytest.mark.parametrize("direction", list(Direction))
@pytest.mark.parametrize("forced", [None, *[p for p in TransferPath if p.value != "fallback"]])
def test_every_path_is_byte_identical(direction, row_kind, layout, forced) -> None:
    row_shape, dtype = ROW_SHAPES[row_kind]
    pool, n = 4096, 1024
    gen = torch.Generator().manual_seed(hash((direction, row_kind, layout)) % 2**31)
    buffer, host = _pinned_rows(pool, row_shape, dtype)
    device_rows = _random((pool, *row_shape), dtype, "cuda")
    host_idx, device_idx = _layout(layout, n, pool, gen)
    if direction is Direction.H2D:
        src, dst, src_idx, dst_idx = host, device_rows, host_idx, device_idx
    else:
        src, dst, src_idx, dst_idx = device_rows, host, device_idx, host_idx
    try:
        chosen = plan(
            src, dst, src_idx, dst_idx, policy=PathPolicy(staging_bytes=1 << 20), force=forced
        )
    except ValueError:
        assert forced is TransferPath.SINGLE_COPY
        buffer.close()
        return
    src_before = _as_bytes(src).clone()
    expected = _as_bytes(dst).clone()
    expected[dst_idx] = _as_bytes(src)[src_idx]
    metrics = Metrics()
    # A real stream, as the engines copy on: the batch API refuses the legacy default stream.
    with torch.cuda.stream(torch.cuda.Stream()):
        Mover(PathPolicy(staging_bytes=1 << 20), metrics=metrics).execute(chosen)
    torch.cuda.synchronize()
    assert torch.equal(_as_bytes(dst), expected), chosen.describe()
    assert torch.equal(_as_bytes(src), src_before)
    assert metrics.snapshot()["fallbacks"] == {}, chosen.describe()
    buffer.close()


def test_batch_refusal_on_the_default_stream_is_counted_and_exact() -> None:
    pool = 4096
    gen = torch.Generator().manual_seed(3)
    buffer, host = _pinned_rows(pool, (2, 8, 128), torch.bfloat16)
    device_rows = _random((pool, 2, 8, 128), torch.bfloat16, "cuda")
    host_idx, device_idx = _layout("long-runs", 1024, pool, gen)
    chosen = plan(host, device_rows, host_idx, device_idx, force=TransferPath.BATCHED_RUNS)
    expected = _as_bytes(device_rows).clone()
    expected[device_idx] = _as_bytes(host)[host_idx]
    metrics = Metrics()
    Mover(metrics=metrics).execute(chosen)
    torch.cuda.synchronize()
    assert torch.equal(_as_bytes(device_rows), expected)
    assert metrics.snapshot()["fallbacks"] == {"batch_copy_refused:legacy default stream": 1}
    buffer.close()


def test_auto_paths_cover_all_four_layouts() -> None:
    pool, n = 4096, 1024
    gen = torch.Generator().manual_seed(0)
    host = torch.empty(pool, 2048, dtype=torch.uint8).pin_memory()
    device_rows = torch.empty(pool, 2048, dtype=torch.uint8, device="cuda")
    seen = {plan(host, device_rows, *_layout(name, n, pool, gen)).path for name in LAYOUTS}
    assert seen == {
        TransferPath.SINGLE_COPY,
        TransferPath.STAGED,
        TransferPath.BATCHED_RUNS,
        TransferPath.GATHER,
    }


def test_page_out_makes_no_host_synchronisation() -> None:
    """Every non-fallback page-out path, with torch's sync debugger set to raise."""
    pool, n = 4096, 1024
    gen = torch.Generator().manual_seed(1)
    buffer, host = _pinned_rows(pool, (1, 576), torch.bfloat16)
    device_rows = _random((pool, 1, 576), torch.bfloat16, "cuda")
    mover = Mover(PathPolicy(staging_bytes=1 << 20))
    plans = []
    for name in LAYOUTS:
        host_idx, device_idx = _layout(name, n, pool, gen)
        plans.append(plan(device_rows, host, device_idx, host_idx))
    for p in plans:  # warm up: first calls compile kernels and allocate staging
        mover.execute(p)
    torch.cuda.synchronize()
    streams = CudaStreams(torch.device("cuda", torch.cuda.current_device()))
    jobs = OrderedJobs(streams, "d2h", streams.compute_stream)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for job_id, p in enumerate(plans):
            jobs.submit(job_id, p.nbytes, lambda p=p: mover.execute(p))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    jobs.drain()
    assert {p.path for p in plans} >= {TransferPath.STAGED, TransferPath.GATHER}
    buffer.close()


def _seconds(job_id: int, nbytes: int, seconds: float | None) -> tuple[int, float | None]:
    return job_id, seconds


def test_page_out_waits_for_the_producer() -> None:
    """A producer held back by a spin kernel: the page-out must read its rows, not stale ones."""
    rows = 2048
    buffer, host = _pinned_rows(rows, (1, 576), torch.bfloat16)
    device_rows = _random((rows, 1, 576), torch.bfloat16, "cuda")
    fresh = _random((rows, 1, 576), torch.bfloat16, "cuda")
    producer = torch.cuda.Stream()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(200_000_000)
        device_rows.copy_(fresh)
    streams = CudaStreams(torch.device("cuda", torch.cuda.current_device()))
    jobs = OrderedJobs(streams, "d2h", lambda: producer)
    idx = torch.randperm(rows)
    out = plan(device_rows, host, idx, torch.arange(rows))
    mover = Mover()
    jobs.submit(1, out.nbytes, lambda: mover.execute(out))
    jobs.wait({1})
    assert torch.equal(_as_bytes(host), _as_bytes(fresh)[idx])
    buffer.close()


def test_a_job_is_reported_only_once_its_copies_landed() -> None:
    rows = 4096
    buffer, host = _pinned_rows(rows, (2, 8, 128), torch.bfloat16)
    device_rows = _random((rows, 2, 8, 128), torch.bfloat16, "cuda")
    streams = CudaStreams(torch.device("cuda", torch.cuda.current_device()))
    jobs = OrderedJobs(streams, "h2d", streams.compute_stream)
    mover = Mover()
    dst_idx = torch.randperm(rows)
    page_in = plan(host, device_rows, torch.arange(rows), dst_idx)

    def slow_copy() -> None:
        torch.cuda._sleep(100_000_000)
        mover.execute(page_in)

    jobs.submit(7, page_in.nbytes, slow_copy)
    assert jobs.finished(_seconds) == []
    jobs.wait({7})
    [(job_id, seconds)] = jobs.finished(_seconds)
    assert job_id == 7 and seconds is not None and seconds > 0
    assert torch.equal(_as_bytes(device_rows[dst_idx]), _as_bytes(host))
    buffer.close()


def test_drain_waits_for_jobs_in_flight_and_pools_their_events() -> None:
    buffer, host = _pinned_rows(8 * 1024, (4096,), torch.uint8)
    device_rows = _random((8 * 1024, 4096), torch.uint8, "cuda")
    streams = CudaStreams(torch.device("cuda", torch.cuda.current_device()))
    jobs = OrderedJobs(streams, "d2h", streams.compute_stream)
    for i in range(8):
        part = slice(i * 1024, (i + 1) * 1024)

        def copy(part: slice = part) -> None:
            torch.cuda._sleep(20_000_000)
            host[part].copy_(device_rows[part], non_blocking=True)

        jobs.submit(i, 4 << 20, copy)
    jobs.drain()
    assert len(jobs) == 0
    assert torch.equal(host, device_rows.cpu())
    # Each job holds two events (its start reuses the compute stream's, released at once).
    assert len(streams._free) == 16
    buffer.close()


def test_registered_buffer_is_pinned_exact_and_copyable_per_segment() -> None:
    segment = 1 << 30
    size = 3 * segment + 4096  # not a power of two: no rounding up
    buffer = allocate_host_buffer(size, pin=True, register_chunk_bytes=segment)
    assert buffer.kind == "registered"
    assert buffer.segment_bytes == segment
    assert buffer.tensor.numel() == size
    assert buffer.tensor.is_pinned()
    src = _random((size,), torch.uint8, "cuda")
    # One DMA per registration segment: a copy spanning two is refused by the driver.
    for begin in range(0, size, segment):
        end = min(begin + segment, size)
        buffer.tensor[begin:end].copy_(src[begin:end], non_blocking=True)
    torch.cuda.synchronize()
    for begin, end in ((segment - 4096, segment), (segment, segment + 4096)):
        assert torch.equal(buffer.tensor[begin:end].cuda(), src[begin:end])
    buffer.close()
    assert buffer.closed


def test_index_uploads_do_not_wait_for_queued_copies() -> None:
    from kvcore.kernels.index_upload import IndexUploader

    uploader = IndexUploader(torch.device("cuda"), slots=4, slot_entries=1 << 12)
    busy = torch.cuda.Stream()
    gen = torch.Generator().manual_seed(9)
    with torch.cuda.stream(busy):
        torch.cuda._sleep(500_000_000)  # far longer than the uploads below
        indices = [torch.randint(0, 1 << 30, (1000 + i,), generator=gen) for i in range(12)]
        outs = [uploader.upload(index) for index in indices]  # wraps the ring three times
        assert not busy.query()  # the host never waited for the sleeping stream
        copies = [out.clone() for out in outs]
    busy.synchronize()
    for index, copy in zip(indices, copies, strict=True):
        assert torch.equal(copy.cpu(), index)
    big = torch.arange(5000)
    assert torch.equal(uploader.upload(big).cpu(), big)  # larger than a slot


def test_an_uploader_and_staging_made_in_inference_mode_serve_outside_it() -> None:
    """vLLM's model runner calls under inference mode, other callers do not: the pinned
    ring and the staging buffer a first call makes must take writes in either mode."""
    from kvcore.kernels.index_upload import IndexUploader
    from kvcore.kernels.reference import buffer_rows
    from kvcore.staging import StagingBuffers

    cuda = torch.device("cuda")
    staging = StagingBuffers(1 << 20)
    like = torch.empty(1, 576, dtype=torch.bfloat16, device=cuda)
    with torch.inference_mode():
        uploader = IndexUploader(cuda, slots=2, slot_entries=1 << 12)
        inside = torch.arange(100)
        assert torch.equal(uploader.upload(inside).cpu(), inside)
        with staging.lease(cuda) as buffer:
            buffer_rows(buffer, 8, like).fill_(1)
    outside = torch.randperm(3000, generator=torch.Generator().manual_seed(5))
    assert torch.equal(uploader.upload(outside).cpu(), outside)
    with staging.lease(cuda) as buffer:
        rows = buffer_rows(buffer, 8, like)
        rows.fill_(2)
        assert torch.equal(rows.cpu(), torch.full((8, 576), 2.0, dtype=torch.bfloat16))


def test_index_upload_is_reused_per_layer_until_the_index_changes() -> None:
    from kvcore.kernels.index_upload import IndexUploader

    uploader = IndexUploader(torch.device("cuda"), slots=2, slot_entries=1 << 12)
    index = torch.randperm(3000)
    first = uploader.upload(index)
    assert uploader.upload(index) is first  # the next layer: no second upload
    index[:10] = index[:10].flip(0)  # an in-place change bumps the version
    second = uploader.upload(index)
    assert second is not first
    assert torch.equal(second.cpu(), index)


def test_a_reused_upload_orders_every_stream_that_reads_it() -> None:
    """The first stream to read a cached upload waits once; a second stream waits too."""
    from kvcore.kernels.index_upload import IndexUploader

    uploader = IndexUploader(torch.device("cuda"), slots=2, slot_entries=1 << 16)
    index = torch.randperm(1 << 16, generator=torch.Generator().manual_seed(21))
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(uploader._stream):
        torch.cuda._sleep(200_000_000)  # holds the upload back on the GPU
    with torch.cuda.stream(first):
        on_device = uploader.upload(index)
        assert uploader.upload(index) is on_device  # the next layer on the same stream
        first_copy = on_device.clone()
    with torch.cuda.stream(second):
        assert uploader.upload(index) is on_device
        second_copy = on_device.clone()
    assert not second.query()  # the second stream waits for the upload too
    torch.cuda.synchronize()
    assert torch.equal(first_copy.cpu(), index)
    assert torch.equal(second_copy.cpu(), index)


def test_index_pairs_upload_in_one_slot_and_are_reused() -> None:
    from kvcore.kernels.index_upload import IndexUploader

    uploader = IndexUploader(torch.device("cuda"), slots=2, slot_entries=1 << 12)
    gen = torch.Generator().manual_seed(12)
    src, dst = torch.randperm(3000, generator=gen)[:1500], torch.randperm(2500, generator=gen)
    first = uploader.upload_all((src, dst))
    assert [t.numel() for t in first] == [1500, 2500]
    assert torch.equal(first[0].cpu(), src) and torch.equal(first[1].cpu(), dst)
    assert uploader.upload_all((src, dst)) is first  # the next layer: no second upload
    swapped = uploader.upload_all((dst, src))  # another pair, not the cached one
    assert torch.equal(swapped[0].cpu(), dst) and torch.equal(swapped[1].cpu(), src)
    big = (torch.arange(3000), torch.arange(2000) + 7)  # together larger than a slot
    on_device = uploader.upload_all(big)
    assert all(torch.equal(d.cpu(), h) for d, h in zip(on_device, big, strict=True))


def test_rebound_plan_copies_every_layer_exactly() -> None:
    layers, pool, n = 3, 4096, 1024
    gen = torch.Generator().manual_seed(11)
    buffer, host = _pinned_rows(layers * pool, (1, 576), torch.bfloat16)
    host = host.view(layers, pool, 1, 576)
    device_layers = [_random((pool, 1, 576), torch.bfloat16, "cuda") for _ in range(layers)]
    host_idx, device_idx = _layout("scattered", n, pool, gen)
    first = plan(host[0], device_layers[0], host_idx, device_idx)
    mover = Mover()
    with torch.cuda.stream(torch.cuda.Stream()):
        for layer in range(layers):
            expected = _as_bytes(device_layers[layer]).clone()
            expected[device_idx] = _as_bytes(host[layer])[host_idx]
            mover.execute(first.rebind(host[layer], device_layers[layer]))
            torch.cuda.current_stream().synchronize()
            assert torch.equal(_as_bytes(device_layers[layer]), expected)
    buffer.close()


@pytest.mark.parametrize("pieces", [1, 2, 4])
@pytest.mark.parametrize("direction", list(Direction))
def test_staged_copy_in_pieces_is_exact(direction, pieces) -> None:
    """64 MiB of 4 KiB rows: in one piece on one stream, or in pieces, each scatter
    overlapping the next DMA."""
    pool, n = 40000, 16384
    gen = torch.Generator().manual_seed(13)
    buffer, host = _pinned_rows(pool, (2, 8, 128), torch.bfloat16)
    device_rows = _random((pool, 2, 8, 128), torch.bfloat16, "cuda")
    host_idx = torch.cat([torch.arange(s, s + n // 4) for s in (0, 9000, 20000, 30000)])
    device_idx = torch.randperm(pool, generator=gen)[:n]
    if direction is Direction.H2D:
        src, dst, src_idx, dst_idx = host, device_rows, host_idx, device_idx
    else:
        src, dst, src_idx, dst_idx = device_rows, host, device_idx, host_idx
    chosen = plan(src, dst, src_idx, dst_idx, force=TransferPath.STAGED)
    src_before = _as_bytes(src).clone()
    expected = _as_bytes(dst).clone()
    expected[dst_idx] = _as_bytes(src)[src_idx]
    with torch.cuda.stream(torch.cuda.Stream()):
        Mover(PathPolicy(staged_pieces=pieces)).execute(chosen)
    torch.cuda.synchronize()
    assert torch.equal(_as_bytes(dst), expected)
    assert torch.equal(_as_bytes(src), src_before)
    buffer.close()


@pytest.mark.parametrize("pieces", [1, 2])
def test_staging_is_not_shared_by_two_streams_at_once(pieces) -> None:
    """A load held back on one stream and a backup on another stage through one buffer in turn."""
    pool, n = 8192, 4096
    gen = torch.Generator().manual_seed(17)
    in_buffer, host_in = _pinned_rows(pool, (2, 8, 128), torch.bfloat16)
    out_buffer, host_out = _pinned_rows(pool, (2, 8, 128), torch.bfloat16)
    device_in = _random((pool, 2, 8, 128), torch.bfloat16, "cuda")
    device_out = _random((pool, 2, 8, 128), torch.bfloat16, "cuda")
    load = plan(
        host_in,
        device_in,
        torch.arange(n),
        torch.randperm(pool, generator=gen)[:n],
        force=TransferPath.STAGED,
    )
    backup = plan(
        device_out,
        host_out,
        torch.randperm(pool, generator=gen)[:n],
        torch.arange(n),
        force=TransferPath.STAGED,
    )
    expected_in = _as_bytes(device_in).clone()
    expected_in[load.dst_idx] = _as_bytes(host_in)[load.src_idx]
    expected_out = _as_bytes(host_out).clone()
    expected_out[backup.dst_idx] = _as_bytes(device_out)[backup.src_idx]
    mover = Mover(PathPolicy(staged_pieces=pieces))
    slow, other = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(slow):
        torch.cuda._sleep(100_000_000)
        mover.execute(load)
    with torch.cuda.stream(other):
        mover.execute(backup)
    # The backup's stream waits on the GPU for the load that used the buffer first.
    assert not other.query()
    torch.cuda.synchronize()
    assert torch.equal(_as_bytes(device_in), expected_in)
    assert torch.equal(_as_bytes(host_out), expected_out)
    in_buffer.close()
    out_buffer.close()


@pytest.mark.parametrize("direction", [Direction.H2D, Direction.D2H], ids=lambda d: d.value)
@pytest.mark.parametrize("name", ["host-run-device-scattered", "scattered"])
def test_device_resident_device_index_is_used_without_a_host_sync(name, direction) -> None:
    """SGLang's kernel io backend: the device rows are a CUDA tensor kvcore never reads."""
    pool, n = 4096, 1024
    gen = torch.Generator().manual_seed(13)
    buffer, host = _pinned_rows(pool, (1, 576), torch.bfloat16)
    host.copy_(_random((pool, 1, 576), torch.bfloat16, "cpu"))
    device_rows = _random((pool, 1, 576), torch.bfloat16, "cuda")
    host_idx, device_idx = _layout(name, n, pool, gen)
    on_device = device_idx.to("cuda", torch.int32)
    page_in = direction is Direction.H2D
    src, dst = (host, device_rows) if page_in else (device_rows, host)
    src_idx, dst_idx = (host_idx, on_device) if page_in else (on_device, host_idx)
    chosen = plan_device_indexed(
        src, dst, src_idx, dst_idx, direction=direction, policy=PathPolicy(staging_bytes=2 << 20)
    )
    # 1024 rows of 1152 B fit the staging buffer: a staged copy, not the gather.
    mover = Mover(PathPolicy(staging_bytes=2 << 20))
    mover.execute(chosen)  # warm up: kernels compile, staging is allocated
    torch.cuda.synchronize()
    rows_to_write = dst_idx.long().cpu()
    poisoned = dst.cpu().clone()
    poisoned[rows_to_write] = _random((n, 1, 576), torch.bfloat16, "cpu")
    dst.copy_(poisoned)
    expected = poisoned.clone()
    expected[rows_to_write] = src.cpu()[src_idx.long().cpu()]
    torch.cuda.set_sync_debug_mode("error")
    try:
        mover.execute(chosen)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert chosen.path is (
        TransferPath.STAGED if name.startswith("host-run") else TransferPath.GATHER
    )
    assert torch.equal(dst.cpu().view(torch.int16), expected.view(torch.int16))
    buffer.close()
