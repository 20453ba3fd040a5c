"""A writable stand-in for an installed engine, as released, without writing to the engine.

The apply/revert tests of both engines need the release's own bytes in a tree they may
change: the files a patch set touches (and the directories on their way) are copied,
everything else is symlinked; where the installed engine is itself patched (a patched
build), the copies are reverted.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from kvcore.patching import apply
from kvcore.patching.patchset import PatchSet
from kvcore.patching.tree import EngineTree, sha256_of


def released_mirror(
    installed: EngineTree, patch_set: PatchSet, set_dir: Path, root: Path
) -> EngineTree:
    """``installed`` mirrored under the empty directory ``root``, as released."""
    copied = {f.path for f in patch_set.files}
    real_dirs = {str(parent) for path in copied for parent in Path(path).parents} - {"."}
    for directory in sorted(real_dirs, key=lambda d: d.count("/")):
        (root / directory).mkdir()
        for entry in (installed.root / directory).iterdir():
            relative = f"{directory}/{entry.name}"
            if relative in real_dirs or entry.name == "__pycache__":
                continue
            if relative in copied:
                shutil.copy2(entry, root / relative)
            else:
                (root / relative).symlink_to(entry)
    tree = EngineTree(root, installed.version)
    apply.revert(patch_set, set_dir, tree)
    return tree


def patched_file_hashes(tree: EngineTree, patch_set: PatchSet) -> dict[str, str]:
    """sha256 of every file of ``tree`` that ``patch_set`` changes, by path."""
    return {f.path: sha256_of(tree.file(f.path)) for f in patch_set.files}
