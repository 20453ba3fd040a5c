"""The adapters' fingerprint tables: every recorded target is checked, every checked one recorded.

The guards import no engine, so this runs without one; the engine lanes check the values
(tests/integration/*/) and that the tables cover what the adapters call.
"""

from __future__ import annotations

import re

import pytest

from kvcore_sglang import guard as sglang_guard
from kvcore_vllm import guard as vllm_guard

SGLANG_GROUPS = sglang_guard.EVERY_GROUP
SHA256 = re.compile(r"[0-9a-f]{64}")


@pytest.mark.parametrize("release", sorted(sglang_guard.FINGERPRINTS))
def test_sglang_records_exactly_the_targets_and_dependencies_of_its_groups(release):
    recorded = sglang_guard.FINGERPRINTS[release]
    assert set(recorded) == set(sglang_guard.recorded_targets(SGLANG_GROUPS))
    assert all(SHA256.fullmatch(value) for value in recorded.values())


def test_sglang_dependencies_belong_to_groups_and_are_never_hooked():
    assert set(sglang_guard.DEPENDENCIES) == set(SGLANG_GROUPS)
    hooked = {t for targets in SGLANG_GROUPS.values() for t in targets}
    depended_on = {t for targets in sglang_guard.DEPENDENCIES.values() for t in targets}
    assert not hooked & depended_on


@pytest.mark.parametrize("release", sorted(vllm_guard.FINGERPRINTS))
def test_vllm_records_exactly_its_targets(release):
    recorded = vllm_guard.FINGERPRINTS[release]
    qualnames = [t.qualname for t in vllm_guard.targets_for(release)]
    assert len(set(qualnames)) == len(qualnames)
    assert set(recorded) == set(qualnames)
    assert all(SHA256.fullmatch(value) for value in recorded.values())


SLOT_METHODS = "".join(
    f"    def {name}(self, *args):\n        return {i}\n\n"
    for i, name in enumerate(("clear", "available_size", "alloc", "free"))
)
FAKE_SGLANG = {
    "sglang/srt/mem_cache/pool_host/base.py": f"class HostKVCache:\n{SLOT_METHODS}",
    "sglang/srt/plugins/hook_registry.py": (
        "class HookRegistry:\n    def register(cls, target, hook):\n        pass\n\n"
        "    def apply_hooks(cls):\n        return None\n"
    ),
}


def test_sglang_a_changed_dependency_leaves_its_group_stock(monkeypatch, tmp_path):
    for relative, text in FAKE_SGLANG.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text, encoding="utf-8")
    monkeypatch.setattr(sglang_guard.fingerprint, "package_root", lambda package: tmp_path)
    group = sglang_guard.ALLOCATOR_GROUP
    checked = (*sglang_guard.ALLOCATOR_TARGETS, *sglang_guard.DEPENDENCIES[group])
    tested = {t: sglang_guard.fingerprint.fingerprint_target(t, tmp_path) for t in checked}
    monkeypatch.setattr(sglang_guard, "FINGERPRINTS", {"9.9.9": tested})
    assert sglang_guard.check_targets("9.9.9").patchable == sglang_guard.ALLOCATOR_TARGETS

    registry = tmp_path / "sglang/srt/plugins/hook_registry.py"
    registry.write_text(registry.read_text().replace("pass", "return hook"), encoding="utf-8")
    result = sglang_guard.check_targets("9.9.9")
    assert result.patchable == ()
    register = sglang_guard.DEPENDENCIES[group][0]
    assert register.endswith("HookRegistry.register")
    assert {s.target: s.reason for s in result.skipped} == dict.fromkeys(
        sglang_guard.ALLOCATOR_TARGETS,
        f"part of the {group} group, whose target {register} changed",
    )


def test_vllm_release_names_rename_targets_and_drop_fill_methods_it_lacks():
    current = {t.qualname for t in vllm_guard.targets_for("0.33.0")}
    pointers = {t.qualname for t in vllm_guard.TARGETS if t.pointers}
    assert pointers == {"resolve_device_pointers", "iter_pointer_groups"}
    own_region = {t.qualname for t in vllm_guard.TARGETS if t.own_region}
    assert own_region == {"pin_mmap_region"}
    shared_region = {t.qualname for t in vllm_guard.TARGETS if t.shared_region}
    assert shared_region == {"_get_populate_write_fn", "SharedOffloadRegion.__init__"}
    assert current == {t.qualname for t in vllm_guard.TARGETS} - pointers - own_region
    # 0.34 hands the handler device pointers: how the connector resolves them is a target.
    assert {t.qualname for t in vllm_guard.targets_for("0.34.0")} == current | pointers
    older = {t.qualname: t for t in vllm_guard.targets_for("0.25.1")}
    assert "CPUOffloadingManager._allocate_blocks" in older
    assert "BlockStatus.__init__" in older
    assert not any("chunk" in name.lower() for name in older)
    # 0.25 fills descriptors inside transfer_async, through the pointer function.
    assert not any(t.fill for t in older.values())
    assert {"SingleDirectionOffloadingHandler.transfer_async", "compute_sub_block_ptrs"} <= set(
        older
    )
    # Overriding is a fact of kvcore's classes, whatever the release calls the method.
    assert older["CPUOffloadingManager._free_block"].overridden
    # 0.25's worker takes kvcore's host mapping as a region: how it registers one is a target.
    assert "pin_mmap_region" in older
    fills = [t for t in vllm_guard.TARGETS if t.fill]
    # 0.25 maps no shared region of its own: how one faults itself in is no target there.
    assert not shared_region & set(older)
    assert len(fills) == 3 and len(older) == len(current) - len(fills) + len(own_region) - len(
        shared_region
    )


def test_vllm_unknown_release_refuses_every_target_by_its_current_name():
    reasons = vllm_guard.refusals("0.1.0", fingerprints={})
    assert set(reasons) == {t.name for t in vllm_guard.TARGETS}
