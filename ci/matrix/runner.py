"""Running one lane: its cached venv, its mode, its test suites, reduced to a LaneResult."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ci.matrix import adapter_coverage
from ci.matrix.lanes import DRIFT, Engine, Lane, Matrix
from ci.matrix.results import INTEGRATION, Coverage, LaneResult, Suite, parse_junit

REPO = Path(__file__).resolve().parents[2]
DRIFT_PROBE = Path(__file__).resolve().with_name("drift_probe.py")
# Written into a lane venv once its install script succeeded: the release it holds.
VENV_MARKER = ".kvcore-matrix-release"
# The modes in which the engine runs kvcore's adapter, so that its coverage is measured.
COVERAGE_MODES = ("plugin", "patched", "classes")


class LaneError(RuntimeError):
    """The lane could not run; the message goes into docs/compat.md."""


@dataclass(frozen=True)
class Workspace:
    """Where a run keeps venvs, logs, JUnit reports and lane results."""

    cache_dir: Path
    repo: Path = REPO

    @property
    def venvs(self) -> Path:
        return self.cache_dir / "venvs"

    @property
    def results(self) -> Path:
        return self.cache_dir / "results"

    def lane_dir(self, lane: Lane) -> Path:
        path = self.cache_dir / "lanes" / lane.name
        path.mkdir(parents=True, exist_ok=True)
        return path


def lane_env(engine: str, mode: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The lane's test environment: kvcore enabled, for ``engine`` only, in plugin mode and
    in classes mode (the engine's own tests with kvcore's classes under stock's names)."""
    env = dict(os.environ if base is None else base)
    env.pop("KVCORE_ENABLE", None)
    if mode in ("plugin", "classes"):
        env["KVCORE_ENABLE"] = engine
    return env


def integration_env(
    engine: str, mode: str, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Our integration tests' environment: as :func:`lane_env`, but a patched build off.

    They compare kvcore against the engine as released, so a patched build, active by
    default, must be turned off for them (``KVCORE_ENABLE=0``); tests/integration's
    patch tests check the active patched build in subprocesses of their own.
    """
    env = lane_env(engine, mode, base)
    if mode == "patched":
        env["KVCORE_ENABLE"] = "0"
    return env


def coverage_env(env: Mapping[str, str], mode: str, report: Path) -> dict[str, str]:
    """``env`` naming ``report`` as the adapter coverage output in the modes that trace
    the adapters; in the others without the variable, whatever the caller's was."""
    env = dict(env)
    env.pop(adapter_coverage.ENV, None)
    if mode in COVERAGE_MODES:
        env[adapter_coverage.ENV] = str(report)
    return env


def newest_release(engine: str) -> str:
    """The newest release of ``engine`` on the package index, as pip reports it."""
    out = _run(
        [sys.executable, "-m", "pip", "index", "versions", engine, "--disable-pip-version-check"],
        log=None,
    )
    return parse_index_versions(engine, out)


def parse_index_versions(engine: str, output: str) -> str:
    """The version in ``pip index versions`` output (``ENGINE (X.Y.Z)`` first line)."""
    match = re.search(rf"^{re.escape(engine)} \(([^)]+)\)", output, re.MULTILINE)
    if match is None:
        raise LaneError(f"pip index versions {engine} gave no version: {_tail(output)}")
    return match.group(1)


def ensure_venv(ws: Workspace, engine: Engine, version: str, name: str, log: Path) -> Path:
    """The lane venv ``name`` holding ``engine`` ``version``, built by the engine's install
    script unless a previous run already did."""
    venv = ws.venvs / name
    marker = venv / VENV_MARKER
    if marker.is_file() and marker.read_text(encoding="utf-8").strip() == version:
        point_kvcore_at(venv, ws.repo, log)
        return venv
    ws.venvs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, engine.version_env: version}
    try:
        _run(["bash", str(ws.repo / engine.install), str(venv)], log=log, env=env, cwd=ws.repo)
    except LaneError as exc:
        raise LaneError(f"installing {engine.name} {version} failed: {exc}") from None
    marker.write_text(version + "\n", encoding="utf-8")
    return venv


# Where the venv finds kvcore and its adapters: one folder a line, the package's parent.
_KVCORE_SOURCE = (
    "import importlib, pathlib\n"
    "for name in ('kvcore', 'kvcore_sglang', 'kvcore_vllm'):\n"
    "    print(pathlib.Path(importlib.import_module(name).__file__).parents[1])"
)


def point_kvcore_at(venv: Path, repo: Path, log: Path | None) -> None:
    """Make the venv's editable kvcore (the core and both adapters) this checkout's.

    A cached venv keeps the editable install of whichever checkout built it (another clone,
    a CI copy): its lanes would import that checkout's kvcore while running this one's tests.
    The check runs outside the checkout, where the working directory cannot hide a stale
    install of the core, and looks at the adapters too.
    """
    python = str(venv / "bin" / "python")
    try:
        installed = _run([python, "-c", _KVCORE_SOURCE], log=log, cwd=venv).split()
    except LaneError:
        # The checkout that built the venv is gone: its editable install imports nothing.
        installed = []
    expected = [repo, repo / "integrations", repo / "integrations"]
    if [Path(p).resolve() for p in installed] != [p.resolve() for p in expected]:
        pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-deps"]
        _run([*pip, "-e", str(repo)], log=log)


