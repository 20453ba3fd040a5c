"""Fingerprints of engine functions, read from source files without importing the engine.

The adapters' version guards record, per tested engine release, a fingerprint of every
engine function they replace, override, call or rely on, and compare the installed
engine's against them before patching anything. A target is a dotted name,
``package.module.Class.method`` or ``package.module.function``; the module is the
longest prefix that names a file under the directory holding the package, the rest is
the qualname.

A fingerprint is the sha256 of the target's definition (decorators included), dedented,
without comments, blank lines or trailing spaces. Relative indentation is kept, since it
is the code's block structure; text, not an AST dump, so that every Python version an
engine ships wheels for reads the same value.

The recorded fingerprints are data: one JSON file per tested release,
``<adapter package>/fingerprints/<release>.json`` (target -> fingerprint), read by
:func:`recorded_releases`. Adding a release is adding its file.

Only the standard library is imported here.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.resources
import importlib.util
import io
import json
import sys
import textwrap
import tokenize
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

_Definition = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


class SourceNotFound(KeyError):
    """A target's module file or definition is not where the engine should have it.

    A KeyError, so that callers which catch a missing definition as one keep working.
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def normalised_source(source: str, qualname: str, tree: ast.Module | None = None) -> str:
    """The definition of ``qualname`` (``Class.method``, ``function``...) in the module text
    ``source`` (``tree``: its parse, where the caller has it), decorators included, dedented,
    without comments, blank lines or trailing spaces. SourceNotFound when the module does
    not define it."""
    node = find_definition(ast.parse(source) if tree is None else tree, qualname)
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    lines = source.splitlines()[first - 1 : node.end_lineno]
    return _without_comments(textwrap.dedent("\n".join(lines)) + "\n")


def fingerprint_source(source: str, qualname: str, tree: ast.Module | None = None) -> str:
    """The fingerprint of ``qualname`` defined in the module text ``source``."""
    return hashlib.sha256(normalised_source(source, qualname, tree).encode("utf-8")).hexdigest()


def find_definition(tree: ast.Module, qualname: str) -> _Definition:
    """The node that defines ``qualname`` in ``tree``; the last one where a name is defined
    twice, as at run time. SourceNotFound names the first part that is not defined."""
    parts = qualname.split(".")
    scope: ast.AST = tree
    for depth, part in enumerate(parts):
        found = [
            node
            for node in getattr(scope, "body", [])
            if isinstance(node, _Definition) and node.name == part
        ]
        if not found:
            raise SourceNotFound(f"{'.'.join(parts[: depth + 1])} is not defined")
        scope = found[-1]
    assert isinstance(scope, _Definition)
    return scope


def package_root(package: str) -> Path:
    """The directory that holds the top-level ``package``: the imported one's if it is
    imported, else the one an import would find (nothing is imported to find it)."""
    module = sys.modules.get(package)
    origin = getattr(module, "__file__", None) if module is not None else None
    if origin is None:
        spec = importlib.util.find_spec(package)
        if spec is None:
            raise SourceNotFound(f"{package} is not installed")
        origin = spec.origin
        if origin is None and spec.submodule_search_locations:
            return Path(next(iter(spec.submodule_search_locations))).parent
    if origin is None:
        raise SourceNotFound(f"{package} has no source files")
    path = Path(origin)
    return path.parent.parent if path.name == "__init__.py" else path.parent


def locate(target: str, root: Path) -> tuple[Path, str]:
    """The file under ``root`` that defines ``target``, and the target's qualname in it."""
    parts = target.split(".")
    for end in range(len(parts) - 1, 0, -1):
        base = root.joinpath(*parts[:end])
        for path in (base.with_name(base.name + ".py"), base / "__init__.py"):
            if path.is_file():
                return path, ".".join(parts[end:])
    raise SourceNotFound(f"no module of {target} under {root}")


