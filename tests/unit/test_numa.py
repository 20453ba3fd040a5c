"""NUMA placement on CPU: fake sysfs trees, a recording mbind, real first-touch order."""

from __future__ import annotations

import ctypes
import errno
import importlib.util
import json
import logging
import mmap
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore import host_mapping, host_pinning, numa
from kvcore.bench import host_buffers
from kvcore.bench.host_buffers import allocate_host_buffer

PAGE = mmap.PAGESIZE


def fake_sysfs(
    root: Path,
    cpus: dict[int, str],
    *,
    online: str | None = None,
    pci: dict[str, str] | None = None,
) -> Path:
    """A sysfs tree with ``cpus`` (node -> cpulist) and PCI devices (bus id -> numa_node)."""
    node_dir = root / "devices" / "system" / "node"
    for node, cpulist in cpus.items():
        (node_dir / f"node{node}").mkdir(parents=True)
        (node_dir / f"node{node}" / "cpulist").write_text(cpulist + "\n")
    if online is not None:
        node_dir.mkdir(parents=True, exist_ok=True)
        (node_dir / "online").write_text(online + "\n")
    for bus_id, node_text in (pci or {}).items():
        device = root / "bus" / "pci" / "devices" / bus_id
        device.mkdir(parents=True)
        (device / "numa_node").write_text(node_text + "\n")
    return root


@pytest.fixture
def two_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = fake_sysfs(
        tmp_path,
        {0: "0-3,8-11", 1: "4-7,12-15"},
        online="0-1",
        pci={"0000:1b:00.0": "0", "0000:9c:00.0": "1", "0000:c1:00.0": "-1"},
    )
    monkeypatch.setattr(numa, "SYSFS", root)
    monkeypatch.setattr(numa.os, "sched_getaffinity", lambda _pid: set(range(16)))
    return root


@pytest.fixture
def one_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = fake_sysfs(tmp_path, {0: "0-15"}, online="0")
    monkeypatch.setattr(numa, "SYSFS", root)
    monkeypatch.setattr(numa, "_single_node_logged", False)
    return root


class FakeMbind:
    """Stands in for syscall(2); records each call, fails with ``error`` when set."""

    def __init__(self, error: int | None = None) -> None:
        self.error = error
        self.calls: list[dict[str, object]] = []

    def __call__(self, number, address, length, mode, mask, maxnode, flags) -> int:
        self.calls.append(
            {
                "number": number.value,
                "address": address.value,
                "length": length.value,
                "mode": mode.value,
                "mask": list(mask),
                "maxnode": maxnode.value,
                "flags": flags.value,
            }
        )
        if self.error is not None:
            ctypes.set_errno(self.error)
            return -1
        return 0


@pytest.fixture
def mbind(monkeypatch: pytest.MonkeyPatch) -> FakeMbind:
    fake = FakeMbind()
    monkeypatch.setattr(numa, "_syscall", lambda: fake)
    monkeypatch.setattr(numa.platform, "machine", lambda: "x86_64")
    return fake


class FakeRegistrar:
    def __init__(self, events: list[str] | None = None) -> None:
        self.events = events if events is not None else []
        self.registered: dict[int, int] = {}

    def register(self, ptr: int, nbytes: int) -> None:
        self.events.append("register")
        self.registered[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        del self.registered[ptr]


@pytest.fixture(autouse=True)
def unlimited_memlock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        host_pinning.resource, "getrlimit", lambda _: (host_pinning.resource.RLIM_INFINITY,) * 2
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", (0,)),
        ("0-3", (0, 1, 2, 3)),
        ("0-3,8-11\n", (0, 1, 2, 3, 8, 9, 10, 11)),
        ("4,2,2,0", (0, 2, 4)),
        ("0-10:4", (0, 4, 8)),
        ("", ()),
        ("\n", ()),
    ],
)
def test_parse_cpulist(text: str, expected: tuple[int, ...]) -> None:
    assert numa.parse_cpulist(text) == expected


@pytest.mark.parametrize("text", ["a", "3-1", "1-", "-1", "0-4:0", "1 2", "0x1"])
def test_parse_cpulist_refuses_garbage(text: str) -> None:
    with pytest.raises(ValueError, match="not a CPU list"):
        numa.parse_cpulist(text)