def apply_patches(venv: Path, engine: str, log: Path) -> None:
    """Apply kvcore's vendored patches to the venv's engine unless they already are."""
    kvcore = [str(venv / "bin" / "python"), "-m", "kvcore", "patches"]
    try:
        state = _run([*kvcore, "check", "--engine", engine], log=log)
        if re.search(r": applied$", state.splitlines()[0] if state else "", re.MULTILINE):
            return
        _run([*kvcore, "apply", "--engine", engine], log=log)
    except LaneError as exc:
        if "invalid choice: 'patches'" in str(exc):
            raise LaneError("`python -m kvcore patches`: no such command") from None
        raise LaneError(f"`kvcore patches` failed: {exc}") from None


def run_suites(
    ws: Workspace, engine: Engine, lane: Lane, venv: Path
) -> tuple[list[Suite], tuple[Coverage, ...]]:
    """The engine's shipped tests (where it ships them) and our integration tests, and the
    adapter lines any of them executed (nothing where the mode is not traced)."""
    lane_dir = ws.lane_dir(lane)
    traced = lane.mode in COVERAGE_MODES
    runs: list[tuple[Suite, adapter_coverage.Report | None]] = []
    if engine.upstream_tests:
        name = f"{engine.name}-tests"
        junit = lane_dir / "upstream.xml"
        command = ["bash", str(ws.repo / engine.upstream_tests), str(venv), lane.mode, str(junit)]
        env = lane_env(engine.name, lane.mode)
        runs.append(_pytest_suite(name, command, junit, lane_dir, lane.mode, env, ws))
    junit = lane_dir / "integration.xml"
    command = [
        str(venv / "bin" / "python"),
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        *(["-p", adapter_coverage.__name__] if traced else []),
        "-q",
        f"--junitxml={junit}",
        engine.integration_tests,
    ]
    env = integration_env(engine.name, lane.mode)
    runs.append(_pytest_suite(INTEGRATION, command, junit, lane_dir, lane.mode, env, ws))
    reports = [report for _, report in runs if report is not None]
    lane_coverage = _package_coverage(adapter_coverage.merge(reports)) if reports else ()
    return [suite for suite, _ in runs], lane_coverage


def drift_verdict(venv: Path, engine: str, log: Path) -> dict[str, object]:
    """What the drift probe says about the release installed in ``venv``."""
    out = _run([str(venv / "bin" / "python"), str(DRIFT_PROBE), engine], log=log)
    verdict: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return verdict


def run_lane(ws: Workspace, matrix: Matrix, lane: Lane) -> LaneResult:
    """Run ``lane`` end to end; never raises for a lane that cannot run (status error)."""
    engine = matrix.engines[lane.engine]
    start = time.monotonic()
    log = ws.lane_dir(lane) / "lane.log"
    log.write_text("", encoding="utf-8")
    version = lane.version
    result = LaneResult(lane.name, lane.engine, lane.mode, version, "ok", 0.0)
    try:
        if lane.mode == DRIFT:
            version = result.version = newest_release(engine.name)
        assert version is not None
        venv = ensure_venv(ws, engine, version, lane.venv_name(version), log)
        if lane.mode == DRIFT:
            verdict = drift_verdict(venv, engine.name, log)
            changed = verdict["changed"]
            assert isinstance(changed, dict)
            result.changed_targets = {str(k): str(v) for k, v in changed.items()}
            result.unsupported_newest = not verdict["tested"]
            tested = "a tested" if verdict["tested"] else "not a tested"
            result.message = (
                f"{version} is {tested} release; its targets compared with "
                f"{verdict['newest_tested']}'s fingerprints"
            )
        else:
            if lane.mode == "patched":
                apply_patches(venv, engine.name, log)
            result.suites, result.coverage = run_suites(ws, engine, lane, venv)
            if result.failed:
                result.status = "failed"
    except LaneError as exc:
        result.status, result.message = "error", str(exc)
    result.minutes = (time.monotonic() - start) / 60
    return result


def _pytest_suite(
    name: str,
    command: Sequence[str],
    junit: Path,
    lane_dir: Path,
    mode: str,
    env: Mapping[str, str],
    ws: Workspace,
) -> tuple[Suite, adapter_coverage.Report | None]:
    junit.unlink(missing_ok=True)
    report = lane_dir / f"{name}.coverage.json"
    report.unlink(missing_ok=True)
    log = lane_dir / f"{name}.log"
    with log.open("w", encoding="utf-8") as out:
        code = subprocess.run(
            list(command),
            cwd=ws.repo,
            env=coverage_env(env, mode, report),
            stdout=out,
            stderr=subprocess.STDOUT,
        ).returncode
    # pytest exits 1 when tests fail; anything else without a report means it did not run.
    if not junit.is_file():
        raise LaneError(f"{name} exited {code} without a report: {_tail(log.read_text())}")
    suite = parse_junit(name, junit.read_text(encoding="utf-8"))
    if not report.is_file():
        return suite, None
    traced = adapter_coverage.Report.from_json(report.read_text(encoding="utf-8"))
    return replace(suite, coverage=_package_coverage(traced)), traced


def _package_coverage(report: adapter_coverage.Report) -> tuple[Coverage, ...]:
    return tuple(
        Coverage(package, executed, executable)
        for package, (executed, executable) in sorted(report.packages().items())
    )


def _run(
    command: Sequence[str],
    log: Path | None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> str:
    """stdout and stderr of ``command``, also appended to ``log``; LaneError if it fails."""
    done = subprocess.run(
        list(command),
        cwd=cwd,
        env=None if env is None else dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if log is not None:
        with log.open("a", encoding="utf-8") as out:
            out.write(f"$ {' '.join(command)}\n{done.stdout}\n")
    if done.returncode != 0:
        raise LaneError(f"exit {done.returncode}: {_tail(done.stdout)}")
    return done.stdout


def _tail(text: str, lines: int = 3) -> str:
    kept = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " / ".join(kept[-lines:])
