"""The vendored SGLang patches against the installed SGLang: drift, apply/revert, a patched import.

The patched tree is a mirror of the installed package: symlinks, except the files the
patch set changes (and the directories on their way), which are copies. The installed
SGLang is never written to.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.mem_cache.pool_host", reason="needs SGLang installed")

from sglang.srt.plugins.hook_registry import HookRegistry

from kvcore.patching import apply as apply_module
from kvcore.patching.apply import FileState
from kvcore.patching.generate import drift, generate
from kvcore.patching.patchset import DEFAULT_PATCHES_DIR, load_set
from kvcore.patching.tree import EngineTree, find_tree
from kvcore_sglang import guard, host_slots, patched
from tests.support.patch_mirror import patched_file_hashes, released_mirror

pytestmark = pytest.mark.sglang

SPEC = patched.PATCH_SPEC
INSTALLED = find_tree(SPEC, None)
PATCH_SET, SET_DIR = load_set(DEFAULT_PATCHES_DIR, "sglang", INSTALLED.version)
HERE = Path(__file__).resolve().parent
ALLOC = f"{guard.HOST_KV_CACHE}.alloc"


@pytest.fixture
def mirrored(tmp_path: Path) -> EngineTree:
    return released_mirror(INSTALLED, PATCH_SET, SET_DIR, tmp_path)


def test_committed_patch_set_is_current(mirrored):
    """The CI drift check for this release: regenerated from the adapter, byte-identical."""
    assert drift(generate(SPEC, mirrored), DEFAULT_PATCHES_DIR) == []


def test_patch_set_hooks_every_recorded_target():
    hooked = {t for f in PATCH_SET.files for t in f.targets}
    groups = guard.EVERY_GROUP
    depended_on = {t for targets in guard.DEPENDENCIES.values() for t in targets}
    assert hooked == set(guard.FINGERPRINTS[INSTALLED.version]) - depended_on
    assert hooked == {t for targets in groups.values() for t in targets}
    assert set(guard.ALLOCATOR_TARGETS) <= hooked


@pytest.mark.parametrize("use_program", [False, True], ids=["python", "patch-program"])
def test_apply_then_revert_restores_the_installed_bytes(mirrored, use_program):
    if use_program and shutil.which("patch") is None:
        pytest.skip("needs patch(1)")
    installed = patched_file_hashes(INSTALLED, PATCH_SET)
    before = patched_file_hashes(mirrored, PATCH_SET)
    assert before == {f.path: f.pristine_sha256 for f in PATCH_SET.files}
    assert apply_module.apply(PATCH_SET, SET_DIR, mirrored, use_program=use_program) == list(before)
    assert {r.state for r in apply_module.check(PATCH_SET, mirrored)} == {FileState.APPLIED}
    apply_module.revert(PATCH_SET, SET_DIR, mirrored, use_program=use_program)
    assert patched_file_hashes(mirrored, PATCH_SET) == before
    assert patched_file_hashes(INSTALLED, PATCH_SET) == installed


def test_hook_follows_kvcore_enable(hooks_recorded_apart, monkeypatch):
    def original(pool, need_size):
        return "stock"

    saved = set(HookRegistry._patched)
    HookRegistry._patched.clear()  # a patched lane's import claimed the targets already
    try:
        monkeypatch.setenv("KVCORE_ENABLE", "0")
        assert patched.hook(ALLOC, original) is original
        monkeypatch.setenv("KVCORE_ENABLE", "vllm")
        assert patched.hook(ALLOC, original) is original
        assert ALLOC not in HookRegistry._patched
        monkeypatch.delenv("KVCORE_ENABLE")
        monkeypatch.setenv("KVCORE_TRANSFERS", "0")
        transfer = guard.TRANSFER_TARGETS[0]
        assert patched.hook(transfer, original) is original
        hooked = patched.hook(ALLOC, original)
        assert getattr(hooked, patched.PATCH_MARK) == ALLOC
        assert ALLOC in HookRegistry._patched
        assert patched.hook(ALLOC, hooked) is hooked  # a reloaded module is not hooked twice
        assert patched.hooked_targets() == (ALLOC,)

        class NotServed:
            pass

        # A pool kvcore does not serve goes through the adapter's hook to the stock method.
        assert host_slots.slots_of(NotServed()) is None
        assert hooked(NotServed(), 16) == "stock"
    finally:
        HookRegistry._patched.clear()
        HookRegistry._patched.update(saved)


def test_plugin_loaded_before_the_patched_module_does_not_hook_again(
    sglang_hooks, hooks_recorded_apart
):
    """The other order (the patched tree's run covers patch first): the plugin registers its
    hooks, then the patched module binds its own, then SGLang applies the registry."""
    from sglang.srt.mem_cache.pool_host.base import HostKVCache

    from kvcore_sglang import plugin

    plugin.load()
    assert all(HookRegistry._hooks.get(t) for t in guard.ALLOCATOR_TARGETS)
    for name in host_slots.HOOKS:
        target = f"{guard.HOST_KV_CACHE}.{name}"
        setattr(HostKVCache, name, patched.hook(target, vars(HostKVCache)[name]))
    bound = {name: vars(HostKVCache)[name] for name in host_slots.HOOKS}
    HookRegistry.apply_hooks()
    assert {name: vars(HostKVCache)[name] for name in host_slots.HOOKS} == bound
    assert all(getattr(f, patched.PATCH_MARK) for f in bound.values())


_PATCHED_RUN = """
import json, os, sys
sys.path[:0] = [{here!r}]
import conftest  # SGLang imports torchvision; the lane's stub stands in for it
from sglang.srt.mem_cache.pool_host import base
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang_pools import mha_host
from kvcore_sglang import guard, host_slots, patched, plugin

def attribute(target):
    module, qualname = guard.split_target(target)
    owner_name, name = qualname.rsplit(".", 1)
    owner = sys.modules.get(module) or __import__(module, fromlist=["_"])
    return vars(getattr(owner, owner_name))[name]

targets = {targets!r}
pool = mha_host(256, 16)
report = {{
    "file": base.__file__,
    "marks": {{t: getattr(attribute(t), patched.PATCH_MARK, None) for t in targets}},
    "hooked": list(patched.hooked_targets()),
    "served": host_slots.slots_of(pool) is not None,
}}
slots = pool.alloc(64)
report["allocated"] = sorted(slots.tolist())
report["free_after"] = [host_slots.slots_of(pool).available_size(), pool.logical_size]
before = {{t: attribute(t) for t in targets}}
os.environ["KVCORE_ENABLE"] = "sglang"
plugin.load()
HookRegistry.apply_hooks()
status = plugin.applied_status()
report["plugin_patched"] = status.patched_targets
report["plugin_skipped"] = [s["target"] for s in status.skipped_targets]
report["registered"] = {{t: len(HookRegistry._hooks.get(t, [])) for t in targets}}
report["unchanged"] = all(attribute(t) is before[t] for t in targets)
print(json.dumps(report))
"""


def test_patched_tree_imports_hooked_and_the_plugin_does_not_hook_again(mirrored):
    apply_module.apply(PATCH_SET, SET_DIR, mirrored)
    targets = sorted(t for f in PATCH_SET.files for t in f.targets)
    env = {key: value for key, value in os.environ.items() if not key.startswith("KVCORE_")} | {
        "KVCORE_TRANSFERS": "1",
        # Every group on, so that every target of the set is hooked.
        "KVCORE_HOST_POOL_PIN_FIRST": "1GiB",
        "PYTHONPATH": os.pathsep.join([str(mirrored.root), str(HERE)]),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    script = _PATCHED_RUN.format(here=str(HERE), targets=targets)
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["file"].startswith(str(mirrored.root))
    # Patched mode is on with KVCORE_ENABLE unset: every target carries the patch's hook.
    assert report["marks"] == {t: t for t in targets}
    assert sorted(report["hooked"]) == targets
    assert report["served"]
    assert report["allocated"] == list(range(64))  # one contiguous run from kvcore's allocator
    free_after, size = report["free_after"]
    assert free_after == size - 64
    # The plugin, enabled on top, passes the guard on the patched tree and registers its
    # hooks, but SGLang's registry leaves the patched targets as the patch bound them.
    assert set(report["plugin_patched"]) == set(targets)
    assert not set(report["plugin_skipped"]) & set(targets)
    assert report["registered"] == dict.fromkeys(targets, 1)
    assert report["unchanged"]
