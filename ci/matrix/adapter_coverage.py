"""Line coverage of kvcore's engine adapters, collected inside a lane's pytest process.

Loaded as a pytest plugin (``-p ci.matrix.adapter_coverage``, or ``-p adapter_coverage``
with this file's folder on the path) while ``KVCORE_ADAPTER_COVERAGE`` names the JSON
report to write; without that variable it does nothing. Lane venvs carry no coverage
package, so this module uses the standard library only and imports nothing of ``ci``.

Only code whose file lies under an adapter package is traced: on Python 3.12 and later
through ``sys.monitoring``, which stops calling back for other code after its first call
and for a line once it is recorded; before that through ``sys.settrace``, whose global
function declines every other file at the call, so their lines run untraced. Code run in
subprocesses of the pytest process is not traced.

A file's executable lines are the line numbers of its compiled code objects; a line
counts as executed once any of its instructions ran.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENV = "KVCORE_ADAPTER_COVERAGE"
PACKAGES = ("kvcore_sglang", "kvcore_vllm")
FORMAT = 1
SETTRACE = "settrace"
MONITORING = "sys.monitoring"
# Python 3.12's module; typed Any so that the checks pass under 3.10 and 3.11 too.
_MONITORING: Any = getattr(sys, "monitoring", None)

TraceFunction = Callable[[types.FrameType, str, Any], Any]


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def executable_lines(path: Path) -> set[int]:
    """The lines of ``path`` that compile to at least one instruction."""
    code = compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
    return {line for obj in _code_objects(code) for _, _, line in obj.co_lines() if line}


def package_files(root: Path) -> list[Path]:
    """Every Python source file of the package at ``root``, imported or not."""
    return sorted(path for path in root.rglob("*.py") if "__pycache__" not in path.parts)


@dataclass(frozen=True)
class FileLines:
    """One adapter file's lines: how many are executable and which of them never ran."""

    executable: int
    missed: tuple[int, ...]

    @property
    def executed(self) -> int:
        return self.executable - len(self.missed)


@dataclass(frozen=True)
class Report:
    """One pytest run's coverage, by file (``package/relative/path.py``)."""

    tracer: str
    files: Mapping[str, FileLines] = field(default_factory=dict)

    def packages(self) -> dict[str, tuple[int, int]]:
        """Executed and executable lines of each package."""
        totals: dict[str, tuple[int, int]] = {}
        for name, lines in self.files.items():
            package = name.split("/", 1)[0]
            executed, executable = totals.get(package, (0, 0))
            totals[package] = (executed + lines.executed, executable + lines.executable)
        return totals

    def to_json(self) -> str:
        files = {
            name: {"executable": f.executable, "executed": f.executed, "missed": list(f.missed)}
            for name, f in sorted(self.files.items())
        }
        packages = {
            name: {"executable": total, "executed": ran, "percent": _percent(ran, total)}
            for name, (ran, total) in sorted(self.packages().items())
        }
        data = {"format": FORMAT, "tracer": self.tracer, "packages": packages, "files": files}
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Report:
        data: dict[str, Any] = json.loads(text)
        if data.get("format") != FORMAT:
            raise ValueError(f"adapter coverage report of format {data.get('format')!r}")
        files = {
            name: FileLines(int(f["executable"]), tuple(int(n) for n in f["missed"]))
            for name, f in data["files"].items()
        }
        return cls(str(data["tracer"]), files)


def _percent(executed: int, executable: int) -> float:
    return round(100 * executed / executable, 1) if executable else 0.0


def merge(reports: Iterable[Report]) -> Report:
    """The lines executed by any of ``reports``: a line is missed only if all missed it."""
    files: dict[str, FileLines] = {}
    tracers: list[str] = []
    for report in reports:
        tracers.append(report.tracer)
        for name, lines in report.files.items():
            seen = files.get(name)
            if seen is None:
                files[name] = lines
                continue
            if seen.executable != lines.executable:
                raise ValueError(f"{name}: the reports measured different sources")
            files[name] = FileLines(
                seen.executable, tuple(sorted(set(seen.missed) & set(lines.missed)))
            )
    return Report("+".join(sorted(set(tracers))), files)


