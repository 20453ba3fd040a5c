"""The prepared per-layer gather on a real GPU: one launch a layer, compiled once.

An engine reloads layer by layer, each request with new indices. After a table's first
launch through Triton's JIT, :class:`kvcore.kernels.triton_layers.LayeredLaunch` calls the
compiled kernel directly, so every later request (other row counts, indices at other
addresses and alignments) must still copy exactly the rows asked for: checked against a
per-index copy, with the untouched rows (random bytes) and the unchanged sources.
"""

from __future__ import annotations

import pytest
import torch

from kvcore.direction import Direction
from kvcore.kernels import triton_tile
from kvcore.kernels.triton_kernels import triton_available
from kvcore.metrics import Metrics
from kvcore.mover import Mover, PreparedLayers
from kvcore.planning.device_indexed import plan_device_indexed
from kvcore.planning.layers import layer_pairs
from kvcore.planning.path_policy import PathPolicy, TransferPath
from kvcore.planning.plans import TransferPlan, plan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not triton_available(), reason="needs Triton"),
]

LAYERS, ROWS = 4, 4096


def _random(rows: int, row_bytes: int, *, host: bool) -> torch.Tensor:
    raw = torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, device="cuda")
    return raw.view(torch.bfloat16).cpu().pin_memory() if host else raw.view(torch.bfloat16)


