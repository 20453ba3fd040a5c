"""vLLM's beside-compute bench's cell loop on a CPU: each side's loads, alone and with a
forward queued between their submission and their collection, every one checked."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs vLLM installed (ci/install_vllm.sh)")

import torch
from vllm.v1.kv_offload.cpu.swap_blocks_triton import THRESHOLD_BYTES

from benchmarks.vllm import beside, beside_steps
from benchmarks.vllm.offload_handlers import stock_handler
from benchmarks.vllm.sweep_plan import ModelLayout
from benchmarks.vllm.sweep_pools import Pools, slice_blocks
from benchmarks.vllm.sweep_sides import kvcore_side
from kvcore.bench.cli import add_arguments

pytestmark = pytest.mark.vllm

MODEL = ModelLayout(False, 4, "small", 1 << 10)
TOKENS = (256, 1024)  # 16 and 64 blocks
LAUNCH_S = 0.002


@dataclass
class FakeEvent:
    at_us: int
    """The host clock when it was recorded, in whole µs (so differences are exact in ms)."""
    synchronized: bool = False

    def synchronize(self) -> None:
        self.synchronized = True

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.at_us - self.at_us) / 1000


def _now_us() -> int:
    return time.perf_counter_ns() // 1000


@dataclass
class FakeForward:
    """A forward whose replay says when it was queued: inside a side's request (between its
    submissions and their collection) or on its own."""

    loads: beside._Loads
    replays: list[str] = field(default_factory=list)
    sized: list[float] = field(default_factory=list)
    ends: list[FakeEvent] = field(default_factory=list)

    def size_for(self, target_ms: float) -> None:
        self.sized.append(target_ms)

    def size_layers(self, count: int) -> None:
        self.sized.append(-count)

    def mark(self) -> FakeEvent:
        return FakeEvent(_now_us())

    def replay(self) -> tuple[FakeEvent, FakeEvent]:
        # Job ids handed out so far: a replay inside a request comes after its submission.
        self.replays.append(f"after job {self.loads.next_id - 1}")
        # A launch that holds the host (as a full launch queue would) for 2 ms, then a
        # forward of 3 ms from there.
        time.sleep(LAUNCH_S)
        start = FakeEvent(_now_us())
        self.ends.append(FakeEvent(start.at_us + 3000))
        return start, self.ends[-1]


def _setup(monkeypatch: pytest.MonkeyPatch, gpu_to_cpu: bool = False, model: ModelLayout = MODEL):
    blocks = slice_blocks(max(TOKENS) // 16)
    device = torch.device("cpu")
    layout = model.layout(blocks)
    region = torch.empty(layout.host_row_bytes * blocks, dtype=torch.int8)
    pools = Pools(layout, region, device, torch.Generator().manual_seed(1))
    stock = stock_handler(pools.gpu, pools.host, pools.layout, gpu_to_cpu=gpu_to_cpu)
    # vLLM's own handler cannot run on a CPU: a kvcore side without its rule stands in.
    stand_in = kvcore_side(stock, device, rule=False)
    stand_in.name = "stock"
    sides = [stand_in, kvcore_side(stock, device), kvcore_side(stock, device, rule=False)]
    return pools, blocks, sides


def test_every_cell_has_its_rows_checked_and_the_forward_beside_each_request(monkeypatch):
    pools, blocks, sides = _setup(monkeypatch)
    loads = beside._Loads(pools, blocks, seed=3)
    forward = FakeForward(loads)
    opts = beside.VllmBesideOptions(
        tokens=TOKENS, loads=("decode-64",), repeats=2, device=torch.device("cpu")
    )
    rows = list(beside.cells(MODEL, loads, sides, {"decode-64": forward}, opts))
    assert [(r["tokens"], r["situation"]) for r in rows] == [
        (256, "alone"),
        (256, "independent"),
        (1024, "alone"),
        (1024, "independent"),
    ]
    for row in rows:
        assert row["engine"] == "vllm" and row["case"] == f"{MODEL.name}/host-0%/load"
        assert row["identical"] and row["repeats"] == 2 and row["page_size"] == 16
        assert row["link_ms"] == pytest.approx(
            row["tokens"] // 16 * MODEL.block_bytes / beside.LINK_GBPS / 1e6
        )
        assert row["own_ms"] > 0 and row["kvcore_ms"] > 0
        # How long each side's submissions held the host: within its request's time.
        submits = row["submit_host_ms"]
        assert set(submits) == {"stock", "kvcore", "own"}
        assert all(0 < submits[name] <= row[f"{name}_ms"] for name in ("kvcore", "own"))
    independent = rows[1]
    assert independent["forward_alone_ms"] == 3.0
    assert independent["forward_with_kvcore_ms"] == independent["forward_with_own_ms"] == 3.0
    launches = independent["forward_launch_host_ms"]
    assert set(launches) == {"stock", "kvcore", "own"}
    assert all(LAUNCH_S * 1e3 <= ms < 50 * LAUNCH_S * 1e3 for ms in launches.values())
    assert "forward_launch_host_ms" not in rows[0]
    # From the request's start, the forward ends after the submissions held the host, the
    # launch and the forward itself; alone, after the launch and the forward.
    done, submits = independent["forward_done_ms"], independent["submit_host_ms"]
    assert set(done) == {"stock", "kvcore", "own"}
    assert all(done[name] >= submits[name] + LAUNCH_S * 1e3 + 3.0 for name in done)
    assert LAUNCH_S * 1e3 + 3.0 <= independent["forward_done_alone_ms"] < 50 * LAUNCH_S * 1e3
    assert "forward_done_ms" not in rows[0]
    # The control: the forward inside a request with no job, no copy beside it.
    assert independent["forward_harness_only_ms"] == 3.0
    assert "forward_harness_only_ms" not in rows[0]
    # Per cell: one replay alone, one in the control and one inside each side's request,
    # for the warm-up too; each inside a request comes after that request's job.
    inside = [r for r in forward.replays if r != "after job -1"]
    assert len(forward.replays) == 2 * 3 * (2 + len(sides))
    assert len({r for r in inside}) >= 2 * 3 * len(sides)
    # The forward is sized to the stock side's median load alone.
    assert forward.sized == [rows[0]["stock_ms"], rows[2]["stock_ms"]]
    assert pools.verify_all()


def test_a_forward_span_sizes_the_forward_to_that_many_loads(monkeypatch):
    pools, blocks, sides = _setup(monkeypatch)
    loads = beside._Loads(pools, blocks, seed=5)
    forward = FakeForward(loads)
    opts = beside.VllmBesideOptions(
        tokens=TOKENS[:1],
        loads=("decode-64",),
        repeats=1,
        device=torch.device("cpu"),
        forward_span=4.0,
    )
    rows = list(beside.cells(MODEL, loads, sides, {"decode-64": forward}, opts))
    assert forward.sized == [pytest.approx(4.0 * rows[0]["stock_ms"])]
    assert pools.verify_all()


def test_a_request_is_checked_only_once_the_forward_beside_it_is_done(monkeypatch):
    pools, blocks, sides = _setup(monkeypatch)
    loads = beside._Loads(pools, blocks, seed=6)
    forward = FakeForward(loads)
    verify = pools.verify
    checked_after_forward: list[bool] = []

    def verify_noting_the_forward(request):
        checked_after_forward.append(bool(forward.ends) and forward.ends[-1].synchronized)
        return verify(request)

    monkeypatch.setattr(pools, "verify", verify_noting_the_forward)
    request = loads.drawer.draw(TOKENS[0] // 16, 0.0, 1, gpu_to_cpu=False)
    beside._beside(loads, sides[1], request, forward)
    # The check's kernels would run beside the forward's tail and stretch its time.
    assert checked_after_forward == [True]


def test_a_side_that_moves_a_wrong_byte_marks_its_rows(monkeypatch):
    pools, blocks, sides = _setup(monkeypatch)
    loads = beside._Loads(pools, blocks, seed=4)
    verify = pools.verify
    calls = []

    def once_wrong(request):
        calls.append(request)
        return verify(request) and len(calls) != 5

    monkeypatch.setattr(pools, "verify", once_wrong)
    opts = beside.VllmBesideOptions(tokens=(256,), loads=(), repeats=2, device=torch.device("cpu"))
    [row] = beside.cells(MODEL, loads, sides, {}, opts)
    assert row["identical"] is False


def test_stores_beside_a_forward_are_rows_of_their_own_every_one_checked(monkeypatch):
    pools, blocks, sides = _setup(monkeypatch, gpu_to_cpu=True)
    loads = beside._Loads(pools, blocks, seed=5)
    forward = FakeForward(loads)
    opts = beside.VllmBesideOptions(
        tokens=(256,), loads=("decode-64",), repeats=2, device=torch.device("cpu"), stores=True
    )
    rows = list(beside.cells(MODEL, loads, sides, {"decode-64": forward}, opts, gpu_to_cpu=True))
    assert [(r["case"], r["situation"]) for r in rows] == [
        (f"{MODEL.name}/host-0%/store", "alone"),
        (f"{MODEL.name}/host-0%/store", "independent"),
    ]
    assert all(row["identical"] and row["own_ms"] > 0 for row in rows)
    assert pools.verify_all()


@pytest.mark.parametrize("stage_regions", ["off", "gather"])
def test_the_sides_stage_their_loads_by_region_under_the_setting(monkeypatch, stage_regions):
    """``KVCORE_STAGE_REGIONS`` reaches the bench's kvcore sides (their movers take the
    environment's policy): the own side's loads go staged, checked as every cell is."""
    monkeypatch.setenv("KVCORE_STAGE_REGIONS", stage_regions)
    pools, blocks, sides = _setup(monkeypatch)
    loads = beside._Loads(pools, blocks, seed=7)
    forward = FakeForward(loads)
    opts = beside.VllmBesideOptions(
        tokens=TOKENS[1:], loads=("decode-64",), repeats=1, device=torch.device("cpu")
    )
    rows = list(beside.cells(MODEL, loads, sides, {"decode-64": forward}, opts))
    assert all(row["identical"] for row in rows)
    own = sides[2].mover_metrics
    assert own is not None
    paths = {row["path"] for row in own.snapshot()["transfers"]}
    assert paths == ({"gather"} if stage_regions == "off" else {"staged"})
    assert pools.verify_all()


def test_the_named_layouts_hold_what_the_rule_rows_they_probe_need():
    """``--rows`` names: pages of 64 KiB per layer, and one tensor whose blocks hold every
    layer's page (1 MiB and more; 24 KiB, which vLLM loads by its Triton kernel), beside
    the forward of their model."""
    layouts = beside.LAYOUTS
    assert layouts["mha-64k"].layer_page_bytes == 64 << 10 and not layouts["mha-64k"].cross_layer
    for name in ("mha-cross", "mla-cross"):
        cross = layouts[name]
        assert cross.cross_layer and cross.layout(8).tensors == 1
        assert cross.layout(8).page_bytes == cross.block_bytes >= 1 << 20
        assert cross.page == name.split("-")[0]
    small = layouts["mha-cross-24k"]
    assert small.cross_layer and small.layout(8).tensors == 1
    assert small.layout(8).page_bytes == 24 << 10 < THRESHOLD_BYTES


@pytest.mark.parametrize("stores", [False, True], ids=["loads", "stores"])
def test_a_cross_layer_layout_runs_through_the_cells_checked(monkeypatch, stores):
    model = ModelLayout(True, 4, "small", 1 << 10)
    pools, blocks, sides = _setup(monkeypatch, gpu_to_cpu=stores, model=model)
    loads = beside._Loads(pools, blocks, seed=11)
    forward = FakeForward(loads)
    opts = beside.VllmBesideOptions(
        tokens=TOKENS, loads=("decode-64",), repeats=1, device=torch.device("cpu")
    )
    rows = list(beside.cells(model, loads, sides, {"decode-64": forward}, opts, stores))
    op = "store" if stores else "load"
    assert [row["case"] for row in rows] == [f"cross-layer/4L/small-1KiB/host-0%/{op}"] * 4
    assert all(row["identical"] for row in rows)
    assert pools.verify_all()


def test_one_host_level_sets_the_fragmentation_and_a_wrong_one_is_one_line(capsys):
    def args(*argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return parser.parse_args(["--engine", "vllm", "--sweep", "--beside-compute", *argv])

    assert beside.options_for(args()).frag == 0.0
    assert not beside.options_for(args()).engine_steps
    assert beside.options_for(args("--engine-steps")).engine_steps
    assert beside.options_for(args()).gpu_frag is None
    assert beside.options_for(args("--host-levels", "100%")).frag == 1.0
    assert beside.options_for(args("--gpu-levels", "50%")).gpu_frag == 0.5
    assert beside.main(args("--host-levels", "0%,100%")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "takes one of 0%, 50%, 100%" in err[0]


def test_a_gpu_level_scatters_the_gpu_ids_alone_and_names_itself_in_the_case(monkeypatch):
    """``--gpu-levels 100%`` with the host in one run: every request's GPU ids broken at
    each neighbour, its CPU ids one run, the rows checked, the case saying both levels."""
    pools, blocks, sides = _setup(monkeypatch)
    loads = beside._Loads(pools, blocks, seed=5)
    drawn = []
    draw = loads.drawer.draw

    def recording(*args, **kwargs):
        request = draw(*args, **kwargs)
        drawn.append(request)
        return request

    monkeypatch.setattr(loads.drawer, "draw", recording)
    opts = beside.VllmBesideOptions(
        tokens=TOKENS, loads=("decode-64",), repeats=1, device=torch.device("cpu"), gpu_frag=1.0
    )
    rows = list(beside.cells(MODEL, loads, sides, {"decode-64": FakeForward(loads)}, opts, False))
    assert {row["case"] for row in rows} == {f"{MODEL.name}/host-0%+gpu-100%/load"}
    assert all(row["identical"] for row in rows) and pools.verify_all()
    assert drawn
    for request in drawn:
        assert (np.diff(request.cpu_ids) == 1).all()
        assert (np.diff(request.gpu_ids) > 1).all()


def _slow_down(monkeypatch, handler, steps: int, waits: bool = False) -> list[str]:
    """``handler`` made one whose copies take ``steps`` of the engine's steps: each job is
    reported by the ``steps``-th ``get_finished`` after its submission. Unless ``waits``,
    nothing may wait for a job (the engine's step loop never does). Patched in place, as
    the bench finds a handler's tensors by the handler itself. Returns the calls' log."""
    calls: list[str] = []
    pending: list[list] = []
    transfer_async, wait, get_finished = handler.transfer_async, handler.wait, handler.get_finished

    def slow_transfer(job_id, *args) -> bool:
        calls.append(f"submit {job_id}")
        ok = transfer_async(job_id, *args)
        wait({job_id})
        pending.append([steps, get_finished()])
        return ok

    def no_wait(job_ids) -> None:
        assert waits, "the step loop waits for no job"

    def slow_finished() -> list:
        calls.append("get_finished")
        done = []
        for entry in pending:
            entry[0] -= 1
            if entry[0] == 0:
                done += entry[1]
        pending[:] = [entry for entry in pending if entry[0] > 0]
        return done

    monkeypatch.setattr(handler, "transfer_async", slow_transfer)
    monkeypatch.setattr(handler, "wait", no_wait)
    monkeypatch.setattr(handler, "get_finished", slow_finished)
    return calls


def test_the_step_loop_submits_then_steps_until_every_job_is_reported(monkeypatch):
    pools, blocks, sides = _setup(monkeypatch)
    loads = beside._Loads(pools, blocks, seed=8)
    side = sides[1]
    calls = _slow_down(monkeypatch, side.handler, steps=3)
    request = loads.drawer.draw(TOKENS[0] // 16, 0.0, 1, gpu_to_cpu=False)
    ids = loads.new_ids(len(request.jobs))

    def step() -> None:
        calls.append("step")
        time.sleep(0.002)

    one = beside_steps.stepped(side, pools, request, ids, step)
    assert one.checked and one.steps == 3
    assert calls == [f"submit {ids[0]}"] + ["step", "get_finished"] * 3
    assert one.ready_ms >= 3 * 2.0 and one.first_step_ms >= 2.0
    assert one.mean_step_ms == pytest.approx(one.ready_ms / 3)
    assert 0 < one.submit_ms <= one.first_step_ms
    # A handler that never reports: lost after the loop's cap, not waited for forever.
    monkeypatch.undo()
    pools, blocks, sides = _setup(monkeypatch)
    loads = beside._Loads(pools, blocks, seed=10)
    side = sides[1]
    _slow_down(monkeypatch, side.handler, steps=10**9)
    monkeypatch.setattr(beside_steps, "MAX_STEPS", 4)
    request = loads.drawer.draw(TOKENS[0] // 16, 0.0, 1, gpu_to_cpu=False)
    with pytest.raises(TimeoutError, match="not reported within 4 steps"):
        beside_steps.stepped(side, pools, request, loads.new_ids(len(request.jobs)), step)


def test_engine_steps_add_a_steps_row_a_cell_with_the_model_sized_forward(monkeypatch):
    pools, blocks, sides = _setup(monkeypatch)
    # The alone and independent rows' requests wait for their jobs; the steps rows' do not.
    _slow_down(monkeypatch, sides[1].handler, steps=2, waits=True)
    loads = beside._Loads(pools, blocks, seed=9)
    forward = FakeForward(loads)
    opts = beside.VllmBesideOptions(
        tokens=TOKENS,
        loads=("decode-64",),
        repeats=2,
        device=torch.device("cpu"),
        engine_steps=True,
    )
    rows = list(beside.cells(MODEL, loads, sides, {"decode-64": forward}, opts))
    assert [(r["tokens"], r["situation"]) for r in rows] == [
        (tokens, situation) for tokens in TOKENS for situation in ("alone", "independent", "steps")
    ]
    for row in (rows[2], rows[5]):
        assert row["identical"] and row["compute"] == "decode-64" and row["repeats"] == 2
        assert row["steps_taken"] == {"stock": 1, "kvcore": 2, "own": 1}
        # A step: the 2 ms launch and the 3 ms forward replayed (FakeForward), then the
        # handler asked; the hit ready at the end of the step that reported its job.
        assert row["forward_alone_ms"] >= LAUNCH_S * 1e3
        assert row["kvcore_ms"] >= 2 * LAUNCH_S * 1e3
        assert row["kvcore_ms"] > row["stock_ms"]
        assert set(row["first_step_ms"]) == set(row["submit_host_ms"]) == {"stock", "kvcore", "own"}
        assert row["forward_with_kvcore_ms"] > 0
    # Sized to stock's load for the independent rows, to the model's layers for the steps.
    assert forward.sized == [rows[0]["stock_ms"], -MODEL.layers, rows[3]["stock_ms"], -MODEL.layers]
    assert pools.verify_all()
