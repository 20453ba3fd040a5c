"""`kvcore bench --engine sglang --sweep --beside-compute`: its options, rows and ideal pipeline
(the GPU run itself is in docs/performance.md)."""

from __future__ import annotations

import argparse
import types
from dataclasses import dataclass

import pytest

from benchmarks import beside_rows
from benchmarks.sglang import beside
from kvcore.bench.cli import add_arguments, argument_problems

ISSUE_FIELDS = [
    "engine",
    "case",
    "situation",
    "tokens",
    "page_size",
    "stock_ms",
    "kvcore_ms",
    "link_ms",
    "forward_alone_ms",
    "forward_with_stock_ms",
    "forward_with_kvcore_ms",
    "identical",
]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--engine", "sglang", "--sweep", "--beside-compute", *argv])


def test_options_come_from_the_bench_arguments():
    args = _args(
        "--sizes",
        "8192,32768",
        "--pages",
        "64,1",
        "--compute",
        "decode-64",
        "--repeats",
        "4",
        "--no-rule",
        "--json",
        "out.json",
    )
    opts = beside.options_for(args)
    assert opts.tokens == (8192, 32768) and opts.pages == (64, 1)
    assert opts.loads == ("decode-64",) and opts.repeats == 4
    assert not opts.serve_rule and opts.partial_json == "out.json" and not opts.backups
    assert beside.options_for(_args("--stores")).backups
    assert opts.forward_span == 1.0
    assert beside.options_for(_args("--forward-span", "4")).forward_span == 4.0
    assert beside.options_for(_args()).loads == ("decode-64", "decode-256", "prefill-4096")


def test_the_ideal_pipeline_is_the_first_copy_then_the_longer_of_compute_and_copy():
    layer_bytes = int(55.3e6)  # 1 ms at the link
    assert beside_rows.ideal_pipeline_ms(layer_bytes, 10, 3.0) == pytest.approx(1 + 10 * 3.0)
    assert beside_rows.ideal_pipeline_ms(layer_bytes, 10, 0.25) == pytest.approx(1 + 10 * 1.0)


def test_a_row_carries_the_fields_the_issue_names_and_a_paired_interval():
    place = beside_rows.RowPlace("sglang", "mha/layer_first/kernel/p64", 8192, 64, 32)
    times = {"stock": [30.0, 31.0, 29.0], "kvcore": [20.0, 21.0, 22.0], "own": [20.0, 20.0, 20.0]}
    forwards = {"stock": [25.0, 24.0, 26.0], "kvcore": [23.0, 22.0, 23.5], "own": [22, 22, 22]}
    row = beside_rows.reload_row(
        place, "independent", "prefill-4096", 19.4, times, forwards, 21.5, True
    )
    assert all(field in row for field in ISSUE_FIELDS)
    assert (row["engine"], row["case"], row["tokens"], row["page_size"], row["layers"]) == (
        "sglang",
        "mha/layer_first/kernel/p64",
        8192,
        64,
        32,
    )
    assert row["stock_ms"] == 30.0 and row["kvcore_ms"] == 21.0 and row["own_ms"] == 20.0
    assert row["forward_with_kvcore_ms"] == 23.0 and row["forward_with_own_ms"] == 22
    low, high = row["speed_paired"][1:]
    assert 1.0 < low <= row["speed_paired"][0] <= high
    assert row["own_speed_paired"][1] > 1.0
    alone = beside_rows.reload_row(place, "alone", "none", 19.4, times, {}, None, False)
    assert alone["forward_with_stock_ms"] is None and alone["identical"] is False


