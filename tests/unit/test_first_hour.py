"""What a new user's first hour runs into: each bad input ends in one line on stderr that
names the value and the fix, with exit status 2 (never a traceback), or it just works."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

import kvcore.patching
from kvcore.bench import cli as bench_cli
from kvcore.bench import suite, suite_options
from kvcore.cli import BROKEN_PIPE_STATUS, main
from kvcore.config import KVCoreConfig
from kvcore.config_values import STAGING_MAX_BYTES, ConfigError
from kvcore.patching.patchset import DEFAULT_PATCHES_DIR, available_versions

REPO = Path(__file__).resolve().parents[2]
PYTHONPATH = os.pathsep.join([str(REPO), str(REPO / "integrations")])


def one_error_line(capsys: pytest.CaptureFixture[str], prefix: str) -> str:
    """The only line on stderr, after checking that it is one line with ``prefix`` and that
    nothing went to stdout."""
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(prefix)
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def no_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any measurement started fails the test: the checks must come before the run."""

    def run(*args: Any, **kwargs: Any) -> dict[str, Any]:
        raise AssertionError("the measurement started")

    monkeypatch.setattr(suite, "run", run)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVCORE_"):
            monkeypatch.delenv(name)


# --- kvcore bench's options --------------------------------------------------------------


def build_bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    return parser


@pytest.mark.parametrize("tokens", ["1", "-5", "0", "100"])
def test_bench_tokens_off_the_page_grid_name_the_smallest_allowed_value(
    capsys: pytest.CaptureFixture[str], no_measuring: None, tokens: str
) -> None:
    assert main(["bench", "--quick", "--tokens", tokens]) == 2
    line = one_error_line(capsys, f"kvcore bench: --tokens {tokens}:")
    assert f"at least {suite_options.PAGE}" in line and f"multiple of {suite_options.PAGE}" in line


def test_bench_tokens_left_out_takes_the_default_and_one_page_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_bench_parser()
    assert suite_options.options_for(parser.parse_args(["--quick"])).tokens == 16384
    assert suite_options.options_for(parser.parse_args([])).tokens == 131072
    args = parser.parse_args(["--quick", "--device", "cpu", "--tokens", str(suite_options.PAGE)])
    assert bench_cli.argument_problems(args) == []
    opts = dataclasses.replace(
        suite_options.options_for(args),
        row_kinds=("mla-1152B",),
        allocator_slots=1024,
        allocator_ops=50,
    )
    report = suite.run(opts, progress=False)
    assert report["tokens"] == suite_options.PAGE
    assert all(result["identical"] for result in report["results"])


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--repeats", "-3"], "--repeats -3:"),
        (["--repeats", "0"], "--repeats 0:"),
        (["--sizes", "2048,lots"], "'lots'"),
        (["--sizes", "2048,0"], "'0'"),
        (["--sizes", "2048,"], "an empty entry"),
        (["--tokens", "0"], "--tokens 0: give a request size of 1 or more"),
    ],
)
def test_bench_sweep_counts_must_be_positive(
    capsys: pytest.CaptureFixture[str], argv: list[str], named: str
) -> None:
    # Checked before the engine is looked for, installed or not.
    assert main(["bench", "--engine", "sglang", "--sweep", *argv]) == 2
    assert named in one_error_line(capsys, "kvcore bench: ")


def test_bench_sweep_sizes_and_tokens_take_any_positive_request_size() -> None:
    args = build_bench_parser().parse_args(
        ["--engine", "sglang", "--sweep", "--sizes", "100, 2048", "--tokens", "1", "--repeats", "1"]
    )
    assert bench_cli.argument_problems(args) == []


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "cannot read it (No such file or directory)"),
        ("not json at all", "not JSON"),
        ("{}", "it lacks device, ceiling_gbps, page_out_host_syncs, results, allocator"),
        ("[1, 2]", "it holds a JSON list, not an object"),
        ('{"device": "cpu", "ceiling_gbps": 1, "page_out_host_syncs": null, "results": {}, '
         '"allocator": {}}', "its results are not a list"),
    ],
)  # fmt: skip
def test_bench_from_json_that_is_no_report_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str | None, problem: str
) -> None:
    path = tmp_path / "report.json"
    if content is not None:
        path.write_text(content)
    assert main(["bench", "--from-json", str(path)]) == 2
    line = one_error_line(capsys, f"kvcore bench: --from-json {path}: ")
    assert problem in line


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_bench_output_into_a_missing_folder_fails_before_the_run(
    capsys: pytest.CaptureFixture[str], no_measuring: None, tmp_path: Path, option: str
) -> None:
    path = tmp_path / "no-such-folder" / "out.png"
    assert main(["bench", "--quick", option, str(path)]) == 2
    line = one_error_line(capsys, f"kvcore bench: {option} {path}: ")
    assert f"the folder {path.parent} does not exist" in line


