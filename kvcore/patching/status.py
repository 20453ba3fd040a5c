"""Whether the installed engines carry kvcore's vendored patches, for ``kvcore doctor``."""

from __future__ import annotations

from kvcore.patching.apply import check
from kvcore.patching.patchset import DEFAULT_PATCHES_DIR, NoPatchSet, load_set
from kvcore.patching.spec import ADAPTER_SPECS, spec_for
from kvcore.patching.tree import TreeError, find_tree


def installed_patch_state(engine: str) -> str | None:
    """``applied``, ``pristine`` or what else the installed ``engine``'s patched files are.

    None when the engine is not installed; a sentence when kvcore has no patch set for it.
    """
    spec = spec_for(engine)
    try:
        tree = find_tree(spec, None)
    except TreeError:
        return None
    try:
        patch_set, _ = load_set(DEFAULT_PATCHES_DIR, engine, tree.version)
    except NoPatchSet:
        return f"no patch set for {engine} {tree.version}"
    states = sorted({report.state.value for report in check(patch_set, tree)})
    return states[0] if len(states) == 1 else "mixed: " + ", ".join(states)


def installed_patch_states() -> dict[str, str | None]:
    return {engine: installed_patch_state(engine) for engine in sorted(ADAPTER_SPECS)}
