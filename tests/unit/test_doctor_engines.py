"""`kvcore doctor` runs each adapter's version guard against fake installed engines.

A fake engine is a source tree with a stub definition of every function the adapter's
guard reads, plus distribution metadata at a chosen version; its package raises when
imported, so a doctor that imported the engine fails. The guard's recorded fingerprints
are replaced by the fake tree's own, so the tree matches until a test changes a file.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest

import kvcore_sglang
import kvcore_vllm
from kvcore import fingerprint
from kvcore.cli import doctor_report, format_doctor, main
from kvcore.config import KVCoreConfig
from kvcore.engine_status import EngineStatus
from kvcore_sglang import guard as sglang_guard
from kvcore_sglang import plugin as sglang_plugin
from kvcore_vllm import guard as vllm_guard
from kvcore_vllm import plugin as vllm_plugin

SGLANG_GROUPS = sglang_guard.EVERY_GROUP
# What doctor would patch by default: every group but the pinning one, which is off until
# KVCORE_HOST_POOL_PIN_FIRST asks for it.
SGLANG_DEFAULT_TARGETS = [
    t
    for group, targets in SGLANG_GROUPS.items()
    if group != sglang_guard.PINNING_GROUP
    for t in targets
]
SGLANG_CHECKED = sglang_guard.recorded_targets(SGLANG_GROUPS)
ALLOC = f"{sglang_guard.HOST_KV_CACHE}.alloc"
PREPARE_STORE = "vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager.prepare_store"


@pytest.fixture(autouse=True)
def clean_kvcore_env(monkeypatch):
    for name in list(sys.modules):
        if name.split(".")[0] in ("sglang", "vllm"):
            monkeypatch.delitem(sys.modules, name)
    for name in [n for n in os.environ if n.startswith("KVCORE_")]:
        monkeypatch.delenv(name)


def write_stubs(root: Path, targets: Iterable[str]) -> None:
    """A module file per target's module, with a stub for each target in it; each stub
    returns its own name, so every fingerprint differs."""
    modules: dict[Path, dict[str, list[str]]] = {}
    for target in targets:
        parts = target.split(".")
        split = next((i for i, p in enumerate(parts) if p[:1].isupper()), len(parts) - 1)
        path = root.joinpath(*parts[:split]).with_suffix(".py")
        owner = parts[split] if split < len(parts) - 1 else ""
        modules.setdefault(path, {}).setdefault(owner, []).append(parts[-1])
    for path, owners in modules.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = []
        for owner, names in owners.items():
            indent = "    " if owner else ""
            if owner:
                lines.append(f"class {owner}:")
            for name in names:
                self_arg = "self" if owner else ""
                lines += [
                    f"{indent}def {name}({self_arg}):",
                    f"{indent}    return {owner + '.' + name!r}",
                ]
        path.write_text("\n".join(lines) + "\n")


@pytest.fixture
def fake_engine(tmp_path, monkeypatch) -> Callable[[str, str, Iterable[str]], Path]:
    """Installs engine ``name`` at ``version`` with stubs of ``targets``; the source root."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def install(name: str, version: str, targets: Iterable[str]) -> Path:
        package = tmp_path / name
        package.mkdir()
        (package / "__init__.py").write_text("raise RuntimeError('the engine was imported')\n")
        write_stubs(tmp_path, targets)
        info = tmp_path / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        importlib.invalidate_caches()
        return tmp_path

    return install


@pytest.fixture
def fake_sglang(fake_engine, monkeypatch) -> Path:
    """SGLang 0.5.23 whose guarded functions match the recorded fingerprints."""
    root = fake_engine("sglang", "0.5.23", SGLANG_CHECKED)
    recorded = {t: fingerprint.fingerprint_target(t, root) for t in SGLANG_CHECKED}
    monkeypatch.setitem(sglang_guard.FINGERPRINTS, "0.5.23", recorded)
    return root


@pytest.fixture
def fake_vllm(fake_engine, monkeypatch) -> Iterator[Path]:
    """vLLM 0.33.0 whose guarded functions match the recorded fingerprints, in a process
    whose plugin has decided nothing yet."""
    root = fake_engine("vllm", "0.33.0", (t.name for t in vllm_guard.TARGETS))
    recorded = {
        t.qualname: fingerprint.fingerprint_target(t.name, root) for t in vllm_guard.TARGETS
    }
    monkeypatch.setitem(vllm_guard.FINGERPRINTS, "0.33.0", recorded)
    with vllm_plugin.INSTALLATION.set_aside():
        yield root


