"""A layer_first host pool pinned in steps with CUDA (kvcore.stepwise_pinning): the slots
each step makes ready copy exactly to and from the GPU while later steps register, through
kvcore's gather (which reads the host rows by their device address) and through torch's
own copies, and the whole pool once every step is in."""

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


def test_ready_slots_copy_exactly_while_the_rest_registers() -> None:
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
    # The whole pool, both ways, with every step in: one copy spans every registration.
    whole = host[1].cuda(non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(whole.cpu(), host[1])
    back = torch.randint(-128, 128, (SLOTS, ROW), dtype=torch.int8, device="cuda")
    host[1, 2].copy_(back, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(host[1, 2], back.cpu())
    pinning.unpin()
    del host, whole
    memory.close()
