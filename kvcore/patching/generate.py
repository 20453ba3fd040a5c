"""Generate an engine release's patch set from the adapter's targets, and check it for drift.

Each changed module gains one block at its end: a guarded import of the adapter's
``hook`` (the identity when kvcore is not importable) and one line per target,
``<expression> = _kvcore_hook("<target>", <expression>)``. The block leaves every
function's own text untouched, so the adapters' version guards, which fingerprint
function source, accept a patched tree as they accept a pristine one.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from kvcore.patching.patchset import MANIFEST, PatchedFile, PatchSet, set_dir
from kvcore.patching.spec import EngineSpec, PatchTarget
from kvcore.patching.tree import EngineTree, sha256_of
from kvcore.patching.unified import make_diff

HOOK_NAME = "_kvcore_hook"
_ROOT_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class GenerateError(ValueError):
    """The release's source is not what the adapter's targets expect; the message says where."""


@dataclass(frozen=True)
class GeneratedSet:
    """A patch set and the text of every file it consists of, by file name."""

    patch_set: PatchSet
    texts: dict[str, str]


def hook_block(hook_module: str, targets: tuple[PatchTarget, ...]) -> str:
    """The text appended to a module: a guarded import and one hook line per target."""
    lines = [
        "",
        "",
        "# kvcore patch: the bindings below run through kvcore's adapter, which does nothing",
        "# when KVCORE_ENABLE excludes this engine. `kvcore patches revert` removes this block.",
        "try:",
        f"    from {hook_module} import hook as {HOOK_NAME}",
        "except ImportError:  # kvcore is not installed: the engine runs stock",
        "",
        f"    def {HOOK_NAME}(target, original):",
        "        return original",
        "",
        "",
        *(f"{t.expression} = {HOOK_NAME}({json.dumps(t.target)}, {t.expression})" for t in targets),
    ]
    return "\n".join(lines) + "\n"


def patched_source(source: str, hook_module: str, targets: tuple[PatchTarget, ...]) -> str:
    """``source`` with the hook block appended; GenerateError when a target is not there."""
    if HOOK_NAME in source:
        raise GenerateError("the module is patched already")
    tree = ast.parse(source)
    for target in targets:
        _check_expression(tree, target)
    if source and not source.endswith("\n"):
        source += "\n"
    return source + hook_block(hook_module, targets)


def generate(spec: EngineSpec, tree: EngineTree) -> GeneratedSet:
    """The patch set for the release in ``tree``, built from the adapter's targets."""
    if tree.version not in spec.versions:
        tested = ", ".join(spec.versions)
        raise GenerateError(
            f"{spec.engine} {tree.version} has no fingerprints in the adapter (tested: {tested})"
        )
    changed = spec.source_changes(tree.version, tree.root)
    if changed:
        named = "\n".join(f"  {target}: {why}" for target, why in sorted(changed.items()))
        raise GenerateError(
            f"{spec.engine} {tree.version}: targets changed in {tree.root}:\n{named}"
        )
    by_module: dict[str, list[PatchTarget]] = {}
    for target in spec.targets(tree.version):
        by_module.setdefault(target.module, []).append(target)
    files: list[PatchedFile] = []
    texts: dict[str, str] = {}
    for module in sorted(by_module):
        targets = tuple(by_module[module])
        relative = spec.module_path(module)
        path = tree.file(relative)
        try:
            source = path.read_bytes().decode("utf-8")
            new = patched_source(source, spec.hook_module, targets)
        except (GenerateError, OSError, UnicodeDecodeError, SyntaxError) as exc:
            raise GenerateError(f"{spec.engine} {tree.version} {relative}: {exc}") from None
        patch_name = f"{module}.patch"
        texts[patch_name] = make_diff(f"a/{relative}", f"b/{relative}", source, new)
        files.append(
            PatchedFile(
                relative,
                patch_name,
                tuple(t.target for t in targets),
                sha256_of(path),
                _sha256_text(new),
            )
        )
    patch_set = PatchSet(spec.engine, tree.version, tuple(files))
    texts[MANIFEST] = patch_set.manifest_text()
    return GeneratedSet(patch_set, texts)


def write_set(generated: GeneratedSet, patches_dir: Path) -> Path:
    """Write ``generated`` to its directory under ``patches_dir``, replacing what was there."""
    directory = set_dir(patches_dir, generated.patch_set.engine, generated.patch_set.version)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in _set_files(directory):
        if stale.name not in generated.texts:
            stale.unlink()
    for name, text in generated.texts.items():
        (directory / name).write_bytes(text.encode("utf-8"))
    return directory


def drift(generated: GeneratedSet, patches_dir: Path) -> list[str]:
    """How the committed patch set differs from ``generated``; empty when it does not."""
    directory = set_dir(patches_dir, generated.patch_set.engine, generated.patch_set.version)
    problems: list[str] = []
    for name, text in generated.texts.items():
        committed = directory / name
        if not committed.is_file():
            problems.append(f"{committed}: missing")
        elif committed.read_bytes() != text.encode("utf-8"):
            problems.append(f"{committed}: differs from the regenerated one")
    problems += [
        f"{extra}: not generated any more"
        for extra in _set_files(directory)
        if extra.name not in generated.texts
    ]
    return problems


def _set_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.suffix == ".patch" or p.name == MANIFEST)


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _check_expression(tree: ast.Module, target: PatchTarget) -> None:
    """The expression's first name must be bound at module level; for ``Class.method``,
    the class must define the method itself (a hook on an inherited one would land on
    the wrong class)."""
    match = _ROOT_NAME.match(target.expression)
    if match is None:
        raise GenerateError(f"{target.target}: {target.expression!r} is not an expression")
    root = match[0]
    defined = {node.name: node for node in tree.body if isinstance(node, _DEFINITIONS)}
    bound = set(defined) | _assigned_names(tree)
    if root not in bound:
        raise GenerateError(f"{target.target}: {root} is not defined at module level")
    rest = target.expression[len(root) :]
    if rest.startswith(".") and _ROOT_NAME.fullmatch(rest[1:]):
        owner = defined.get(root)
        if not isinstance(owner, ast.ClassDef) or rest[1:] not in _class_attributes(owner):
            raise GenerateError(f"{target.target}: {root} does not define {rest[1:]}")


_DEFINITIONS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _assigned_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _class_attributes(node: ast.ClassDef) -> set[str]:
    names = {n.name for n in node.body if isinstance(n, _DEFINITIONS)}
    for statement in node.body:
        if isinstance(statement, ast.Assign):
            names.update(t.id for t in statement.targets if isinstance(t, ast.Name))
        elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            names.add(statement.target.id)
    return names
