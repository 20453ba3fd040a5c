"""Version guard: which SGLang releases kvcore patches, and the source it expects to find.

Every function kvcore hooks, and every SGLang function the hooks' code calls, is
fingerprinted from its source (:mod:`kvcore.fingerprint`). Targets are patched in
groups (a group's functions share state, so replacing part of it would split that
state); a changed fingerprint of a group's target, or of a function the group depends
on, skips the whole group.

Only the standard library and kvcore's core are imported here.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvcore import fingerprint

HOST_KV_CACHE = "sglang.srt.mem_cache.pool_host.base.HostKVCache"

ALLOCATOR_GROUP = "host-slot allocator"
ALLOCATOR_TARGETS: tuple[str, ...] = tuple(
    f"{HOST_KV_CACHE}.{name}" for name in ("clear", "available_size", "alloc", "free")
)
TARGET_GROUPS: dict[str, tuple[str, ...]] = {ALLOCATOR_GROUP: ALLOCATOR_TARGETS}

_POOL_HOST = "sglang.srt.mem_cache.pool_host"
TRANSFER_GROUP = "host-pool transfers"
TRANSFER_TARGETS: tuple[str, ...] = tuple(
    f"{_POOL_HOST}.{pool}.{method}"
    for pool in ("mha.MHATokenToKVPoolHost", "mla.MLATokenToKVPoolHost")
    for method in ("load_to_device_per_layer", "backup_from_device_all_layer")
)
_DSA_POOL = f"{_POOL_HOST}.dsa.DSAIndexerPoolHost"
DSA_TRANSFER_GROUP = "DSA indexer transfers"
DSA_TRANSFER_TARGETS: tuple[str, ...] = tuple(
    f"{_DSA_POOL}.{method}"
    for method in ("load_to_device_per_layer", "backup_from_device_all_layer")
)
# With the ``kernel`` io backend SGLang moves the host indices to the GPU here; the hook
# keeps the CPU tensor it was given, so that the transfer hooks can plan from it.
INDEX_MEMO_GROUP = "kernel io backend host indices"
INDEX_MEMO_TARGETS: tuple[str, ...] = (
    "sglang.srt.managers.cache_controller.HiCacheController.move_indices",
)
# Once SGLang has built an MHA or MLA host pool, kvcore warms its copy paths up for the
# pool's rows (kvcore_sglang.pool_warm_up), so that no first-use cost lands on a request.
WARM_UP_GROUP = "transfer warm-up"
WARM_UP_TARGETS: tuple[str, ...] = tuple(
    f"{_POOL_HOST}.{pool}.__init__"
    for pool in ("mha.MHATokenToKVPoolHost", "mla.MLATokenToKVPoolHost")
)
# Checked and registered only when the transfer hooks are asked for (see plugin). The
# groups share no state, so a changed DSA method leaves the MHA and MLA hooks in place,
# and without the index memo ``kernel`` calls simply run stock.
TRANSFER_GROUPS: dict[str, tuple[str, ...]] = {
    TRANSFER_GROUP: TRANSFER_TARGETS,
    DSA_TRANSFER_GROUP: DSA_TRANSFER_TARGETS,
    INDEX_MEMO_GROUP: INDEX_MEMO_TARGETS,
    WARM_UP_GROUP: WARM_UP_TARGETS,
}

# SGLang's default host allocation, faulted in by kvcore (kvcore_sglang.host_memory).
# Checked and registered only under KVCORE_HOST_POOL (see plugin).
HOST_MEMORY_GROUP = "host pool memory"
HOST_MEMORY_TARGET = f"{_POOL_HOST}.common.HostTensorAllocator.allocate"
HOST_MEMORY_GROUPS: dict[str, tuple[str, ...]] = {HOST_MEMORY_GROUP: (HOST_MEMORY_TARGET,)}

# SGLang's MHA and MLA host pools pinned in steps (kvcore_sglang.pool_pinning). Checked and
# registered only under KVCORE_HOST_POOL_PIN_FIRST, and only with the host-slot allocator's
# group: that allocator is what hands out pinned slots alone.
PINNING_GROUP = "host pool pinning"
PINNING_TARGETS: tuple[str, ...] = (
    *(
        f"{_POOL_HOST}.{pool}.init_kv_buffer"
        for pool in ("mha.MHATokenToKVPoolHost", "mla.MLATokenToKVPoolHost")
    ),
    f"{HOST_KV_CACHE}.destroy",
)
PINNING_GROUPS: dict[str, tuple[str, ...]] = {PINNING_GROUP: PINNING_TARGETS}

EVERY_GROUP: dict[str, tuple[str, ...]] = {
    **TARGET_GROUPS,
    **TRANSFER_GROUPS,
    **HOST_MEMORY_GROUPS,
    **PINNING_GROUPS,
}
"""Every group the plugin may hook, in the order it registers them."""

_REGISTER = "sglang.srt.plugins.hook_registry.HookRegistry.register"
# Uninstalling applies another plugin's hooks again on a target kvcore shared with it.
_APPLY = "sglang.srt.plugins.hook_registry.HookRegistry.apply_hooks"
# SGLang functions a group's hooks call (tests.support.stock_uses finds them; a test requires each
# here): checked with the group, never hooked. The plugin registers every hook through
# HookRegistry.register; the layer helpers are those kvcore_sglang.pool_jobs asks which
# layer a pool holds and where (HostKVCache's for MHA and MLA, the DSA pool's own).
DEPENDENCIES: dict[str, tuple[str, ...]] = {
    ALLOCATOR_GROUP: (_REGISTER, _APPLY),
    TRANSFER_GROUP: (
        _REGISTER,
        _APPLY,
        *(
            f"{HOST_KV_CACHE}.{name}"
            for name in ("_host_layer_index", "_is_device_layer_owned", "_is_device_layer_sharded")
        ),
    ),
    DSA_TRANSFER_GROUP: (
        _REGISTER,
        _APPLY,
        *(
            f"{_DSA_POOL}.{name}"
            for name in ("_draft_host_layer", "_host_layer_index", "_is_device_layer_owned")
        ),
        f"{HOST_KV_CACHE}._is_device_layer_sharded",
    ),
    INDEX_MEMO_GROUP: (_REGISTER, _APPLY),
    WARM_UP_GROUP: (_REGISTER, _APPLY),
    # The mapping kvcore's hook stands in for, and the caller that registers what it returns.
    HOST_MEMORY_GROUP: (
        _REGISTER,
        _APPLY,
        "sglang.srt.mem_cache.storage.mmap.mmap_allocator.alloc_mmap",
        f"{_POOL_HOST}.common.alloc_with_host_register",
    ),
    # The buffer's allocation and registration that the hooks turn off and stand in for,
    # the unregistration that reads kvcore's ranges, and the constructor that builds the
    # buffer before it makes the pool's lock and calls clear().
    PINNING_GROUP: (
        _REGISTER,
        _APPLY,
        f"{_POOL_HOST}.common.alloc_with_host_register",
        f"{_POOL_HOST}.common._cuda_host_register",
        f"{_POOL_HOST}.common._cuda_host_unregister",
        f"{HOST_KV_CACHE}._allocate_host_buffer",
        f"{HOST_KV_CACHE}.__init__",
    ),
}

# Target -> fingerprint per tested release, one data file per release
# (kvcore_sglang/fingerprints/RELEASE.json):
# ``python -m kvcore_sglang.guard [ROOT]`` prints it.
FINGERPRINTS: dict[str, dict[str, str]] = fingerprint.recorded_releases("kvcore_sglang")


@dataclass(frozen=True)
class Skipped:
    target: str
    reason: str


@dataclass(frozen=True)
class GuardResult:
    """Targets whose source matches the recorded fingerprint, and those skipped with why."""

    patchable: tuple[str, ...]
    skipped: tuple[Skipped, ...]


def fingerprint_target(target: str) -> str:
    """Fingerprint of the installed source of ``target``, a dotted ``module.Class.function``.

    The text comes from the module's file, so a target already wrapped by a hook still
    reads as the engine's own source.
    """
    return fingerprint.fingerprint_target(target)


def split_target(target: str) -> tuple[str, str]:
    """``(module, qualname)`` of a dotted target whose qualname starts at the first capital."""
    parts = target.split(".")
    for i, part in enumerate(parts):
        if part[:1].isupper():
            return ".".join(parts[:i]), ".".join(parts[i:])
    raise ValueError(f"{target!r} names no class")


def check_targets(version: str, groups: dict[str, tuple[str, ...]] = TARGET_GROUPS) -> GuardResult:
    """Which targets of ``groups`` may be patched on SGLang ``version`` (a release string,
    no local label); a group's DEPENDENCIES are checked with it."""
    recorded = FINGERPRINTS.get(version)
    if recorded is None:
        tested = ", ".join(sorted(FINGERPRINTS))
        reason = f"SGLang {version} is not a tested version (tested: {tested})"
        every = (Skipped(t, reason) for group in groups.values() for t in group)
        return GuardResult((), tuple(every))
    patchable: list[str] = []
    skipped: list[Skipped] = []
    for group, targets in groups.items():
        changed = fingerprint.drift(recorded, targets=(*targets, *DEPENDENCIES.get(group, ())))
        if not changed:
            patchable.extend(targets)
            continue
        for target in targets:
            reason = changed.get(target) or (
                f"part of the {group} group, whose target {next(iter(changed))} changed"
            )
            skipped.append(Skipped(target, reason))
    return GuardResult(tuple(patchable), tuple(skipped))