def test_the_summary_line_gives_each_sides_forward_launch_host_time_where_the_row_has_it():
    place = beside_rows.RowPlace("vllm", "per-layer/32L/mha-32KiB/host-0%/load", 8192, 16, 32)
    times = {"stock": [18.0, 19.0], "kvcore": [12.0, 12.5]}
    row = beside_rows.reload_row(
        place,
        "independent",
        "decode-64",
        9.7,
        times,
        {"stock": [26.0], "kvcore": [26.5]},
        16.0,
        True,
    )
    assert "launch host" not in beside_rows.summary_line(row)
    row["forward_launch_host_ms"] = {"stock": 0.04, "kvcore": 9.5}
    assert beside_rows.summary_line(row).endswith(
        "with kvcore 26.5 launch host 0.04/9.50 identical=True"
    )
    row["forward_harness_only_ms"] = 16.2
    assert beside_rows.summary_line(row).endswith(
        "launch host 0.04/9.50 in a request of no job 16.2 identical=True"
    )
    row["submit_host_ms"] = {"stock": 0.05, "kvcore": 11.25}
    assert "kvcore 12.2 submit host 0.05/11.25  forward alone" in beside_rows.summary_line(row)
    row["forward_done_alone_ms"], row["forward_done_ms"] = 16.3, {"stock": 26.2, "kvcore": 37.9}
    assert "launch host 0.04/9.50 done alone 16.3 with 26.2/37.9 in a request" in (
        beside_rows.summary_line(row)
    )


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--beside-compute"], "--beside-compute: give it with --engine sglang or vllm --sweep"),
        (["--engine", "vllm", "--beside-compute"], "--engine sglang or vllm --sweep"),
        (
            ["--engine", "vllm", "--sweep", "--beside-compute", "--pages", "64"],
            "--pages 64: vLLM's blocks are 16 tokens; --pages is SGLang's",
        ),
        (["--compute", "decode-64"], "--compute decode-64: it applies only with"),
        (["--engine", "sglang", "--sweep", "--stores"], "--stores: it applies only with"),
        (["--pages", "64"], "--pages 64: it applies only with"),
        (["--forward-span", "3"], "--forward-span 3: it applies only with --beside-compute"),
        (
            ["--engine", "sglang", "--sweep", "--beside-compute", "--gpu-levels", "100%"],
            "--gpu-levels 100%: it applies only with --engine vllm --sweep --beside-compute",
        ),
        (
            ["--engine", "sglang", "--sweep", "--beside-compute", "--engine-steps"],
            "--engine-steps: it applies only with --engine vllm --sweep --beside-compute",
        ),
        (["--engine-steps"], "--engine-steps: it applies only with --engine vllm"),
        (
            ["--engine", "vllm", "--sweep", "--beside-compute", "--forward-span", "0"],
            "--forward-span 0: give a multiple of stock's copy time from 0.1 to 100",
        ),
        (
            ["--engine", "sglang", "--sweep", "--beside-compute", "--compute", "prefill-9"],
            "'prefill-9' is no compute load; give a comma list of decode-64, decode-256",
        ),
        (
            ["--engine", "sglang", "--sweep", "--beside-compute", "--pages", "64,0"],
            "--pages 64,0: give a comma list of page sizes of 1 or more",
        ),
    ],
)
def test_beside_compute_options_out_of_place_are_one_line_each(argv, needle):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    problems = argument_problems(parser.parse_args(argv))
    assert any(needle in problem for problem in problems), problems


def test_beside_compute_options_in_place_raise_no_problem():
    assert argument_problems(_args("--compute", "decode-64,prefill-4096", "--pages", "64,1")) == []


def test_beside_compute_without_a_gpu_is_one_line(capsys):
    if beside.torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert beside.main(_args()) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a CUDA GPU" in err[0]


class _Metrics:
    """Snapshots as kvcore's Metrics gives them, advanced by hand."""

    def __init__(self) -> None:
        self.transfers: dict[tuple[str, str], int] = {}
        self.fallbacks: dict[str, int] = {}

    def snapshot(self) -> dict[str, object]:
        return {
            "transfers": [
                {"direction": d, "path": p, "count": n} for (d, p), n in self.transfers.items()
            ],
            "fallbacks": dict(self.fallbacks),
        }


def test_a_tally_says_what_the_rule_on_side_did_and_ignores_the_others():
    metrics = _Metrics()
    tally = beside_rows.Tally(metrics)
    kvcore, stock = types.SimpleNamespace(name="kvcore"), types.SimpleNamespace(name="stock")

    def served() -> float:
        metrics.transfers[("h2d", "staged")] = metrics.transfers.get(("h2d", "staged"), 0) + 1
        return 1.5

    def passed() -> float:
        metrics.fallbacks["stock_kernel_near_link"] = (
            metrics.fallbacks.get("stock_kernel_near_link", 0) + 1
        )
        return 2.5

    assert tally.timed(kvcore, served) == 1.5
    assert tally.timed(kvcore, passed) == 2.5
    assert tally.timed(stock, served) == 1.5  # not counted: another side's request
    assert tally.fields() == {
        "kvcore_paths": ["staged"],
        "kvcore_passes": {"stock_kernel_near_link": 0.5},
    }


