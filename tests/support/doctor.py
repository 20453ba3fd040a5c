"""``kvcore doctor`` run as a user runs it: in its own process, this checkout on the path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_doctor(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` with no ``KVCORE_*`` variable but ``env``'s."""
    variables = {k: v for k, v in os.environ.items() if not k.startswith("KVCORE_")}
    variables.update(env, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'integrations'}")
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=variables, timeout=120
    )


def engine_entry(stdout: str, engine: str) -> dict[str, Any]:
    """``engine``'s entry of ``kvcore doctor --json``'s report."""
    report = json.loads(stdout)
    entry: dict[str, Any] = next(e for e in report["engines"] if e["engine"] == engine)
    return entry
