"""Triton kernels run on CPU by Triton's interpreter, in a subprocess.

TRITON_INTERPRET must be set before Triton is first imported, and other tests may import it
first, so the kernels run in a subprocess: it loads the cases written here, runs a runner
script over every one and saves the outputs; the assertions run in the test's process.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (optional dependency)"
)


def run_interpreted(runner: str, cases: dict[str, dict], work: Path) -> dict[str, dict]:
    """``runner`` (a script taking the cases file and the results file) over ``cases``;
    the results by case name."""
    cases_path, results_path = work / "cases.pt", work / "results.pt"
    torch.save(list(cases.values()), cases_path)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", runner, str(cases_path), str(results_path)],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stdout}\n{proc.stderr}"
    return dict(zip(cases, torch.load(results_path), strict=True))