def test_a_cell_yields_alone_then_each_load_in_both_situations(monkeypatch):
    """The cell loop on a CPU, with each situation's timing stood in for: the rows it yields,
    in order, with every side's times, the ideal for the dependent forward and the tally."""
    metrics = _Metrics()
    calls: list[tuple[str, str]] = []

    def timing(situation: str, value: float):
        def run(reloads, side, cpu, *forward):
            calls.append((situation, side.name))
            if side.name == "kvcore":
                metrics.fallbacks["r"] = metrics.fallbacks.get("r", 0) + 1
            return value if situation == "alone" else (value, 2 * value)

        return run

    sides = [types.SimpleNamespace(name=n) for n in ("stock", "kvcore", "own")]
    monkeypatch.setattr(beside, "_sides", lambda case, opts, op: sides)
    monkeypatch.setattr(beside, "_Reloads", lambda case, layers: None)
    monkeypatch.setattr(beside, "_identical", lambda reloads, side, cpu, op: True)
    monkeypatch.setattr(beside, "_alone", timing("alone", 1.0))
    monkeypatch.setattr(beside, "_independent", timing("independent", 3.0))
    monkeypatch.setattr(beside, "_dependent", timing("dependent", 4.0))
    sized = []
    forward = types.SimpleNamespace(
        layer_ms=0.5,
        size_for=sized.append,
        replay=lambda: (
            types.SimpleNamespace(elapsed_time=lambda end: 9.0),
            types.SimpleNamespace(synchronize=lambda: None),
        ),
    )
    case = types.SimpleNamespace(
        kind="mha", page_size=64, row_bytes=4096, opts=types.SimpleNamespace(layers=4)
    )
    opts = beside.BesideOptions(repeats=2, loads=("decode-64",), device=beside.torch.device("cpu"))
    rows = list(beside._cells(case, 128, opts, {"decode-64": forward}, metrics))
    assert [(r["situation"], r["compute"]) for r in rows] == [
        ("alone", "none"),
        ("independent", "decode-64"),
        ("dependent", "decode-64"),
    ]
    assert sized == [1.0]  # the forward sized to stock's reload alone
    span = beside.BesideOptions(
        repeats=2, loads=("decode-64",), device=beside.torch.device("cpu"), forward_span=3.0
    )
    list(beside._cells(case, 128, span, {"decode-64": forward}, metrics))
    assert sized == [1.0, 3.0]  # --forward-span 3: three times as long
    assert [r["repeats"] for r in rows] == [2, 2, 2]  # the warm-up request is not timed
    assert rows[1]["forward_alone_ms"] == 9.0 and rows[1]["forward_with_kvcore_ms"] == 6.0
    ideal = beside_rows.ideal_pipeline_ms(128 * 4096, 4, 0.5)
    assert rows[2]["forward_alone_ms"] == ideal and rows[2]["own_ms"] == 4.0
    assert all(r["kvcore_passes"] == {"r": 1.0} for r in rows)
    # Each request's sides alternate their order.
    alone = [name for situation, name in calls if situation == "alone"]
    assert alone[:6] == ["stock", "kvcore", "own", "own", "kvcore", "stock"]


def test_backups_yield_alone_then_each_load_beside_another_batch_only(monkeypatch):
    """A backup cell on a CPU, timings stood in for: SGLang's device-to-host submission
    (``_Backups``), checked as a backup, no dependent situation, each row saying ``op``."""
    made, checked = [], []
    sides = [types.SimpleNamespace(name=n) for n in ("stock", "kvcore")]
    monkeypatch.setattr(beside, "_sides", lambda case, opts, op: checked.append(op) or sides)
    monkeypatch.setattr(beside, "_Reloads", lambda case, layers: made.append("reloads"))
    monkeypatch.setattr(beside, "_Backups", lambda case, layers: made.append("backups"))
    monkeypatch.setattr(beside, "_identical", lambda r, side, cpu, op: checked.append(op) or True)
    monkeypatch.setattr(beside, "_alone", lambda *a: 2.0)
    monkeypatch.setattr(beside, "_independent", lambda *a: (3.0, 5.0))
    monkeypatch.setattr(beside, "_dependent", lambda *a: pytest.fail("a backup has no dependent"))
    forward = types.SimpleNamespace(
        layer_ms=0.5,
        size_for=lambda ms: None,
        replay=lambda: (
            types.SimpleNamespace(elapsed_time=lambda end: 4.0),
            types.SimpleNamespace(synchronize=lambda: None),
        ),
    )
    case = types.SimpleNamespace(
        kind="mla", page_size=1, row_bytes=1152, opts=types.SimpleNamespace(layers=3)
    )
    opts = beside.BesideOptions(
        repeats=2, loads=("prefill-4096",), with_own=False, device=beside.torch.device("cpu")
    )
    rows = list(beside._cells(case, 64, opts, {"prefill-4096": forward}, _Metrics(), "backup"))
    assert made == ["backups"] and set(checked) == {"backup"}
    assert [(r["situation"], r["compute"], r["op"]) for r in rows] == [
        ("alone", "none", "backup"),
        ("independent", "prefill-4096", "backup"),
    ]
    assert rows[1]["forward_with_stock_ms"] == 5.0 and rows[1]["forward_alone_ms"] == 4.0
    assert beside_rows.summary_line(rows[1]).startswith("mla/layer_first/kernel/p1/backup 64 ")


def test_side_samples_keep_each_field_per_side_in_request_order():
    @dataclass(frozen=True)
    class Sample:
        load_ms: float
        steps: int

    samples = beside_rows.SideSamples(["stock", "kvcore"], ["load_ms", "steps"])
    samples.add("kvcore", Sample(3.0, 2))
    samples.add("stock", Sample(5.0, 1))
    samples.add("kvcore", Sample(1.0, 4))
    assert samples["load_ms"] == {"stock": [5.0], "kvcore": [3.0, 1.0]}
    assert samples.medians("steps") == {"stock": 1, "kvcore": 3.0}
    with pytest.raises(AttributeError):
        samples.add("stock", object())
