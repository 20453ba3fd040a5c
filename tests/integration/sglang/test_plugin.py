"""The sglang.srt.plugins entry point and the version guard, against the installed SGLang."""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import os

import pytest

pytest.importorskip("sglang.srt.mem_cache.pool_host", reason="needs SGLang installed")

from sglang.srt.mem_cache.pool_host import base
from sglang.srt.mem_cache.pool_host.base import HostKVCache
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang_pools import mha_host

import kvcore_sglang
from kvcore.engine_status import release_of
from kvcore.fingerprint import fingerprint_source
from kvcore_sglang import guard, host_slots, plugin

pytestmark = pytest.mark.sglang

ALLOC = f"{guard.HOST_KV_CACHE}.alloc"
VERSION = release_of(importlib.metadata.version("sglang"))


def our_hooks() -> dict[str, int]:
    return {t: len(HookRegistry._hooks.get(t, [])) for t in guard.ALLOCATOR_TARGETS}


# Collected before any test applies hooks.
STOCK_METHODS = {name: vars(HostKVCache)[name] for name in host_slots.HOOKS}


def is_stock(method_name: str) -> bool:
    return vars(HostKVCache)[method_name] is STOCK_METHODS[method_name]


def kvcore_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("kvcore") and r.levelname == "WARNING"]


@pytest.fixture(autouse=True)
def transfers_off(monkeypatch) -> None:
    """These tests cover the plugin's loading and its host-slot allocator, which
    KVCORE_TRANSFERS=0 and KVCORE_HOST_POOL=0 leave alone; test_transfers.py covers the
    transfer hooks and test_sglang_host_memory.py the host pool's, both on by default."""
    monkeypatch.setenv("KVCORE_TRANSFERS", "0")
    monkeypatch.setenv("KVCORE_HOST_POOL", "0")


@pytest.mark.parametrize("enable", [None, "0", "vllm"])
def test_inactive_unless_enabled_for_sglang(sglang_hooks, monkeypatch, enable):
    if enable is None:
        monkeypatch.delenv("KVCORE_ENABLE")
    else:
        monkeypatch.setenv("KVCORE_ENABLE", enable)
    assert sglang_hooks() is None
    assert our_hooks() == dict.fromkeys(guard.ALLOCATOR_TARGETS, 0)
    assert host_slots.slots_of(mha_host(256, 16)) is None
    status = kvcore_sglang.status()
    assert not status.enabled and status.patched_targets == []


def test_recorded_fingerprints_match_the_installed_release():
    result = guard.check_targets(VERSION)
    assert result.skipped == ()
    assert set(result.patchable) == set(guard.ALLOCATOR_TARGETS)


def test_enabled_plugin_patches_and_reports(sglang_hooks):
    status = sglang_hooks()
    assert status.active
    assert set(status.patched_targets) == set(guard.ALLOCATOR_TARGETS)
    skipped = {s["target"]: s["reason"] for s in status.skipped_targets}
    assert set(skipped) == set(host_slots.STOCK_POOLS)
    assert "own slot allocator" in skipped["sglang.srt.mem_cache.pool_host.mamba.MambaPoolHost"]
    # The adapter's status is the plugin's, with the guard's verdict now beside it.
    reported = kvcore_sglang.status()
    assert reported.plugin_applied and reported is not status
    assert reported.patched_targets == status.patched_targets
    assert reported.skipped_targets == status.skipped_targets
    assert reported.would_patch == list(guard.ALLOCATOR_TARGETS)
    assert host_slots.slots_of(mha_host(256, 16)) is not None


def test_activation_is_one_info_line_naming_what_is_active(sglang_hooks, caplog):
    caplog.set_level(logging.INFO, logger="kvcore")
    status = sglang_hooks()
    sglang_hooks()
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("kvcore")]
    assert lines == [
        f"kvcore: active in SGLang {status.version} (pid {os.getpid()}): "
        f"{len(guard.ALLOCATOR_TARGETS)} targets patched, {len(host_slots.STOCK_POOLS)} left "
        "stock; transfers off, serve rule on"
    ]


def test_loading_twice_registers_and_wraps_once(sglang_hooks):
    sglang_hooks()
    sglang_hooks()
    plugin.load()
    HookRegistry.apply_hooks()
    assert our_hooks() == dict.fromkeys(guard.ALLOCATOR_TARGETS, 1)
    for name in host_slots.HOOKS:
        # One AROUND wrapper directly over SGLang's own function.
        assert vars(HostKVCache)[name].__wrapped__ is STOCK_METHODS[name]
    pool = mha_host(256, 16)
    slots = pool.alloc(32)
    assert pool.free(slots) == 32 and pool.available_size() == pool.size


