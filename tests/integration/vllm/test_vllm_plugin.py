"""The vLLM plugin and its version guard, against the installed vLLM."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM installed (ci/install_vllm.sh)")

from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
from vllm_support import SHAPE, name, spec_args, spec_selection

import kvcore_vllm
from kvcore.config import KVCoreConfig
from kvcore.fingerprint import package_root
from kvcore_vllm import guard, patched, plugin
from kvcore_vllm.manager import KVCoreCPUOffloadingManager
from kvcore_vllm.spec import KVCoreCPUOffloadingSpec

pytestmark = pytest.mark.vllm

OVERRIDDEN = [
    f"vllm.v1.kv_offload.cpu.manager.{SHAPE.qualname(qualname)}"
    for qualname in (
        "CPUOffloadingManager._get_num_free_chunks",
        "CPUOffloadingManager._allocate_chunks",
        "CPUOffloadingManager._free_chunk",
        "CPUOffloadingManager.reset_cache",
    )
] + [
    "vllm.v1.kv_offload.cpu.spec.CPUOffloadingSpec.get_manager",
    "vllm.v1.kv_offload.cpu.spec.CPUOffloadingSpec.create_worker",
]
ENABLED = KVCoreConfig(enable={"vllm"})


@pytest.fixture(autouse=True)
def fresh_process_state(monkeypatch):
    """Each test starts as a process that has not loaded the plugin, and leaves none behind:
    the test fails unless the plugin's uninstall puts back every factory entry it found."""
    monkeypatch.setattr(OffloadingSpecFactory, "_registry", dict(OffloadingSpecFactory._registry))
    monkeypatch.delenv("KVCORE_ENABLE", raising=False)
    found = dict(OffloadingSpecFactory._registry)
    with plugin.INSTALLATION.set_aside():
        yield
    changed = {
        name
        for name in found.keys() | OffloadingSpecFactory._registry.keys()
        if OffloadingSpecFactory._registry.get(name) is not found.get(name)
    }
    assert not changed, f"uninstall left these factory entries changed: {sorted(changed)}"


def _default_spec() -> type:
    return OffloadingSpecFactory.get_spec_cls(spec_selection({}))


def _installed_release() -> str:
    status = kvcore_vllm.status(ENABLED)
    assert status.version is not None
    return status.version.split("+", 1)[0]


@pytest.mark.parametrize("value", [None, "", "0", "sglang"])
def test_inactive_unless_kvcore_enable_names_vllm(monkeypatch, caplog, value):
    if value is not None:
        monkeypatch.setenv("KVCORE_ENABLE", value)
    registry = dict(OffloadingSpecFactory._registry)
    with caplog.at_level(logging.WARNING):
        plugin.register()
        plugin.register()
    assert OffloadingSpecFactory._registry == registry
    assert _default_spec() is CPUOffloadingSpec
    assert "KVCoreCPUOffloadingSpec" not in OffloadingSpecFactory._registry
    assert caplog.records == []
    status = kvcore_vllm.status()
    assert not status.enabled and status.patched_targets == []


@pytest.mark.parametrize("value", ["vllm", "1", "sglang,vllm"])
def test_enabled_plugin_selects_kvcore_spec_and_is_idempotent(monkeypatch, caplog, value):
    monkeypatch.setenv("KVCORE_ENABLE", value)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            plugin.register()
    assert caplog.records == []
    assert _default_spec() is KVCoreCPUOffloadingSpec
    assert issubclass(KVCoreCPUOffloadingSpec, CPUOffloadingSpec)
    explicit = OffloadingSpecFactory.get_spec_cls(
        spec_selection({"spec_name": "KVCoreCPUOffloadingSpec"})
    )
    assert explicit is KVCoreCPUOffloadingSpec
    tiering = OffloadingSpecFactory.get_spec_cls(
        spec_selection({"spec_name": "TieringOffloadingSpec"})
    )
    assert tiering is TieringOffloadingSpec
    spec = OffloadingSpecFactory.create_spec(*spec_args({"cpu_bytes_to_use": 1 << 20}))
    assert isinstance(spec.get_manager(), KVCoreCPUOffloadingManager)
    status = kvcore_vllm.status()
    assert status.active and status.skipped_targets == []
    assert status.patched_targets == [plugin.REGISTRY_TARGET, *OVERRIDDEN]
    assert status.plugin_applied and status.would_patch == status.patched_targets
    assert status.summary().endswith("7 patched in this process, 0 skipped")


