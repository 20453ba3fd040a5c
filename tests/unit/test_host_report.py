"""kvcore.host_report: doctor's view of host memory for pinned pools, on fake hosts."""

from __future__ import annotations

import json
import mmap

import pytest

from kvcore import host_report, numa
from kvcore.cli import _describe_estimate, main

PAGE = mmap.PAGESIZE


def test_available_memory_is_read_from_meminfo(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  1000 kB\nMemFree:  300 kB\nMemAvailable:  512 kB\n")
    monkeypatch.setattr(host_report, "MEMINFO", meminfo)
    assert host_report.available_bytes() == 512 * 1024
    meminfo.write_text("MemTotal:  1000 kB\n")
    assert host_report.available_bytes() is None
    monkeypatch.setattr(host_report, "MEMINFO", tmp_path / "missing")
    assert host_report.available_bytes() is None


def test_topology_lists_each_node_with_its_cpus(tmp_path, monkeypatch):
    node_dir = tmp_path / "devices" / "system" / "node"
    for node, cpus in ((0, "0-3"), (1, "")):
        (node_dir / f"node{node}").mkdir(parents=True)
        (node_dir / f"node{node}" / "cpulist").write_text(cpus + "\n")
    (node_dir / "online").write_text("0-1\n")
    monkeypatch.setattr(numa, "SYSFS", tmp_path)
    assert host_report.topology() == {
        "nodes": [{"node": 0, "cpus": 4}, {"node": 1, "cpus": 0}],
        "gpu_nodes": [],
    }


class FakeRegistrar:
    """Registers instantly and counts what it was given and given back."""

    def __init__(self) -> None:
        self.registered: list[int] = []
        self.addresses: list[int] = []
        self.unregistered: list[int] = []

    def register(self, address: int, nbytes: int) -> None:
        assert address % PAGE == 0 and nbytes % PAGE == 0
        self.registered.append(nbytes)
        self.addresses.append(address)

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)


def test_an_estimate_scales_the_sample_to_the_pool_and_unregisters_it():
    registrar = FakeRegistrar()
    estimate = host_report.pin_estimate(
        64 * 16 * PAGE, sample_bytes=16 * PAGE, threads=2, registrar=registrar
    )
    # A one-page warm-up, then kvcore's sample and the engines' way, each given back.
    assert registrar.registered == [PAGE, 16 * PAGE, 16 * PAGE]
    assert registrar.unregistered == registrar.addresses
    assert estimate["threads"] == 2 and estimate["pool_bytes"] == 64 * 16 * PAGE
    assert estimate["fault_gib_per_s"] > 0 and estimate["register_gib_per_s"] > 0
    assert estimate["kvcore_seconds"] > 0 and estimate["stock_seconds"] is not None
    assert estimate["kvcore_usable_seconds"] is None
    assert estimate["vllm_region_usable_seconds"] is None


def _estimate_with_a_first_share() -> dict:
    """A 64-sample pool's estimate with one sample as its first share."""
    return host_report.pin_estimate(
        64 * 16 * PAGE,
        sample_bytes=16 * PAGE,
        threads=2,
        registrar=FakeRegistrar(),
        first_bytes=16 * PAGE,
    )


def test_a_first_share_is_usable_after_the_faulting_and_its_own_registration():
    estimate = _estimate_with_a_first_share()
    fault_s = estimate["pool_bytes"] / (estimate["fault_gib_per_s"] * (1 << 30))
    register_s = 16 * PAGE / (estimate["register_gib_per_s"] * (1 << 30))
    assert estimate["kvcore_usable_seconds"] == pytest.approx(fault_s + register_s, rel=1e-6)
    assert estimate["kvcore_usable_seconds"] < estimate["kvcore_seconds"]
    # vLLM's shared tier faults only the first share before it is usable: a 64th here.
    first_fault_s = fault_s / 64
    assert estimate["vllm_region_usable_seconds"] == pytest.approx(
        first_fault_s + register_s, rel=1e-6
    )


def test_the_sample_is_the_pool_up_to_a_cap_and_a_quarter_of_what_is_free():
    cap = host_report.SAMPLE_BYTES
    assert host_report.sample_size(cap * 8, None) == cap
    assert host_report.sample_size(512 << 20, None) == 512 << 20
    assert host_report.sample_size(cap * 8, 4 << 30) == 1 << 30
    assert host_report.sample_size(cap * 8, 1 << 20) == host_report.MIN_SAMPLE_BYTES
    assert host_report.sample_size((512 << 20) + 1, None) % PAGE == 0


def test_without_a_registrar_only_faulting_is_measured():
    estimate = host_report.pin_estimate(1 << 30, sample_bytes=16 * PAGE, threads=1)
    assert estimate["register_gib_per_s"] is None and estimate["stock_seconds"] is None
    assert estimate["kvcore_seconds"] > 0


def test_doctor_reports_the_host_and_estimates_a_pool_asked_about(capsys, monkeypatch):
    monkeypatch.setattr(host_report, "SAMPLE_BYTES", 16 * PAGE)
    monkeypatch.setattr(host_report, "MIN_SAMPLE_BYTES", 16 * PAGE)
    assert main(["doctor", "--json", "--pool-gib", "0.5"]) == 0
    host = json.loads(capsys.readouterr().out)["host"]
    assert host["usable_cpus"] >= 1 and host["nodes"]
    assert host["pin_estimate"]["pool_bytes"] == 1 << 29
    assert main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("host ") and "usable CPUs" in line for line in lines)
    assert not any(line.startswith("pin ") for line in lines)
    monkeypatch.setattr(host_report, "available_bytes", lambda: 1 << 30)
    assert main(["doctor", "--pool-gib", "2"]) == 0
    [pin] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("pin ")]
    assert pin.startswith("pin 2 GiB") and "more than the 1 GiB available" in pin


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "lots"])
def test_doctor_refuses_a_pool_size_that_is_no_size(capsys, value):
    assert main(["doctor", "--pool-gib", value]) == 2
    assert "not a positive number of GiB" in capsys.readouterr().err


def test_doctor_says_when_each_engines_pool_is_usable_with_a_first_share():
    estimate = _estimate_with_a_first_share()
    text = _describe_estimate(estimate)
    assert "KVCORE_HOST_POOL_PIN_FIRST" in text
    assert f"SGLang's pool usable after about {estimate['kvcore_usable_seconds']:.0f} s" in text
    assert f"shared tier after about {estimate['vllm_region_usable_seconds']:.1f} s" in text
    assert "pinned" not in _describe_estimate({**estimate, "kvcore_usable_seconds": None})
