"""scripts/region_tail_probe.py: each request's steps read off a profiler trace, and its
refusals without a GPU or with a load it does not know."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vLLM installed (ci/install_vllm.sh)")

from tests.support.scripts import load_script

pytestmark = pytest.mark.vllm

script = load_script("region_tail_probe")


def _event(name: str, ts: float, dur: float, cat: str = "user_annotation", **args: float):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "args": args}


def test_a_requests_steps_are_timed_from_its_start_and_others_left_out():
    trace = {
        "traceEvents": [
            _event("request-0", 1000.0, 3000.0),
            _event("submit", 1000.0, 400.0),
            _event("scatters", 1100.0, 250.0),
            _event("wait", 1500.0, 2400.0),
            _event("copy", 1200.0, 1000.0, cat="gpu_memcpy", bytes=55e6),
            _event("copy", 2200.0, 1000.0, cat="gpu_memcpy", bytes=55e6),
            _event("scatter", 2300.0, 100.0, cat="kernel"),
            _event("scatter", 3250.0, 500.0, cat="kernel"),
            # Another request's copy: not this one's.
            _event("request-1", 9000.0, 100.0),
            _event("copy", 9010.0, 50.0, cat="gpu_memcpy", bytes=1e6),
            {"ph": "i", "name": "request-2", "ts": 1.0},
        ]
    }
    first, second = script.timelines(trace, link_ms=2.0)
    assert first == {
        "wall_ms": 3.0,
        "link_ms": 2.0,
        "submit_returned_ms": 0.4,
        "scatters_returned_ms": 0.35,
        "wait_returned_ms": 2.9,
        "first_dma_ms": 0.2,
        "last_dma_end_ms": 2.2,
        "dma_busy_ms": 2.0,
        "dma_gbps": 55.0,
        "dma_count": 2.0,
        "kernels_after_last_dma": 1.0,
        "last_kernel_end_ms": 2.75,
        "kernel_count": 2.0,
    }
    assert second["dma_count"] == 1.0 and second["submit_returned_ms"] == -1.0
    assert "last_kernel_end_ms" not in second


def test_without_a_gpu_it_says_so_in_one_line(capsys):
    assert script.main(["--sizes", "2048"]) == 2
    assert capsys.readouterr().err.strip() == "region_tail_probe: needs a CUDA GPU"


def test_an_unknown_load_is_refused_before_the_gpu_is_asked_for(capsys, monkeypatch):
    assert script.main(["--compute", "none,training"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("region_tail_probe: --compute from none,") and "\n" not in err
