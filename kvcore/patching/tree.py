"""Where an engine's package lives and which release it is, found without importing it."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from kvcore.engine_status import release_of
from kvcore.patching.spec import EngineSpec

# setuptools-scm / vcs-versioning write ``__version__ = version = '0.32.0'``; others
# write ``__version__ = "0.32.0"``.
_VERSION_LINE = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.M)


class TreeError(LookupError):
    """The engine's package or its version cannot be found where it was looked for."""


@dataclass(frozen=True)
class EngineTree:
    """The directory that holds the engine's package (site-packages, an unpacked wheel,
    or a source checkout's package parent) and the release found there."""

    root: Path
    version: str

    def file(self, relative: str) -> Path:
        return self.root / relative


def find_tree(spec: EngineSpec, target: Path | None, version: str | None = None) -> EngineTree:
    """The engine tree at ``target`` (default: as installed for this interpreter).

    ``target`` may be the package directory itself, the directory holding it, or a
    source checkout holding it under ``python/``. ``version`` overrides detection.
    """
    if target is None:
        root = _installed_root(spec)
        found = version or _installed_version(spec)
    else:
        root = _root_in(spec, target)
        found = version or _version_in(spec, root)
    return EngineTree(root, release_of(found))


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _installed_root(spec: EngineSpec) -> Path:
    # The top-level spec only: finding a submodule would import the package.
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise TreeError(f"{spec.engine} is not installed for this interpreter; pass --target")
    return Path(next(iter(found.submodule_search_locations))).parent


def _installed_version(spec: EngineSpec) -> str:
    try:
        return importlib.metadata.version(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise TreeError(f"{spec.distribution} has no installed metadata; pass --version") from None


def _root_in(spec: EngineSpec, target: Path) -> Path:
    target = target.resolve()
    candidates = [target, target / "python"]
    if target.name == spec.package:
        candidates.insert(0, target.parent)
    for root in candidates:
        if (root / spec.package / "__init__.py").is_file():
            return root
    raise TreeError(f"no {spec.package} package in {target}")


def _version_in(spec: EngineSpec, root: Path) -> str:
    dist = spec.distribution.replace("-", "_")
    infos = sorted(root.glob(f"{dist}-*.dist-info"))
    if len(infos) == 1:
        return infos[0].name.removesuffix(".dist-info").split("-", 1)[1]
    version_file = root / spec.package / "_version.py"
    if version_file.is_file():
        match = _VERSION_LINE.search(version_file.read_text(encoding="utf-8"))
        if match:
            return match[1]
    raise TreeError(f"cannot tell which {spec.engine} release {root} holds; pass --version")