def test_uninstall_puts_the_factory_back_as_it_was_found(monkeypatch):
    OffloadingSpecFactory._registry.pop("KVCoreCPUOffloadingSpec", None)
    found = dict(OffloadingSpecFactory._registry)
    monkeypatch.setenv("KVCORE_ENABLE", "vllm")
    plugin.register()
    assert _default_spec() is KVCoreCPUOffloadingSpec
    plugin.uninstall()
    assert OffloadingSpecFactory._registry == found and _default_spec() is CPUOffloadingSpec
    assert not kvcore_vllm.status(ENABLED).plugin_applied
    plugin.uninstall()  # twice: nothing more to put back
    assert OffloadingSpecFactory._registry == found
    plugin.register()  # and in again, as a fresh activation
    assert _default_spec() is KVCoreCPUOffloadingSpec
    plugin.uninstall()
    assert OffloadingSpecFactory._registry == found


class StandIn:
    """A worker or a handler: any object the installation can refer to weakly, as to vLLM's."""


def test_uninstall_restores_every_original_object_and_installs_again(monkeypatch):
    """Every target install touches (the factory's entries, as activation and a patched
    source write them, and a worker's handlers) holds its original object again after
    uninstall, and a second install after it changes them all again."""
    OffloadingSpecFactory._registry.pop(plugin.SPEC_NAME, None)
    stock_loader = OffloadingSpecFactory._registry[plugin.DEFAULT_SPEC_NAME]
    worker = StandIn()
    worker._store_handler, worker._load_handler = StandIn(), StandIn()
    stock_handlers = vars(worker).copy()
    monkeypatch.setenv("KVCORE_ENABLE", "vllm")
    for _ in range(2):
        plugin.register()
        assert patched.hook(plugin.REGISTRY_TARGET, stock_loader) is plugin.load_spec
        kvcore_handlers = {attribute: StandIn() for attribute in stock_handlers}
        for attribute, handler in kvcore_handlers.items():
            plugin.INSTALLATION.replace_handler(worker, attribute, handler)
        registry = OffloadingSpecFactory._registry
        assert registry[plugin.DEFAULT_SPEC_NAME] is plugin.load_spec
        assert registry[plugin.SPEC_NAME] is plugin.load_spec
        assert vars(worker) == kvcore_handlers
        assert patched.hooked_targets() == (plugin.REGISTRY_TARGET,)
        assert kvcore_vllm.status(ENABLED).plugin_applied
        plugin.uninstall()
        assert registry[plugin.DEFAULT_SPEC_NAME] is stock_loader
        assert plugin.SPEC_NAME not in registry
        assert all(getattr(worker, a) is held for a, held in stock_handlers.items())
        assert patched.hooked_targets() == ()
        assert not kvcore_vllm.status(ENABLED).plugin_applied


@pytest.mark.parametrize(("transfers", "said"), [("0", "off"), ("1", "on")])
def test_activation_is_one_info_line_naming_what_is_active(monkeypatch, caplog, transfers, said):
    monkeypatch.setenv("KVCORE_ENABLE", "vllm")
    monkeypatch.setenv("KVCORE_TRANSFERS", transfers)
    caplog.set_level(logging.INFO, logger="kvcore")
    for _ in range(3):
        plugin.register()
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("kvcore")]
    version = kvcore_vllm.status().version
    assert lines == [
        f"kvcore: active in vLLM {version} (pid {os.getpid()}): {1 + len(OVERRIDDEN)} targets "
        f"patched; transfers {said}, serve rule on"
    ]


def test_a_stock_share_is_warned_of_once_and_shown_in_the_status(monkeypatch, caplog):
    monkeypatch.setenv("KVCORE_ENABLE", "vllm")
    monkeypatch.setenv("KVCORE_STOCK_SHARE", "0.5")
    caplog.set_level(logging.INFO, logger="kvcore")
    for _ in range(3):
        plugin.register()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("kvcore: KVCORE_STOCK_SHARE=0.5:")
    assert kvcore_vllm.status().settings == {
        "transfers": True,
        "serve_rule": True,
        "host_pool": True,
        "stock_share": 0.5,
    }


def test_status_before_loading_reports_nothing_patched_and_the_guard_passing():
    status = kvcore_vllm.status(ENABLED)
    assert status.active
    assert status.patched_targets == [] and status.skipped_targets == []
    assert status.would_patch == [plugin.REGISTRY_TARGET, *OVERRIDDEN]
    assert not status.plugin_applied
    assert _default_spec() is CPUOffloadingSpec


def test_recorded_fingerprints_match_the_installed_vllm():
    release = _installed_release()
    assert release in guard.SUPPORTED_VERSIONS
    assert guard.current_fingerprints(release) == guard.FINGERPRINTS[release]
    assert guard.refusals(release) == {}


