"""The soak's accounting, report and phase clock (benchmarks.soak_report, soak_state),
engine-free."""

from __future__ import annotations

import json
import re
import threading
import time

import numpy as np
import pytest
import torch

from benchmarks import soak, soak_state
from benchmarks.soak_report import OBSERVED, Accounting, Tally, document, kvcore_counts
from benchmarks.soak_state import PhaseClock, RandomPages, mover_state, settle
from kvcore.metrics import Metrics
from kvcore.mover import Mover

CPU = torch.device("cpu")


def test_exact_items_leak_when_they_differ_bounded_ones_when_over_their_bound():
    accounting = Accounting()
    accounting.exact("slots", 64, 64, "public")
    accounting.exact("events", 0, 2, "private")
    accounting.bounded("requests", 0, 3, 4, "public")
    accounting.bounded("memo", 0, 5, 4, "public")
    assert accounting.leaks == 2
    items = {i["name"]: i for i in accounting.to_dict()["items"]}
    assert items["slots"]["ok"] and not items["events"]["ok"]
    assert items["requests"]["ok"] and not items["requests"]["equal"]
    assert not items["memo"]["ok"]


def test_unreadable_state_is_listed_as_not_checked_never_passed():
    accounting = Accounting()
    accounting.compare({"a": 1, "b": None, "c": 3}, {"a": 1, "b": 2, "c": None}, {"a": "public"})
    assert [i.name for i in accounting.items] == ["a"]
    assert set(accounting.not_checked) == {"b", "c"}


def test_an_observed_counter_is_reported_with_why_but_not_judged():
    accounting = Accounting()
    reads = {"pinned_host_in_use": OBSERVED, "pinned_tensors_alive": "public"}
    accounting.compare(
        {"pinned_host_in_use": 100, "pinned_tensors_alive": 2},
        {"pinned_host_in_use": 900, "pinned_tensors_alive": 3},
        reads,
    )
    assert accounting.leaks == 1
    assert [i.name for i in accounting.items] == ["pinned_tensors_alive"]
    (observed,) = accounting.to_dict()["observed"]
    assert observed["name"] == "pinned_host_in_use"
    assert (observed["baseline"], observed["end"], observed["ok"]) == (100, 900, None)
    assert "pinned_growth_probe" in observed["note"]


def test_the_document_is_ok_only_without_mismatches_leaks_or_errors():
    tally = Tally()
    tally.add(loads=2, load_calls=8, backups=1, loaded_bytes=10, backed_up_bytes=5)
    tally.add(reloads_checked=2, backups_verified=1)
    clean = document(
        engine="x",
        device="cpu",
        seconds_requested=1,
        seconds=1.0,
        tally=tally,
        accounting=Accounting(),
        errors=[],
        extra={},
    )
    assert clean["ok"] and clean["calls"] == {
        "loads": 2,
        "load_calls": 8,
        "backups": 1,
        "jobs": 3,
    }
    assert clean["bytes"]["total"] == 15
    tally.add(stray_bytes=1)
    wrong = document(
        engine="x",
        device="cpu",
        seconds_requested=1,
        seconds=1.0,
        tally=tally,
        accounting=Accounting(),
        errors=[],
        extra={},
    )
    assert wrong["mismatches"] == 1 and not wrong["ok"]


def test_kvcore_counts_are_what_happened_between_two_snapshots():
    metrics = Metrics()
    metrics.record_transfer("h2d", "gather", 100, 0.1)
    before = metrics.snapshot()
    metrics.record_transfer("h2d", "gather", 50, 0.1)
    metrics.record_pass("small_request")
    metrics.record_decision("serve", "rule_serves")
    counts = kvcore_counts(before, metrics.snapshot())
    assert counts["paths"] == {"h2d/gather": {"submissions": 1, "bytes": 50}}
    assert counts["fallbacks"] == {"small_request": 1}
    assert counts["decisions"] == {"pass:small_request": 1, "serve:rule_serves": 1}