def test_bench_output_onto_a_folder_fails_before_the_run(
    capsys: pytest.CaptureFixture[str], no_measuring: None, tmp_path: Path
) -> None:
    assert main(["bench", "--quick", "--json", str(tmp_path)]) == 2
    assert "is a folder" in one_error_line(capsys, "kvcore bench: --json")


def test_bench_plot_in_a_format_matplotlib_cannot_write_fails_before_the_run(
    capsys: pytest.CaptureFixture[str], no_measuring: None, tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "chart.xyz"
    assert main(["bench", "--quick", "--plot", str(path)]) == 2
    line = one_error_line(capsys, f"kvcore bench: --plot {path}: ")
    assert "cannot write .xyz" in line and ".png" in line and ".svg" in line


@pytest.mark.parametrize("name", ["chart.png", "chart.PDF", "chart.svg", "chart"])
def test_bench_plot_names_matplotlib_writes_pass(tmp_path: Path, name: str) -> None:
    pytest.importorskip("matplotlib")
    args = build_bench_parser().parse_args(["--plot", str(tmp_path / name)])
    assert bench_cli.argument_problems(args) == []


@pytest.mark.parametrize(
    ("engine", "argv"),
    [("sglang", ["--sweep"]), ("vllm", ["--sweep"]), ("sglang", [])],
)
def test_bench_engine_not_installed_is_one_line_with_the_install(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    engine: str,
    argv: list[str],
) -> None:
    find_spec = importlib.util.find_spec
    # The check must hold where the engine is installed too: hide it there.
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == engine else find_spec(name, *args),
    )
    assert main(["bench", "--engine", engine, *argv]) == 2
    line = one_error_line(capsys, f"kvcore bench: --engine {engine}: {engine} is not installed")
    assert sys.executable in line
    assert f"ci/install_{engine}.sh" in line


# --- a broken pipe -----------------------------------------------------------------------