def test_guard_refuses_a_changed_fingerprint(sglang_hooks, monkeypatch, caplog):
    monkeypatch.setitem(
        guard.FINGERPRINTS, VERSION, {**guard.FINGERPRINTS[VERSION], ALLOC: "0" * 64}
    )
    caplog.set_level(logging.WARNING)
    status = sglang_hooks()
    assert status.patched_targets == []
    skipped = {s["target"]: s["reason"] for s in status.skipped_targets}
    assert set(skipped) == set(guard.ALLOCATOR_TARGETS)
    assert skipped[ALLOC].startswith("source changed")
    assert ALLOC in skipped[f"{guard.HOST_KV_CACHE}.free"]
    warnings = kvcore_warnings(caplog)
    assert len(warnings) == 1 and ALLOC in warnings[0].getMessage()
    assert all(is_stock(name) for name in host_slots.HOOKS)
    pool = mha_host(256, 16)
    assert host_slots.slots_of(pool) is None
    assert len(pool.free_slots) == pool.size, "the pool should run SGLang's own allocator"


def test_unknown_version_patches_nothing(sglang_hooks, monkeypatch, caplog):
    monkeypatch.setattr(plugin, "SUPPORTED_VERSIONS", ("0.0.1",))
    caplog.set_level(logging.WARNING)
    status = sglang_hooks()
    assert status is None or not status.active
    assert our_hooks() == dict.fromkeys(guard.ALLOCATOR_TARGETS, 0)
    warnings = kvcore_warnings(caplog)
    assert len(warnings) == 1 and "not a tested version" in warnings[0].getMessage()
    result = guard.check_targets("0.0.1")
    assert result.patchable == ()
    assert all("not a tested version" in s.reason for s in result.skipped)


def test_fingerprint_ignores_layout_but_not_code():
    source = inspect.getsource(base)
    original = fingerprint_source(source, "HostKVCache.alloc")
    assert original == guard.FINGERPRINTS[VERSION][ALLOC]
    reflowed = source.replace(
        "        if need_size > self.available_size():",
        "        # a comment\n\n        if need_size > self.available_size():   ",
    )
    assert fingerprint_source(reflowed, "HostKVCache.alloc") == original
    edited = source.replace("return select_index\n", "return select_index.clone()\n")
    assert edited != source
    assert fingerprint_source(edited, "HostKVCache.alloc") != original
    with pytest.raises(KeyError):
        fingerprint_source(source, "HostKVCache.no_such_method")


def test_sglang_load_plugins_runs_the_entry_point(sglang_hooks, monkeypatch):
    import sglang.srt.plugins as sglang_plugins

    entry_point = importlib.metadata.EntryPoint(
        name="kvcore", value="kvcore_sglang.plugin:load", group=sglang_plugins.GENERAL_PLUGINS_GROUP
    )
    monkeypatch.setattr(sglang_plugins, "entry_points", lambda group: [entry_point])
    monkeypatch.setattr(sglang_plugins, "_plugins_loaded", False)
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    sglang_plugins.load_plugins()
    assert set(kvcore_sglang.status().patched_targets) == set(guard.ALLOCATOR_TARGETS)
    assert all(not is_stock(name) for name in host_slots.HOOKS)
    assert host_slots.slots_of(mha_host(256, 16)) is not None


def test_a_bad_kvcore_setting_leaves_sglang_stock_with_one_line(sglang_hooks, monkeypatch, caplog):
    monkeypatch.setenv("KVCORE_GATHER_CTAS", "0")
    with caplog.at_level(logging.WARNING, logger="kvcore"):
        assert sglang_hooks() is None
        assert sglang_hooks() is None
    assert our_hooks() == dict.fromkeys(guard.ALLOCATOR_TARGETS, 0)
    assert all(is_stock(name) for name in host_slots.HOOKS)
    [record] = caplog.records
    assert record.exc_info is None  # no traceback
    message = record.getMessage()
    assert message.startswith("kvcore: KVCORE_GATHER_CTAS='0': out of range; ")
    assert message.endswith("unset KVCORE_GATHER_CTAS for the default (8); SGLang runs stock")
