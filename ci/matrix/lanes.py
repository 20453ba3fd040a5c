"""Lanes: ci/matrix.toml expanded into engine x version x mode, plus a drift lane per engine."""

from __future__ import annotations

import fnmatch
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

MODES = ("stock", "plugin", "patched", "classes")
# The modes of an engine whose table names none (classes needs an engine's own tests).
DEFAULT_MODES = MODES[:3]
DRIFT = "drift"


class MatrixError(ValueError):
    """ci/matrix.toml, or a lane selection, is not usable."""


@dataclass(frozen=True)
class Engine:
    """One engine's entry in the matrix."""

    name: str
    versions: tuple[str, ...]
    install: str  # script that builds a lane venv: ``bash INSTALL VENV``
    version_env: str  # the variable that tells the install script which release
    integration_tests: str  # our tests for this engine, relative to the repo
    upstream_tests: str  # script running the engine's own shipped tests; "" if none
    modes: tuple[str, ...] | None = None  # this engine's modes; None: the matrix's


@dataclass(frozen=True)
class Lane:
    """One row of the matrix. A drift lane has no version until the run looks it up."""

    engine: str
    mode: str
    version: str | None = None

    @property
    def name(self) -> str:
        if self.mode == DRIFT:
            return f"{self.engine}-{DRIFT}"
        return f"{self.engine}-{self.version}-{self.mode}"

    def venv_name(self, version: str) -> str:
        """Stock and plugin lanes of a release share a venv (the mode is only an environment
        variable); patched lanes get their own, since patching rewrites the engine's files."""
        suffix = "-patched" if self.mode == "patched" else ""
        return f"{self.engine}-{version}{suffix}"


@dataclass(frozen=True)
class Matrix:
    modes: tuple[str, ...]
    cache_dir: Path
    engines: Mapping[str, Engine]

    def lanes(self) -> list[Lane]:
        """Every lane, in table order: per engine, its versions x modes, then its drift lane."""
        lanes: list[Lane] = []
        for engine in self.engines.values():
            lanes.extend(
                Lane(engine.name, mode, version)
                for version in engine.versions
                for mode in engine.modes or self.modes
            )
            lanes.append(Lane(engine.name, DRIFT))
        return lanes

    def select(self, patterns: Iterable[str], everything: bool = False) -> list[Lane]:
        """The lanes named by ``patterns`` (exact names or shell globs), in table order."""
        lanes = self.lanes()
        if everything:
            return lanes
        patterns = list(patterns)
        if not patterns:
            raise MatrixError("name lanes with --lane NAME (globs allowed) or pass --all")
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(lane.name, pattern) for lane in lanes):
                known = ", ".join(lane.name for lane in lanes)
                raise MatrixError(f"no lane matches {pattern!r}; lanes: {known}")
        return [
            lane
            for lane in lanes
            if any(fnmatch.fnmatchcase(lane.name, pattern) for pattern in patterns)
        ]


def parse_matrix(data: Mapping[str, Any]) -> Matrix:
    """A Matrix from ci/matrix.toml's parsed contents; MatrixError says what is wrong."""
    modes = _modes(data.get("modes", DEFAULT_MODES), "modes")
    engines_table = data.get("engines")
    if not isinstance(engines_table, Mapping) or not engines_table:
        raise MatrixError("the matrix names no [engines.NAME] table")
    engines: dict[str, Engine] = {}
    for name, table in engines_table.items():
        try:
            versions = tuple(str(v) for v in table["versions"])
            engine = Engine(
                name=name,
                versions=versions,
                install=str(table["install"]),
                version_env=str(table["version_env"]),
                integration_tests=str(table["integration_tests"]),
                upstream_tests=str(table.get("upstream_tests", "")),
                modes=_modes(table["modes"], f"[engines.{name}] modes")
                if "modes" in table
                else None,
            )
        except (KeyError, TypeError) as exc:
            raise MatrixError(f"[engines.{name}] lacks or misspells {exc}") from None
        if not versions or len(set(versions)) != len(versions):
            raise MatrixError(f"[engines.{name}] versions must be distinct and non-empty")
        engines[name] = engine
    cache_dir = Path(str(data.get("cache_dir", "~/.cache/kvcore-ci/matrix"))).expanduser()
    return Matrix(modes=modes, cache_dir=cache_dir, engines=engines)


def _modes(value: Any, where: str) -> tuple[str, ...]:
    modes = tuple(value)
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown or not modes:
        raise MatrixError(f"{where} must be among {', '.join(MODES)}; got {list(modes)}")
    return modes


def load_matrix(path: Path) -> Matrix:
    with path.open("rb") as file:
        return parse_matrix(tomllib.load(file))
