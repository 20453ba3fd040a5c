"""``kvcore launch`` end to end: the command in a subprocess, as a user runs it, and what the
user sees (stdout, stderr, exit status). A fake engine module stands where the engine's
server would start and reports the arguments and KVCORE_* variables it got."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvcore import launch
from kvcore.config import SETTINGS
from kvcore.launch import ENGINE_ENTRY_MODULES

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
STAGING = next(s for s in SETTINGS if s.name == "staging_bytes")
WARNING = "kvcore launch: warning: "
FAKE_ENGINE = textwrap.dedent(
    """
    import json, os, sys
    print("fake engine started", file=sys.stderr)
    env = {k: v for k, v in os.environ.items() if k.startswith("KVCORE_")}
    metrics_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    print(json.dumps({"argv": sys.argv[1:], "env": env, "metrics_dir": metrics_dir}))
    """
)
# Variables that change what kvcore says; the tests set the ones they mean to.
OWN_VARIABLES = (
    "KVCORE_",
    "SGLANG_PLUGINS",
    "VLLM_PLUGINS",
    "VLLM_USE_SIMPLE_KV_OFFLOAD",
    "PROMETHEUS_MULTIPROC_DIR",
    "prometheus_multiproc_dir",
)


def run_python(
    argv: list[str], env: dict[str, str] | None = None, path: tuple[Path, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """``python -S ARGV`` with the worktree (and ``path``) on PYTHONPATH.

    -S leaves site-packages out: an engine installed there can then neither shadow a
    fake one nor add a version warning; kvcore launch itself needs nothing from there.
    """
    environ = {k: v for k, v in os.environ.items() if not k.startswith(OWN_VARIABLES)}
    search = [*map(str, path), str(ROOT), str(ROOT / "integrations")]
    environ.update(PYTHONPATH=os.pathsep.join(search), **(env or {}))
    return subprocess.run(
        [sys.executable, "-S", *argv], capture_output=True, text=True, env=environ, timeout=60
    )


def kvcore(*argv: str, env: dict[str, str] | None = None, path: tuple[Path, ...] = ()):
    return run_python(["-m", "kvcore", *argv], env, path)


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Path:
    """A folder holding a fake entry module for every engine."""
    root = tmp_path_factory.mktemp("engines")
    for module in ENGINE_ENTRY_MODULES.values():
        *packages, name = module.split(".")
        folder = root
        for package in packages:
            folder = folder / package
            folder.mkdir(exist_ok=True)
            (folder / "__init__.py").write_text("")
        (folder / f"{name}.py").write_text(FAKE_ENGINE)
    return root


def engine_saw(result: subprocess.CompletedProcess[str]) -> dict:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def warnings_before_start(stderr: str) -> list[str]:
    """The warning lines, checked to be all of stderr before the engine started."""
    lines = stderr.splitlines()
    start = lines.index("fake engine started")
    assert lines[start + 1 :] == []
    assert all(line.startswith(WARNING) for line in lines[:start]), stderr
    return [line.removeprefix(WARNING) for line in lines[:start]]


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["launch", "--help"], {}),
        (["launch", "sglang", "--kvcore-transfers", "--help"], {"KVCORE_GATHER_CTAS": "lots"}),
        (["launch", "vllm", "-h", "--", "serve", "m"], {}),
    ],
)
def test_help_shows_every_setting_for_any_engine_installed_or_not(argv, env):
    result = kvcore(*argv, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    out = result.stdout
    assert out.startswith("usage: kvcore launch ENGINE")
    for setting in SETTINGS:
        assert f"{setting.flag}{'' if setting.is_bool else ' VALUE'}  [{setting.env};" in out
        assert f"default {setting.default_text()}]" in out
    assert "--enable-hierarchical-cache" in out and "--kv-offloading-size" in out
    assert "kvcore launch sglang -- --help" in out


def test_engine_help_after_the_separator_goes_to_the_engine(engines):
    result = kvcore("launch", "sglang", "--", "--help", path=(engines,))
    assert engine_saw(result)["argv"] == ["--help"]
    # Asked for its help, the engine's arguments say nothing about kvcore: no warning.
    assert warnings_before_start(result.stderr) == []


@pytest.mark.parametrize("argv", [["launch"], ["launch", "--", "x"]])
def test_missing_engine_is_one_plain_line_naming_the_choices(argv):
    result = kvcore(*argv)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "kvcore launch: name the engine to start: sglang or vllm (kvcore launch --help)"
    ]


@pytest.mark.parametrize(
    ("engine_args", "env", "expected"),
    [
        (["--model-path", "m"], {}, ["add --enable-hierarchical-cache"]),
        (
            ["--model-path", "m", "--enable-hicache"],
            {"SGLANG_PLUGINS": "other"},
            ["SGLANG_PLUGINS='other' leaves out kvcore's plugin: add kvcore to it"],
        ),
    ],
)
def test_sglang_warnings_come_before_the_engine_starts(engines, engine_args, env, expected):
    result = kvcore("launch", "sglang", "--", *engine_args, env=env, path=(engines,))
    assert engine_saw(result)["argv"] == engine_args
    warnings = warnings_before_start(result.stderr)
    assert len(warnings) == len(expected)
    for warning, fragment in zip(warnings, expected, strict=True):
        assert fragment in warning


@pytest.mark.parametrize(
    ("engine_args", "env", "expected"),
    [
        (["serve", "m"], {}, ["add --kv-offloading-size <GiB>"]),
        (["serve", "m", "--kv-offloading-size", "8"], {}, []),
        (
            ["serve", "m", "--kv-offloading-size", "8"],
            {"VLLM_PLUGINS": "", "VLLM_USE_SIMPLE_KV_OFFLOAD": "1"},
            ["VLLM_PLUGINS='' leaves out kvcore's plugin", "VLLM_USE_SIMPLE_KV_OFFLOAD"],
        ),
    ],
)
def test_vllm_warnings_come_before_the_engine_starts(engines, engine_args, env, expected):
    result = kvcore("launch", "vllm", "--", *engine_args, env=env, path=(engines,))
    assert engine_saw(result)["argv"] == engine_args
    warnings = warnings_before_start(result.stderr)
    assert len(warnings) == len(expected)
    for warning, fragment in zip(warnings, expected, strict=True):
        assert fragment in warning


def test_dry_run_warns_too_and_starts_nothing(engines):
    result = kvcore("launch", "vllm", "--dry-run", "--", "serve", "m", path=(engines,))
    assert result.returncode == 0
    assert result.stdout.startswith("environment (set by kvcore launch):")
    assert result.stderr.splitlines() == [
        WARNING + "vLLM would run without CPU offloading, so kvcore would have nothing to "
        "serve: add --kv-offloading-size <GiB>"
    ]


def test_an_untested_engine_version_is_a_warning(engines, tmp_path):
    dist_info = tmp_path / "sglang-0.4.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.4.0\n")
    argv = ["launch", "sglang", "--", "--enable-hicache"]
    result = kvcore(*argv, path=(engines, tmp_path))
    assert engine_saw(result)["argv"] == ["--enable-hicache"]
    assert warnings_before_start(result.stderr) == [
        "sglang 0.4.0 is not a version kvcore has tested (0.5.22, 0.5.23), so it would run "
        "stock: install a tested one"
    ]


@pytest.mark.parametrize(
    ("argv", "env", "line"),
    [
        (
            [],
            {"KVCORE_GATHER_CTAS": "lots"},
            "KVCORE_GATHER_CTAS='lots': not an integer; allowed: an integer from 1 to 1024; "
            "set one, or unset KVCORE_GATHER_CTAS for the default (8)",
        ),
        (
            ["--kvcore-staging-bytes=0"],
            {},
            "--kvcore-staging-bytes='0': below the minimum of 1; allowed: "
            + STAGING.kind.allowed
            + "; the default is 256MiB",
        ),
        (
            ["--kvcore-staging-byte", "1G"],
            {},
            "unknown kvcore flag --kvcore-staging-byte (did you mean --kvcore-staging-bytes?); "
            "known: " + ", ".join(s.flag for s in SETTINGS),
        ),
    ],
)
def test_a_bad_setting_stops_the_launch_with_one_line(engines, argv, env, line):
    result = kvcore("launch", "sglang", *argv, "--", "--enable-hicache", env=env, path=(engines,))
    assert result.returncode == 2
    assert result.stdout == ""  # the engine never started
    assert result.stderr.splitlines() == [f"kvcore launch: {line}"]


def declared_entry_points() -> dict[str, str]:
    with open(ROOT / "pyproject.toml", "rb") as file:
        groups = tomllib.load(file)["project"]["entry-points"]
    return {group: points["kvcore"] for group, points in groups.items()}


# Each engine's plugin entry point, called twice as engines may; what would activate
# kvcore is recorded instead of run, and the calls counted.
ACTIVATIONS = {"sglang.srt.plugins": "register_hooks", "vllm.general_plugins": "activate"}
ENTRY_POINTS_SCRIPT = textwrap.dedent(
    """
    import importlib, json, sys
    counts = []
    for value, activation in json.loads(sys.argv[1]):
        module, function = value.split(":")
        entry = importlib.import_module(module)
        calls = []
        setattr(entry, activation, lambda *args, calls=calls: calls.append(args))
        getattr(entry, function)()
        getattr(entry, function)()
        counts.append(len(calls))
    print(counts)
    """
)


def call_entry_points(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    points = [(value, ACTIVATIONS[group]) for group, value in declared_entry_points().items()]
    return run_python(["-c", ENTRY_POINTS_SCRIPT, json.dumps(points)], env)


@pytest.mark.parametrize(
    ("name", "value"), [("KVCORE_STAGED_PIECES", "99"), ("KVCORE_ENABLE", "sglang;vllm")]
)
def test_plugin_entry_points_with_a_bad_value_log_one_line_and_leave_the_engine_stock(name, value):
    assert list(declared_entry_points()) == list(ACTIVATIONS)
    result = call_entry_points({"KVCORE_ENABLE": "sglang,vllm", name: value})
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[0, 0]\n"
    lines = result.stderr.splitlines()
    assert len(lines) == 2, result.stderr
    for line, engine in zip(lines, ("SGLang", "vLLM"), strict=True):
        assert line.startswith(f"kvcore: {name}={value!r}: ")
        assert f"; set one, or unset {name} for the default (" in line
        assert line.endswith(f"; {engine} runs stock")


def test_plugin_entry_points_with_good_values_activate():
    result = call_entry_points({"KVCORE_ENABLE": "sglang,vllm"})
    assert (result.stdout, result.stderr) == ("[2, 2]\n", "")


def test_metrics_get_a_fresh_multiprocess_directory_unless_one_is_set_or_metrics_are_off(
    engines, tmp_path
):
    """The engine serves /metrics from another process than the one kvcore counts in:
    launch turns on prometheus_client's multiprocess mode, in a new empty directory."""
    argv = ("launch", "vllm", "--", "serve", "m", "--kv-offloading-size", "8")
    first, second = (engine_saw(kvcore(*argv, path=(engines,)))["metrics_dir"] for _ in "12")
    for made in (first, second):
        assert Path(made).is_dir() and Path(made).name.startswith("kvcore-metrics-")
        assert list(Path(made).iterdir()) == []
    assert first != second
    own = str(tmp_path)
    seen = engine_saw(kvcore(*argv, env={"PROMETHEUS_MULTIPROC_DIR": own}, path=(engines,)))
    assert seen["metrics_dir"] == own
    off = engine_saw(kvcore(*argv, env={"KVCORE_METRICS": "0"}, path=(engines,)))
    assert off["metrics_dir"] is None


def test_an_adapter_that_does_not_import_leaves_help_working_and_stops_its_launch(
    monkeypatch,
):
    monkeypatch.setitem(launch.ADAPTERS, "vllm", "kvcore_no_such_adapter")
    epilog = launch._epilog()
    assert "kvcore_no_such_adapter.launch_checks does not import" in epilog
    # The other engine's line is its adapter's own.
    assert "--enable-hierarchical-cache" in epilog
    with pytest.raises(launch.LaunchError, match=r"vllm adapter \(kvcore_no_such_adapter\)"):
        launch.idle_warnings("vllm", ["serve", "m"], launch.KVCoreConfig(), {})
