from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from kvcore import __version__
from kvcore.cli import main
from kvcore.config import SETTINGS, KVCoreConfig
from kvcore.planning.path_policy import DMA_IN_PLACE_RUN_BYTES, dma_in_place_policy

DOCTOR_KEYS = {
    *("kvcore", "torch", "cuda", "engines", "pinned", "host", "config", "patches", "serve_rule")
}


@pytest.fixture(autouse=True)
def clean_kvcore_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("KVCORE_"):
            monkeypatch.delenv(name)


def installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def doctor_json(capsys) -> dict:
    assert main(["doctor", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_doctor_json(capsys, monkeypatch):
    monkeypatch.setenv("KVCORE_ENABLE", "vllm")
    monkeypatch.setenv("KVCORE_STAGING_BYTES", "1GiB")
    report = doctor_json(capsys)
    assert set(report) == DOCTOR_KEYS
    assert report["kvcore"]["version"] == __version__
    assert report["torch"]["version"] == torch.__version__
    cuda = report["cuda"]
    assert cuda["available"] is torch.cuda.is_available()
    assert cuda["version"] == torch.version.cuda
    assert cuda["device_count"] == len(cuda["devices"])
    engines = {e["engine"]: e for e in report["engines"]}
    assert [e["engine"] for e in report["engines"]] == ["sglang", "vllm"]
    for name, status in engines.items():
        assert status["installed"] is installed(name)
        assert status["enabled"] is (name == "vllm")
        assert status["patched_targets"] == []
    assert engines["sglang"]["supported_versions"] == ["0.5.22", "0.5.23"]
    # The engine lanes install released engines: their patch state is pristine.
    assert report["patches"] == {
        name: "pristine" if installed(name) else None for name in ("sglang", "vllm")
    }
    assert report["config"]["staging_bytes"] == 1 << 30
    assert report["config"]["enable"] == ["vllm"]


def test_doctor_json_pinned_limits(capsys):
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def expected(value: int) -> int | str:
        return "unlimited" if value == resource.RLIM_INFINITY else value

    assert doctor_json(capsys)["pinned"] == {
        "memlock_soft": expected(soft),
        "memlock_hard": expected(hard),
        "root": os.geteuid() == 0,
    }


def test_doctor_human(capsys, monkeypatch):
    monkeypatch.setenv("KVCORE_GATHER_CTAS", "16")
    assert main(["doctor"]) == 0
    summary, rule = capsys.readouterr().out.split("\n\n")
    # An installed, enabled engine's target groups are indented lines under its own.
    lines = [line for line in summary.splitlines() if not line.startswith(" ")]
    labels = [line.split()[0] for line in lines]
    assert labels == [
        *("kvcore", "torch", "CUDA", "sglang", "vllm", "patches", "memlock", "host", "config")
    ]
    assert rule.startswith("serve-or-pass rule: on")
    # Aligned: every value starts in the same column.
    columns = {
        len(line) - len(line[len(label) :].lstrip())
        for line, label in zip(lines, labels, strict=True)
    }
    assert len(columns) == 1
    text = "\n".join(lines)
    assert __version__ in text
    assert torch.__version__ in text
    assert "KVCORE_GATHER_CTAS=16" in text
    sglang_line = lines[labels.index("sglang")]
    assert sglang_line.endswith("not installed") is not installed("sglang")


def test_doctor_with_a_bad_variable(capsys, monkeypatch):
    monkeypatch.setenv("KVCORE_GATHER_CTAS", "lots")
    assert main(["doctor", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "KVCORE_GATHER_CTAS='lots'" in captured.err
    assert "Traceback" not in captured.err


def parse_dry_run(out: str) -> tuple[dict[str, str], list[str]]:
    lines = out.splitlines()
    assert lines[0].startswith("environment")
    split = lines.index("command:")
    env = dict(shlex.split(line)[0].split("=", 1) for line in lines[1:split] if "=" in line)
    assert len(lines) == split + 2
    return env, shlex.split(lines[split + 1])


@pytest.mark.parametrize(
    ("engine", "module"),
    [("sglang", "sglang.launch_server"), ("vllm", "vllm.entrypoints.cli.main")],
)
def test_launch_dry_run(capsys, engine, module):
    argv = ["launch", engine, "--kvcore-staging-bytes", "512MiB", "--kvcore-metrics", "--dry-run"]
    engine_args = ["--model-path", "/models/x y", "--kvcore-not-ours", "--port", "3000"]
    assert main([*argv, "--", *engine_args]) == 0
    env, command = parse_dry_run(capsys.readouterr().out)
    assert command == [sys.executable, "-m", module, *engine_args]
    # The engine list and what the flags gave; every other setting stays unset.
    assert env == {
        "KVCORE_ENABLE": engine,
        "KVCORE_STAGING_BYTES": "512MiB",
        "KVCORE_METRICS": "1",
    }


def test_launch_dry_run_adds_the_engine_to_enable_and_shows_only_changes(capsys, monkeypatch):
    monkeypatch.setenv("KVCORE_ENABLE", "vllm")
    monkeypatch.setenv("KVCORE_GATHER_CTAS", "4")
    monkeypatch.setenv("KVCORE_LOG_LEVEL", "info")
    assert main(["launch", "--dry-run", "sglang", "--kvcore-gather-ctas=32"]) == 0
    env, command = parse_dry_run(capsys.readouterr().out)
    assert command == [sys.executable, "-m", "sglang.launch_server"]
    assert env["KVCORE_ENABLE"] == "sglang,vllm"
    assert env["KVCORE_GATHER_CTAS"] == "32"
    # Spelled differently (info -> INFO), so it is part of the change.
    assert env["KVCORE_LOG_LEVEL"] == "INFO"
    monkeypatch.setenv("KVCORE_LOG_LEVEL", "INFO")
    assert main(["launch", "--dry-run", "sglang", "--kvcore-gather-ctas=32"]) == 0
    env, _ = parse_dry_run(capsys.readouterr().out)
    assert "KVCORE_LOG_LEVEL" not in env
    assert set(env) == {"KVCORE_ENABLE", "KVCORE_GATHER_CTAS"}


def test_launch_leaves_unset_what_nobody_set(capsys, monkeypatch):
    """Unset is more than the default for the thresholds vLLM's handlers read: with neither
    set they copy blocks by DMA into place, so launch must not set them to their defaults."""
    for setting in SETTINGS:
        monkeypatch.delenv(setting.env, raising=False)
    assert main(["launch", "--dry-run", "vllm", "--", "serve", "m"]) == 0
    env, _ = parse_dry_run(capsys.readouterr().out)
    assert env == {"KVCORE_ENABLE": "vllm"}
    config = KVCoreConfig.from_env(env)
    assert dma_in_place_policy(config, env).long_run_bytes == DMA_IN_PLACE_RUN_BYTES


def test_launch_without_separator_passes_other_arguments_to_the_engine(capsys):
    argv = ["launch", "vllm", "serve", "m", "--kvcore-gather-ctas", "2", "--dry-run", "-tp", "2"]
    assert main(argv) == 0
    env, command = parse_dry_run(capsys.readouterr().out)
    assert command[3:] == ["serve", "m", "-tp", "2"]
    assert env["KVCORE_GATHER_CTAS"] == "2"


def test_launch_unknown_engine(capsys):
    assert main(["launch", "tgi", "--dry-run", "--", "--model", "m"]) == 2
    err = capsys.readouterr().err
    assert "unknown engine 'tgi'" in err
    assert "sglang" in err and "vllm" in err


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--kvcore-gather-ctas", "0"], ["--kvcore-gather-ctas='0'", "from 1 to 1024"]),
        (["--kvcore-staging-bytes=big"], ["--kvcore-staging-bytes='big'", "MiB"]),
        (["--kvcore-gather-ctass", "8"], ["unknown kvcore flag --kvcore-gather-ctass", "known:"]),
        (["--kvcore-gather-ctas"], ["--kvcore-gather-ctas needs a value"]),
        (["--model", "m"], ["unexpected --model m before '--'"]),
    ],
)
def test_launch_bad_flags(capsys, argv, needles):
    assert main(["launch", "sglang", *argv, "--dry-run", "--", "x"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    for needle in needles:
        assert needle in captured.err
    assert "Traceback" not in captured.err


@pytest.mark.skipif(bool(importlib.util.find_spec("vllm")), reason="vLLM is installed here")
def test_launch_refuses_an_engine_that_is_not_installed(capsys, monkeypatch):
    monkeypatch.setattr(os, "execvpe", record_exec)
    assert main(["launch", "vllm", "--", "serve", "m"]) == 2
    assert "vllm is not installed" in capsys.readouterr().err


def write_fake_sglang(root) -> None:
    """A stand-in ``sglang.launch_server`` that prints its argv and the KVCORE_* variables."""
    package = root / "sglang"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(
        textwrap.dedent(
            """
            import json, os, sys
            env = {k: v for k, v in os.environ.items() if k.startswith("KVCORE_")}
            print(json.dumps({"argv": sys.argv[1:], "env": env, "other": os.environ["OTHER"]}))
            """
        )
    )


class Execed(Exception):
    """Raised by the stand-in for os.execvpe, which does not return either."""


def record_exec(file: str, args: list[str], env: dict[str, str]) -> None:
    raise Execed(file, args, env)


def test_launch_replaces_the_process(tmp_path, monkeypatch):
    write_fake_sglang(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(os, "execvpe", record_exec)
    monkeypatch.setenv("OTHER", "kept")
    with pytest.raises(Execed) as execed:
        main(["launch", "sglang", "--kvcore-gather-ctas=3", "--", "--port", "1"])
    file, args, env = execed.value.args
    assert file == sys.executable
    assert args == [sys.executable, "-m", "sglang.launch_server", "--port", "1"]
    assert env["OTHER"] == "kept"
    assert env["KVCORE_GATHER_CTAS"] == "3"
    assert KVCoreConfig.from_env(env) == KVCoreConfig(enable={"sglang"}, gather_ctas=3)


def test_main_usage_errors(capsys):
    assert main([]) == 2
    assert main(["launch"]) == 2
    assert main(["frobnicate"]) == 2
    assert main(["doctor", "--xml"]) == 2
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kvcore {__version__}"


@pytest.mark.parametrize("command", [[], ["doctor"], ["bench"], ["launch"], ["patches"]])
def test_every_help_prints(capsys, command):
    assert main([*command, "--help"]) == 0
    assert "usage:" in capsys.readouterr().out


def test_bench_help_names_the_host_levels(capsys):
    assert main(["bench", "--help"]) == 0
    assert "0%, 50%, 100%" in capsys.readouterr().out


def test_launch_help_lists_every_setting(capsys):
    assert main(["launch", "--help"]) == 0
    out = capsys.readouterr().out
    for setting in SETTINGS:
        assert setting.flag in out and setting.env in out


@pytest.fixture
def console_script() -> str:
    path = shutil.which("kvcore")
    if path is None:
        pytest.skip("the kvcore console script is not installed (pip install -e .)")
    return path


def test_console_script_doctor_json(console_script):
    result = subprocess.run(
        [console_script, "doctor", "--json"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report) == DOCTOR_KEYS
    assert [e["engine"] for e in report["engines"]] == ["sglang", "vllm"]
    assert all(e["installed"] is installed(e["engine"]) for e in report["engines"])


def test_console_script_launch_execs_the_engine(console_script, tmp_path):
    write_fake_sglang(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCORE_")}
    env.update(PYTHONPATH=str(tmp_path), OTHER="kept", KVCORE_METRICS="0")
    result = subprocess.run(
        [console_script, "launch", "sglang", "--kvcore-enable=vllm", "--", "--tp", "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["argv"] == ["--tp", "2"]
    assert seen["other"] == "kept"
    config = KVCoreConfig.from_env(seen["env"])
    assert config == KVCoreConfig(enable={"sglang", "vllm"}, metrics=False)
    # The engine list and the variable already set; the rest stay unset.
    assert set(seen["env"]) == {"KVCORE_ENABLE", "KVCORE_METRICS"}