class Collector:
    """Records the lines run in the files of ``roots`` (package name -> its folder)."""

    def __init__(self, roots: Mapping[str, Path], backend: str | None = None) -> None:
        self._roots = {name: Path(os.path.realpath(root)) for name, root in roots.items()}
        self._prefixes = tuple(str(root) + os.sep for root in self._roots.values())
        # co_filename -> its executed lines, or None for a file outside the roots.
        self._hits: dict[str, set[int] | None] = {}
        if backend is None:
            backend = MONITORING if _monitoring_free() else SETTRACE
        self.backend = backend
        self._stop: Callable[[], None] | None = None

    def _lines_of(self, filename: str) -> set[int] | None:
        if filename not in self._hits:
            inside = os.path.realpath(filename).startswith(self._prefixes)
            self._hits[filename] = set() if inside else None
        return self._hits[filename]

    def start(self) -> None:
        if self._stop is not None:
            raise RuntimeError("the collector is already running")
        self._stop = self._start_monitoring() if self.backend == MONITORING else self._start_trace()

    def stop(self) -> None:
        if self._stop is not None:
            self._stop()
            self._stop = None

    def _start_trace(self) -> Callable[[], None]:
        tracers: dict[str, TraceFunction | None] = {}

        def line_tracer(hits: set[int]) -> TraceFunction:
            add = hits.add

            def trace(frame: types.FrameType, event: str, arg: Any) -> TraceFunction:
                if event == "line":
                    add(frame.f_lineno)
                return trace

            return trace

        def on_call(frame: types.FrameType, event: str, arg: Any) -> TraceFunction | None:
            filename = frame.f_code.co_filename
            try:
                return tracers[filename]
            except KeyError:
                hits = self._lines_of(filename)
                tracer = tracers[filename] = None if hits is None else line_tracer(hits)
                return tracer

        previous, previous_threads = sys.gettrace(), threading.gettrace()
        threading.settrace(on_call)
        sys.settrace(on_call)

        def stop() -> None:
            sys.settrace(previous)
            threading.settrace(previous_threads)

        return stop

    def _start_monitoring(self) -> Callable[[], None]:
        monitoring = _MONITORING
        tool, events = monitoring.COVERAGE_ID, monitoring.events
        traced: list[types.CodeType] = []

        def on_start(code: types.CodeType, offset: int) -> object:
            if self._lines_of(code.co_filename) is not None:
                monitoring.set_local_events(tool, code, events.LINE)
                traced.append(code)
            return monitoring.DISABLE

        def on_line(code: types.CodeType, line: int) -> object:
            hits = self._hits[code.co_filename]
            assert hits is not None
            hits.add(line)
            return monitoring.DISABLE

        monitoring.use_tool_id(tool, "kvcore adapter coverage")
        monitoring.register_callback(tool, events.PY_START, on_start)
        monitoring.register_callback(tool, events.LINE, on_line)
        monitoring.set_events(tool, events.PY_START)

        def stop() -> None:
            monitoring.set_events(tool, 0)
            for code in traced:
                monitoring.set_local_events(tool, code, 0)
            monitoring.register_callback(tool, events.PY_START, None)
            monitoring.register_callback(tool, events.LINE, None)
            monitoring.free_tool_id(tool)

        return stop

    def report(self) -> Report:
        """Every file of the roots, with the executable lines that have not run so far."""
        executed: dict[str, set[int]] = {}
        for filename, hits in list(self._hits.items()):
            if hits is not None:
                executed.setdefault(os.path.realpath(filename), set()).update(hits)
        files: dict[str, FileLines] = {}
        for package, root in self._roots.items():
            for path in package_files(root):
                lines = executable_lines(path)
                ran = executed.get(str(path), set())
                name = f"{package}/{path.relative_to(root).as_posix()}"
                files[name] = FileLines(len(lines), tuple(sorted(lines - ran)))
        return Report(self.backend, files)


def _monitoring_free() -> bool:
    """Whether ``sys.monitoring`` exists here and no other tool holds its coverage slot."""
    return _MONITORING is not None and _MONITORING.get_tool(_MONITORING.COVERAGE_ID) is None


def adapter_roots(names: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """The folders of the adapter packages this interpreter would import, unimported."""
    roots: dict[str, Path] = {}
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            roots[name] = Path(next(iter(spec.submodule_search_locations)))
    return roots


# The collector of this pytest process and the report it writes at the end.
_active: list[tuple[Collector, Path]] = []


def pytest_load_initial_conftests(early_config: object, parser: object, args: object) -> None:
    # Before conftests and test modules import the adapters, so that their module-level
    # lines are seen; pytest's own implementation, which loads the conftests, runs last.
    output = os.environ.get(ENV)
    if output and not _active:
        collector = Collector(adapter_roots())
        collector.start()
        _active.append((collector, Path(output)))


def pytest_unconfigure(config: object) -> None:
    while _active:
        collector, path = _active.pop()
        collector.stop()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(collector.report().to_json() + "\n", encoding="utf-8")
