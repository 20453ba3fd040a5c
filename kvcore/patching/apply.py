"""Check, apply and revert a patch set on an engine tree, all files or none.

Every file is classified by its sha256 against the manifest before anything is
written; apply and revert compute every new file in memory (through patch(1) when
it is installed, else :mod:`kvcore.patching.unified`), check each result against
the manifest's hash, and only then replace the files, restoring the replaced ones
if a later replacement fails.
"""

from __future__ import annotations

import enum
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvcore.patching.patchset import PatchedFile, PatchSet
from kvcore.patching.tree import EngineTree, sha256_of
from kvcore.patching.unified import DiffError, apply_diff, parse_diff


class FileState(str, enum.Enum):
    APPLIED = "applied"
    PRISTINE = "pristine"
    MODIFIED = "modified-elsewhere"
    MISSING = "missing"


class PatchError(RuntimeError):
    """The tree cannot be patched or restored as asked; nothing was changed."""


@dataclass(frozen=True)
class FileReport:
    file: PatchedFile
    state: FileState


def check(patch_set: PatchSet, tree: EngineTree) -> list[FileReport]:
    """Each file of ``patch_set`` in ``tree``: applied, pristine, modified elsewhere or missing."""
    return [FileReport(f, _state(f, tree)) for f in patch_set.files]


def apply(
    patch_set: PatchSet, directory: Path, tree: EngineTree, *, use_program: bool | None = None
) -> list[str]:
    """Patch every pristine file (none when any file is modified or missing); the paths
    changed, empty when the tree was patched already."""
    return _transform_all(patch_set, directory, tree, reverse=False, use_program=use_program)


def revert(
    patch_set: PatchSet, directory: Path, tree: EngineTree, *, use_program: bool | None = None
) -> list[str]:
    """Restore the original bytes of every patched file (none when any file is modified or
    missing); the paths changed, empty when the tree was pristine already."""
    return _transform_all(patch_set, directory, tree, reverse=True, use_program=use_program)


def _state(file: PatchedFile, tree: EngineTree) -> FileState:
    path = tree.file(file.path)
    if not path.is_file():
        return FileState.MISSING
    digest = sha256_of(path)
    if digest == file.patched_sha256:
        return FileState.APPLIED
    if digest == file.pristine_sha256:
        return FileState.PRISTINE
    return FileState.MODIFIED


def _transform_all(
    patch_set: PatchSet,
    directory: Path,
    tree: EngineTree,
    *,
    reverse: bool,
    use_program: bool | None,
) -> list[str]:
    reports = check(patch_set, tree)
    refused = [r for r in reports if r.state in (FileState.MODIFIED, FileState.MISSING)]
    if refused:
        listed = "; ".join(f"{r.file.path}: {r.state.value}" for r in refused)
        raise PatchError(
            f"{tree.root} does not hold {patch_set.engine} {patch_set.version} as released or "
            f"as patched ({listed}); nothing changed"
        )
    source_state = FileState.APPLIED if reverse else FileState.PRISTINE
    todo = [r.file for r in reports if r.state is source_state]
    if use_program is None:
        use_program = shutil.which("patch") is not None
    results = {f.path: _transform(f, directory, tree, reverse, use_program) for f in todo}
    _replace_all(tree, results)
    return list(results)


def _transform(
    file: PatchedFile, directory: Path, tree: EngineTree, reverse: bool, use_program: bool
) -> bytes:
    patch_file = directory / file.patch
    source = tree.file(file.path).read_bytes()
    if use_program:
        result = _run_patch_program(file.path, source, patch_file, reverse)
    else:
        diffs = parse_diff(patch_file.read_bytes().decode("utf-8"))
        if len(diffs) != 1:
            raise PatchError(f"{patch_file}: expected one file diff, found {len(diffs)}")
        try:
            result = apply_diff(source.decode("utf-8"), diffs[0], reverse=reverse).encode("utf-8")
        except DiffError as exc:
            raise PatchError(f"{patch_file}: {exc}; nothing changed") from None
    expected = file.pristine_sha256 if reverse else file.patched_sha256
    if hashlib.sha256(result).hexdigest() != expected:
        raise PatchError(f"{patch_file} does not give the bytes its manifest records")
    return result


def _run_patch_program(relative: str, source: bytes, patch_file: Path, reverse: bool) -> bytes:
    with tempfile.TemporaryDirectory(prefix="kvcore-patch-") as scratch:
        copy = Path(scratch, relative)
        copy.parent.mkdir(parents=True)
        copy.write_bytes(source)
        command = ["patch", "--batch", "--forward", "--fuzz=0", "--no-backup-if-mismatch"]
        command += ["--reverse"] if reverse else []
        command += ["-p1", "-d", scratch, "-i", str(patch_file.resolve())]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            said = (done.stdout + done.stderr).strip()
            raise PatchError(f"patch(1) refused {patch_file}: {said}; nothing changed")
        return copy.read_bytes()


def _replace_all(tree: EngineTree, contents: dict[str, bytes]) -> None:
    """Write every file or, when one write fails, put back the ones already written."""
    originals = {path: tree.file(path).read_bytes() for path in contents}
    staged: dict[str, str] = {}
    replaced: list[str] = []
    try:
        for path, data in contents.items():
            staged[path] = _stage(tree.file(path), data)
        for path, temporary in staged.items():
            os.replace(temporary, tree.file(path))
            replaced.append(path)
    except OSError as exc:
        for path in replaced:
            os.replace(_stage(tree.file(path), originals[path]), tree.file(path))
        for path, temporary in staged.items():
            if path not in replaced and os.path.exists(temporary):
                os.unlink(temporary)
        raise PatchError(f"writing {tree.root} failed ({exc}); nothing changed") from exc


def _stage(target: Path, data: bytes) -> str:
    """A temporary file beside ``target`` holding ``data``, with ``target``'s mode."""
    descriptor, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.kvcore-")
    try:
        with os.fdopen(descriptor, "wb") as out:
            out.write(data)
        os.chmod(temporary, os.stat(target).st_mode & 0o7777)
    except OSError:
        os.unlink(temporary)
        raise
    return temporary
