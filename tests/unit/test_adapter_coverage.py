"""The lanes' adapter line coverage: the collector, its JSON, its pytest plugin, its table."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from ci.matrix import adapter_coverage
from ci.matrix.adapter_coverage import (
    MONITORING,
    SETTRACE,
    Collector,
    FileLines,
    Report,
    executable_lines,
    merge,
)
from ci.matrix.lanes import Lane
from ci.matrix.render import render_compat
from ci.matrix.results import Coverage, LaneResult, Suite, load_all, save
from ci.matrix.runner import coverage_env

REPO = Path(__file__).resolve().parents[2]
BACKENDS = [
    SETTRACE,
    pytest.param(
        MONITORING,
        marks=pytest.mark.skipif(
            not hasattr(sys, "monitoring"), reason="sys.monitoring is Python 3.12's"
        ),
    ),
]

# Lines 1-4, 6-7 and 9 compile to instructions; 4 and 7 never run when it is imported.
BRANCHY = """\
def branch(flag):
    if flag:
        return "taken"
    return "not taken"

def never():
    return 0

VALUE = branch(True)
"""


def _package(root: Path, name: str, files: dict[str, str]) -> Path:
    package = root / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for filename, text in files.items():
        (package / filename).write_text(text)
    return package


def _load(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _outer_trace(frame: types.FrameType, event: str, arg: Any) -> None:
    return None


def _frame_trace() -> Any:
    return sys._getframe().f_trace


@pytest.mark.parametrize("backend", BACKENDS)
def test_collector_counts_executed_and_missed_lines_per_file_and_package(
    tmp_path: Path, backend: str
) -> None:
    package = _package(tmp_path, "pkga", {"mod.py": BRANCHY, "unused.py": "X = 1\n"})
    previous = sys.gettrace()
    sys.settrace(_outer_trace)  # a debugger's, say: the collector must hand it back
    collector = Collector({"pkga": package}, backend=backend)
    collector.start()
    try:
        module = _load(package / "mod.py", f"pkga_mod_{backend.replace('.', '_')}")
    finally:
        collector.stop()
        restored = sys.gettrace()
        sys.settrace(previous)
    assert module.VALUE == "taken"
    assert restored is _outer_trace
    report = collector.report()
    assert report.tracer == backend
    assert report.files == {
        "pkga/__init__.py": FileLines(0, ()),
        "pkga/mod.py": FileLines(7, (4, 7)),
        "pkga/unused.py": FileLines(1, (1,)),
    }
    assert report.packages() == {"pkga": (5, 8)}


def test_executable_lines_skip_blanks_comments_and_docstrings(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        '"""Doc."""\n\n# note\ndef f():\n    """Doc."""\n    return (1 +\n        2)\n'
    )
    # The module docstring is stored (line 1); a function's is not an instruction; the
    # folded constant leaves its continuation line without one.
    assert executable_lines(source) == {1, 4, 6}


def test_settrace_leaves_other_files_untraced(tmp_path: Path) -> None:
    probe = "import sys\n\ndef trace():\n    return sys._getframe().f_trace\n"
    inside = _package(tmp_path / "in", "pkgb", {"probe.py": probe})
    outside = _package(tmp_path / "out", "other", {"probe.py": probe})
    traced = _load(inside / "probe.py", "pkgb_probe")
    untraced = _load(outside / "probe.py", "other_probe")
    collector = Collector({"pkgb": inside}, backend=SETTRACE)
    collector.start()
    try:
        seen = traced.trace(), untraced.trace(), _frame_trace()
    finally:
        collector.stop()
    assert seen[0] is not None
    assert seen[1] is None and seen[2] is None


@pytest.mark.skipif(not hasattr(sys, "monitoring"), reason="sys.monitoring is Python 3.12's")
def test_monitoring_leaves_other_files_untraced(tmp_path: Path) -> None:
    monitoring: Any = getattr(sys, "monitoring")  # noqa: B009 - absent before 3.12
    inside = _package(tmp_path / "in", "pkgc", {"f.py": "def f():\n    return 1\n"})
    outside = _package(tmp_path / "out", "other", {"f.py": "def f():\n    return 1\n"})
    traced, untraced = _load(inside / "f.py", "pkgc_f"), _load(outside / "f.py", "other_f")
    collector = Collector({"pkgc": inside}, backend=MONITORING)
    collector.start()
    try:
        traced.f(), untraced.f()
        events = [
            monitoring.get_local_events(monitoring.COVERAGE_ID, m.f.__code__)
            for m in (traced, untraced)
        ]
    finally:
        collector.stop()
    assert events == [monitoring.events.LINE, 0]
    assert monitoring.get_tool(monitoring.COVERAGE_ID) is None


def test_report_json_round_trips_with_package_totals() -> None:
    report = Report(SETTRACE, {"p/a.py": FileLines(4, (2, 3)), "p/b.py": FileLines(6, ())})
    data = json.loads(report.to_json())
    assert data["packages"] == {"p": {"executable": 10, "executed": 8, "percent": 80.0}}
    assert data["files"]["p/a.py"] == {"executable": 4, "executed": 2, "missed": [2, 3]}
    assert Report.from_json(report.to_json()) == report
    with pytest.raises(ValueError, match="format"):
        Report.from_json(json.dumps({**data, "format": 0}))


def test_merge_misses_only_what_every_run_missed() -> None:
    first = Report(SETTRACE, {"p/a.py": FileLines(5, (1, 2, 3)), "p/b.py": FileLines(2, (1, 2))})
    second = Report(MONITORING, {"p/a.py": FileLines(5, (3, 4))})
    merged = merge([first, second])
    assert merged.files == {"p/a.py": FileLines(5, (3,)), "p/b.py": FileLines(2, (1, 2))}
    assert merged.packages() == {"p": (4, 7)}
    assert merged.tracer == "settrace+sys.monitoring"
    with pytest.raises(ValueError, match="different sources"):
        merge([first, Report(SETTRACE, {"p/a.py": FileLines(6, ())})])


def _run_pytest(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            adapter_coverage.__name__,
            "-q",
            "-p",
            "no:cacheprovider",
            "tests",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )


def test_plugin_traces_the_adapters_from_before_the_conftests(tmp_path: Path) -> None:
    # A stand-in kvcore_vllm ahead of the real one on the path: the plugin finds the
    # adapters the pytest process would import.
    fake = _package(tmp_path / "site", "kvcore_vllm", {"mod.py": BRANCHY})
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "conftest.py").write_text("import kvcore_vllm.mod\n")
    (tests / "test_it.py").write_text(
        "import kvcore_vllm.mod\n\ndef test_never():\n    assert kvcore_vllm.mod.never() == 0\n"
    )
    output = tmp_path / "out" / "coverage.json"
    path = os.pathsep.join([str(fake.parent), str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, adapter_coverage.ENV: str(output)}
    done = _run_pytest(tmp_path, env)
    assert done.returncode == 0, done.stdout + done.stderr
    report = Report.from_json(output.read_text())
    # Module-level lines ran at the conftest's import; only the untaken branch is missed.
    assert report.files["kvcore_vllm/mod.py"] == FileLines(7, (4,))
    assert "kvcore_sglang/__init__.py" in report.files


def test_plugin_without_its_variable_traces_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(adapter_coverage.ENV, raising=False)
    previous = sys.gettrace()
    adapter_coverage.pytest_load_initial_conftests(None, None, [])
    assert sys.gettrace() is previous
    assert adapter_coverage._active == []


def test_coverage_env_names_the_report_only_in_modes_that_enable_kvcore() -> None:
    base = {"PATH": "/bin", adapter_coverage.ENV: "/elsewhere.json"}
    for mode in ("plugin", "patched", "classes"):
        assert coverage_env(base, mode, Path("/r.json")) == {
            "PATH": "/bin",
            adapter_coverage.ENV: "/r.json",
        }
    assert coverage_env(base, "stock", Path("/r.json")) == {"PATH": "/bin"}


def _traced(lane: Lane, suites: list[Suite], lane_coverage: tuple[Coverage, ...]) -> LaneResult:
    return LaneResult(
        lane.name,
        lane.engine,
        lane.mode,
        lane.version,
        "ok",
        1.0,
        suites=suites,
        coverage=lane_coverage,
    )


def test_coverage_table_in_compat_and_round_trip(tmp_path: Path) -> None:
    vllm = Lane("vllm", "plugin", "1")
    sglang = Lane("sglang", "patched", "2")
    stock = Lane("vllm", "stock", "1")
    other = Coverage("kvcore_sglang", 0, 300)
    results = {
        vllm.name: _traced(
            vllm,
            [
                Suite("vllm-tests", passed=3, coverage=(Coverage("kvcore_vllm", 50, 200), other)),
                Suite("integration", passed=2, coverage=(Coverage("kvcore_vllm", 120, 200), other)),
            ],
            (Coverage("kvcore_vllm", 150, 200), other),
        ),
        sglang.name: _traced(
            sglang,
            [Suite("integration", passed=2, coverage=(Coverage("kvcore_sglang", 1, 3),))],
            (Coverage("kvcore_sglang", 1, 3),),
        ),
        stock.name: _traced(stock, [Suite("integration", passed=2)], ()),
    }
    for result in results.values():
        save(result, tmp_path)
    assert load_all(tmp_path) == results
    text = render_compat([stock, vllm, sglang], results)
    section = text[text.index("## Adapter line coverage, by lane") :]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    assert rows == [
        "| Lane | Adapter | Engine's tests | Integration tests | Either |",
        "| vllm-1-plugin | `kvcore_vllm` | 25.0% (50/200) | 60.0% (120/200) | 75.0% (150/200) |",
        "| sglang-2-patched | `kvcore_sglang` | - | 33.3% (1/3) | 33.3% (1/3) |",
    ]
    # The lane table keeps its format; the section comes after it.
    assert text.index("| vllm | 1 | plugin | ok | 5 | 0 | 0 | 0 | 1.0 |") < text.index(section)


def test_compat_has_no_coverage_section_without_traced_lanes() -> None:
    lane = Lane("vllm", "stock", "1")
    text = render_compat([lane], {lane.name: _traced(lane, [Suite("integration")], ())})
    assert "coverage" not in text.lower()
