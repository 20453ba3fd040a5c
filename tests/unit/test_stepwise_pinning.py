"""kvcore.stepwise_pinning: a host pool's slots pinned in steps, page-aligned, taken back whole."""

from __future__ import annotations

import gc
import math
import mmap
import threading
import time
import weakref

import numpy as np
import pytest
import torch

from kvcore.host_pinning import format_bytes
from kvcore.stepwise_pinning import (
    PinStep,
    SlotLayout,
    StepwisePinning,
    crosses_step,
    range_steps,
    slot_layout,
    slot_steps,
    slot_unit,
)

PAGE = 4096
_MAPS: list[mmap.mmap] = []  # keeps every page-aligned buffer's memory alive


def aligned(shape: tuple[int, ...], dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """A contiguous CPU tensor whose data starts on a 4096-byte page."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    mapping = mmap.mmap(-1, nbytes)
    _MAPS.append(mapping)
    tensor = torch.frombuffer(mapping, dtype=dtype).view(shape)
    assert tensor.data_ptr() % PAGE == 0
    return tensor


class Recorder:
    """A registrar that keeps {address: size}, refuses overlaps and unknown addresses, and
    can fail on (``fail_on``) or block in (``block_on``) its Nth register call."""

    def __init__(self, fail_on: int | None = None, block_on: int | None = None) -> None:
        self.held: dict[int, int] = {}
        self.unregistered: list[int] = []
        self.calls = 0
        self.fail_on = fail_on
        self.block_on = block_on
        self.entered = threading.Event()
        self.release = threading.Event()

    def register(self, ptr: int, nbytes: int) -> None:
        self.calls += 1
        if self.calls == self.fail_on:
            raise RuntimeError("injected failure")
        if self.calls == self.block_on:
            self.entered.set()
            assert self.release.wait(10)
        assert nbytes > 0
        for address, size in self.held.items():
            if ptr < address + size and address < ptr + nbytes:
                raise ValueError(f"{ptr:#x}+{nbytes} overlaps {address:#x}+{size}")
        self.held[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        if ptr not in self.held:
            raise KeyError(f"{ptr:#x} is not registered")
        del self.held[ptr]
        self.unregistered.append(ptr)


def ranges_of(steps: tuple[PinStep, ...] | list[PinStep]) -> dict[int, int]:
    return {address: size for step in steps for address, size in step.ranges}


def assert_covers(ranges: list[tuple[int, int]], start: int, nbytes: int) -> None:
    """The ranges tile ``[start, start + nbytes)``: every byte once, no gap, no overlap."""
    at = start
    for address, size in sorted(ranges):
        assert address == at and size > 0
        at += size
    assert at == start + nbytes


# page_first (2, slots, layers, heads, dim): two parts, so a step has two ranges.
def page_first_steps() -> tuple[SlotLayout, tuple[PinStep, ...]]:
    layout = slot_layout(aligned((2, 160, 4, 2, 32)), 160)
    assert layout is not None
    steps = slot_steps(layout, 4, first_bytes=5000, step_bytes=20000)
    assert steps is not None and len(steps) >= 5
    assert all(len(step.ranges) == 2 for step in steps)
    return layout, steps


def test_slot_layout_shapes() -> None:
    mha = slot_layout(aligned((2, 3, 64, 4, 8)), 64)
    assert mha is not None
    assert (mha.parts, mha.slots, mha.slot_bytes) == (6, 64, 4 * 8 * 2)
    assert mha.part_stride == 64 * mha.slot_bytes and mha.nbytes == 2 * 3 * 64 * 4 * 8 * 2
    page_first = slot_layout(torch.empty(2, 48, 3, 4, 8, dtype=torch.float32), 48)
    assert page_first is not None
    assert (page_first.parts, page_first.slot_bytes) == (2, 3 * 4 * 8 * 4)
    assert page_first.part_stride == 48 * 3 * 4 * 8 * 4
    mla_buffer = torch.empty(5, 32, 1, 576, dtype=torch.bfloat16)
    mla = slot_layout(mla_buffer, 32)
    assert mla is not None and mla.address == mla_buffer.data_ptr()
    assert (mla.parts, mla.slot_bytes, mla.part_stride) == (5, 1152, 32 * 1152)
    assert slot_layout(torch.empty(2, 4, 4, 8), 4) is None  # two dims of `slots`
    assert slot_layout(torch.empty(2, 3, 5, 8), 4) is None  # none
    assert slot_layout(torch.empty(2, 64, 3, 8).transpose(1, 2), 64) is None


def test_slot_unit() -> None:
    def unit(address: int, stride: int, slot_bytes: int, page_size: int) -> int | None:
        return slot_unit(
            SlotLayout(address, 2, stride, stride // slot_bytes, slot_bytes), page_size
        )

    assert unit(PAGE, 8 * PAGE, 2048, 1) == 2
    assert unit(PAGE, 3 * PAGE * 128, 3 * PAGE, 64) == 64
    assert unit(2 * PAGE, 96 * 128, 96, 48) == math.lcm(48, 4096 // 32)
    assert unit(PAGE, 16 * 1024, 1024, 3) == 12
    assert unit(PAGE + 64, 8 * PAGE, 2048, 1) is None
    assert unit(PAGE, 8 * PAGE + 2048, 2048, 1) is None


@pytest.mark.parametrize(
    ("shape", "dtype", "slots", "page_size", "first_bytes", "step_bytes"),
    [
        ((2, 3, 256, 2, 32), torch.float16, 256, 16, 10_000, 30_000),  # layer_first MHA
        ((2, 160, 4, 2, 32), torch.float16, 160, 4, 5000, 20_000),  # page_first
        ((4, 96, 1, 576), torch.float16, 96, 1, 1, 1),  # MLA
        ((3, 16, 1024), torch.int8, 16, 3, 0, 0),  # slots not a multiple of the unit (12)
        ((2, 3, 256, 2, 32), torch.float16, 256, 16, 32 * 768 + 1, 1),  # 1 B past a unit
        ((2, 3, 256, 2, 32), torch.float16, 256, 16, 10**9, 30_000),  # first step is all
    ],
)
def test_slot_steps_tile_the_buffer_on_pages(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    slots: int,
    page_size: int,
    first_bytes: int,
    step_bytes: int,
) -> None:
    layout = slot_layout(aligned(shape, dtype), slots)
    assert layout is not None
    unit = slot_unit(layout, page_size)
    steps = slot_steps(layout, page_size, first_bytes, step_bytes)
    assert unit is not None and steps is not None
    all_ranges = [r for step in steps for r in step.ranges]
    assert_covers(all_ranges, layout.address, layout.nbytes)
    for address, size in all_ranges:
        assert address % PAGE == 0 and (address + size) % PAGE == 0
    ready = [step.ready_slots for step in steps]
    assert ready == sorted(set(ready)) and ready[-1] == slots and ready[0] > 0
    assert all(r % unit == 0 for r in ready[:-1])
    assert steps[0].nbytes >= min(first_bytes, layout.nbytes)
    assert sum(step.nbytes for step in steps) == layout.nbytes


def test_slot_steps_whole_pool_first_is_one_range() -> None:
    layout = slot_layout(aligned((2, 3, 256, 2, 32)), 256)
    assert layout is not None
    steps = slot_steps(layout, 16, first_bytes=layout.nbytes + 1, step_bytes=4096)
    assert steps == (PinStep(((layout.address, layout.nbytes),), 256),)
    unaligned = SlotLayout(layout.address + 128, 6, 256 * 128, 256, 128)
    assert slot_steps(unaligned, 16, 4096, 4096) is None


def test_pin_first_then_background_pins_everything() -> None:
    layout, steps = page_first_steps()
    recorder = Recorder()
    seen: list[tuple[int, bool]] = []
    pinning: StepwisePinning

    def on_ready() -> None:
        free = pinning.lock.acquire(blocking=False)  # called with no lock held
        if free:
            pinning.lock.release()
        seen.append((pinning.ready_slots, free))

    pinning = StepwisePinning(steps, recorder, on_ready=on_ready, name="test pool")
    assert pinning.ready_slots == 0 and not pinning.done and pinning.steps[-1].ready_slots == 160
    pinning.pin_first(1)
    assert recorder.held == dict(steps[0].ranges)
    assert pinning.ready_slots == steps[0].ready_slots and pinning.registered == list(
        steps[0].ranges
    )
    pinning.start()
    assert pinning.wait(10)
    assert pinning.done and pinning.failure is None
    assert pinning.ready_slots == 160
    assert seen == [(step.ready_slots, True) for step in steps[1:]]
    assert pinning.registered == [r for step in steps for r in step.ranges]
    assert recorder.held == ranges_of(steps)
    assert_covers(list(recorder.held.items()), layout.address, layout.nbytes)


def test_failure_mid_step_takes_that_step_back() -> None:
    layout, steps = page_first_steps()
    recorder = Recorder(fail_on=6)  # pin_first: calls 1-2; step 1: 3-4; step 2: 5 then 6
    ready: list[int] = []
    pinning = StepwisePinning(steps, recorder, on_ready=lambda: ready.append(0))
    pinning.pin_first(1)
    pinning.start()
    assert pinning.wait(10)
    assert recorder.calls == 6
    assert recorder.held == ranges_of(steps[:2])
    assert pinning.registered == [r for step in steps[:2] for r in step.ranges]
    assert not pinning.done and pinning.ready_slots == steps[1].ready_slots
    assert len(ready) == 1
    assert pinning.failure is not None
    assert "injected failure" in pinning.failure and "ulimit -l" in pinning.failure
    assert format_bytes(steps[0].nbytes + steps[1].nbytes) in pinning.failure
    assert format_bytes(layout.nbytes) in pinning.failure


@pytest.mark.parametrize(("count", "fail_on"), [(1, 1), (1, 2), (2, 3), (3, 6)])
def test_pin_first_failure_leaves_nothing(count: int, fail_on: int) -> None:
    _, steps = page_first_steps()
    recorder = Recorder(fail_on=fail_on)
    pinning = StepwisePinning(steps, recorder)
    with pytest.raises(RuntimeError, match="injected failure"):
        pinning.pin_first(count)
    assert recorder.calls == fail_on
    assert recorder.held == {} and pinning.registered == []
    assert pinning.ready_slots == 0


def test_unpin_after_wait_takes_everything_back() -> None:
    _, steps = page_first_steps()
    recorder = Recorder()
    pinning = StepwisePinning(steps, recorder)
    pinning.pin_first(2)
    pinning.start()
    assert pinning.wait(10) and pinning.done
    assert len(recorder.held) == 2 * len(steps)
    pinning.unpin()
    assert recorder.held == {} and pinning.registered == []
    assert recorder.unregistered == [a for step in reversed(steps) for a, _ in step.ranges[::-1]]
    assert pinning.ready_slots == 0


def test_stop_ends_the_thread_after_the_step_in_progress() -> None:
    _, steps = page_first_steps()
    recorder = Recorder(block_on=5)  # first register of the 2nd background step
    pinning = StepwisePinning(steps, recorder)
    pinning.pin_first(1)
    pinning.start()
    assert recorder.entered.wait(10)
    assert pinning.ready_slots == steps[1].ready_slots and not pinning.wait(0)
    recorder.release.set()
    pinning.stop()
    assert pinning.wait(0)  # the thread has ended
    assert not pinning.done and pinning.failure is None
    assert pinning.ready_slots in (steps[1].ready_slots, steps[2].ready_slots)
    upto = next(i for i, step in enumerate(steps) if step.ready_slots == pinning.ready_slots)
    assert recorder.held == ranges_of(steps[: upto + 1])
    calls = recorder.calls
    time.sleep(0.05)
    assert recorder.calls == calls and recorder.held == ranges_of(steps[: upto + 1])


def test_misuse() -> None:
    with pytest.raises(ValueError, match="no steps"):
        StepwisePinning([], Recorder())
    _, steps = page_first_steps()
    pinning = StepwisePinning(steps, Recorder())
    pinning.pin_first(1)
    with pytest.raises(RuntimeError, match="once"):
        pinning.pin_first(1)


@pytest.mark.parametrize(
    ("slots", "crossed"),
    [
        ([254, 255, 256, 257], True),  # one run over the end at 256
        ([255, 257, 256], False),  # 255 and 256 are not neighbours in the list
        ([256, 255], False),  # descending: two runs of one slot
        ([0, 1, 2, 511, 512], True),
        ([0, 1, 2, 300, 301], False),
        ([7], False),
        ([], False),
    ],
)
def test_crosses_step_finds_a_run_over_a_steps_end(slots: list[int], crossed: bool) -> None:
    ends = np.array([256, 512], dtype=np.int64)
    assert crosses_step(np.array(slots, dtype=np.int64), ends) is crossed


def test_crosses_step_without_ends_is_false() -> None:
    assert not crosses_step(np.arange(10), np.array([], dtype=np.int64))


def test_the_memory_lives_as_long_as_the_pinning() -> None:
    _, steps = page_first_steps()
    memory = torch.empty(16)
    kept = weakref.ref(memory)
    pinning = StepwisePinning(steps, Recorder(), memory=memory)
    del memory
    gc.collect()
    assert kept() is not None
    del pinning
    gc.collect()
    assert kept() is None


def test_a_failing_hand_out_stops_the_thread_with_a_failure() -> None:
    _, steps = page_first_steps()
    recorder = Recorder()

    def on_ready() -> None:
        raise RuntimeError("the allocator refused")

    pinning = StepwisePinning(steps, recorder, on_ready=on_ready, name="test pool")
    pinning.pin_first()
    pinning.start()
    assert pinning.wait(10)
    assert pinning.failure is not None and "the allocator refused" in pinning.failure
    assert not pinning.done and pinning.ready_slots == steps[1].ready_slots


def test_each_step_is_prepared_just_before_its_registration() -> None:
    _, steps = page_first_steps()
    recorder = Recorder()
    order: list[tuple[str, int, int]] = []

    def prepare(step: PinStep, at_once: int) -> None:
        assert not any(address in recorder.held for address, _ in step.ranges)
        order.append(("prepare", step.ready_slots, at_once))

    pinning = StepwisePinning(
        steps, recorder, prepare=prepare, on_ready=lambda: order.append(("ready", 0, 0))
    )
    pinning.pin_first(1)
    pinning.start()
    assert pinning.wait(10) and pinning.done
    expected = [("prepare", steps[0].ready_slots, 1)]
    for step in steps[1:]:
        expected += [("prepare", step.ready_slots, 1), ("ready", 0, 0)]
    assert order == expected


def test_later_steps_are_prepared_ahead_and_each_registered_only_once_prepared() -> None:
    _, steps = page_first_steps()
    recorder = Recorder()
    lock = threading.Lock()
    running: set[int] = set()
    most_at_once = 0
    prepared: set[int] = set()
    second_registered = threading.Event()
    register = recorder.register

    def prepare(step: PinStep, at_once: int) -> None:
        nonlocal most_at_once
        assert at_once == (1 if step is steps[0] else 2)
        with lock:
            running.add(step.ready_slots)
            most_at_once = max(most_at_once, len(running))
        # The third step's preparation ends only once the second step is registered: one
        # step at a time, prepared just before its registration, would never get there.
        if step is steps[2]:
            assert second_registered.wait(10)
        with lock:
            running.discard(step.ready_slots)
            prepared.add(step.ready_slots)

    def registered_once_prepared(ptr: int, nbytes: int) -> None:
        step = next(s for s in steps if any(address == ptr for address, _ in s.ranges))
        with lock:
            assert step.ready_slots in prepared
        register(ptr, nbytes)
        if step is steps[1] and ptr == step.ranges[-1][0]:
            second_registered.set()

    recorder.register = registered_once_prepared  # type: ignore[method-assign]
    pinning = StepwisePinning(steps, recorder, prepare=prepare, prepare_ahead=2)
    pinning.pin_first(1)
    pinning.start()
    assert pinning.wait(10) and pinning.done and pinning.failure is None
    assert recorder.held == ranges_of(steps)
    assert most_at_once <= 2


def test_stopping_waits_for_the_steps_being_prepared_and_starts_no_more() -> None:
    _, steps = page_first_steps()
    recorder = Recorder(block_on=3)  # the second step's first range, on the thread
    started: list[int] = []
    finished: list[int] = []

    def prepare(step: PinStep, at_once: int) -> None:
        started.append(step.ready_slots)
        time.sleep(0.05)
        finished.append(step.ready_slots)

    pinning = StepwisePinning(steps, recorder, prepare=prepare, prepare_ahead=3)
    pinning.pin_first(1)
    pinning.start()
    assert recorder.entered.wait(10)
    stopper = threading.Thread(target=pinning.stop)
    stopper.start()
    recorder.release.set()
    stopper.join(10)
    assert not stopper.is_alive()
    # Every preparation begun has ended once stop returns, and none begins after it.
    assert sorted(started) == sorted(finished)
    count = len(started)
    time.sleep(0.1)
    assert len(started) == count < len(steps)


def test_preparing_ahead_needs_at_least_one_step() -> None:
    _, steps = page_first_steps()
    with pytest.raises(ValueError, match="prepare_ahead must be at least 1, not 0"):
        StepwisePinning(steps, Recorder(), prepare_ahead=0)


def test_a_step_whose_preparation_fails_is_not_registered() -> None:
    _, steps = page_first_steps()
    recorder = Recorder()

    def prepare(step: PinStep, at_once: int) -> None:
        if step is steps[2]:
            raise OSError("cannot fault the pages in")

    pinning = StepwisePinning(steps, recorder, prepare=prepare)
    pinning.pin_first(1)
    pinning.start()
    assert pinning.wait(10)
    assert recorder.held == ranges_of(steps[:2])
    assert pinning.ready_slots == steps[1].ready_slots and not pinning.done
    assert pinning.failure is not None and "cannot fault the pages in" in pinning.failure


def test_range_steps_group_whole_slots_by_bytes() -> None:
    ranges = [(1000 * i, 100) for i in range(10)]
    steps = range_steps(ranges, first_bytes=250, step_bytes=400)
    assert [step.ready_slots for step in steps] == [3, 7, 10]
    assert [list(step.ranges) for step in steps] == [ranges[:3], ranges[3:7], ranges[7:]]
    assert range_steps(ranges, first_bytes=1 << 30, step_bytes=1)[0].ready_slots == 10
    with pytest.raises(ValueError, match="no slots"):
        range_steps([], 1, 1)
