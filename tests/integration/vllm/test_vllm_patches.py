"""The vendored vLLM patches against the installed vLLM: drift, apply/revert, a patched import.

The patched tree is a mirror of the installed package: symlinks, except the files the
patch set changes (and the directories on their way), which are copies. The installed
vLLM is never written to.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM installed (ci/install_vllm.sh)")


from kvcore.patching import apply as apply_module
from kvcore.patching.apply import FileState
from kvcore.patching.generate import drift, generate
from kvcore.patching.patchset import DEFAULT_PATCHES_DIR, load_set
from kvcore.patching.tree import EngineTree, find_tree
from kvcore_vllm import patched, plugin
from tests.support.patch_mirror import patched_file_hashes, released_mirror

pytestmark = pytest.mark.vllm

SPEC = patched.PATCH_SPEC
INSTALLED = find_tree(SPEC, None)
PATCH_SET, SET_DIR = load_set(DEFAULT_PATCHES_DIR, "vllm", INSTALLED.version)


@pytest.fixture
def mirrored(tmp_path: Path) -> EngineTree:
    return released_mirror(INSTALLED, PATCH_SET, SET_DIR, tmp_path)


def test_committed_patch_set_is_current(mirrored):
    """The CI drift check for this release: regenerated from the adapter, byte-identical."""
    assert drift(generate(SPEC, mirrored), DEFAULT_PATCHES_DIR) == []


def test_patch_set_hooks_the_plugins_registry_entry():
    assert [t for f in PATCH_SET.files for t in f.targets] == [plugin.REGISTRY_TARGET]


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


def test_hook_follows_kvcore_enable(monkeypatch):
    def stock_loader() -> type:
        raise AssertionError("not called")

    # Set aside: a patched lane's import hooked already.
    with plugin.INSTALLATION.set_aside():
        for value in ("0", "sglang"):
            monkeypatch.setenv("KVCORE_ENABLE", value)
            assert patched.hook(plugin.REGISTRY_TARGET, stock_loader) is stock_loader
        assert patched.hooked_targets() == ()
        # A target the adapter does not hook stays as it is, whatever the setting.
        monkeypatch.delenv("KVCORE_ENABLE")
        assert patched.hook("vllm.v1.Other.thing", stock_loader) is stock_loader
        assert patched.hooked_targets() == ()


_PATCHED_RUN = """
import json, os
from vllm.v1.kv_offload import factory
from kvcore.config import KVCoreConfig
from kvcore_vllm import patched, plugin

registry = factory.OffloadingSpecFactory._registry
report = {
    "file": factory.__file__,
    "hooked": list(patched.hooked_targets()),
    "default_loader_is_kvcore": registry["CPUOffloadingSpec"] is plugin.load_spec,
    "names": sorted(registry),
}
names = sorted(registry)
status = plugin.activate(KVCoreConfig(enable=frozenset({"vllm"})))
report["plugin_patched"] = status.patched_targets
report["plugin_skipped"] = status.skipped_targets
report["registry_unchanged"] = sorted(registry) == names
report["still_kvcore"] = registry["CPUOffloadingSpec"] is plugin.load_spec
print(json.dumps(report))
"""


def test_patched_tree_imports_hooked_and_the_plugin_changes_nothing_more(mirrored):
    apply_module.apply(PATCH_SET, SET_DIR, mirrored)
    env = {key: value for key, value in os.environ.items() if not key.startswith("KVCORE_")} | {
        "PYTHONPATH": str(mirrored.root),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    done = subprocess.run(
        [sys.executable, "-c", _PATCHED_RUN], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["file"].startswith(str(mirrored.root))
    # Patched mode is on with KVCORE_ENABLE unset: the default spec is kvcore's.
    assert report["hooked"] == [plugin.REGISTRY_TARGET]
    assert report["default_loader_is_kvcore"]
    # Loading the spec itself (the plugin's loader) is the plugin tests' business, and
    # costs this lane another import of vLLM's offloading stack.
    assert plugin.SPEC_NAME in report["names"]
    # The plugin, enabled on top, passes the guard on the patched tree; its change is
    # the one already made.
    assert report["plugin_skipped"] == []
    assert plugin.REGISTRY_TARGET in report["plugin_patched"]
    assert report["registry_unchanged"] and report["still_kvcore"]
