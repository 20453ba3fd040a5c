"""SGLang host pools pinned in steps (kvcore_sglang.pool_pinning), on the CPU with a
registrar that records what CUDA would be asked to pin."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("sglang.srt.mem_cache.pool_host", reason="needs SGLang installed")
pytestmark = pytest.mark.sglang

import torch  # noqa: E402
from hicache_cpu import transfer_kv_direct  # noqa: E402
from sglang.srt.mem_cache.pool_host import common, mha  # noqa: E402
from sglang.srt.mem_cache.pool_host.base import HostKVCache  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang_pools import mha_device, mla_device  # noqa: E402

from benchmarks.sglang.hook_adapter import register_transfer_hooks  # noqa: E402
from benchmarks.sglang.host_pools import mha_host_pool, mla_host_pool  # noqa: E402
from kvcore.config import KVCoreConfig  # noqa: E402
from kvcore.metrics import METRICS  # noqa: E402
from kvcore_sglang import call_plans, guard, pool_pinning  # noqa: E402

# Page 16, one head of 8 bf16 dims: a slot's row is 16 B, so a step ends on 256 slots
# (4 KiB of each part); 1016 device tokens give a host pool of 2048 slots.
TOKENS, PAGE = 1016, 16
SIZE = 2048
FIRST_BYTES = 16 << 10  # 256 slots of 4 parts of 16 B
STEP_BYTES = 32 << 10  # 512 slots a step: steps end at 256, 768, 1280, 1792, 2048
STEP_ENDS = [256, 768, 1280, 1792, 2048]


class Recorder:
    """Records registrations, refuses overlaps and unknown unregistrations; blocks the
    registrations after the first ``free_calls`` until :attr:`go` is set; fails call
    ``fail_on`` (1-based)."""

    def __init__(self, free_calls: int = 1 << 30, fail_on: int = 0) -> None:
        self.ranges: dict[int, int] = {}
        self.calls = 0
        self.free_calls = free_calls
        self.fail_on = fail_on
        self.go = threading.Event()

    def register(self, ptr: int, nbytes: int) -> None:
        self.calls += 1
        if self.calls > self.free_calls:
            assert self.go.wait(10)
        if self.calls == self.fail_on:
            raise RuntimeError("cudaHostRegister failed: out of memory")
        for start, size in self.ranges.items():
            assert ptr + nbytes <= start or start + size <= ptr, "registered twice"
        self.ranges[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        del self.ranges[ptr]

    def bytes(self) -> int:
        return sum(self.ranges.values())


def fallbacks() -> dict[str, int]:
    return dict(METRICS.snapshot()["fallbacks"])


@pytest.fixture
def pinned_pools(
    sglang_hooks: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., Any]]:
    """Builds pinned host pools through the plugin's allocator and transfer hooks, with the
    pinning hooks over a test's registrar (undone before the plugin's own check)."""
    monkeypatch.setenv("KVCORE_SERVE_RULE", "0")
    monkeypatch.setenv("KVCORE_HOST_POOL", "0")
    register_transfer_hooks()
    from sglang.srt.plugins.hook_registry import HookRegistry

    HookRegistry.apply_hooks()
    registered: list[tuple[int, Any]] = []

    def register(buffer: Any, granularity: int | None = None) -> None:
        registered.append((buffer.data_ptr(), granularity))

    with pytest.MonkeyPatch.context() as patcher:
        patcher.setattr(common, "_cuda_host_register", register)
        patcher.setattr(mha, "transfer_kv_direct", transfer_kv_direct, raising=False)

        def build(
            recorder: Recorder, kind: str = "mha", layout: str = "layer_first", first: int = 1
        ) -> Any:
            config = KVCoreConfig(host_pool_pin_first=FIRST_BYTES * first)
            hooks = pool_pinning.hooks(config, lambda: recorder, STEP_BYTES)
            for cls in (MHATokenToKVPoolHost, MLATokenToKVPoolHost, HostKVCache):
                for name in ("init_kv_buffer", "destroy"):
                    target = f"{cls.__module__}.{cls.__qualname__}.{name}"
                    if target in hooks and name in vars(cls):
                        patcher.setattr(cls, name, _around(hooks[target], vars(cls)[name]))
            args = dict(host_to_device_ratio=2.0, host_size=0, page_size=PAGE, layout=layout)
            if kind == "mha":
                return mha_host_pool(mha_device(TOKENS, PAGE), pin_memory=True, **args)
            return mla_host_pool(mla_device(TOKENS, PAGE), pin_memory=True, **args)

        build.stock_registered = registered  # type: ignore[attr-defined]
        yield build


def _around(hook: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    def hooked(pool: Any) -> Any:
        return hook(original, pool)

    return hooked


def test_only_pinned_slots_are_handed_out_until_every_step_is_in(pinned_pools) -> None:
    recorder = Recorder(free_calls=4)
    pool = pinned_pools(recorder)
    pinning = pool_pinning.pinning_of(pool)
    assert pinning is not None and pool.size == SIZE and pool.pin_memory
    assert [step.ready_slots for step in pinning.steps] == STEP_ENDS
    buffer = pool.kv_buffer
    # The first step: slots [0, 256) in each of K and V of both layers, 4 KiB each.
    assert recorder.ranges == {buffer.data_ptr() + part * SIZE * 16: 256 * 16 for part in range(4)}
    assert getattr(buffer, common._CUDA_HOST_REGISTERED_RANGES_ATTR) is pinning.registered
    assert pool.available_size() == 256
    assert sorted(pool.free_slots.tolist()) == list(range(256))
    taken = pool.alloc(256)
    assert taken is not None and int(taken.max()) < 256
    assert pool.alloc(PAGE) is None
    pool.free(taken)
    recorder.go.set()
    assert pinning.wait(10) and pinning.done and pinning.failure is None
    assert recorder.bytes() == buffer.numel() * buffer.element_size()
    assert pool.available_size() == SIZE
    assert sorted(pool.free_slots.tolist()) == list(range(SIZE))
    assert pool_pinning.step_ends(pool) is not None
    assert pinned_pools.stock_registered == []


def test_a_reset_while_pinning_frees_only_the_pinned_slots(pinned_pools) -> None:
    recorder = Recorder(free_calls=4)
    pool = pinned_pools(recorder)
    assert pool.alloc(128) is not None
    pool.clear()
    assert pool.available_size() == 256
    recorder.go.set()
    assert pool_pinning.pinning_of(pool).wait(10)
    assert pool.available_size() == SIZE


def served_paths() -> int:
    return sum(row["count"] for row in METRICS.snapshot()["transfers"])


@pytest.mark.parametrize("pinned_whole", [False, True])
def test_kvcore_copies_slots_within_a_step_and_passes_a_run_across_a_steps_end(
    pinned_pools, pinned_whole
) -> None:
    recorder = Recorder(free_calls=4)
    pool = pinned_pools(recorder)
    if pinned_whole:
        recorder.go.set()
        assert pool_pinning.pinning_of(pool).wait(10)
    generator = torch.Generator().manual_seed(3)
    device_k = pool.device_k_buffers[0]
    device_idx = torch.randperm(len(device_k), generator=generator)[:16]
    within = torch.arange(224, 240)  # inside the first step, pinned from the start
    across = torch.arange(248, 264)  # 255 and 256 sit in two registrations
    for host_idx, served in ((within, True), (across, False)):
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=generator))
        device_k.zero_()
        before, paths = fallbacks(), served_paths()
        pool.load_to_device_per_layer(None, host_idx, device_idx, 0, "direct")
        assert torch.equal(device_k[device_idx], pool.kv_buffer[0, 0, host_idx])
        others = torch.ones(len(device_k), dtype=torch.bool)
        others[device_idx] = False
        assert not device_k[others].any()
        crossed = fallbacks().get(call_plans.STEP_CROSSED, 0) - before.get(
            call_plans.STEP_CROSSED, 0
        )
        assert (crossed, served_paths() > paths) == ((0, True) if served else (1, False))
    recorder.go.set()


def test_the_kernel_backend_copies_a_run_across_a_steps_end_one_registration_at_a_time(
    pinned_pools, device_indices_unread, use_mover, monkeypatch
) -> None:
    """As on a GPU, the kernel backend's device indices stay unread: the plan stages the
    host slots by DMA, its runs cut where a registration ends, so no copy crosses two."""
    from kvcore.kernels import reference
    from kvcore.mover import Mover
    from kvcore.planning.path_policy import PathPolicy

    # This pool's rows are 16 B: runs of them count as long enough for DMA.
    use_mover(Mover(PathPolicy(long_run_bytes=16), metrics=METRICS))

    copied: list[tuple[int, int]] = []
    listed = reference.listed_runs_to_staging

    def recording(host_words: Any, host_runs: Any, staging: Any, *, into_staging: bool) -> None:
        runs = list(host_runs)
        copied.extend(runs)
        listed(host_words, runs, staging, into_staging=into_staging)

    monkeypatch.setattr(reference, "listed_runs_to_staging", recording)
    recorder = Recorder(free_calls=4)
    pool = pinned_pools(recorder)
    recorder.go.set()
    assert pool_pinning.pinning_of(pool).wait(10)
    ends = pool_pinning.step_ends(pool)
    assert ends is not None and 256 in ends
    generator = torch.Generator().manual_seed(5)
    device_k, device_v = pool.device_k_buffers[0], pool.device_v_buffers[0]
    host_idx = torch.arange(200, 320)  # over slot 256, where the second step begins
    device_idx = torch.randperm(len(device_k), generator=generator)[: len(host_idx)]
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=generator))
    host_before = pool.kv_buffer.clone()
    device_k.zero_()
    device_v.zero_()
    before, paths = fallbacks(), served_paths()
    copied.clear()  # the pool's warm-up staged rows of its own
    pool.load_to_device_per_layer(None, host_idx, device_idx, 0, "kernel")
    for kv, device in enumerate((device_k, device_v)):
        assert torch.equal(device[device_idx], pool.kv_buffer[kv, 0, host_idx])
        others = torch.ones(len(device), dtype=torch.bool)
        others[device_idx] = False
        assert not device[others].any()
    assert torch.equal(pool.kv_buffer, host_before)
    assert fallbacks() == before and served_paths() > paths
    assert copied and sum(length for _, length in copied) == 2 * len(host_idx)
    assert not any(start < 256 < start + length for start, length in copied)


def test_a_failed_step_keeps_the_pinned_slots_and_never_hands_out_the_rest(pinned_pools) -> None:
    recorder = Recorder(fail_on=4 * 2 + 3)  # the third range of the third step
    pool = pinned_pools(recorder)
    pinning = pool_pinning.pinning_of(pool)
    assert pinning.wait(10)
    assert pinning.failure is not None and "ulimit -l" in pinning.failure
    assert pinning.ready_slots == 768 and pool.available_size() == 768
    # Two whole steps pinned, the failed one taken back.
    assert recorder.bytes() == 768 * 16 * 4
    assert pool_pinning.step_ends(pool) is not None


def test_destroy_stops_the_background_steps_first(pinned_pools) -> None:
    recorder = Recorder(free_calls=4)
    pool = pinned_pools(recorder)
    pinning = pool_pinning.pinning_of(pool)
    destroyer = threading.Thread(target=pool.destroy)
    destroyer.start()
    recorder.go.set()
    destroyer.join(10)
    assert not destroyer.is_alive() and pinning.wait(0)
    assert pool.kv_buffer is None
    assert not pinning.done


def test_a_first_step_that_fails_leaves_sglang_to_pin_the_pool(pinned_pools) -> None:
    before = fallbacks()
    pool = pinned_pools(Recorder(fail_on=2))
    assert pool_pinning.pinning_of(pool) is None
    assert pinned_pools.stock_registered == [(pool.kv_buffer.data_ptr(), None)]
    assert pool.available_size() == SIZE
    assert fallbacks().get("host_pool_stock:RuntimeError", 0) == (
        before.get("host_pool_stock:RuntimeError", 0) + 1
    )


def test_a_release_that_keeps_its_ranges_elsewhere_pins_the_pool_itself(
    pinned_pools, monkeypatch
) -> None:
    """kvcore reads where SGLang keeps a buffer's registered ranges from SGLang's own
    module: without that name, destroy() could not unregister kvcore's steps, so nothing is
    registered in steps and SGLang pins the pool as it would."""
    monkeypatch.delattr(common, "_CUDA_HOST_REGISTERED_RANGES_ATTR")
    recorder = Recorder()
    before = fallbacks()
    pool = pinned_pools(recorder)
    assert pool_pinning.pinning_of(pool) is None and recorder.ranges == {}
    assert pinned_pools.stock_registered == [(pool.kv_buffer.data_ptr(), None)]
    assert fallbacks().get("host_pool_stock:AttributeError", 0) == (
        before.get("host_pool_stock:AttributeError", 0) + 1
    )


def test_a_layout_without_a_slot_dimension_is_pinned_whole_by_sglang(pinned_pools) -> None:
    pool = pinned_pools(Recorder(), layout="page_first_direct")
    assert pool_pinning.pinning_of(pool) is None
    assert [ptr for ptr, _ in pinned_pools.stock_registered] == [pool.kv_buffer.data_ptr()]


def test_a_first_share_past_the_pool_pins_it_whole_before_sglang_goes_on(pinned_pools) -> None:
    recorder = Recorder()
    pool = pinned_pools(recorder, kind="mla", first=1 << 10)
    pinning = pool_pinning.pinning_of(pool)
    assert pinning.done and len(pinning.steps) == 1
    buffer = pool.kv_buffer
    assert recorder.ranges == {buffer.data_ptr(): buffer.numel() * buffer.element_size()}
    assert pool.available_size() == SIZE
    # One registration a part: no run of slots can cross two.
    assert pool_pinning.step_ends(pool) is None


def test_the_plugin_registers_the_pinning_hooks_only_under_the_setting(
    sglang_hooks, monkeypatch
) -> None:
    monkeypatch.setenv("KVCORE_HOST_POOL_PIN_FIRST", "4GiB")
    status = sglang_hooks()
    assert set(guard.PINNING_TARGETS) <= set(status.patched_targets)


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({}, None),
        ({"dcp_size": 2}, "decode context parallel"),
        ({"pin_memory": False}, "does not pin"),
        ({"allocator": object()}, "storage backend"),
    ],
)
def test_what_leaves_a_pool_pinned_whole(changes: dict[str, Any], reason: str | None) -> None:
    pool = object.__new__(MHATokenToKVPoolHost)
    attributes = {"pin_memory": True, "allocator": common.HostTensorAllocator(), "dcp_size": 1}
    pool.__dict__.update(attributes | changes)
    found = pool_pinning._pinned_whole(pool, 1 << 30)
    assert found is None if reason is None else reason in found
    assert pool_pinning._pinned_whole(pool, 0) == "KVCORE_HOST_POOL_PIN_FIRST is 0"


class SteppedRecorder(Recorder):
    """Registers the first step's 4 ranges at once, then one range per release."""

    def __init__(self) -> None:
        super().__init__()
        self.releases = threading.Semaphore(0)

    def register(self, ptr: int, nbytes: int) -> None:
        if self.calls >= 4:
            assert self.releases.acquire(timeout=10)
        super().register(ptr, nbytes)


