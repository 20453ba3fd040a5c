"""The process state the live driver records per mode."""

from __future__ import annotations

import sys
import threading

import torch

from benchmarks.process_state import process_state, python_call_us


def test_process_state_sees_a_tracer_and_a_thread_and_times_python_calls():
    done = threading.Event()
    worker = threading.Thread(target=done.wait, name="state-test-worker")
    worker.start()
    sys.settrace(lambda *_: None)
    try:
        traced = process_state(torch.device("cpu"))
    finally:
        sys.settrace(None)
        done.set()
        worker.join()
    plain = process_state(torch.device("cpu"))
    assert traced["tracer"] and not plain["tracer"]
    assert "state-test-worker" in traced["threads"]
    assert "state-test-worker" not in plain["threads"]
    assert plain["python_call_us"] > 0 and plain["gc_tracked_objects"] > 0
    assert plain["current_stream_is_default"] is None


def test_python_call_time_is_per_thousand_calls():
    assert 0 < python_call_us(calls=2000, rounds=3) < 1e5
