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

_REGISTER = "sglang.srt.plugins.hook_registry.HookRegistry.register"
# Uninstalling applies another plugin's hooks again on a target kvcore shared with it.
_APPLY = "sglang.srt.plugins.hook_registry.HookRegistry.apply_hooks"
# SGLang functions a group's hooks call (kvcore.stock_uses finds them; a test requires each
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
}

# Recorded from each release's files with ``python -m kvcore_sglang.guard [ROOT]``;
# 0.5.22 and 0.5.23 define these functions identically.
_HOST_SLOTS_0_5_22: dict[str, str] = {
    f"{HOST_KV_CACHE}.clear": "645ec28ecee0ff6417687f9436565884d047cc17f2b77f4e8dcf458c70fd46ac",
    f"{HOST_KV_CACHE}.available_size": (
        "11e3e4640250bb955f035319adb0f19e7422a107c19f4161c5973b58445a520f"
    ),
    f"{HOST_KV_CACHE}.alloc": "62a204f7af352646535afdc1527c61e5b16565d616fb37fd7d6686f9c4314edb",
    f"{HOST_KV_CACHE}.free": "36a58622f3462b1196886a44c5cf7d1625c9fce93d6ab0d50c543077ca1c1967",
}
# The MHA and MLA transfers differ between the releases (0.5.22 maps layers through the
# device pool's layer sharding, 0.5.23 through its pools' slot maps); kvcore_sglang.pool_jobs
# has builders for each, and the hooks use those of the release whose fingerprint matches.
_TRANSFERS_0_5_22: dict[str, str] = {
    f"{_POOL_HOST}.mha.MHATokenToKVPoolHost.load_to_device_per_layer": (
        "e3911f280ac28ad7fbc4896d10e7769147cac54af2be31f395da8181e5e2c143"
    ),
    f"{_POOL_HOST}.mha.MHATokenToKVPoolHost.backup_from_device_all_layer": (
        "5de21c9b730afaa9e51a8a7818bd1732682493a64265f11407cdd5b49d87fef2"
    ),
    f"{_POOL_HOST}.mla.MLATokenToKVPoolHost.load_to_device_per_layer": (
        "80cb98b750f6ebb30cb74cbfeaaef7fb663d15a4501109e2f8eacb39c7d67b85"
    ),
    f"{_POOL_HOST}.mla.MLATokenToKVPoolHost.backup_from_device_all_layer": (
        "22bbc79d9405d5c0d5d0a803fc5ad0311a9698350002d564862ce6d222a4d8f9"
    ),
}
_TRANSFERS_0_5_23: dict[str, str] = {
    f"{_POOL_HOST}.mha.MHATokenToKVPoolHost.load_to_device_per_layer": (
        "3f5280b6ec2342ea190bf91f712bef3437e290da467d10d2eb19cc4aabf1fa60"
    ),
    f"{_POOL_HOST}.mha.MHATokenToKVPoolHost.backup_from_device_all_layer": (
        "98825fee47f310e39a389272274aff52baf79fca1d78270ac41cb093d20871dc"
    ),
    f"{_POOL_HOST}.mla.MLATokenToKVPoolHost.load_to_device_per_layer": (
        "4437289ce26c07cdcc1dc9f5fc70a29ebdd7412a8f852ae2b8c863617d4c683f"
    ),
    f"{_POOL_HOST}.mla.MLATokenToKVPoolHost.backup_from_device_all_layer": (
        "bac3c6ac78bf272f4180fc85554507cfa562644686443b21753b058e597951f0"
    ),
}
# 0.5.22 and 0.5.23 define the DSA indexer pool's transfers (and the helpers they use)
# identically, apart from XPU-only code.
_DSA_TRANSFERS_0_5_22: dict[str, str] = {
    f"{_DSA_POOL}.load_to_device_per_layer": (
        "0b052fb3b16de7789049aeaade1ab122eb239db50ccbf20e7ed78ed9e22af869"
    ),
    f"{_DSA_POOL}.backup_from_device_all_layer": (
        "75c6618281547e4a064b191c3fbd0b2ee235036d1baf815ceeb09051bfba8bd7"
    ),
}
# 0.5.22 and 0.5.23 define HiCacheController.move_indices identically.
_INDEX_MEMO_0_5_22: dict[str, str] = {
    INDEX_MEMO_TARGETS[0]: "febbd6c1c68ebfc3dda1829a6021fa639465da9ccb6b94ff2cff123377e1528b",
}
# The functions of DEPENDENCIES, the same in both releases.
_DEPENDENCIES_0_5_22: dict[str, str] = {
    _REGISTER: "d63b75e9c26f0c9e71a125acf6ea791a1231472737ce7639b4fa8d93c792bafe",
    _APPLY: "ac5f7bc0943ca673a0264a9d0b430facf147040038205f67440c4cc5173ee76f",
    f"{HOST_KV_CACHE}._host_layer_index": (
        "1d968730bf62265f7c444932dd6c829f0441ddda42eb4217f8ded4052f929eab"
    ),
    f"{HOST_KV_CACHE}._is_device_layer_owned": (
        "6fd77015986332b463c9214815b24bdcee0514661b2a9a217778de39e1c9ff21"
    ),
    f"{HOST_KV_CACHE}._is_device_layer_sharded": (
        "7586a5ce8e5aa144007da401d1aefe5e5061ad16900c342bd47acbc2b58e1ae3"
    ),
    f"{_DSA_POOL}._draft_host_layer": (
        "9bda1862b625bf2be550dd61664c646d341b2a4d89e44f43a4d9ee24f3fbe8b3"
    ),
    f"{_DSA_POOL}._host_layer_index": (
        "68f331ffcc63508e60117dffa0097449355cff16d1f9ca5081c18bae6666001d"
    ),
    f"{_DSA_POOL}._is_device_layer_owned": (
        "6c997506e14b19652a8922718f59e8984aaddab5ebd576e01798ad428a146565"
    ),
}
_WARM_UP_0_5_22: dict[str, str] = {
    f"{_POOL_HOST}.mha.MHATokenToKVPoolHost.__init__": (
        "f0077b273bdc5f7fd7f51a99d3c63b717ad5fe864db78e18119de930529c21bc"
    ),
    f"{_POOL_HOST}.mla.MLATokenToKVPoolHost.__init__": (
        "f0d57b0443e179d9ec5945f02bd0d0f7eecc22f01d39dd00f14581bc2bcd0e54"
    ),
}
_WARM_UP_0_5_23: dict[str, str] = {
    f"{_POOL_HOST}.mha.MHATokenToKVPoolHost.__init__": (
        "475077138cc83546c02a7d51198355d7e37198b5e56f69aa7fa247b5d7d90c9f"
    ),
    f"{_POOL_HOST}.mla.MLATokenToKVPoolHost.__init__": (
        "3cbdf3b71c63e27756bf8c2653b6553c8ed9c6ea6b6caf029d9959b72c128bbf"
    ),
}
FINGERPRINTS: dict[str, dict[str, str]] = {
    "0.5.22": {
        **_HOST_SLOTS_0_5_22,
        **_TRANSFERS_0_5_22,
        **_DSA_TRANSFERS_0_5_22,
        **_INDEX_MEMO_0_5_22,
        **_DEPENDENCIES_0_5_22,
        **_WARM_UP_0_5_22,
    },
    "0.5.23": {
        **_HOST_SLOTS_0_5_22,
        **_TRANSFERS_0_5_23,
        **_DSA_TRANSFERS_0_5_22,
        **_INDEX_MEMO_0_5_22,
        **_DEPENDENCIES_0_5_22,
        **_WARM_UP_0_5_23,
    },
}


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
    """Print the fingerprints of every target in a release's files: ``ROOT`` is the directory
    that holds the ``sglang`` package (e.g. an unzipped wheel); the installed one by default."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1:
        print("usage: python -m kvcore_sglang.guard [ROOT]", file=sys.stderr)
        return 2
    root = Path(args[0]) if args else None
    for target in recorded_targets({**TARGET_GROUPS, **TRANSFER_GROUPS}):
        print(f'"{target}": "{fingerprint.fingerprint_target(target, root)}",')
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
