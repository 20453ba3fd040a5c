"""scripts/ that import the checkout's benchmarks/ package run from anywhere: asked for
``--help`` from another folder, none ends in a traceback (one line where vLLM or a GPU is
missing, as ``benchmarks.script_env`` and the probes say)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.script_env import need_vllm

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
USES_BENCHMARKS = sorted(
    path.name
    for path in SCRIPTS.glob("*.py")
    if re.search(r"^from benchmarks", path.read_text(), re.M)
)


def test_the_scripts_that_need_it_are_found():
    assert {"resident_scatter_probe.py", "vllm_pass_cost.py"} <= set(USES_BENCHMARKS)


@pytest.mark.parametrize("script", USES_BENCHMARKS)
def test_help_from_another_folder_ends_without_a_traceback(script, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / script), "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    if done.returncode:
        assert len(done.stderr.strip().splitlines()) == 1


def test_need_vllm_says_what_to_do_where_vllm_is_missing(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match=r"^probe_x: needs vLLM importable \(ci/install_vllm.sh"):
        need_vllm("probe_x")
