"""What both engine lanes' patch tests share: a writable mirror of the installed engine and
the apply/revert round trip on it. The installed engine is never written to."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from kvcore.patching import apply as apply_module
from kvcore.patching.apply import FileState
from kvcore.patching.patchset import PatchSet
from kvcore.patching.tree import EngineTree


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def released_mirror(
    installed: EngineTree, patch_set: PatchSet, set_dir: Path, root: Path
) -> EngineTree:
    """``root`` mirroring ``installed`` as released: symlinks, except the files the patch set
    changes (and the directories on their way), which are copies, reverted there if the
    installed engine is itself patched (a patched lane)."""
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
    apply_module.revert(patch_set, set_dir, tree)
    return tree


def check_apply_then_revert(
    installed: EngineTree, patch_set: PatchSet, set_dir: Path, tree: EngineTree, use_program: bool
) -> None:
    """Apply then revert on ``tree``: applied everywhere, then the released bytes exactly."""
    if use_program and shutil.which("patch") is None:
        pytest.skip("needs patch(1)")
    installed_before = {f.path: sha(installed.file(f.path)) for f in patch_set.files}
    before = {f.path: sha(tree.file(f.path)) for f in patch_set.files}
    assert before == {f.path: f.pristine_sha256 for f in patch_set.files}
    changed = apply_module.apply(patch_set, set_dir, tree, use_program=use_program)
    assert changed == list(before)
    assert {r.state for r in apply_module.check(patch_set, tree)} == {FileState.APPLIED}
    apply_module.revert(patch_set, set_dir, tree, use_program=use_program)
    assert {path: sha(tree.file(path)) for path in before} == before
    assert {f.path: sha(installed.file(f.path)) for f in patch_set.files} == installed_before