def change_source(root: Path, target: str) -> None:
    """Rewrites ``target``'s stub to return something else: a drifted fingerprint."""
    path, qualname = fingerprint.locate(target, root)
    text = path.read_text()
    assert f"return {qualname!r}" in text
    path.write_text(text.replace(f"return {qualname!r}", "return 'changed'"))


def engine_entry(report: dict, engine: str) -> dict:
    return next(e for e in report["engines"] if e["engine"] == engine)


def test_sglang_with_transfers_off_would_patch_every_allocator_target_alone(fake_sglang):
    status = kvcore_sglang.status(KVCoreConfig(enable={"sglang"}, transfers=False, host_pool=False))
    assert status.would_patch == list(sglang_guard.ALLOCATOR_TARGETS)
    assert status.patched_targets == [] and not status.plugin_applied
    assert status.skipped_targets == []
    assert status.groups_off == {
        **dict.fromkeys(sglang_guard.TRANSFER_GROUPS, "KVCORE_TRANSFERS=0"),
        sglang_guard.HOST_MEMORY_GROUP: "KVCORE_HOST_POOL=0",
        sglang_guard.PINNING_GROUP: "KVCORE_HOST_POOL_PIN_FIRST=0",
    }
    assert status.target_groups == {g: list(t) for g, t in SGLANG_GROUPS.items()}
    assert status.settings == {"transfers": False, "serve_rule": True, "host_pool": False}
    assert status.guard_seconds is not None and status.guard_seconds >= 0
    assert "sglang" not in sys.modules


def test_sglang_enabled_alone_would_patch_every_group(fake_sglang):
    status = kvcore_sglang.status(
        KVCoreConfig(enable={"sglang"}, serve_rule=False, host_pool_pin_first=1 << 30)
    )
    assert status.would_patch == [t for targets in SGLANG_GROUPS.values() for t in targets]
    assert status.groups_off == {} and status.skipped_targets == []
    assert status.settings == {
        "transfers": True,
        "serve_rule": False,
        "host_pool": True,
        "host_pool_pin_first": 1 << 30,
    }


def test_sglang_not_enabled_runs_no_guard(fake_sglang):
    status = kvcore_sglang.status(KVCoreConfig(enable={"vllm"}))
    assert status.installed and not status.enabled
    assert status.would_patch == [] and status.target_groups == {}
    assert status.guard_seconds is None


def test_sglang_drift_skips_the_group_by_function_name(fake_sglang):
    change_source(fake_sglang, ALLOC)
    config = KVCoreConfig(enable={"sglang"}, transfers=True)
    status = kvcore_sglang.status(config)
    skipped = {s["target"]: s for s in status.skipped_targets}
    assert set(skipped) == set(sglang_guard.ALLOCATOR_TARGETS)
    assert skipped[ALLOC]["reason"].startswith("source changed")
    assert {s["group"] for s in skipped.values()} == {sglang_guard.ALLOCATOR_GROUP}
    for target in set(sglang_guard.ALLOCATOR_TARGETS) - {ALLOC}:
        assert ALLOC in skipped[target]["reason"]
    # The other groups share no state with the allocator: still patched.
    assert set(status.would_patch) == {
        t
        for groups in (sglang_guard.TRANSFER_GROUPS, sglang_guard.HOST_MEMORY_GROUPS)
        for ts in groups.values()
        for t in ts
    }
    text = format_doctor(doctor_report(config))
    allocator_line = next(
        line for line in text.splitlines() if line.strip().startswith("host-slot allocator")
    )
    assert "would patch 0; skipped 4:" in allocator_line
    assert "HostKVCache.alloc: source changed" in allocator_line
    verbose = format_doctor(doctor_report(config), verbose=True)
    assert f"skipped {ALLOC}: source changed" in verbose


def test_sglang_missing_module_skips_its_group(fake_sglang):
    (fake_sglang / "sglang/srt/mem_cache/pool_host/dsa.py").unlink()
    status = kvcore_sglang.status(KVCoreConfig(enable={"sglang"}, transfers=True))
    skipped = {s["target"]: s["reason"] for s in status.skipped_targets}
    assert set(skipped) == set(sglang_guard.DSA_TRANSFER_TARGETS)
    for reason in skipped.values():
        assert "cannot read its source" in reason
    assert not set(sglang_guard.DSA_TRANSFER_TARGETS) & set(status.would_patch)
    assert set(sglang_guard.ALLOCATOR_TARGETS) <= set(status.would_patch)


def test_sglang_untested_version_skips_every_target(fake_engine):
    fake_engine("sglang", "0.5.99", SGLANG_CHECKED)
    status = kvcore_sglang.status(KVCoreConfig(enable={"sglang"}, transfers=False, host_pool=False))
    assert not status.supported and status.would_patch == []
    skipped = {s["target"]: s["reason"] for s in status.skipped_targets}
    assert set(skipped) == set(sglang_guard.ALLOCATOR_TARGETS)
    assert all("0.5.99 is not a tested version" in reason for reason in skipped.values())


