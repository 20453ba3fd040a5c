"""The live HiCache driver on a GPU, small: SGLang's JIT ``kernel`` io backend, both modes.

Each mode is its own process (loading SGLang's plugins patches its classes for the life of
the process), as scripts/sglang_hicache_live.sh runs them; both host layouts. Every loaded
byte must match, and both modes must see the same hits (same trace, same seed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("sglang", reason="needs SGLang installed")

from benchmarks.sglang.hicache_live_combine import combine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.sglang,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--layers", "4", "--scale", "16", "--conversations", "14", "--turns", "3"]


def run_mode(tmp: Path, mode: str, layout: str) -> dict[str, Any]:
    out = tmp / f"live-{mode}-{layout}.json"
    env = {**os.environ}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), str(REPO / "integrations"), env.get("PYTHONPATH", "")]
    )
    command = [sys.executable, "-m", "benchmarks.sglang.hicache_live", "--mode", mode]
    done = subprocess.run(
        [*command, "--json", str(out), "--layout", layout, *SMALL],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_both_modes_load_back_every_byte_and_see_the_same_hits(tmp_path, layout):
    stock, kvcore = (run_mode(tmp_path, mode, layout) for mode in ("stock", "kvcore"))
    summary = combine([stock, kvcore])
    assert summary["all_checks_passed"] and summary["same_hits"], summary["modes"]
    assert stock["cache"]["io_backend"] == "kernel" and stock["cache"]["host_layout"] == layout
    assert stock["summary"]["loadbacks"] > 0 and stock["summary"]["evictions"]["device_tokens"] > 0
    assert kvcore["prepared"]["plugins"]["patched_targets"]
    assert summary["by_size"]
