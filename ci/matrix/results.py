"""Lane results: JUnit XML reduced to counts and failing test ids, stored as JSON per lane."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# The name of the suite that runs tests/integration/<engine>.
INTEGRATION = "integration"


@dataclass(frozen=True)
class Coverage:
    """How many of an adapter package's executable lines a suite (or a lane) executed."""

    package: str
    executed: int
    executable: int


@dataclass(frozen=True)
class Suite:
    """One pytest run inside a lane."""

    name: str
    passed: int = 0
    failed: int = 0  # failures and errors
    skipped: int = 0
    failed_ids: tuple[str, ...] = ()
    # Adapter line coverage, for the modes that enable kvcore; empty when untraced.
    coverage: tuple[Coverage, ...] = ()


@dataclass
class LaneResult:
    """What one lane run found. ``status`` is ok (every suite ran), failed (a suite has
    failures) or error (the lane could not run; ``message`` says why)."""

    lane: str
    engine: str
    mode: str
    version: str | None
    status: str
    minutes: float
    message: str = ""
    suites: list[Suite] = field(default_factory=list)
    # Drift lanes: target -> why it differs from the newest tested release.
    changed_targets: dict[str, str] = field(default_factory=dict)
    # Drift lanes: the index's newest release is not one kvcore supports.
    unsupported_newest: bool = False
    # The adapter lines executed by any of the lane's suites.
    coverage: tuple[Coverage, ...] = ()

    @property
    def passed(self) -> int:
        return sum(suite.passed for suite in self.suites)

    @property
    def failed(self) -> int:
        return sum(suite.failed for suite in self.suites)

    @property
    def skipped(self) -> int:
        return sum(suite.skipped for suite in self.suites)

    def failed_ids(self) -> set[str]:
        return {f"{suite.name}:{test}" for suite in self.suites for test in suite.failed_ids}

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> LaneResult:
        data: dict[str, Any] = json.loads(text)
        data["suites"] = [
            Suite(
                **{
                    **suite,
                    "failed_ids": tuple(suite["failed_ids"]),
                    "coverage": _coverage(suite.get("coverage", ())),
                }
            )
            for suite in data.get("suites", [])
        ]
        data["coverage"] = _coverage(data.get("coverage", ()))
        return cls(**data)


def _coverage(items: Iterable[Mapping[str, Any]]) -> tuple[Coverage, ...]:
    return tuple(Coverage(**item) for item in items)


def parse_junit(name: str, xml_text: str) -> Suite:
    """Counts and failing ids (``module.path::test[params]``) of a pytest JUnit report."""
    root = ET.fromstring(xml_text)
    passed = skipped = 0
    failed: list[str] = []
    for case in root.iter("testcase"):
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            failed.append(f"{case.get('classname', '')}::{case.get('name', '')}")
        elif "skipped" in kinds:
            skipped += 1
        else:
            passed += 1
    return Suite(name, passed, len(failed), skipped, tuple(sorted(failed)))


def also_failing_on_stock(result: LaneResult, stock: LaneResult | None) -> set[str]:
    """The lane's failing tests that fail in the same release's stock lane too."""
    if stock is None or result.mode == "stock":
        return set()
    return result.failed_ids() & stock.failed_ids()


_PARAMS = re.compile(r"\[.*\]$")


def grouped(test_ids: set[str]) -> list[tuple[str, int]]:
    """Test ids with their parametrisation dropped, and how many cases each stands for."""
    counts: dict[str, int] = {}
    for test_id in test_ids:
        base = _PARAMS.sub("", test_id)
        counts[base] = counts.get(base, 0) + 1
    return sorted(counts.items())


def save(result: LaneResult, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{result.lane}.json"
    path.write_text(result.to_json() + "\n", encoding="utf-8")
    return path


def load_all(directory: Path) -> dict[str, LaneResult]:
    """Every stored lane result, by lane name."""
    if not directory.is_dir():
        return {}
    results = (
        LaneResult.from_json(p.read_text(encoding="utf-8")) for p in directory.glob("*.json")
    )
    return {result.lane: result for result in results}