def test_doctor_into_a_closed_pipe_exits_quietly() -> None:
    """``kvcore doctor | head -3`` where head has gone: no traceback, SIGPIPE's status."""
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    process = subprocess.Popen(
        [sys.executable, "-m", "kvcore", "doctor"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert process.stdout is not None and process.stderr is not None
    # Closed before the child has imported anything: its first write finds no reader.
    process.stdout.close()
    err = process.stderr.read().decode()
    assert process.wait(timeout=120) == BROKEN_PIPE_STATUS == 141
    assert err == ""


# --- settings ----------------------------------------------------------------------------

BAD_VARIABLES = {
    "KVCORE_GATHER_CTAS": "lots",
    "KVCORE_STAGING_BYTES": "99999999T",
    "KVCORE_METRICS": "maybe",
}


def test_every_bad_variable_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as error:
        KVCoreConfig.from_env({**BAD_VARIABLES, "KVCORE_STAGED_PIECES": "2"})
    problems = error.value.problems
    assert len(problems) == len(BAD_VARIABLES)
    for name, problem in zip(sorted(BAD_VARIABLES), sorted(problems), strict=True):
        assert problem.startswith(f"{name}={BAD_VARIABLES[name]!r}: ")
    assert str(error.value).splitlines() == list(problems)


def test_every_bad_setting_in_code_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as error:
        KVCoreConfig(gather_ctas=0, staged_pieces=99)
    assert [p.split("=")[0] for p in error.value.problems] == ["gather_ctas", "staged_pieces"]


def test_the_cli_prints_every_bad_variable_without_a_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, clean_env: None
) -> None:
    for name, value in BAD_VARIABLES.items():
        monkeypatch.setenv(name, value)
    assert main(["doctor"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    lines = err.splitlines()
    assert sorted(line.split("=")[0] for line in lines) == [
        f"kvcore doctor: {name}" for name in sorted(BAD_VARIABLES)
    ]


def test_launch_reports_bad_flags_and_bad_variables_together(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, clean_env: None
) -> None:
    monkeypatch.setenv("KVCORE_GATHER_CTAS", "lots")
    argv = ["--kvcore-staged-pieces", "99", "--kvcore-bogus", "--kvcore-staging-bytes", "9P"]
    assert main(["launch", "sglang", *argv, "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 4
    assert all(line.startswith("kvcore launch: ") for line in lines)
    for named in ("--kvcore-staged-pieces='99'", "--kvcore-bogus", "KVCORE_GATHER_CTAS='lots'"):
        assert sum(named in line for line in lines) == 1
    assert sum("--kvcore-staging-bytes='9P'" in line for line in lines) == 1


@pytest.mark.parametrize("text", ["99999999T", "1025GiB", str(STAGING_MAX_BYTES + 1), "2TB"])
def test_staging_bytes_above_a_tebibyte_are_refused(text: str) -> None:
    with pytest.raises(ConfigError) as error:
        KVCoreConfig.from_env({"KVCORE_STAGING_BYTES": text})
    (problem,) = error.value.problems
    assert problem.startswith(f"KVCORE_STAGING_BYTES={text!r}: above the maximum of 1TiB")
    assert "no GPU holds that" in problem


def test_staging_bytes_up_to_a_tebibyte_are_taken() -> None:
    assert KVCoreConfig.from_env({"KVCORE_STAGING_BYTES": "1T"}).staging_bytes == STAGING_MAX_BYTES
    assert KVCoreConfig.from_env({"KVCORE_STAGING_BYTES": "141GB"}).staging_bytes == 141 * 10**9


def test_launch_refuses_huge_staging_bytes_in_one_line(
    capsys: pytest.CaptureFixture[str], clean_env: None
) -> None:
    argv = ["launch", "sglang", "--kvcore-staging-bytes", "99999999T", "--dry-run"]
    assert main(argv) == 2
    line = one_error_line(capsys, "kvcore launch: --kvcore-staging-bytes='99999999T': ")
    assert "at most 1TiB" in line


def dry_run_plan(out: str) -> dict[str, str]:
    """The variables a dry run says it sets."""
    lines = out.splitlines()
    body = lines[lines.index("environment (set by kvcore launch):") + 1 : lines.index("command:")]
    return dict(line.strip().split("=", 1) for line in body if "=" in line)


@pytest.mark.parametrize(
    ("argv", "variable", "said"),
    [
        (["--kvcore-enable", "0"], None, "--kvcore-enable 0"),
        (["--kvcore-enable=off"], None, "--kvcore-enable 0"),
        ([], "0", "KVCORE_ENABLE=0"),
        ([], "false", "KVCORE_ENABLE=false"),
    ],
)
def test_launch_with_kvcore_turned_off_starts_the_engine_stock(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    clean_env: None,
    argv: list[str],
    variable: str | None,
    said: str,
) -> None:
    if variable is not None:
        monkeypatch.setenv("KVCORE_ENABLE", variable)
    assert main(["launch", "sglang", *argv, "--dry-run", "--", "--model-path", "m"]) == 0
    out, err = capsys.readouterr()
    plan = dry_run_plan(out)
    assert KVCoreConfig.from_env({**os.environ, **plan}).enable == frozenset()
    notes = [line for line in err.splitlines() if "turns kvcore off" in line]
    assert notes == [
        f"kvcore launch: note: {said} turns kvcore off: sglang starts stock, without kvcore "
        "(drop it to start with kvcore)"
    ]
    # kvcore has nothing to say about an engine it stays out of.
    assert "warning" not in err


@pytest.mark.parametrize(
    ("argv", "variable", "enabled"),
    [
        (["--kvcore-enable", "0", "--kvcore-enable", "sglang"], None, {"sglang"}),
        (["--kvcore-enable", "sglang"], "0", {"sglang"}),
        ([], "vllm", {"sglang", "vllm"}),
        ([], "", {"sglang"}),
    ],
)
def test_launch_enables_the_engine_unless_turned_off(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    clean_env: None,
    argv: list[str],
    variable: str | None,
    enabled: set[str],
) -> None:
    if variable is not None:
        monkeypatch.setenv("KVCORE_ENABLE", variable)
    assert main(["launch", "sglang", *argv, "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert KVCoreConfig.from_env({**os.environ, **dry_run_plan(out)}).enable == enabled
    assert "turns kvcore off" not in err


def test_launch_turned_off_execs_the_engine_stock(tmp_path: Path) -> None:
    package = tmp_path / "sglang"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(
        textwrap.dedent(
            """
            import json, os, sys
            names = ("KVCORE_ENABLE", "PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")
            print(json.dumps({"argv": sys.argv[1:], "env": {n: os.environ.get(n) for n in names}}))
            """
        )
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("KVCORE_") and k.lower() != "prometheus_multiproc_dir"
    }
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), PYTHONPATH])
    result = subprocess.run(
        [sys.executable, "-m", "kvcore", "launch", "sglang", "--kvcore-enable", "0", "--", "-x"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["argv"] == ["-x"]
    # Stock: kvcore's plugin reads kvcore off, and no metrics directory was made for it.
    assert seen["env"] == {
        "KVCORE_ENABLE": "0",
        "PROMETHEUS_MULTIPROC_DIR": None,
        "prometheus_multiproc_dir": None,
    }
    assert result.stderr.splitlines() == [
        "kvcore launch: note: --kvcore-enable 0 turns kvcore off: sglang starts stock, "
        "without kvcore (drop it to start with kvcore)"
    ]


# --- packaging ---------------------------------------------------------------------------


def test_patches_list_with_no_patch_sets_fails_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["patches", "list", "--patches", str(tmp_path)]) == 2
    line = one_error_line(capsys, "kvcore patches list: no patch sets for sglang or vllm in ")
    assert str(tmp_path) in line and "--patches" in line
    assert main(["patches", "list", "--engine", "vllm", "--patches", str(tmp_path)]) == 2
    assert "no patch sets for vllm in" in one_error_line(capsys, "kvcore patches list: ")


def test_the_default_patch_sets_are_the_package_s_own() -> None:
    """In a checkout the package's sets/ is the repository's patches/, which holds every
    set (a wheel carries a copy: test_a_wheel_carries_the_patch_sets_and_the_license)."""
    assert Path(kvcore.patching.__file__).parent.joinpath("sets").resolve() == DEFAULT_PATCHES_DIR
    assert DEFAULT_PATCHES_DIR.samefile(REPO / "patches")
    assert available_versions(DEFAULT_PATCHES_DIR, "sglang")
    assert available_versions(DEFAULT_PATCHES_DIR, "vllm")


def test_a_wheel_carries_the_patch_sets_and_the_license(tmp_path: Path) -> None:
    if int(version("setuptools").split(".")[0]) < 77:
        pytest.skip("the build needs setuptools>=77 installed (pyproject's build-system)")
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        (source / name).write_bytes((REPO / name).read_bytes())
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    shutil.copytree(REPO / "kvcore", source / "kvcore", symlinks=True, ignore=skip)
    shutil.copytree(REPO / "integrations", source / "integrations", ignore=skip)
    shutil.copytree(REPO / "patches", source / "patches", ignore=skip)
    out = tmp_path / "dist"
    build = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from setuptools import build_meta; "
            "print(build_meta.build_wheel(sys.argv[1]))",
            str(out),
        ],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = out / build.stdout.split()[-1]
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read("kvcore-0.1.0.dist-info/METADATA").decode()
    expected = {
        f"kvcore/patching/sets/{path.relative_to(REPO / 'patches').as_posix()}"
        for path in (REPO / "patches").rglob("*")
        if path.is_file()
    }
    assert any(name.endswith("/manifest.json") for name in expected)
    assert expected <= names
    assert "kvcore-0.1.0.dist-info/licenses/LICENSE" in names
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
    assert not any(name.startswith("patches/") for name in names)


def test_a_core_suite_too_large_for_this_host_says_so_before_it_starts(monkeypatch, capsys):
    from kvcore.bench import suite as core_suite

    monkeypatch.setattr(core_suite, "available_bytes", lambda: 1 << 30)
    assert main(["bench", "--device", "cpu", "--no-progress", "--rows", "mha-16KiB"]) == 2
    line = capsys.readouterr().err.strip()
    # 7 pools of 2 x 131072 rows of 16 KiB: 28 GiB asked, 1 GiB here.
    assert line.startswith("kvcore bench: --tokens 131072 over mha-16KiB rows needs about 28.0")
    assert "1.0 GiB is available: give --tokens 4672 or less" in line
    assert "\n" not in line