def test_combine_sums_the_parts_and_fails_on_a_missing_one(tmp_path, capsys):
    parts = []
    for engine, ok in (("sglang", True), ("vllm", True)):
        doc = {"engine": engine, "seconds": 300.0, "mismatches": 0, "leaks": 0, "ok": ok}
        path = tmp_path / f"{engine}.json"
        path.write_text(json.dumps(doc))
        parts.append(str(path))
    out = tmp_path / "summary.json"
    assert soak.main(["--combine", *parts, "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["seconds"] == 600.0 and summary["ok"]
    assert [run["engine"] for run in summary["runs"]] == ["sglang", "vllm"]
    # A summary of summaries keeps every run.
    again = json.loads(capsys.readouterr().out)
    assert len(soak.combine([str(out)])["runs"]) == len(again["runs"]) == 2
    assert soak.main(["--combine", *parts, str(tmp_path / "missing.json")]) == 1


def test_phases_share_the_seconds_and_are_cut_short_to_meet_a_deadline():
    even = PhaseClock(40.0, 4, None)
    assert [even.next(0.0) for _ in range(4)] == [10.0] * 4
    tight = PhaseClock(40.0, 4, time.perf_counter() + 8.0)
    first = tight.next(reserve_s=4.0)
    assert 0.5 <= first <= 1.0
    late = PhaseClock(40.0, 2, time.perf_counter() - 1.0)
    assert late.next(0.0) == 0.5


def test_random_pages_hand_out_whole_free_pages_and_take_them_back():
    pages = RandomPages(64, 8, np.random.default_rng(0), reserved=1)
    rows = pages.alloc(32)
    assert rows is not None and len(rows) == 32 and (rows >= 8).all()
    assert len(set((rows // 8).tolist())) == 4
    assert pages.alloc(32) is None  # 3 free pages left
    pages.free(rows)
    assert pages.alloc(56) is not None


def test_settle_leaves_the_mover_in_the_same_state_each_time():
    mover = Mover(metrics=Metrics())
    settle(mover, CPU)
    first, reads = mover_state(mover, CPU)
    settle(mover, CPU)
    assert mover_state(mover, CPU)[0] == first
    assert first["staging_leases_held"] == 0
    assert reads["staging_leases_held"] == "private"


@pytest.mark.parametrize("argv", [[], ["--seconds", "1"]])
def test_the_command_needs_an_engine_or_documents_to_combine(argv):
    with pytest.raises(SystemExit):
        soak.main(argv)


def test_pinned_frees_are_flushed_through_whichever_empty_cache_torch_has(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", lambda: calls.append("a"))
    assert soak_state.flush_pinned_frees() and calls == ["a"]
    monkeypatch.delattr(torch.accelerator, "empty_host_cache")
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.append("c"), raising=False)
    assert soak_state.flush_pinned_frees() and calls == ["a", "c"]
    monkeypatch.delattr(torch._C, "_host_emptyCache")
    assert not soak_state.flush_pinned_frees()


def test_holders_name_what_keeps_an_object_alive():
    class Leaked:
        pass

    class Keeper:
        def __init__(self, held: Leaked) -> None:
            self.held = held

    target = Leaked()
    keeper = Keeper(target)
    chains = soak_state.holders(target, depth=2)
    # An instance's attributes may live in its own dict or inline, as the interpreter keeps them.
    assert any(re.match(r"Leaked <- (dict\['held'\] <- )?Keeper", c) for c in chains), chains
    # The walk's own lists of referrers (and their iterators) are nobody's reason.
    assert not any("list" in c.split(" <- ")[1:3] for c in chains), chains
    del keeper


def test_other_threads_name_each_live_thread_and_where_it_is():
    entered, release = threading.Event(), threading.Event()

    def still_copying() -> None:
        entered.set()
        release.wait(10)

    worker = threading.Thread(target=still_copying, name="traffic")
    worker.start()
    try:
        assert entered.wait(10)
        lines = soak_state.other_threads()
    finally:
        release.set()
        worker.join()
    assert any(re.match(r"thread traffic at wait .* <- still_copying ", line) for line in lines)
    assert not any("other_threads" in line for line in lines), lines
    assert not any("traffic" in line for line in soak_state.other_threads())


def test_prepared_plan_holders_is_empty_for_a_mover_with_nothing_prepared():
    assert soak_state.prepared_plan_holders(Mover()) == []
