"""What the measuring scripts of scripts/ check before importing the engine benches, so that
a machine without the engine gets one line saying what to do, not a traceback."""

from __future__ import annotations

import importlib.util


def need_vllm(script: str) -> None:
    """Stop ``script`` with one line where vLLM cannot be imported."""
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit(
            f"{script}: needs vLLM importable (ci/install_vllm.sh makes a CPU venv with it; "
            "on the GPU machine, source scripts/vllm_device_env.sh first)"
        )