def test_churn_while_steps_land_keeps_exact_accounting(pinned_pools) -> None:
    recorder = SteppedRecorder()
    pool = pinned_pools(recorder)
    pinning = pool_pinning.pinning_of(pool)
    rng = torch.Generator().manual_seed(11)
    held: list[torch.Tensor] = []
    for ready in STEP_ENDS:
        deadline = time.monotonic() + 10
        while pool.available_size() + sum(len(h) for h in held) < ready:
            assert time.monotonic() < deadline, "a step's slots never reached the pool"
            time.sleep(0.01)
        for _ in range(40):
            if held and int(torch.randint(0, 3, (1,), generator=rng)) == 0:
                pool.free(held.pop(int(torch.randint(0, len(held), (1,), generator=rng))))
                continue
            taken = pool.alloc(PAGE * int(torch.randint(1, 5, (1,), generator=rng)))
            if taken is not None:
                held.append(taken)
        used = torch.cat(held).tolist() if held else []
        assert len(used) == len(set(used)) and all(slot < ready for slot in used)
        assert pool.available_size() == ready - len(used)
        assert sorted(pool.free_slots.tolist()) == sorted(set(range(ready)) - set(used))
        assert int(pool.slot_used.sum()) == len(used)
        for _ in range(4):  # the next step's four ranges
            recorder.releases.release()
    assert pinning.wait(10) and pinning.done
