"""python -m benchmarks.sglang.host_cost on CPU: every call of a reload timed through
SGLang's real pools and kvcore's hook, first and later calls apart, and the profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.mem_cache.pool_host", reason="needs SGLang installed")

from benchmarks.sglang import host_cost, host_cost_phases
from kvcore import kernels

pytestmark = pytest.mark.sglang


def test_each_reload_call_is_timed_and_the_profile_has_both_kinds(tmp_path: Path) -> None:
    before = kernels.registered("cpu")
    out, profile = tmp_path / "cost.json", tmp_path / "profile.txt"
    argv = ["--device", "cpu", "--no-copy", "--tokens", "64,128", "--layers", "3"]
    argv += [
        "--requests",
        "2",
        "--cases",
        "mha/layer_first/kernel/p64",
        "mha/layer_first/direct/p64",
    ]
    profiling = ["--profile", str(profile), "--profile-tokens", "128", "--profile-cases"]
    profiling += ["mha/layer_first/kernel/p64", "mha/layer_first/direct/p64"]
    assert host_cost.main([*argv, "--json", str(out), *profiling]) == 0
    rows = json.loads(out.read_text())["rows"]
    # On a CPU only kvcore's side is timed, one row per request size.
    assert [(r["case"], r["side"], r["tokens"], r["layers"]) for r in rows] == [
        (case, "kvcore", tokens, 3)
        for case in ("mha/layer_first/kernel/p64", "mha/layer_first/direct/p64")
        for tokens in (64, 128)
    ]
    assert all(r["first_us"] > 0 and r["later_us"] > 0 for r in rows)
    assert all(r["paths"] for r in rows)  # kvcore served the calls (rule off)
    text = profile.read_text()
    assert "first calls of 2 requests" in text and "later calls of 2 requests" in text
    # Each case asked for, at the size asked for (not the first one).
    assert "kernel/p64 128 tokens: first calls" in text
    assert "direct/p64 128 tokens: first calls" in text
    # Per-request microseconds, not pstats' seconds (which round this path to 0.000).
    first_table = text.split("later calls")[0]
    assert "own us" in first_table and "transfers.py" in first_table
    totals = [float(line.split()[1]) for line in first_table.splitlines() if "transfers.py" in line]
    assert max(totals) > 1.0
    assert kernels.registered("cpu") is before  # the copy-free kernels are taken back


def test_with_the_rule_on_a_passing_reload_runs_its_later_layers_through_the_binding(
    tmp_path: Path,
) -> None:
    from benchmarks.sglang.hook_adapter import bench_adapter

    out = tmp_path / "cost.json"
    argv = ["--device", "cpu", "--no-copy", "--rule", "--tokens", "128,4096", "--layers", "4"]
    argv += ["--requests", "2", "--cases", "mha/layer_first/direct/p64", "--json", str(out)]
    assert host_cost.main(argv) == 0
    rows = {r["tokens"]: r for r in json.loads(out.read_text())["rows"]}
    # Direct page-64 reloads pass below 4k tokens: every later layer found stock bound on
    # the pool and nothing was served; from 4k kvcore serves each layer through its hook.
    assert rows[128]["bound_share"] == 1.0 and rows[128]["paths"] == []
    assert rows[4096]["bound_share"] == 0.0 and rows[4096]["paths"]
    assert not bench_adapter().bindings.passing  # the pools are gone, and their bindings with them


def test_with_no_copy_a_pass_runs_no_sglang_kernel_on_a_cpu(tmp_path: Path) -> None:
    # SGLang's kernel-backend copies exist only in its CUDA build: a pass reaching them on a
    # CPU would raise, so --no-copy lends the pools stand-ins for the run, and only for it.
    from sglang.srt.mem_cache.pool_host import mla

    def kernels_named() -> dict[str, object]:
        return {k: v for k, v in vars(mla).items() if k.startswith("transfer_kv_")}

    before = kernels_named()
    out, phases = tmp_path / "cost.json", tmp_path / "phases.txt"
    argv = ["--device", "cpu", "--no-copy", "--device-indices-unread", "--rule", "--tokens"]
    argv += ["16384", "--layers", "3", "--requests", "2", "--cases", "mla/layer_first/kernel/p1"]
    argv += ["--host-frag", "0%,100%", "--phases", str(phases), "--json", str(out)]
    assert host_cost.main(argv) == 0
    rows = {r["host_frag"]: r for r in json.loads(out.read_text())["rows"]}
    # Below 32k tokens token-granular MLA reloads pass, whatever their host slots.
    assert rows["0%"]["paths"] == [] and rows["100%"]["paths"] == []
    assert rows["0%"]["first_us"] > 0 and rows["100%"]["first_us"] > 0
    assert phases.read_text().count("host slots 100%") == 2
    assert kernels_named() == before


def test_phases_break_down_first_and_later_calls_at_each_host_level(tmp_path: Path) -> None:
    phases = tmp_path / "phases.txt"
    argv = ["--device", "cpu", "--no-copy", "--tokens", "128", "--layers", "3", "--requests"]
    argv += ["2", "--cases", "mla/layer_first/kernel/p1", "--host-frag", "0%,100%"]
    assert host_cost.main([*argv, "--phases", str(phases)]) == 0
    sections = phases.read_text().split("== ")[1:]
    titles = [s.splitlines()[0] for s in sections]
    assert [t.split(": ")[0] for t in titles] == [
        f"mla/layer_first/kernel/p1 128 tokens, host slots {level}"
        for level in ("0%", "0%", "100%", "100%")
    ]
    assert [t.split(": ")[1].split(" of ")[0] for t in titles] == ["first calls", "later calls"] * 2

    def calls(section: str, name: str) -> float:
        line = next(x for x in section.splitlines() if x.endswith(f" {name}"))
        return float(line.split()[1])

    plan = f"{host_cost_phases._PLANS}:first_plan"
    for first, later in (sections[0:2], sections[2:4]):
        # Per request: one first call that plans, two later calls that plan nothing.
        assert calls(first, "the whole call") == 1.0 and calls(later, "the whole call") == 2.0
        assert calls(first, plan) == 1.0 and calls(later, plan) == 0.0
        assert calls(later, f"{host_cost_phases._HOOKS}:later_layer_served") == 2.0


def test_device_indices_unread_plans_on_a_cpu_as_the_kernel_backend_does_on_a_gpu(
    tmp_path: Path,
) -> None:
    phases = tmp_path / "phases.txt"
    argv = ["--device", "cpu", "--no-copy", "--device-indices-unread", "--tokens", "128"]
    argv += ["--layers", "2", "--requests", "2", "--cases", "mla/layer_first/kernel/p1"]
    argv += ["--host-frag", "0%", "--phases", str(phases), "--json", str(tmp_path / "c.json")]
    assert host_cost.main(argv) == 0
    first = phases.read_text().split("later calls")[0]
    rows = [line.split() for line in first.splitlines() if ":" in line and "==" not in line]
    counts = {row[-1]: float(row[1]) for row in rows}
    assert counts[f"{host_cost_phases._PLANS}:plan_device_indexed_for"] == 1.0
    assert counts[f"{host_cost_phases._PLANS}:plan_for"] == 0.0
    (row,) = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert row["paths"] == ["staged"]
    with pytest.raises(SystemExit, match="for a CPU run"):
        host_cost.main(["--device", "cuda", "--device-indices-unread", "--tokens", "64"])


def test_device_indices_read_plans_whole_pages_by_dma_on_a_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on a GPU under KVCORE_SGLANG_DMA_IN_PLACE=1: pages of 64 MHA tokens go by DMA
    into place, where the same calls planned around their device indices are staged."""
    monkeypatch.setenv("KVCORE_SGLANG_DMA_IN_PLACE", "1")
    paths = {}
    for flag in ("--device-indices-read", "--device-indices-unread"):
        out = tmp_path / f"{flag}.json"
        argv = ["--device", "cpu", "--no-copy", flag, "--tokens", "1024", "--layers", "2"]
        argv += ["--requests", "2", "--cases", "mha/layer_first/kernel/p64"]
        argv += ["--host-frag", "100%", "--json", str(out)]
        assert host_cost.main(argv) == 0
        (row,) = json.loads(out.read_text())["rows"]
        paths[flag] = row["paths"]
    assert paths == {
        "--device-indices-read": ["batched_runs"],
        "--device-indices-unread": ["staged"],
    }
    both = ["--device", "cpu", "--device-indices-read", "--device-indices-unread"]
    with pytest.raises(SystemExit, match="give one of"):
        host_cost.main([*both, "--tokens", "64"])
