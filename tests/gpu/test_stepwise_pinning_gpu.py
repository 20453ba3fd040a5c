"""A layer_first host pool pinned in steps with CUDA (kvcore.stepwise_pinning): the slots
each step makes ready copy exactly to and from the GPU while later steps register, through
kvcore's gather (which reads the host rows by their device address); once every step is
in, each step's rows both ways by DMA (a DMA may not cross two registrations) and rows of
every step in one gather."""

from __future__ import annotations

import mmap

import pytest
import torch

from kvcore.direction import Direction
from kvcore.host_pinning import CudaHostRegistrar
from kvcore.mover import Mover
from kvcore.planning.path_policy import TransferPath
from kvcore.planning.plans import plan
from kvcore.stepwise_pinning import StepwisePinning, slot_layout, slot_steps

pytestmark = pytest.mark.gpu

LAYERS, SLOTS, ROW = 4, 8192, 2048  # 2 x 4 parts of 16 MiB: 128 MiB in all


def _pool_in_steps() -> tuple[mmap.mmap, torch.Tensor, StepwisePinning]:
    """A layer_first pool of random bytes, its first step pinned, the rest still to go."""
    nbytes = 2 * LAYERS * SLOTS * ROW
    memory = mmap.mmap(-1, nbytes)
    host = torch.frombuffer(memory, dtype=torch.int8, count=nbytes).view(2, LAYERS, SLOTS, ROW)
    host.copy_(torch.randint(-128, 128, host.shape, dtype=torch.int8))
    layout = slot_layout(host, SLOTS)
    assert layout is not None
    steps = slot_steps(layout, 64, 8 << 20, 16 << 20)
    assert steps is not None and len(steps) > 2
    pinning = StepwisePinning(steps, CudaHostRegistrar())
    pinning.pin_first()
    return memory, host, pinning


def test_ready_slots_copy_exactly_while_the_rest_registers() -> None:
    memory, host, pinning = _pool_in_steps()
    ready = pinning.ready_slots
    pinning.start()
    mover = Mover()
    generator = torch.Generator().manual_seed(3)
    slots = torch.randperm(ready, generator=generator)[:256]
    rows = torch.randperm(SLOTS, generator=generator)[:256]
    others = sorted(set(range(SLOTS)) - set(rows.tolist()))
    for layer in range(LAYERS):
        source = host[0, layer]
        device = torch.zeros((SLOTS, ROW), dtype=torch.int8, device="cuda")
        gather = TransferPath.GATHER
        mover.execute(plan(source, device, slots, rows, direction=Direction.H2D, force=gather))
        torch.cuda.synchronize()
        assert torch.equal(device[rows.cuda()].cpu(), source[slots])
        assert not device[others].any()
    assert pinning.wait(60) and pinning.done and pinning.failure is None
    # Every step in: each step's slots of a layer copy both ways by DMA (one registration
    # each), and a gather reads slots of every step in one launch.
    begin = 0
    for end in [*pinning.step_ends.tolist(), SLOTS]:
        rows_of_step = host[1, 2, begin:end]
        assert torch.equal(rows_of_step.cuda(non_blocking=True).cpu(), rows_of_step)
        back = torch.randint(-128, 128, rows_of_step.shape, dtype=torch.int8, device="cuda")
        rows_of_step.copy_(back, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(rows_of_step, back.cpu())
        begin = end
    everywhere = torch.randperm(SLOTS, generator=generator)[: len(rows)]
    device = torch.zeros((SLOTS, ROW), dtype=torch.int8, device="cuda")
    gather = TransferPath.GATHER
    source = host[1, 3]
    mover.execute(plan(source, device, everywhere, rows, direction=Direction.H2D, force=gather))
    torch.cuda.synchronize()
    assert torch.equal(device[rows.cuda()].cpu(), source[everywhere])
    pinning.unpin()
    del host, source, rows_of_step
    memory.close()


@pytest.mark.parametrize("direction", [Direction.H2D, Direction.D2H], ids=lambda d: d.name)
def test_a_staged_copy_across_every_steps_end_goes_one_registration_at_a_time(direction) -> None:
    """One run of slots over every step's end, its device rows scattered: the staged plan
    cuts its host runs at the step ends (``host_cuts``), so each DMA stays inside one
    registration; every byte lands where it belongs and the rest is untouched."""
    from kvcore.planning.device_indexed import plan_device_indexed

    memory, host, pinning = _pool_in_steps()
    pinning.start()
    assert pinning.wait(60) and pinning.failure is None
    cuts = pinning.step_ends
    generator = torch.Generator().manual_seed(7)
    slots = torch.arange(int(cuts[0]) - 100, int(cuts[-1]) + 100)
    rows = torch.randperm(SLOTS, generator=generator)[: len(slots)].cuda()
    device = torch.randint(-128, 128, (SLOTS, ROW), dtype=torch.int8, device="cuda")
    source = host[0, 1]
    before_host, before_device = source.clone(), device.clone()
    src, dst, src_idx, dst_idx = (
        (source, device, slots, rows)
        if direction is Direction.H2D
        else (device, source, rows, slots)
    )
    chosen = plan_device_indexed(src, dst, src_idx, dst_idx, direction=direction, host_cuts=cuts)
    assert chosen.path is TransferPath.STAGED
    assert chosen.host_runs.count == 1 + len(cuts)
    Mover().execute(chosen)
    torch.cuda.synchronize()
    if direction is Direction.H2D:
        expected = before_device.clone()
        expected[rows] = before_host[slots].cuda()
        assert torch.equal(device, expected) and torch.equal(source, before_host)
    else:
        expected = before_host.clone()
        expected[slots] = before_device[rows].cpu()
        assert torch.equal(source, expected) and torch.equal(device, before_device)
    pinning.unpin()
    del host, source, src, dst
    memory.close()