@settings(max_examples=150, deadline=None)
@given(st.sets(st.integers(0, 300), max_size=80))
def test_parse_cpulist_reads_back_kernel_style_ranges(cpus: set[int]) -> None:
    ordered = sorted(cpus)
    parts: list[str] = []
    start = 0
    while start < len(ordered):
        end = start
        while end + 1 < len(ordered) and ordered[end + 1] == ordered[end] + 1:
            end += 1
        first, last = ordered[start], ordered[end]
        parts.append(str(first) if first == last else f"{first}-{last}")
        start = end + 1
    assert numa.parse_cpulist(",".join(parts)) == tuple(ordered)


def test_nodes_and_cpus_from_a_two_node_tree(two_nodes: Path) -> None:
    assert numa.online_nodes() == (0, 1)
    assert numa.node_count() == 2
    assert numa.node_cpus(1) == (4, 5, 6, 7, 12, 13, 14, 15)
    with pytest.raises(numa.NumaError, match="node 2 does not exist"):
        numa.node_cpus(2)


def test_online_nodes_without_online_file_counts_node_dirs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(numa, "SYSFS", fake_sysfs(tmp_path, {0: "0-1", 2: "2-3"}))
    (tmp_path / "devices" / "system" / "node" / "nodeX").mkdir()
    assert numa.online_nodes() == (0, 2)


def test_host_without_node_information_counts_as_one_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(numa, "SYSFS", tmp_path)
    assert numa.online_nodes() == (0,)


def test_pci_numa_node(two_nodes: Path) -> None:
    assert numa.pci_numa_node("0000:9c:00.0") == 1
    assert numa.pci_numa_node("0000:9C:00.0") == 1
    assert numa.pci_numa_node("0000:1b:00.0") == 0
    assert numa.pci_numa_node("0000:c1:00.0") is None  # firmware says -1
    assert numa.pci_numa_node("0000:00:00.0") is None  # no such device


