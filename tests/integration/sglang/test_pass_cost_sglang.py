"""scripts/sglang_pass_cost.py on CPU: passing reloads called as SGLang 0.5.23 calls them,
kvcore's hook on the pool class, beside stock's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.mem_cache.pool_host", reason="needs SGLang installed")

from tests.support.scripts import load_script

pytestmark = pytest.mark.sglang

pass_cost = load_script("sglang_pass_cost")


def _row(tmp_path: Path, layers: int, requests: int, rounds: int) -> dict:
    out = tmp_path / f"cost-{layers}.json"
    argv = ["--device", "cpu", "--tokens", "128", "--layers", str(layers)]
    argv += ["--requests", str(requests), "--rounds", str(rounds), "--json", str(out)]
    assert pass_cost.main(argv) == 0
    (row,) = json.loads(out.read_text())["rows"]
    return row


def test_a_pass_adds_no_frame_to_its_later_layers_and_each_reload_is_counted_once(
    tmp_path: Path,
) -> None:
    from sglang.srt.mem_cache.pool_host import mha

    from benchmarks.sglang.hook_adapter import bench_adapter

    had_copy = hasattr(mha, "transfer_kv_direct")
    requests, rounds = 3, 1
    rows = {layers: _row(tmp_path, layers, requests, rounds) for layers in (4, 12)}
    extra = set()
    for layers, row in rows.items():
        assert row["case"] == "mha/layer_first/direct/p64" and row["layers"] == layers
        calls = row["python_calls"]
        extra.add(calls["kvcore"] - calls["stock"])
        # Two kvcore requests a turn (the timed one and the one before it), each decided
        # once, whatever the layer count.
        turns = requests * (rounds + 1)
        assert row["passes"] == {"pass:stock_direct_small_request": 2 * turns}
        assert all(v > 0 for v in (*row["first_us"].values(), *row["later_us"].values()))
    # kvcore's extra calls come with the first layer's decision alone: the later layers find
    # stock's method itself bound on the pool, so eight more layers add none.
    (only,) = extra
    assert only > 0
    assert rows[12]["python_calls"]["stock"] > rows[4]["python_calls"]["stock"]
    assert not bench_adapter().bindings.passing  # the class and the pool got stock's method back
    assert hasattr(mha, "transfer_kv_direct") == had_copy  # the copy stand-in is gone