def source_changes(version: str, root: Path | None = None) -> dict[str, str]:
    """Every target recorded for ``version`` -> why its source in ``root`` (the directory
    holding the ``sglang`` package; the installed one by default) differs."""
    return fingerprint.drift(FINGERPRINTS[version], root)


def recorded_targets(groups: Mapping[str, tuple[str, ...]]) -> tuple[str, ...]:
    """The hooked targets of ``groups`` and the functions they depend on, each once."""
    every = (t for group, hooked in groups.items() for t in (*hooked, *DEPENDENCIES[group]))
    return tuple(dict.fromkeys(every))


def main(argv: list[str] | None = None) -> int:
    """Print a release's fingerprint file, every target's fingerprint in its files: ``ROOT``
    is the directory that holds the ``sglang`` package (e.g. an unzipped wheel); the
    installed one by default."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1:
        print("usage: python -m kvcore_sglang.guard [ROOT]", file=sys.stderr)
        return 2
    root = Path(args[0]) if args else None
    targets = recorded_targets(EVERY_GROUP)
    return fingerprint.print_release_file(
        lambda: {target: fingerprint.fingerprint_target(target, root) for target in targets},
        "SGLang",
        "kvcore_sglang.guard",
    )


if __name__ == "__main__":
    raise SystemExit(main())