def fake_cuda(monkeypatch: pytest.MonkeyPatch, **ids: int) -> list[object]:
    asked: list[object] = []

    def properties(device: object) -> SimpleNamespace:
        asked.append(device)
        return SimpleNamespace(name="Fake GPU", **ids)

    monkeypatch.setattr(numa.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(numa.torch.cuda, "get_device_properties", properties)
    return asked


def test_cuda_device_to_bus_id_to_node(two_nodes: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked = fake_cuda(monkeypatch, pci_domain_id=0, pci_bus_id=0x9C, pci_device_id=0)
    assert numa.cuda_pci_bus_id(3) == "0000:9c:00.0"
    assert numa.cuda_numa_node(torch.device("cuda", 3)) == 1
    assert asked == [3, torch.device("cuda", 3)]


def test_cuda_node_is_unknown_without_bus_ids_or_cuda(
    two_nodes: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_cuda(monkeypatch, pci_bus_id=0x9C)
    assert numa.cuda_pci_bus_id(0) is None
    assert numa.cuda_numa_node(0) is None
    monkeypatch.setattr(numa.torch.cuda, "is_available", lambda: False)
    assert numa.cuda_numa_node(0) is None


def test_resolve_node(two_nodes: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, pci_domain_id=0, pci_bus_id=0x1B, pci_device_id=0)
    assert numa.resolve_node("off", 0) is None
    assert numa.resolve_node("auto", 0) == 0
    assert numa.resolve_node(1, 0) == 1
    assert numa.resolve_node(0, 0) == 0
    for bad in ("on", -1, True):
        with pytest.raises(numa.NumaError, match="'off', 'auto' or a node number"):
            numa.resolve_node(bad)


def test_auto_without_a_known_node_is_default_placement(
    two_nodes: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake_cuda(monkeypatch, pci_domain_id=0, pci_bus_id=0xC1, pci_device_id=0)
    with caplog.at_level(logging.INFO, logger="kvcore.numa"):
        assert numa.resolve_node("auto", 0) is None
    assert "no NUMA node known" in caplog.text


def test_placement_takes_the_node_cpus_this_process_may_use(
    two_nodes: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert numa.placement_for(1) == numa.Placement(1, (4, 5, 6, 7, 12, 13, 14, 15))
    monkeypatch.setattr(numa.os, "sched_getaffinity", lambda _pid: {0, 5, 13, 20})
    assert numa.placement_for(1) == numa.Placement(1, (5, 13))
    assert numa.placement_for(None) is None


def test_placement_on_a_node_without_usable_cpus_warns(
    two_nodes: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(numa.os, "sched_getaffinity", lambda _pid: {0, 1})
    with caplog.at_level(logging.WARNING, logger="kvcore.numa"):
        assert numa.placement_for(1) == numa.Placement(1, ())
    assert "no CPU this process may run on" in caplog.text


def test_placement_on_an_offline_node_is_an_error(two_nodes: Path) -> None:
    with pytest.raises(numa.NumaError, match=r"node 3 is not online.*online: 0, 1"):
        numa.placement_for(3)


def test_single_node_host_places_nothing_and_says_so_once(
    one_node: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kvcore.numa"):
        assert numa.placement_for(0) is None
        assert numa.placement_for(5) is None
    assert caplog.text.count("one NUMA node") == 1


@pytest.mark.parametrize(
    ("machine", "number"), [("x86_64", 237), ("aarch64", 235), ("ppc64le", 259)]
)
@pytest.mark.parametrize(("node", "word", "bit"), [(0, 0, 0), (5, 0, 5), (70, 1, 6)])
def test_bind_memory_passes_range_mode_and_node_mask(
    mbind: FakeMbind,
    monkeypatch: pytest.MonkeyPatch,
    machine: str,
    number: int,
    node: int,
    word: int,
    bit: int,
) -> None:
    monkeypatch.setattr(numa.platform, "machine", lambda: machine)
    assert numa.bind_memory(0x7F0000000000, 3 * PAGE, node, mode=numa.MPOL_BIND)
    (call,) = mbind.calls
    words = word + 1
    mask = [0] * words
    mask[word] = 1 << bit
    assert call == {
        "number": number,
        "address": 0x7F0000000000,
        "length": 3 * PAGE,
        "mode": numa.MPOL_BIND,
        "mask": mask,
        "maxnode": 64 * words + 1,
        "flags": 0,
    }


def test_bind_memory_prefers_by_default(mbind: FakeMbind) -> None:
    numa.bind_memory(PAGE, PAGE, 1)
    assert mbind.calls[0]["mode"] == numa.MPOL_PREFERRED == 1


@pytest.mark.parametrize(
    ("code", "said"),
    [
        (errno.ENOSYS, "no NUMA support"),
        (errno.EPERM, "CAP_SYS_NICE"),
        (errno.EINVAL, "cpuset"),
    ],
)
def test_host_refusals_warn_and_fall_back(
    mbind: FakeMbind, caplog: pytest.LogCaptureFixture, code: int, said: str
) -> None:
    mbind.error = code
    with caplog.at_level(logging.WARNING, logger="kvcore.numa"):
        assert numa.bind_memory(PAGE, PAGE, 1) is False
    assert said in caplog.text and "node 1" in caplog.text


def test_other_mbind_errors_raise(mbind: FakeMbind) -> None:
    mbind.error = errno.EFAULT
    with pytest.raises(OSError, match="mbind to NUMA node 1 failed"):
        numa.bind_memory(PAGE, PAGE, 1)


def test_unknown_architecture_binds_nothing(
    mbind: FakeMbind, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(numa.platform, "machine", lambda: "riscv64")
    with caplog.at_level(logging.WARNING, logger="kvcore.numa"):
        assert numa.bind_memory(PAGE, PAGE, 0) is False
    assert mbind.calls == [] and "riscv64" in caplog.text


def test_real_mbind_places_pages_touched_afterwards() -> None:
    """The real syscall on this host's node 0 (every Linux host has one)."""
    mapping = mmap.mmap(-1, 16 * PAGE)
    array = np.frombuffer(mapping, dtype=np.uint8)
    address = array.__array_interface__["data"][0]
    if not numa.bind_memory(address, array.size, 0):
        pytest.skip("mbind is refused on this host")
    array[::PAGE] = 7
    assert numa.pages_by_node(address, array.size) == {0: 16}
    (line,) = [
        text
        for text in Path("/proc/self/numa_maps").read_text().splitlines()
        if int(text.split()[0], 16) == address
    ]
    assert line.split()[1] == "prefer:0"
    del array
    mapping.close()


def test_pages_by_node_sums_the_mappings_inside_the_range(tmp_path: Path) -> None:
    maps = tmp_path / "numa_maps"
    maps.write_text(
        "7f0000000000 default anon=4 N0=4 kernelpagesize_kB=4\n"
        "7f0000100000 prefer:1 file=/dev/zero\\040(deleted) dirty=9 N0=2 N1=7\n"
        "7f0000200000 prefer:1 file=/dev/zero\\040(deleted) N1=5 kernelpagesize_kB=4\n"
        "7f0000300000 default anon=1 N1=1\n"
    )
    assert numa.pages_by_node(0x7F0000100000, 0x200000, maps) == {0: 2, 1: 12}
    assert numa.pages_by_node(0x7F0000100000, 0x200000, tmp_path / "absent") == {}


def test_restrict_thread_to_leaves_other_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, object]] = []
    monkeypatch.setattr(numa.os, "sched_setaffinity", lambda pid, cpus: calls.append((pid, cpus)))
    numa.restrict_thread_to(())
    numa.restrict_thread_to((2, 3))
    assert calls == [(0, (2, 3))]


def test_refused_affinity_warns_and_prefault_still_touches_every_page(
    caplog: pytest.LogCaptureFixture,
) -> None:
    array = np.full(6 * PAGE, 9, dtype=np.uint8)
    with caplog.at_level(logging.WARNING, logger="kvcore.numa"):
        # No such CPU: the kernel refuses.
        host_pinning.populate(array.ctypes.data, array.size, 3, cpus=(100_000,))
    assert (array == 9).all()
    assert "cannot run a pre-fault thread on CPUs [100000]" in caplog.text


@pytest.mark.parametrize("threads", [1, 4])
def test_prefault_threads_run_on_the_given_cpus_and_caller_keeps_its_own(
    monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    restricted: list[tuple[int, tuple[int, ...]]] = []
    monkeypatch.setattr(
        numa.os,
        "sched_setaffinity",
        lambda pid, cpus: restricted.append((threading.get_ident(), tuple(cpus))),
    )
    original = np.random.default_rng(threads).integers(1, 256, 9 * PAGE, dtype=np.uint8)
    array = original.copy()
    host_pinning.populate(array.ctypes.data, array.size, threads, cpus=(4, 5))
    # The pool starts threads as it needs them; each one runs the initializer first.
    assert 1 <= len(restricted) <= threads
    assert {cpus for _, cpus in restricted} == {(4, 5)}
    assert threading.get_ident() not in {ident for ident, _ in restricted}
    assert np.array_equal(array, original)


def recording_allocation(
    monkeypatch: pytest.MonkeyPatch, mbind: FakeMbind, events: list[str]
) -> list[tuple[int, object]]:
    """Records mbind, pre-fault (with its cpus) and registration in the order they happen."""
    prefaults: list[tuple[int, object]] = []
    real_populate = host_mapping.populate
    real_call = mbind.__call__

    def populate(address: int, nbytes: int, threads: int, *, cpus: Any = None) -> None:
        events.append("prefault")
        prefaults.append((address, cpus))
        real_populate(address, nbytes, threads, cpus=cpus)

    def syscall(*args: object) -> int:
        events.append("mbind")
        return real_call(*args)

    monkeypatch.setattr(host_mapping, "populate", populate)
    monkeypatch.setattr(numa, "_syscall", lambda: syscall)
    monkeypatch.setattr(numa.os, "sched_setaffinity", lambda pid, cpus: None)
    return prefaults


def test_pinned_buffer_is_bound_before_first_touch_then_registered(
    two_nodes: Path, mbind: FakeMbind, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    prefaults = recording_allocation(monkeypatch, mbind, events)
    registrar = FakeRegistrar(events)
    buf = allocate_host_buffer(
        5 * PAGE, pin=True, registrar=registrar, numa_node=1, register_chunk_bytes=2 * PAGE
    )
    assert events == ["mbind", "prefault", "register", "register", "register"]
    (call,) = mbind.calls
    base = buf.tensor.data_ptr()
    assert (call["address"], call["length"], call["mask"]) == (base, 5 * PAGE, [0b10])
    assert prefaults == [(base, (4, 5, 6, 7, 12, 13, 14, 15))]
    assert buf.numa_node == 1
    data = torch.randint(0, 256, (5 * PAGE,), dtype=torch.uint8)
    buf.tensor.copy_(data)
    assert torch.equal(buf.tensor, data)
    buf.close()


def test_refused_policy_still_places_by_first_touch_from_node_cpus(
    two_nodes: Path, mbind: FakeMbind, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    prefaults = recording_allocation(monkeypatch, mbind, events)
    mbind.error = errno.EPERM
    buf = allocate_host_buffer(PAGE, pin=True, registrar=FakeRegistrar(), numa_node=1)
    assert prefaults[0][1] == (4, 5, 6, 7, 12, 13, 14, 15) and buf.numa_node == 1
    buf.close()
    monkeypatch.setattr(numa.os, "sched_getaffinity", lambda _pid: {0})
    buf = allocate_host_buffer(PAGE, pin=True, registrar=FakeRegistrar(), numa_node=1)
    assert buf.numa_node is None  # neither the policy nor the threads could place it
    buf.close()


def test_no_node_means_no_placement(
    two_nodes: Path, mbind: FakeMbind, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefaults = recording_allocation(monkeypatch, mbind, [])
    buf = allocate_host_buffer(2 * PAGE, pin=True, registrar=FakeRegistrar())
    assert mbind.calls == [] and prefaults[0][1] is None and buf.numa_node is None
    buf.close()


def test_single_node_host_allocates_without_binding(
    one_node: Path, mbind: FakeMbind, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kvcore.numa"):
        buf = allocate_host_buffer(2 * PAGE, pin=True, registrar=FakeRegistrar(), numa_node=0)
    assert mbind.calls == [] and buf.numa_node is None
    assert "one NUMA node" in caplog.text
    buf.close()


def test_offline_node_fails_before_mapping(
    two_nodes: Path, mbind: FakeMbind, monkeypatch: pytest.MonkeyPatch
) -> None:
    registrar = FakeRegistrar()
    monkeypatch.setattr(
        host_buffers.mmap, "mmap", lambda *a: pytest.fail("mapped memory for an offline node")
    )
    with pytest.raises(numa.NumaError, match="node 4 is not online"):
        allocate_host_buffer(PAGE, pin=True, registrar=registrar, numa_node=4)
    assert registrar.events == [] and mbind.calls == []


def test_pageable_buffers_are_not_placed(
    two_nodes: Path, mbind: FakeMbind, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kvcore.bench.host_buffers"):
        buf = allocate_host_buffer(PAGE, pin=False, numa_node=1)
    assert mbind.calls == [] and buf.numa_node is None and "ignored" in caplog.text


@pytest.mark.parametrize(
    ("setting", "gpu_bus", "expected"),
    [("off", 0x9C, None), ("auto", 0x9C, 1), ("auto", 0x1B, 0), (0, 0x9C, 0), (1, 0x1B, 1)],
)
def test_a_resolved_setting_places_the_buffer_on_its_node(
    two_nodes: Path,
    mbind: FakeMbind,
    monkeypatch: pytest.MonkeyPatch,
    setting: str | int,
    gpu_bus: int,
    expected: int | None,
) -> None:
    asked = fake_cuda(monkeypatch, pci_domain_id=0, pci_bus_id=gpu_bus, pci_device_id=0)
    registrar = FakeRegistrar()
    prefaults = recording_allocation(monkeypatch, mbind, [])
    buf = allocate_host_buffer(
        5 * PAGE,
        pin=True,
        registrar=registrar,
        register_chunk_bytes=2 * PAGE,
        numa_node=numa.resolve_node(setting, 2),
    )
    assert buf.numa_node == expected
    assert sorted(registrar.registered.values()) == [PAGE, 2 * PAGE, 2 * PAGE]
    assert buf.segment_bytes == 2 * PAGE
    assert asked == ([2] if setting == "auto" else [])
    if expected is None:
        assert mbind.calls == [] and prefaults[0][1] is None
    else:
        assert mbind.calls[0]["mask"] == [1 << expected]
        assert prefaults[0][1] == numa.node_cpus(expected)
    buf.close()


@pytest.mark.parametrize(
    ("text", "expected"), [("off", "off"), ("AUTO", "auto"), (" 0 ", 0), ("7", 7), ("1023", 1023)]
)
def test_parse_setting(text: str, expected: object) -> None:
    assert numa.parse_setting(text) == expected


@pytest.mark.parametrize("text", ["on", "-1", "1024", "node1", "1.0", "yes", ""])
def test_parse_setting_refuses_other_values(text: str) -> None:
    with pytest.raises(numa.NumaError, match=r"allowed: off, auto .* node number from 0 to 1023"):
        numa.parse_setting(text)


# scripts/multi_gpu_bench.py: its logic on the CPU.

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "multi_gpu_bench.py"


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    # Imported by name from a path entry, so that spawned workers (which get this
    # process's sys.path) can import it too.
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        yield importlib.import_module(SCRIPT.stem)
    finally:
        sys.path.remove(str(SCRIPT.parent))
        sys.modules.pop(SCRIPT.stem, None)


class CountingBarrier:
    def __init__(self) -> None:
        self.waits = 0

    def wait(self, timeout: float | None = None) -> None:
        self.waits += 1


def one_rank(bench: ModuleType, tokens: int = 256) -> tuple[Any, CountingBarrier]:
    config = bench.BenchConfig("cpu", 1, tokens, 2, ("off", 0), "unused", 5.0)
    barrier = CountingBarrier()
    return bench.Worker(0, config, barrier), barrier


def test_one_rank_measures_every_scenario_exactly(bench: ModuleType) -> None:
    worker, barrier = one_rank(bench)
    report = worker.run()
    rounds = report["rounds"]
    assert [r["numa"] for r in rounds] == ["off", "0"]
    names = [s["scenario"] for s in rounds[0]["scenarios"]]
    assert len(names) == len(set(names)) == 8
    for scenario in (s for r in rounds for s in r["scenarios"]):
        assert scenario["identical"], scenario
        assert scenario["bytes"] == 2 * 256 * (4096 if "mha" in scenario["scenario"] else 1152)
        assert scenario["gbps"] > 0 and scenario["ceiling_gbps"] > 0
        assert scenario["started"] <= scenario["ended"]
        assert scenario["ceiling_together_started"] <= scenario["ceiling_together_ended"]
    # Per round: one before the buffer; per scenario one turn alone, one start of the
    # ceiling copy together and one start of the transfer together.
    assert barrier.waits == 2 * (1 + 8 * 3)


@pytest.mark.parametrize("fault", ["wrong_byte", "stray_row"])
def test_byte_check_catches_a_wrong_or_stray_row(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    worker, _ = one_rank(bench)
    real_execute = worker.mover.execute

    def faulty(plan: Any) -> None:
        real_execute(plan)
        rows = plan.dst.view(plan.dst.shape[0], -1)
        if fault == "wrong_byte":
            row = int(plan.dst_idx[len(plan.dst_idx) // 2])
        else:
            outside = torch.ones(plan.dst.shape[0], dtype=torch.bool)
            outside[plan.dst_idx] = False
            if not outside.any():
                return  # a page-in fills every device row: nothing stray to write
            row = int(outside.nonzero()[0])
        rows[row].view(torch.uint8)[0] += 1  # not an xor: repeats would undo it

    monkeypatch.setattr(worker.mover, "execute", faulty)
    scenarios = [s for r in worker.run()["rounds"] for s in r["scenarios"]]
    caught = {s["scenario"]: s["identical"] for s in scenarios}
    if fault == "wrong_byte":
        assert not any(caught.values())
    else:
        assert caught == {name: "/h2d/" in name for name in caught}


def test_summary_aggregates_over_the_wall_span_and_compares_rounds(bench: ModuleType) -> None:
    def scenario(started: float, ended: float, gbps: float, ceiling: float) -> dict[str, Any]:
        # The ceiling copy ran together 1 s before the transfer and took half as long.
        return {
            "ceiling_together_started": started - 1.0,
            "ceiling_together_ended": started - 1.0 + (ended - started) / 2,
            "scenario": "mha-4KiB/h2d/host-contiguous",
            "path": "single_copy",
            "bytes": 10**9,
            "gbps": gbps,
            "started": started,
            "ended": ended,
            "ceiling_gbps": ceiling,
            "alone_gbps": ceiling,
            "identical": True,
        }

    def rank(n: int, off: dict[str, Any], auto: dict[str, Any]) -> dict[str, Any]:
        return {
            "rank": n,
            "rounds": [
                {"numa": "off", "scenarios": [off]},
                {"numa": "auto", "scenarios": [auto]},
            ],
        }

    ranks = [
        rank(0, scenario(10.0, 10.05, 25.0, 50.0), scenario(20.0, 20.04, 25.0, 50.0)),
        rank(1, scenario(10.01, 10.1, 12.0, 40.0), scenario(20.01, 20.05, 25.0, 40.0)),
    ]
    off, auto = bench.summarise(ranks)
    assert off["aggregate_gbps"] == pytest.approx(2e9 / 0.1 / 1e9)
    assert off["n_x_ceiling_gbps"] == pytest.approx(90.0)
    assert off["share_of_n_x_ceiling"] == pytest.approx(20.0 / 90.0)
    assert off["per_gpu_gbps"] == [25.0, 12.0] and off["gpus"] == 2
    # rank 0's copy spans [9.0, 9.025], rank 1's [9.01, 9.055]: 2 GB in 0.055 s.
    assert off["ceiling_together_gbps"] == pytest.approx(2e9 / 0.055 / 1e9)
    assert off["share_of_ceiling_together"] == pytest.approx(0.055 / 0.1)
    assert auto["aggregate_gbps"] == pytest.approx(40.0)
    gain = bench.numa_gain([off, auto])
    assert gain == {"mha-4KiB/h2d/host-contiguous": pytest.approx(2.0)}
    ranks[1]["rounds"][0]["scenarios"][0]["identical"] = False
    assert not bench.summarise(ranks)[0]["identical"]


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--tokens", "100"], "multiple of 64"),
        (["--repeats", "0"], "at least 1"),
        (["--numa", "off,near"], "allowed: off, auto"),
    ],
)
def test_bench_arguments_are_checked(
    bench: ModuleType, capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert said in capsys.readouterr().err


def test_cpu_smoke_run_with_two_processes(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "multi.json"
    argv = ["--device", "cpu", "--tokens", "1024", "--repeats", "2", "--json", str(out)]
    assert bench.main(argv) == 0
    stdout = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["device"].startswith("2x cpu; ") and "NUMA node" in report["device"]
    assert report["numa_nodes"] == numa.node_count() and report["host_cpu"]
    assert sorted(rank["rank"] for rank in report["ranks"]) == [0, 1]
    assert len(report["summary"]) == 2 * 8
    assert {row["numa"] for row in report["summary"]} == {"off", "auto"}
    for row in report["summary"]:
        assert row["gpus"] == 2 and row["identical"] and row["aggregate_gbps"] > 0
        assert row["share_of_n_x_ceiling"] > 0
    assert len(report["numa_gain"]) == 8
    assert "N x ceil" in stdout and "numa=auto / numa=off" in stdout


def test_the_current_gpus_placement(two_nodes: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, pci_domain_id=0, pci_bus_id=0x9C, pci_device_id=0)
    monkeypatch.setattr(numa.torch.cuda, "current_device", lambda: 2)
    assert numa.current_gpu_placement() == numa.Placement(1, (4, 5, 6, 7, 12, 13, 14, 15))
    monkeypatch.setattr(numa, "online_nodes", lambda: (0, 2))
    assert numa.current_gpu_placement() is None  # node 1 is not online: default policy
    monkeypatch.setattr(numa.torch.cuda, "is_available", lambda: False)
    assert numa.current_gpu_placement() is None
