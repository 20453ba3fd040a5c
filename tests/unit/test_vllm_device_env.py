"""scripts/vllm_device_env.sh, sourced by the vLLM device scripts: with no carried
.vllm-tree it falls back to the vLLM that scripts/vllm_live_setup.sh installed (VSITE), and
where neither is there it stops with one line instead of running a bench without vLLM."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "vllm_device_env.sh"


def _sourced(folder: Path, vsite: Path) -> tuple[int, str]:
    """Source the script in ``folder`` (no .vllm-tree there); its status and output."""
    done = subprocess.run(
        ["bash", "-c", f'source "{SCRIPT}"; echo "status=$?"'],
        cwd=folder,
        env={
            **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
            "OUT": str(folder / "out"),
            "VSITE": str(vsite),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    status = int(done.stdout.rsplit("status=", 1)[1])
    return status, done.stdout + done.stderr


def test_without_a_tree_or_an_installed_vllm_it_stops_with_one_line(tmp_path):
    status, output = _sourced(tmp_path, tmp_path / "no-vsite")
    assert status == 1
    assert "no .vllm-tree" in output and "vllm_live_setup.sh" in output
    assert "Traceback" not in output


def test_without_a_tree_it_takes_the_installed_vllm_and_checks_it_imports(tmp_path):
    vsite = tmp_path / "vsite"
    (vsite / "vllm").mkdir(parents=True)
    status, output = _sourced(tmp_path, vsite)
    # The folder has no benchmarks/ package, so the import check fails and says why.
    assert status == 1
    assert f"vLLM from {vsite}" in (tmp_path / "out" / "env.txt").read_text()
    assert "No module named" in (tmp_path / "out" / "preflight.log").read_text()
    assert "run scripts/vllm_device_tree.sh" not in output