def test_guard_refuses_a_changed_fingerprint_with_one_warning(caplog):
    release = _installed_release()
    changed = {release: dict(guard.FINGERPRINTS[release])}
    target = SHAPE.qualname("CPUOffloadingManager._allocate_chunks")
    changed[release][target] = "0" * 64
    registry = dict(OffloadingSpecFactory._registry)
    with caplog.at_level(logging.WARNING, logger="kvcore"):
        status = plugin.activate(ENABLED, changed)
        again = plugin.activate(ENABLED, changed)
    assert OffloadingSpecFactory._registry == registry
    assert _default_spec() is CPUOffloadingSpec
    assert status.patched_targets == []
    full_name = f"vllm.v1.kv_offload.cpu.manager.{target}"
    assert [s["target"] for s in status.skipped_targets] == [full_name]
    assert status.skipped_targets[0]["reason"].startswith("source changed")
    assert again == status
    # The status reports what activation decided, and beside it the guard's verdict on the
    # recorded table, which the installed vLLM passes.
    reported = kvcore_vllm.status(ENABLED).to_dict()
    assert reported.pop("would_patch") == [plugin.REGISTRY_TARGET, *OVERRIDDEN]
    expected = status.to_dict()
    expected.pop("would_patch")
    reported.pop("guard_seconds")
    expected.pop("guard_seconds")
    assert reported == expected
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "vLLM runs stock" in warnings[0].getMessage()
    assert full_name in warnings[0].getMessage()


def test_guard_refuses_a_release_without_fingerprints(caplog):
    with caplog.at_level(logging.WARNING, logger="kvcore"):
        status = plugin.activate(ENABLED, {})
    assert _default_spec() is CPUOffloadingSpec
    assert len(status.skipped_targets) == len(guard.TARGETS)
    assert all("no fingerprints recorded" in s["reason"] for s in status.skipped_targets)
    assert len(caplog.records) == 1


def test_guard_refuses_a_target_whose_source_changed(tmp_path):
    installed = package_root("vllm")
    release = _installed_release()
    for module in {t.module for t in guard.targets_for(release)}:
        relative = Path(*module.split(".")).with_suffix(".py")
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(installed / relative, tmp_path / relative)
    assert guard.refusals(release, root=tmp_path) == {}
    manager = tmp_path / "vllm/v1/kv_offload/cpu/manager.py"
    original = manager.read_text(encoding="utf-8")
    reused = f"{name('chunks')}.append({name('ChunkStatus')}(self._free_list.pop()))"
    edited = original.replace(reused, reused.replace("pop()", "pop(0)"))
    assert edited != original
    manager.write_text(edited, encoding="utf-8")
    reasons = guard.refusals(release, root=tmp_path)
    allocate = SHAPE.qualname("CPUOffloadingManager._allocate_chunks")
    assert list(reasons) == [f"vllm.v1.kv_offload.cpu.manager.{allocate}"]


def test_vllm_plugin_loader_runs_the_entry_point(tmp_path, monkeypatch):
    import vllm.plugins

    dist_info = tmp_path / "kvcore_entry_probe-0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvcore-entry-probe\n")
    (dist_info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nkvcore_entry_probe = kvcore_vllm.plugin:register\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("VLLM_PLUGINS", "kvcore_entry_probe")
    monkeypatch.setenv("KVCORE_ENABLE", "vllm")
    for _ in range(2):
        monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
        vllm.plugins.load_general_plugins()
    assert _default_spec() is KVCoreCPUOffloadingSpec
    assert kvcore_vllm.status().patched_targets == [plugin.REGISTRY_TARGET, *OVERRIDDEN]


def test_kvcore_distribution_declares_the_entry_point():
    from importlib.metadata import entry_points

    declared = [
        ep
        for ep in entry_points(group="vllm.general_plugins")
        if ep.dist is not None and ep.dist.name == "kvcore"
    ]
    if not declared:
        pytest.skip("kvcore is installed without its vllm.general_plugins entry point")
    assert [(ep.name, ep.value) for ep in declared] == [("kvcore", "kvcore_vllm.plugin:register")]


def test_a_bad_kvcore_setting_leaves_vllm_stock_and_says_so(monkeypatch, caplog):
    monkeypatch.setenv("KVCORE_ENABLE", "vllm")
    monkeypatch.setenv("KVCORE_GATHER_CTAS", "many")
    with caplog.at_level(logging.ERROR, logger="kvcore"):
        plugin.register()
        plugin.register()
    assert _default_spec() is CPUOffloadingSpec
    [record] = caplog.records
    assert record.exc_info is None  # no traceback
    message = record.getMessage()
    assert message.startswith("kvcore: KVCORE_GATHER_CTAS='many': not an integer; ")
    assert message.endswith("unset KVCORE_GATHER_CTAS for the default (8); vLLM runs stock")


def test_a_handler_without_weak_references_is_still_replaced_and_restored():
    from kvcore_vllm.installation import Installation

    class Worker:
        __slots__ = ("_store_handler",)

    class Handler:
        __slots__ = ()

    worker, original, mine = Worker(), Handler(), Handler()
    worker._store_handler = original
    installation = Installation()
    installation.replace_handler(worker, "_store_handler", mine)
    assert worker._store_handler is mine
    installation.uninstall()
    assert worker._store_handler is original