def _staged_page_in(
    mover: Mover,
    host: torch.Tensor,
    device: torch.Tensor,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
) -> TransferPlan:
    """The mover's staged page-in plan for these rows."""
    return plan(
        host,
        device,
        src_idx,
        dst_idx,
        direction=Direction.H2D,
        policy=mover.policy,
        force=TransferPath.STAGED,
    )


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Random bytes hold NaNs, which compare unequal as numbers: compare the bytes."""
    return t.cpu().view(torch.uint8)


@pytest.mark.parametrize("row_bytes", [48, 1152, 4096])
@pytest.mark.parametrize("direction", [Direction.H2D, Direction.D2H])
def test_requests_of_every_size_after_the_first_launch_copy_exactly(row_bytes, direction):
    h2d = direction is Direction.H2D
    host = [_random(ROWS, row_bytes, host=True) for _ in range(LAYERS)]
    device = [_random(ROWS, row_bytes, host=False) for _ in range(LAYERS)]
    srcs, dsts = (host, device) if h2d else (device, host)
    pairs = layer_pairs(srcs, dsts)
    mover = Mover(metrics=Metrics())
    gen = torch.Generator().manual_seed(row_bytes)
    # Row counts on and off Triton's specialisation points (1, multiples of 16, odd).
    for count in (37, 1, 16, 1000, 2047, 4096):
        src_idx = torch.randperm(ROWS, generator=gen)[:count]
        dst_idx = torch.randperm(ROWS, generator=gen)[:count]
        sources = [t.clone() for t in srcs]
        want = [t.clone() for t in dsts]
        for src, dst in zip(sources, want, strict=True):
            dst[dst_idx] = src[src_idx].to(dst.device)
        first = plan(
            srcs[0], dsts[0], src_idx, dst_idx, direction=direction, force=TransferPath.GATHER
        )
        prepared = mover.prepare_layers(first)
        assert prepared.rows is not None
        for layer in range(LAYERS):
            one = layer_pairs([srcs[layer]], [dsts[layer]])
            mover.execute_prepared(prepared, one)
        mover.execute_prepared(prepared, pairs)  # all layers again in one launch: same rows
        torch.cuda.synchronize()
        for got, wanted in zip(dsts, want, strict=True):
            assert torch.equal(_bytes(got), _bytes(wanted))
        for src, kept in zip(srcs, sources, strict=True):
            assert torch.equal(_bytes(src), _bytes(kept))


def test_later_launches_skip_the_jit_and_indices_at_odd_addresses_still_copy(monkeypatch):
    jit_launches = []
    through_jit = triton_tile.Launch.run

    def counted(self, *args, **kwargs):
        jit_launches.append(args[0])
        return through_jit(self, *args, **kwargs)

    monkeypatch.setattr(triton_tile.Launch, "run", counted)
    host = [_random(ROWS, 1152, host=True) for _ in range(2)]
    device = [_random(ROWS, 1152, host=False) for _ in range(2)]
    pairs = layer_pairs(host, device)
    mover = Mover()
    kernels = mover.kernels(torch.device("cuda"))
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        src_idx = torch.randperm(ROWS, generator=gen)[:333]
        dst_idx = torch.randperm(ROWS, generator=gen)[:333]
        # Views one element into a block: 8-byte aligned, not 16.
        src_on = torch.empty(334, dtype=torch.int64, device="cuda")[1:]
        dst_on = torch.empty(334, dtype=torch.int64, device="cuda")[1:]
        src_on.copy_(src_idx)
        dst_on.copy_(dst_idx)
        want = [t.clone() for t in device]
        for src, dst in zip(host, want, strict=True):
            dst[dst_idx.cuda()] = src[src_idx].cuda()
        assert kernels.prepare_rows is not None and kernels.gather_prepared is not None
        kernels.gather_prepared(pairs, kernels.prepare_rows(src_on, dst_on, src_on.device))
        torch.cuda.synchronize()
        for got, wanted in zip(device, want, strict=True):
            assert torch.equal(_bytes(got), _bytes(wanted))
    # The first launch compiled (or found) the kernel; the two after it went straight to it.
    assert len(jit_launches) == 1


def test_layered_gathers_under_inference_mode_copy_exactly_and_never_reuse_a_stale_upload():
    """vLLM's model runner calls the offload handler under torch.inference_mode: every
    tensor made there (kvcore's own launch tables included) has no version counter, so
    an upload of one can never be reused as unchanged."""
    metrics = Metrics()
    mover = Mover(metrics=metrics)
    gen = torch.Generator().manual_seed(9)
    with torch.inference_mode():
        host = [_random(ROWS, 1152, host=True) for _ in range(LAYERS)]
        device = [_random(ROWS, 1152, host=False) for _ in range(LAYERS)]
        pairs = layer_pairs(host, device)
        src_idx = torch.randperm(ROWS, generator=gen)[:700]
        dst_idx = torch.randperm(ROWS, generator=gen)[:700]
        assert src_idx.is_inference()
        for rewrite in range(2):
            if rewrite:
                # Written in place where no counter sees it: the next copy must read it anew.
                src_idx.copy_(torch.randperm(ROWS, generator=gen)[:700])
            want = [t.clone() for t in device]
            for src, dst in zip(host, want, strict=True):
                dst[dst_idx.cuda()] = src[src_idx].cuda()
            chosen = plan(
                host[0],
                device[0],
                src_idx,
                dst_idx,
                direction=Direction.H2D,
                force=TransferPath.GATHER,
            )
            mover.execute(chosen, pairs)
            torch.cuda.synchronize()
            for got, wanted in zip(device, want, strict=True):
                assert torch.equal(_bytes(got), _bytes(wanted))
    assert metrics.snapshot()["fallbacks"] == {}


@pytest.mark.parametrize("rows_on_gpu", [True, False])
def test_prepared_staged_page_ins_between_other_streams_copy_exactly(rows_on_gpu):
    """Each layer of a prepared staged page-in goes through the shared staging buffer in
    chunks, while another stream's staged page-ins use the same buffer between layers:
    the lease must order them, whether the destination rows came on the GPU (SGLang's
    ``kernel`` backend) or were uploaded once."""
    row_bytes, count = 1152, 2500
    host = [_random(ROWS, row_bytes, host=True) for _ in range(LAYERS)]
    device = [_random(ROWS, row_bytes, host=False) for _ in range(LAYERS)]
    other_host = _random(ROWS, row_bytes, host=True)
    other_device = _random(ROWS, row_bytes, host=False)
    gen = torch.Generator().manual_seed(29)
    src_idx = torch.cat([torch.arange(100, 1100), torch.arange(2000, 3500)])
    dst_idx = torch.randperm(ROWS, generator=gen)[:count]
    other_src, other_dst = torch.arange(0, 3000), torch.randperm(ROWS, generator=gen)[:3000]
    want = [t.clone() for t in device]
    for src, dst in zip(host, want, strict=True):
        dst[dst_idx.cuda()] = src[src_idx].cuda()
    other_want = other_device.clone()
    other_want[other_dst.cuda()] = other_host[other_src].cuda()
    sources = [t.clone() for t in host]
    mover = Mover(PathPolicy(staging_bytes=1000 * row_bytes), metrics=Metrics())
    rows = dst_idx.cuda() if rows_on_gpu else dst_idx
    plan_for = plan_device_indexed if rows_on_gpu else plan
    first = plan_for(
        host[0],
        device[0],
        src_idx,
        rows,
        direction=Direction.H2D,
        policy=mover.policy,
        force=TransferPath.STAGED,
    )
    prepared = mover.prepare_layers(first)
    assert prepared.rows is not None
    other_plan = _staged_page_in(mover, other_host, other_device, other_src, other_dst)
    load, other = torch.cuda.Stream(), torch.cuda.Stream()
    for layer in range(LAYERS):
        with torch.cuda.stream(load):
            torch.cuda._sleep(200_000)  # the load stream runs behind: the other must wait
            mover.execute_prepared(prepared, layer_pairs([host[layer]], [device[layer]]))
        with torch.cuda.stream(other):
            mover.execute(other_plan)
    torch.cuda.synchronize()
    for got, wanted in zip(device, want, strict=True):
        assert torch.equal(_bytes(got), _bytes(wanted))
    for src, kept in zip(host, sources, strict=True):
        assert torch.equal(_bytes(src), _bytes(kept))
    assert torch.equal(_bytes(other_device), _bytes(other_want))


@pytest.mark.parametrize(
    ("staging_rows", "overlapped"), [(20000, True), (4096, True), (3000, False)]
)
def test_staged_page_ins_of_many_pairs_back_to_back_copy_exactly(staging_rows, overlapped):
    """A vLLM-shaped load job: every layer's pair in one call, through a ring of slots of
    the staging buffer where two or more fit (the DMAs on a second stream; one round, or
    rounds that reuse the slots), else in turn. Calls follow each other on a stream held
    back on the GPU, with new host bytes and new destination rows each time: a DMA that
    ran ahead of the scatter reading its slot, or of the engine's earlier work, would
    leave wrong bytes."""
    row_bytes, count, layers = 1152, 1800, 6
    device = [_random(ROWS, row_bytes, host=False) for _ in range(layers)]
    mover = Mover(PathPolicy(staging_bytes=staging_rows * row_bytes), metrics=Metrics())
    gen = torch.Generator().manual_seed(staging_rows)
    load = torch.cuda.Stream()
    want = [t.clone() for t in device]
    sources = []
    for call in range(4):
        host = [_random(ROWS, row_bytes, host=True) for _ in range(layers)]
        sources.append((host, [t.clone() for t in host]))
        start = call * 500
        src_idx = torch.arange(start, start + count)
        dst_idx = torch.randperm(ROWS, generator=gen)[:count]
        for src, dst in zip(host, want, strict=True):
            dst[dst_idx.cuda()] = src[src_idx].cuda()
        chosen = _staged_page_in(mover, host[0], device[0], src_idx, dst_idx)
        with torch.cuda.stream(load):
            torch.cuda._sleep(500_000)
            mover.execute(chosen, layer_pairs(host, device))
    torch.cuda.synchronize()
    for got, wanted in zip(device, want, strict=True):
        assert torch.equal(_bytes(got), _bytes(wanted))
    for host, kept in sources:
        for src, copy in zip(host, kept, strict=True):
            assert torch.equal(_bytes(src), _bytes(copy))
    lanes = mover.kernels(torch.device("cuda")).stage_in_prepared.__self__._lanes
    assert bool(lanes) is overlapped


def test_a_staged_ring_that_fails_midway_leaves_the_next_page_in_exact(monkeypatch):
    """A ring whose third DMA raises has DMAs of its first two units issued on the second
    stream: the call must still end with the current stream waiting for them, so that
    the next page-in through the same staging rows reads its own bytes."""
    from kvcore.kernels import reference

    row_bytes, count, layers = 1152, 1800, 6
    host = [_random(ROWS, row_bytes, host=True) for _ in range(layers)]
    device = [_random(ROWS, row_bytes, host=False) for _ in range(layers)]
    mover = Mover(PathPolicy(staging_bytes=20000 * row_bytes), metrics=Metrics())
    gen = torch.Generator().manual_seed(41)

    def job() -> tuple[torch.Tensor, torch.Tensor]:
        src_idx = torch.arange(100, 100 + count)
        dst_idx = torch.randperm(ROWS, generator=gen)[:count]
        chosen = _staged_page_in(mover, host[0], device[0], src_idx, dst_idx)
        mover.execute(chosen, layer_pairs(host, device))
        return src_idx, dst_idx

    issued = []
    real = reference.listed_runs_to_staging

    def third_fails(*args, **kwargs):
        issued.append(None)
        if len(issued) == 3:
            raise RuntimeError("injected")
        real(*args, **kwargs)

    monkeypatch.setattr(reference, "listed_runs_to_staging", third_fails)
    with pytest.raises(RuntimeError, match="injected"):
        job()
    monkeypatch.setattr(reference, "listed_runs_to_staging", real)
    torch.cuda._sleep(1_000_000)
    want = [t.clone() for t in device]
    src_idx, dst_idx = job()
    for src, dst in zip(host, want, strict=True):
        dst[dst_idx.cuda()] = src[src_idx].cuda()
    torch.cuda.synchronize()
    for got, wanted in zip(device, want, strict=True):
        assert torch.equal(_bytes(got), _bytes(wanted))


def _ring_request(
    mover: Mover,
    host: torch.Tensor,
    device: torch.Tensor,
    start: int,
    count: int,
    gen: torch.Generator,
) -> tuple[PreparedLayers, torch.Tensor, torch.Tensor]:
    """A prepared staged reload of ``count`` host rows from ``start`` (one run) into random
    device rows given on the GPU, as SGLang's ``kernel`` backend hands them over."""
    src_idx = torch.arange(start, start + count)
    dst_idx = torch.randperm(ROWS, generator=gen)[:count]
    chosen = plan_device_indexed(
        host,
        device,
        src_idx,
        dst_idx.cuda(),
        direction=Direction.H2D,
        policy=mover.policy,
        force=TransferPath.STAGED,
    )
    return mover.prepare_layers(chosen), src_idx, dst_idx


@pytest.mark.parametrize(
    ("slots", "row_bytes", "count", "pairs"),
    [
        (2, 1152, 1500, 2),  # one pair a slot: two slots of K and V do not fit
        (5, 1152, 1500, 2),  # K and V a slot, one scatter launch
        (5, 1000, 1501, 2),  # V's rows off 16 bytes in the slot: index_copy_ scatters
        (3, 1152, 1500, 1),  # MLA: one buffer a layer
    ],
)
def test_layer_ring_reloads_copy_exactly_behind_a_held_back_stream(slots, row_bytes, count, pairs):
    """SGLang-shaped reloads (K and V a layer, or MLA's one buffer, one call a layer)
    through the layer ring: the DMAs of later layers run ahead on their own stream while
    each layer's scatter waits for the load stream, held back on the GPU and writing every
    destination layer just before its call; another stream's staged page-in takes the
    staging buffer between some layers. A DMA into a slot whose scatter has not run, or a
    scatter before the load stream's own write, would leave wrong bytes."""
    layers = 6
    device = [[_random(ROWS, row_bytes, host=False) for _ in range(pairs)] for _ in range(layers)]
    poison = [[t.clone() for t in pair] for pair in device]
    mover = Mover(PathPolicy(staging_bytes=slots * count * row_bytes), metrics=Metrics())
    gen = torch.Generator().manual_seed(slots)
    other_host = _random(ROWS, row_bytes, host=True)
    other_device = _random(ROWS, row_bytes, host=False)
    other_src, other_dst = torch.arange(0, 600), torch.randperm(ROWS, generator=gen)[:600]
    other_want = other_device.clone()
    other_want[other_dst.cuda()] = other_host[other_src].cuda()
    other_plan = _staged_page_in(mover, other_host, other_device, other_src, other_dst)
    load, other = torch.cuda.Stream(), torch.cuda.Stream()
    for request in range(3):
        host = [[_random(ROWS, row_bytes, host=True) for _ in range(pairs)] for _ in range(layers)]
        kept = [[t.clone() for t in pair] for pair in host]
        prepared, src_idx, dst_idx = _ring_request(
            mover, host[0][0], device[0][0], request * 700, count, gen
        )
        for layer in range(layers):
            with torch.cuda.stream(load):
                torch.cuda._sleep(300_000)
                for got, clean in zip(device[layer], poison[layer], strict=True):
                    got.copy_(clean)
                mover.execute_prepared(prepared, layer_pairs(host[layer], device[layer]))
            if layer == 2:
                with torch.cuda.stream(other):
                    mover.execute(other_plan)
        load.synchronize()
        for layer in range(layers):
            for got, clean, src in zip(device[layer], poison[layer], host[layer], strict=True):
                want = clean.clone()
                want[dst_idx.cuda()] = src[src_idx].cuda()
                assert torch.equal(_bytes(got), _bytes(want)), (request, layer)
        for pair, copies in zip(host, kept, strict=True):
            for src, copy in zip(pair, copies, strict=True):
                assert torch.equal(_bytes(src), _bytes(copy))
    torch.cuda.synchronize()
    assert torch.equal(_bytes(other_device), _bytes(other_want))
    ops = mover.kernels(torch.device("cuda")).stage_in_prepared.__self__
    assert ops._rings, "the reloads did not take the layer ring"
    # Rows on 16 bytes take the compiled scatter; V's rows off them take index_copy_.
    assert bool(ops._slot_scatter._compiled) == (row_bytes % 16 == 0)


def test_a_layer_ring_call_that_fails_midway_leaves_the_next_request_exact(monkeypatch):
    """A ring call whose second DMA is refused has issued a DMA into a slot with no scatter
    after it: the call raises, the caller's stream still waits for what was issued, and the
    next request (its DMAs ordered afresh) copies exactly."""
    from kvcore.kernels.cudart import CudaCallError, StreamCalls

    row_bytes, count, layers = 1152, 1500, 3
    host = [[_random(ROWS, row_bytes, host=True) for _ in range(2)] for _ in range(layers)]
    device = [[_random(ROWS, row_bytes, host=False) for _ in range(2)] for _ in range(layers)]
    mover = Mover(PathPolicy(staging_bytes=3 * count * row_bytes), metrics=Metrics())
    gen = torch.Generator().manual_seed(7)

    def prepared_request() -> tuple[PreparedLayers, torch.Tensor, torch.Tensor]:
        return _ring_request(mover, host[0][0], device[0][0], 300, count, gen)

    real_copy = StreamCalls.copy
    copies: list[None] = []

    def second_refused(self, *args):
        copies.append(None)
        if len(copies) == 2:
            raise CudaCallError("cudaMemcpyAsync", 1)
        real_copy(self, *args)

    load = torch.cuda.Stream()
    failing, _, _ = prepared_request()
    monkeypatch.setattr(StreamCalls, "copy", second_refused)
    with torch.cuda.stream(load), pytest.raises(CudaCallError):
        mover.execute_prepared(failing, layer_pairs(host[0], device[0]))
    monkeypatch.setattr(StreamCalls, "copy", real_copy)
    torch.cuda.synchronize()  # what the failed call did write is the starting point
    prepared, src_idx, dst_idx = prepared_request()
    want = [[t.clone() for t in pair] for pair in device]
    for pair, wanted in zip(host, want, strict=True):
        for src, dst in zip(pair, wanted, strict=True):
            dst[dst_idx.cuda()] = src[src_idx].cuda()
    with torch.cuda.stream(load):
        torch.cuda._sleep(500_000)
        for layer in range(layers):
            mover.execute_prepared(prepared, layer_pairs(host[layer], device[layer]))
    torch.cuda.synchronize()
    for pair, wanted in zip(device, want, strict=True):
        for got, expected in zip(pair, wanted, strict=True):
            assert torch.equal(_bytes(got), _bytes(expected))
