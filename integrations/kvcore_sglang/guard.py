"""Version guard: which SGLang releases kvcore patches, and the source it expects to replace.

Each replaced function is fingerprinted from its source text: the sha256 of its
lines with indentation, blank lines and whole-line comments removed. Text, not an
AST dump, so the fingerprint is the same under every Python version SGLang ships
wheels for. Targets are patched in groups (a group's functions share state, so
replacing part of it would split that state); a changed fingerprint skips its
whole group.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import sys
from dataclasses import dataclass

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
DSA_TRANSFER_GROUP = "DSA indexer transfers"
DSA_TRANSFER_TARGETS: tuple[str, ...] = tuple(
    f"{_POOL_HOST}.dsa.DSAIndexerPoolHost.{method}"
    for method in ("load_to_device_per_layer", "backup_from_device_all_layer")
)
# With the ``kernel`` io backend SGLang moves the host indices to the GPU here; the hook
# keeps the CPU tensor it was given, so that the transfer hooks can plan from it.
INDEX_MEMO_GROUP = "kernel io backend host indices"
INDEX_MEMO_TARGETS: tuple[str, ...] = (
    "sglang.srt.managers.cache_controller.HiCacheController.move_indices",
)
# Checked and registered only when the transfer hooks are asked for (see plugin). The
# groups share no state, so a changed DSA method leaves the MHA and MLA hooks in place,
# and without the index memo ``kernel`` calls simply run stock.
TRANSFER_GROUPS: dict[str, tuple[str, ...]] = {
    TRANSFER_GROUP: TRANSFER_TARGETS,
    DSA_TRANSFER_GROUP: DSA_TRANSFER_TARGETS,
    INDEX_MEMO_GROUP: INDEX_MEMO_TARGETS,
}

# Recorded from each release's wheel with ``python -m kvcore_sglang.guard ROOT``;
# 0.5.22 and 0.5.23 define these functions identically.
_HOST_SLOTS_0_5_22: dict[str, str] = {
    f"{HOST_KV_CACHE}.clear": "77c229ee3f69285f93361bf214b45de28c2552347ae9d74048507d2172c3eb26",
    f"{HOST_KV_CACHE}.available_size": (
        "72715d2073cb57bb9d3e4f1d5952f7412fa1dcdbcdeda3a689191dde0ec4499c"
    ),
    f"{HOST_KV_CACHE}.alloc": "12afebe1815e6d36d7f16115ed89f39d976e95205e549e14ce9b3d218d287020",
    f"{HOST_KV_CACHE}.free": "b5651e29ed7e3b808d54222e22b7424c8266602beb9a8342da0333c7213f32c0",
}
# The MHA and MLA transfers differ between the releases (0.5.22 maps layers through the
# device pool's layer sharding, 0.5.23 through its pools' slot maps); kvcore_sglang.pool_jobs
# has builders for each, and the hooks use those of the release whose fingerprint matches.
_TRANSFERS_0_5_22: dict[str, str] = {
    f"{_POOL_HOST}.mha.MHATokenToKVPoolHost.load_to_device_per_layer": (
        "70c64fb27349702d4b290eb0f3091d9efd853fafbc08083a248ed32a909d7edd"
    ),
    f"{_POOL_HOST}.mha.MHATokenToKVPoolHost.backup_from_device_all_layer": (
        "6c89ab6f1a2a728c9fd9191cea93137bfdad78478a9ca995667bec9f993eb8d0"
    ),
    f"{_POOL_HOST}.mla.MLATokenToKVPoolHost.load_to_device_per_layer": (
        "65a71d6e51e328aab6dfe61f99446a5d27db5f7bf0dbffa44c4a264d1b44e9fa"
    ),
    f"{_POOL_HOST}.mla.MLATokenToKVPoolHost.backup_from_device_all_layer": (
        "2acbfcfaef39884e132e6b345c1683787dd8500abb08f0c49e523041edbfc046"
    ),
}
_TRANSFERS_0_5_23: dict[str, str] = {
    f"{_POOL_HOST}.mha.MHATokenToKVPoolHost.load_to_device_per_layer": (
        "9bd30c239ff84b6cdd08f8c9bf3c52b94c088c95d7387ef7b4b3026d689c421c"
    ),
    f"{_POOL_HOST}.mha.MHATokenToKVPoolHost.backup_from_device_all_layer": (
        "16ba921ce9ad0a399ea0ffd29661494fe68254b00554d0dffe5f623542dab451"
    ),
    f"{_POOL_HOST}.mla.MLATokenToKVPoolHost.load_to_device_per_layer": (
        "fce382eecb032ba34d8bb561822c4708d6138cdb8cf4f86764a154fa6a9fb670"
    ),
    f"{_POOL_HOST}.mla.MLATokenToKVPoolHost.backup_from_device_all_layer": (
        "5f35499e804eef01c4c2a44e84bc974ba0af10fea286834594297acd79489ef5"
    ),
}
# 0.5.22 and 0.5.23 define the DSA indexer pool's transfers (and the helpers they use)
# identically, apart from XPU-only code.
_DSA_TRANSFERS_0_5_22: dict[str, str] = {
    f"{_POOL_HOST}.dsa.DSAIndexerPoolHost.load_to_device_per_layer": (
        "750fe765a274fb33260d63c98094c1f4a8984a01695dce79f20a067a73a24559"
    ),
    f"{_POOL_HOST}.dsa.DSAIndexerPoolHost.backup_from_device_all_layer": (
        "ac81f2a3d3f4ec18f1dfdf1839d1f8419b88579a8e49eda2e5c639e6ff042c85"
    ),
}
# 0.5.22 and 0.5.23 define HiCacheController.move_indices identically.
_INDEX_MEMO_0_5_22: dict[str, str] = {
    INDEX_MEMO_TARGETS[0]: "c87b308f4104a118fdbf0ebc64dc6fc3c488683b9d950112444e43be9f1353a8",
}
FINGERPRINTS: dict[str, dict[str, str]] = {
    "0.5.22": {
        **_HOST_SLOTS_0_5_22,
        **_TRANSFERS_0_5_22,
        **_DSA_TRANSFERS_0_5_22,
        **_INDEX_MEMO_0_5_22,
    },
    "0.5.23": {
        **_HOST_SLOTS_0_5_22,
        **_TRANSFERS_0_5_23,
        **_DSA_TRANSFERS_0_5_22,
        **_INDEX_MEMO_0_5_22,
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


def normalise_source(source: str) -> str:
    lines = (line.strip() for line in source.splitlines())
    return "\n".join(line for line in lines if line and not line.startswith("#"))


def fingerprint_text(source: str) -> str:
    return hashlib.sha256(normalise_source(source).encode()).hexdigest()


def fingerprint_in_source(module_source: str, qualname: str) -> str:
    """Fingerprint of ``qualname`` (e.g. ``HostKVCache.alloc``) defined in ``module_source``,
    decorators included. KeyError when the module does not define it."""
    lines = module_source.splitlines()
    node = _find_definition(ast.parse(module_source), qualname.split("."))
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    assert node.end_lineno is not None
    return fingerprint_text("\n".join(lines[first - 1 : node.end_lineno]))


def fingerprint_target(target: str) -> str:
    """Fingerprint of the installed source of ``target``, a dotted ``module.Class.function``.

    The module is imported; the text comes from its file, so a target already
    wrapped by a hook still reads as the engine's own source.
    """
    module_name, qualname = split_target(target)
    module = importlib.import_module(module_name)
    return fingerprint_in_source(inspect.getsource(module), qualname)


def split_target(target: str) -> tuple[str, str]:
    """``(module, qualname)`` of a dotted target whose qualname starts at the first capital."""
    parts = target.split(".")
    for i, part in enumerate(parts):
        if part[:1].isupper():
            return ".".join(parts[:i]), ".".join(parts[i:])
    raise ValueError(f"{target!r} names no class")


def check_targets(version: str, groups: dict[str, tuple[str, ...]] = TARGET_GROUPS) -> GuardResult:
    """Which targets of ``groups`` may be patched on SGLang ``version`` (a release string,
    no local label)."""
    recorded = FINGERPRINTS.get(version)
    if recorded is None:
        tested = ", ".join(sorted(FINGERPRINTS))
        reason = f"SGLang {version} is not a tested version (tested: {tested})"
        every = (Skipped(t, reason) for group in groups.values() for t in group)
        return GuardResult((), tuple(every))
    patchable: list[str] = []
    skipped: list[Skipped] = []
    for group, targets in groups.items():
        changed = {t: why for t in targets if (why := _mismatch(t, recorded.get(t)))}
        if not changed:
            patchable.extend(targets)
            continue
        for target in targets:
            reason = changed.get(target) or (
                f"part of the {group} group, whose target {next(iter(changed))} changed"
            )
            skipped.append(Skipped(target, reason))
    return GuardResult(tuple(patchable), tuple(skipped))


def _mismatch(target: str, expected: str | None) -> str | None:
    if expected is None:
        return "no fingerprint recorded for this version"
    try:
        actual = fingerprint_target(target)
    except (ImportError, AttributeError, KeyError, OSError, SyntaxError) as exc:
        return f"cannot read its source: {type(exc).__name__}: {exc}"
    if actual != expected:
        return f"source changed (fingerprint {actual[:12]}, recorded {expected[:12]})"
    return None


_Definition = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


def _find_definition(tree: ast.Module, path: list[str]) -> _Definition:
    body: list[ast.stmt] = tree.body
    node: ast.stmt | None = None
    for name in path:
        node = next(
            (n for n in body if isinstance(n, _Definition) and n.name == name),
            None,
        )
        if node is None:
            raise KeyError(".".join(path))
        body = node.body
    assert isinstance(node, _Definition)
    return node


def main(argv: list[str] | None = None) -> int:
    """Print the fingerprints of every target in a release's files: ``ROOT`` is the directory
    that holds the unpacked ``sglang`` package (e.g. an unzipped wheel)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kvcore_sglang.guard ROOT", file=sys.stderr)
        return 2
    for targets in (*TARGET_GROUPS.values(), *TRANSFER_GROUPS.values()):
        for target in targets:
            module_name, qualname = split_target(target)
            path = f"{args[0]}/{module_name.replace('.', '/')}.py"
            with open(path, encoding="utf-8") as source:
                print(f'"{target}": "{fingerprint_in_source(source.read(), qualname)}",')
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
