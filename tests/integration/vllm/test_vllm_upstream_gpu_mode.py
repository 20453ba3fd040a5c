"""The staged conftest's classes-gpu mode against the installed vLLM, on CPU: the worker that
vLLM's GPU transfer tests import is kvcore's, and the run stops where it would not be.

vLLM's own test_gpu_worker.py needs CUDA tensors (its handler asserts them), so a stand-in
test module takes its place and checks what it imported; scripts/vllm_upstream_gpu.sh runs
the real one on the GPU machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM installed (ci/install_vllm.sh)")

from ci.vllm_upstream import stage

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[3]
GPU_TESTS = "tests/v1/kv_offload/cpu/test_gpu_worker.py"

SWAPPED = """
from vllm.v1.kv_offload.cpu import gpu_worker
from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker

from kvcore_vllm import handler_install, transfers
from kvcore_vllm.releases import installed_shape


def test_the_worker_and_its_handlers_are_kvcores():
    stock = CPUOffloadingWorker.__mro__[1]
    assert CPUOffloadingWorker is gpu_worker.CPUOffloadingWorker
    assert (stock.__module__, stock.__name__) == (gpu_worker.__name__, "CPUOffloadingWorker")
    handler = handler_install.KVCoreOffloadingHandler
    assert handler.__mro__[1].__module__ == transfers.__name__
    # The layer references go by another name in each release's stock handler.
    refs = installed_shape().name("layer_refs_per_group")
    assert {"src_tensors", "dst_tensors", refs, "_transfers"} <= set(vars(handler))
"""

# What a module gets that bound the worker before the swap (stock's class).
EARLY = """
from vllm.v1.kv_offload.cpu import gpu_worker

CPUOffloadingWorker = gpu_worker.CPUOffloadingWorker.__mro__[1]


def test_never_runs():
    pass
"""


def _run(tmp_path: Path, module: str, **env: str) -> subprocess.CompletedProcess[str]:
    sdist = tmp_path / "sdist"
    for relative, text in {GPU_TESTS: module, "tests/__init__.py": ""}.items():
        (sdist / relative).parent.mkdir(parents=True, exist_ok=True)
        (sdist / relative).write_text(text)
    run_dir = tmp_path / "run"
    stage.stage(sdist, run_dir, (GPU_TESTS,))
    environ = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "integrations")]),
        "UPSTREAM_TESTS_MODE": "classes-gpu",
        "KVCORE_ENABLE": "vllm",
        "KVCORE_TRANSFERS": "1",
        "KVCORE_SERVE_RULE": "0",
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        **env,
    }
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", GPU_TESTS],
        cwd=run_dir,
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_gpu_tests_import_kvcores_worker(tmp_path: Path) -> None:
    result = _run(tmp_path, SWAPPED)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "CPUOffloadingWorker -> stock's with kvcore's handlers (serve rule off)" in result.stdout
    # No worker was built, so no job ran: nothing to hold against kvcore.
    assert "jobs copied by kvcore 0, handed to stock 0" in result.stdout


def test_a_module_that_bound_stocks_worker_stops_the_run(tmp_path: Path) -> None:
    result = _run(tmp_path, EARLY)
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert "bound stock's CPUOffloadingWorker" in result.stderr


def test_the_mode_refuses_to_run_without_kvcores_transfers(tmp_path: Path) -> None:
    result = _run(tmp_path, SWAPPED, KVCORE_TRANSFERS="0")
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert "KVCORE_TRANSFERS=0 leaves the stock handlers in place" in result.stderr