def test_sglang_in_process_shows_patched_beside_would_patch(fake_sglang, monkeypatch):
    applied = EngineStatus(
        "sglang", "sglang", True, "0.5.23", True, ["0.5.22", "0.5.23"], True, plugin_applied=True
    )
    applied.patched_targets = list(sglang_guard.ALLOCATOR_TARGETS[:2])
    applied.skip("sglang.srt.mem_cache.pool_host.mamba.MambaPoolHost", "own allocator", "pools")
    monkeypatch.setattr(sglang_plugin.INSTALLATION, "status", applied)
    report = doctor_report(KVCoreConfig(enable={"sglang"}, transfers=False, host_pool=False))
    entry = engine_entry(report, "sglang")
    assert entry["plugin_applied"]
    assert entry["patched_targets"] == list(sglang_guard.ALLOCATOR_TARGETS[:2])
    assert entry["would_patch"] == list(sglang_guard.ALLOCATOR_TARGETS)
    # The plugin's own skips stand; the plugin's status is not changed by the doctor.
    assert [s["target"] for s in entry["skipped_targets"]] == [
        "sglang.srt.mem_cache.pool_host.mamba.MambaPoolHost"
    ]
    assert applied.would_patch == []
    text = format_doctor(report)
    assert "enabled: 2 patched in this process, 1 skipped" in text
    assert "host-slot allocator (4 targets): patched 2 in this process; would patch 4" in text
    assert "pools (1): MambaPoolHost: own allocator" in text


def test_vllm_would_patch_the_spec_group(fake_vllm):
    status = kvcore_vllm.status(KVCoreConfig(enable={"vllm"}))
    expected = vllm_plugin.spec_targets(status.version)
    assert status.would_patch == expected and len(expected) > 1
    assert status.would_patch[0] == vllm_plugin.REGISTRY_TARGET
    assert status.skipped_targets == [] and status.patched_targets == []
    assert status.target_groups == {vllm_plugin.SPEC_GROUP: expected}
    assert "vllm" not in sys.modules


def test_vllm_drifted_dependency_skips_everything_by_name(fake_vllm):
    change_source(fake_vllm, PREPARE_STORE)
    config = KVCoreConfig(enable={"vllm"})
    status = kvcore_vllm.status(config)
    assert status.would_patch == []
    assert [s["target"] for s in status.skipped_targets] == [PREPARE_STORE]
    assert status.skipped_targets[0]["reason"].startswith("source changed")
    text = format_doctor(doctor_report(config), verbose=True)
    assert (
        "kvcore offloading spec (7 targets): would patch 0; skipped 1: "
        "CPUOffloadingManager.prepare_store: source changed"
    ) in text
    assert f"not patched {PREPARE_STORE}: source changed" in text


def test_doctor_text_groups_targets_and_verbose_lists_them(fake_sglang, capsys, monkeypatch):
    monkeypatch.setenv("KVCORE_ENABLE", "sglang")
    monkeypatch.setenv("KVCORE_TRANSFERS", "0")
    monkeypatch.setenv("KVCORE_HOST_POOL", "0")
    assert main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("sglang "))
    assert lines[start].endswith(
        "would patch 4, 0 skipped; transfers off, serve rule on, host pool off"
    )
    groups = lines[start + 1 : start + 1 + len(SGLANG_GROUPS)]
    assert groups[0].strip() == "host-slot allocator (4 targets): would patch 4, fingerprints match"
    assert groups[3].strip() == (
        "kernel io backend host indices (1 target): off (KVCORE_TRANSFERS=0), not checked"
    )
    assert lines[start + 1 + len(SGLANG_GROUPS)].startswith("vllm ")
    assert not any(ALLOC in line for line in lines)

    assert main(["doctor", "--verbose"]) == 0
    verbose = capsys.readouterr().out
    for target in sglang_guard.ALLOCATOR_TARGETS:
        assert f"would patch {target}\n" in verbose


def test_doctor_json_lists_would_patch(fake_sglang, capsys, monkeypatch):
    monkeypatch.setenv("KVCORE_ENABLE", "sglang")
    assert main(["doctor", "--json"]) == 0
    entry = engine_entry(json.loads(capsys.readouterr().out), "sglang")
    assert entry["would_patch"] == SGLANG_DEFAULT_TARGETS
    assert entry["patched_targets"] == [] and entry["plugin_applied"] is False
    assert entry["settings"] == {"transfers": True, "serve_rule": True, "host_pool": True}