def fingerprint_target(
    target: str,
    root: Path | None = None,
    parsed: dict[Path, tuple[str, ast.Module]] | None = None,
) -> str:
    """The fingerprint of ``target`` in the source tree ``root`` (the directory holding the
    engine's package), by default the installed engine's. ``parsed`` (path -> text and
    parse) is filled and reused, so that checking many targets parses each file once."""
    tree = package_root(target.split(".", 1)[0]) if root is None else root
    path, qualname = locate(target, tree)
    parsed = {} if parsed is None else parsed
    if path not in parsed:
        source = path.read_text(encoding="utf-8")
        parsed[path] = source, ast.parse(source)
    try:
        source, module = parsed[path]
        return fingerprint_source(source, qualname, module)
    except SourceNotFound as exc:
        raise SourceNotFound(f"{exc} in {path}") from None


def drift(
    recorded: Mapping[str, str],
    root: Path | None = None,
    targets: Iterable[str] | None = None,
) -> dict[str, str]:
    """Target -> why it differs from ``recorded`` (target -> fingerprint) in the source tree
    ``root`` (by default the installed engine's); empty when every target matches.

    ``targets`` defaults to every recorded one; a target without a recorded fingerprint
    is reported as such.
    """
    reasons: dict[str, str] = {}
    parsed: dict[Path, tuple[str, ast.Module]] = {}
    for target in recorded if targets is None else targets:
        expected = recorded.get(target)
        if expected is None:
            reasons[target] = "no fingerprint recorded"
            continue
        try:
            actual = fingerprint_target(target, root, parsed)
        except (SourceNotFound, OSError, SyntaxError, UnicodeDecodeError) as exc:
            reasons[target] = f"cannot read its source: {type(exc).__name__}: {exc}"
            continue
        if actual != expected:
            reasons[target] = (
                f"source changed (fingerprint {actual[:12]}, recorded {expected[:12]})"
            )
    return reasons


def release_key(release: str) -> tuple[int, ...]:
    """``"0.5.23"`` -> ``(0, 5, 23)``, so that releases sort as numbers."""
    return tuple(int(part) for part in release.split(".") if part.isdigit())


def recorded_releases(package: str) -> dict[str, dict[str, str]]:
    """Release -> target -> fingerprint, read from ``package``'s ``fingerprints/*.json``,
    oldest release first."""
    folder = importlib.resources.files(package).joinpath("fingerprints")
    tables: dict[str, dict[str, str]] = {}
    for entry in folder.iterdir():
        if not entry.name.endswith(".json"):
            continue
        try:
            table = json.loads(entry.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ValueError(f"{package}/fingerprints/{entry.name}: {exc}") from None
        if not isinstance(table, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in table.items()
        ):
            raise ValueError(f"{package}/fingerprints/{entry.name} is not target -> fingerprint")
        tables[entry.name.removesuffix(".json")] = table
    return dict(sorted(tables.items(), key=lambda item: release_key(item[0])))


def release_file(table: Mapping[str, str]) -> str:
    """``table`` (target -> fingerprint) as the text of a release's fingerprint file."""
    return json.dumps(dict(table), indent=2) + "\n"


def print_release_file(read: Callable[[], Mapping[str, str]], engine: str, guard: str) -> int:
    """Print the fingerprint file ``read()`` gives (what a guard's ``main`` does); 1, with a
    line naming ``guard`` and ``engine``, where the engine's source cannot be read."""
    try:
        table = read()
    except (SourceNotFound, OSError, SyntaxError) as exc:
        print(f"{guard}: cannot read {engine}'s source: {exc}", file=sys.stderr)
        return 1
    print(release_file(table), end="")
    return 0


def _without_comments(block: str) -> str:
    comments: dict[int, int] = {}
    for token in tokenize.generate_tokens(io.StringIO(block).readline):
        if token.type == tokenize.COMMENT:
            row, col = token.start
            comments[row] = col
    kept = []
    for row, line in enumerate(block.splitlines(), start=1):
        line = line[: comments.get(row, len(line))].rstrip()
        if line:
            kept.append(line)
    return "\n".join(kept) + "\n"
