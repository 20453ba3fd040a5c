"""The serve-or-pass rule: which SGLang calls kvcore serves, and what doctor shows of it."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kvcore.config import KVCoreConfig
from kvcore.planning import path_policy, rule_evidence, serve_rule, vllm_rule
from kvcore.planning.serve_rule import SERVE, SGLangRule, sglang_decision


@pytest.mark.parametrize(
    ("op", "backend", "layout", "page", "tokens", "expected"),
    [
        # Stock's load kernel is near the link at every size and page.
        ("load", "kernel", "layer_first", 64, 1 << 20, "stock_kernel_near_link"),
        ("load", "kernel", "page_first", 1, 256, "stock_kernel_near_link"),
        # Paged layer_first backups stay stock; token-granular ones serve from 16k.
        ("backup", "kernel", "layer_first", 64, 1 << 20, "stock_kernel_near_link"),
        ("backup", "kernel", "layer_first", 1, 16383, "stock_kernel_small_backup"),
        ("backup", "kernel", "layer_first", 1, 16384, SERVE),
        ("backup", "kernel", "page_first", 1, 1023, "stock_page_first_backup_slow"),
        ("backup", "kernel", "page_first", 1, 1024, SERVE),
        ("backup", "kernel", "page_first", 64, 1 << 20, "stock_kernel_near_link"),
        # The direct backend: per token always, per page from 4k tokens.
        ("load", "direct", "layer_first", 1, 1, SERVE),
        ("backup", "direct", "page_first_direct", 64, 4095, "stock_direct_small_request"),
        ("backup", "direct", "page_first_direct", 64, 4096, SERVE),
        # Anything else: served from 2k tokens.
        ("load", "kernel_ascend", "layer_first", 64, 2047, "small_request"),
        ("load", "kernel_ascend", "layer_first", 64, 2048, SERVE),
    ],
)
def test_each_kind_of_call_is_decided_by_its_first_matching_rule(
    op, backend, layout, page, tokens, expected
):
    assert sglang_decision(op, backend, layout, page, tokens) == expected


def test_the_rule_off_serves_everything():
    assert sglang_decision("load", "kernel", "layer_first", 64, 256, enabled=False) is SERVE


def _never(op: str, backend: str, layout: str, page: int, pool: str = "") -> str | None:
    rule = serve_rule.sglang_rule(op, backend, layout, page, pool=pool)
    return rule.reason if rule is not None and rule.never else None


def test_the_row_of_a_call_says_what_the_table_says():
    assert _never("load", "kernel", "layer_first", 64) == "stock_kernel_near_link"
    assert _never("backup", "kernel", "layer_first", 1) is None
    token_backups = serve_rule.sglang_rule("backup", "kernel", "layer_first", 1)
    assert token_backups is not None and not token_backups.dense_host
    assert token_backups.decision(16383) == "stock_kernel_small_backup"
    assert token_backups.decision(16384) is SERVE
    page_first = serve_rule.sglang_rule("backup", "kernel", "page_first", 1)
    assert page_first is not None and page_first.dense_host


def test_rules_match_on_every_field():
    rule = SGLangRule("load", "direct", "page_first", (2, 8), 0, "r", "e")
    assert rule.matches("load", "direct", "page_first", 8)
    for args in [
        ("backup", "direct", "page_first", 8),
        ("load", "kernel", "page_first", 8),
        ("load", "direct", "layer_first", 8),
        ("load", "direct", "page_first", 1),
        ("load", "direct", "page_first", 9),
    ]:
        assert not rule.matches(*args), args


def test_describe_lists_every_rule_once_with_its_evidence():
    rows = serve_rule.describe()
    sglang = [row for row in rows if row["engine"] == "sglang"]
    assert len(sglang) == len(serve_rule.SGLANG_RULES)
    assert all(row["evidence"] and row["reason"] for row in rows)
    assert [row["reason"] for row in rows if row["engine"] == "vllm"] == [
        "stock_gather_beside_compute",
        "stock_store_large_pages",
        "few_pages",
        "few_pages",
        "stock_kernel_load",
        "stock_dma_large_pages",
    ]
    sizes = {row["reason"]: row["page_sizes"] for row in rows if row["engine"] == "vllm"}
    assert sizes["stock_store_large_pages"] == sizes["stock_dma_large_pages"] == ">= 1 MiB"
    assert sizes["stock_kernel_load"] == "< 28 KiB"


def test_vllm_large_pages_take_their_own_thresholds():
    rules = vllm_rule.VLLM_RULES
    small, large = rules.large_page_bytes // 2, rules.large_page_bytes
    assert rules.min_pages(small) == rules.min_pages_per_submission
    assert rules.min_pages(large) == rules.min_large_pages_per_submission
    stores_from = rules.stock_stores_from_page_bytes
    assert stores_from is not None and stores_from > large
    assert rules.store_passes(stores_from) and not rules.store_passes(large)
    assert not replace(rules, stock_stores_from_page_bytes=None).store_passes(stores_from)
    largest = rules.stock_scattered_loads_from_page_bytes
    assert largest is not None and largest > large
    assert rules.scattered_load_passes(largest) and not rules.scattered_load_passes(large)
    unset = replace(rules, stock_scattered_loads_from_page_bytes=None)
    assert not unset.scattered_load_passes(largest)


def _doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvcore", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_doctor_prints_the_table_the_rule_uses():
    result = _doctor()
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "serve-or-pass rule: on" in text
    for rule in serve_rule.SGLANG_RULES:
        assert rule.reason in text
    report = json.loads(_doctor("--json").stdout)
    assert report["serve_rule"]["enabled"] is True
    assert report["serve_rule"]["rules"] == serve_rule.describe()


def test_doctor_says_when_the_rule_is_off():
    import os

    env = {**os.environ, "KVCORE_SERVE_RULE": "0"}
    result = _doctor(env=env)
    assert "serve-or-pass rule: off" in result.stdout


@pytest.mark.parametrize(
    ("pool", "tokens", "expected"),
    [
        # A row for MLA pools decides theirs alone; the others meet the rows for any pool.
        ("mla", 8191, "stock_kernel_small_load"),
        ("mla", 8192, SERVE),
        ("dsa", 1 << 20, "stock_kernel_near_link"),
        ("", 1 << 20, "stock_kernel_near_link"),
    ],
)
def test_rows_for_one_pool_kind_decide_only_that_kind(monkeypatch, pool, tokens, expected):
    mla_row = SGLangRule(
        "load", "kernel", "layer_first", (1, 1), 8192, "stock_kernel_small_load", "e", pool="mla"
    )
    monkeypatch.setattr(serve_rule, "SGLANG_RULES", (mla_row, *serve_rule.SGLANG_RULES))
    serve_rule._sglang_rule.cache_clear()
    try:
        assert sglang_decision("load", "kernel", "layer_first", 1, tokens, pool=pool) == expected
        never = _never("load", "kernel", "layer_first", 1, pool=pool)
        assert (never is None) == (pool == "mla")
        # A kind no row names stays stock's at any size, paged or not.
        assert _never("load", "kernel", "layer_first", 64, pool="dsa")
    finally:
        serve_rule._sglang_rule.cache_clear()


def test_a_row_serving_dense_host_runs_decides_by_size_then_by_the_host_slots():
    rule = SGLangRule(
        "backup", "*", "*", (1, 1), 100, "r", "e", dense_host=False, dense_min_tokens=400
    )
    assert not rule.never and rule.reads_host_runs
    # The lower threshold lets a call through to its host slots.
    assert rule.decision(99) == "r" and rule.decision(100) is SERVE
    assert rule.host_decision(200, few_host_runs=False) is SERVE
    assert rule.host_decision(200, few_host_runs=True) == serve_rule.DENSE_HOST_REASON
    assert rule.host_decision(400, few_host_runs=True) is SERVE
    dense_only = SGLangRule("backup", "*", "*", (1, 1), None, "r", "e", dense_min_tokens=400)
    assert dense_only.decision(399) == "r" and dense_only.decision(400) is SERVE
    assert dense_only.host_decision(5000, few_host_runs=False) == "r"
    assert dense_only.host_decision(400, few_host_runs=True) is SERVE
    plain = SGLangRule("backup", "*", "*", (1, 1), 100, "r", "e")
    assert (
        not plain.reads_host_runs
        and not SGLangRule("load", "*", "*", (1, 1), None, "r", "e").reads_host_runs
    )


@pytest.mark.parametrize("page", [1, 64])
def test_layer_first_backups_on_few_host_runs_are_served_from_32k_tokens_but_paged_mla(page):
    mha = serve_rule.sglang_rule("backup", "kernel", "layer_first", page, pool="mha")
    mla = serve_rule.sglang_rule("backup", "kernel", "layer_first", page, pool="mla")
    assert mha is not None and mla is not None
    assert mha.host_decision(32768, few_host_runs=True) is SERVE
    assert mha.host_decision(32767, few_host_runs=True) is not SERVE
    if page == 1:
        assert mla.host_decision(32768, few_host_runs=True) is SERVE
        assert mla.host_decision(32767, few_host_runs=True) is not SERVE
    else:
        # Paged MLA backups beside a forward lost at both sizes: they stay stock.
        assert mla.host_decision(1 << 20, few_host_runs=True) is not SERVE
        assert mla.dense_min_tokens is None


@pytest.mark.parametrize(
    ("pool", "layout", "page", "tokens", "expected"),
    [
        # layer_first reloads of MLA pools, any page size: from 32k tokens (on few
        # long host runs, which host_decision then asks).
        ("mla", "layer_first", 1, 32767, "stock_kernel_small_mla_load"),
        ("mla", "layer_first", 1, 32768, SERVE),
        ("mla", "layer_first", 64, 32767, "stock_kernel_near_link"),
        ("mla", "layer_first", 64, 32768, SERVE),
        ("mha", "layer_first", 64, 32768, SERVE),
        ("mha", "layer_first", 1, 1 << 20, SERVE),
        # MHA's from 4k, the smallest size measured beside compute with today's ring.
        ("mha", "layer_first", 16, 8192, SERVE),
        ("mha", "layer_first", 64, 4096, SERVE),
        ("mha", "layer_first", 64, 4095, "stock_kernel_near_link"),
        # page_first, or another pool kind: stock's kernel at any size.
        ("mla", "page_first", 1, 1 << 20, "stock_kernel_near_link"),
        ("mha", "page_first", 64, 1 << 20, "stock_kernel_near_link"),
        ("dsa", "layer_first", 1, 1 << 20, "stock_kernel_near_link"),
    ],
)
def test_kernel_loads_serve_layer_first_mla_from_32k_tokens_and_mha_from_4k(
    pool, layout, page, tokens, expected
):
    assert sglang_decision("load", "kernel", layout, page, tokens, pool=pool) == expected


@pytest.mark.parametrize(("pool", "page"), [("mha", 64), ("mha", 1), ("mla", 64), ("mla", 1)])
def test_layer_first_kernel_loads_are_served_only_on_few_long_host_runs(pool, page):
    """Judged beside the model's compute: the layer ring (DMA, then a high-priority scatter)
    beats stock's kernel only where the host slots are a few long runs; scattered slots
    would take the gather, which is no faster for paged reloads."""
    rule = serve_rule.sglang_rule("load", "kernel", "layer_first", page, pool=pool)
    assert rule is not None and rule.reads_host_runs
    first = 4096 if pool == "mha" else 32768
    assert rule.host_decision(first, few_host_runs=True) is SERVE
    assert rule.host_decision(first - 1, few_host_runs=True) is not SERVE
    scattered = rule.host_decision(1 << 20, few_host_runs=False)
    assert (scattered is SERVE) == (pool == "mla" and page == 1)
    assert all(cited in rule.evidence for cited in rule_evidence.RING_EVIDENCE) or pool == "mla"


@pytest.mark.parametrize(
    ("tokens", "few_host_runs", "expected"),
    [
        (32767, True, "stock_kernel_small_mla_load"),
        (32768, True, SERVE),
        (32767, False, "stock_kernel_small_mla_load"),
        (32768, False, SERVE),
    ],
)
def test_token_granular_mla_reloads_are_served_from_32k_on_any_host_slots(
    tokens, few_host_runs, expected
):
    rule = serve_rule.sglang_rule("load", "kernel", "layer_first", 1, pool="mla")
    assert rule is not None and rule.reads_host_runs and rule.serves_from == 32768
    assert rule.host_decision(tokens, few_host_runs) == expected


# A forward beside kvcore's reload may be this much slower than beside stock's and count as
# no slower: repeats of one cell spread about as much on the H200.
_FORWARD_NOISE = 1.03


def _beside_cells(rule: SGLangRule) -> list[dict]:
    """The beside-compute rows of the JSON files ``rule`` cites that its calls would meet:
    its pool and layout, its page sizes, with compute running."""
    root = Path(__file__).resolve().parents[2]
    low, high = rule.page_sizes
    found = []
    for cited in rule.cited:
        for row in json.loads((root / cited).read_text())["rows"]:
            pool, layout, backend, _ = row["case"].split("/")
            if (
                pool == rule.pool
                and layout == rule.layout
                and backend == rule.io_backend
                and low <= row["page_size"] <= high
                and row["situation"] != "alone"
                and row.get("op", "load") == rule.op
            ):
                found.append(row)
    return found


# A backup kvcore serves may take this much longer than stock's (rule_evidence.BACKUP_EVIDENCE:
# nothing waits for it, but its pages stay locked until it is done).
_BACKUP_SLACK = 1.25


def _kvcore_wins(row: dict) -> bool:
    """kvcore's own path (``own``: the rule off) is no worse for the forward beside it
    (noise aside) and, for a reload, faster than stock's beside compute; for a backup, at
    most :data:`_BACKUP_SLACK` slower."""
    no_slower = row["forward_with_own_ms"] <= _FORWARD_NOISE * row["forward_with_stock_ms"]
    if row.get("op") == "backup":
        return no_slower and row["own_ms"] <= _BACKUP_SLACK * row["stock_ms"]
    return no_slower and row["own_ms"] < row["stock_ms"]


@pytest.mark.parametrize(
    "rule",
    [r for r in serve_rule.SGLANG_RULES if r.cited],
    ids=lambda r: f"{r.pool}-{r.page_sizes}",
)
def test_rows_judged_beside_compute_hold_against_the_json_they_cite(rule):
    """Every cell the row serves (few long host runs, from its size) was won beside compute;
    below that size some cell was lost, or nothing was measured (the row starts at the
    smallest size the runs hold), which is why the row starts where it does."""
    cells = _beside_cells(rule)
    threshold = rule.dense_min_tokens
    assert cells and threshold is not None
    served = [row for row in cells if row["tokens"] >= threshold]
    passed = [row for row in cells if row["tokens"] < threshold]
    assert served and all(_kvcore_wins(row) for row in served), [
        (row["case"], row["tokens"], row["situation"], row["compute"])
        for row in served
        if not _kvcore_wins(row)
    ]
    if passed:
        assert not all(_kvcore_wins(row) for row in passed)
    else:
        assert threshold == min(row["tokens"] for row in cells)
    assert all(row["identical"] for row in cells)


def test_vllm_stores_kvcore_would_gather_pass_from_16_kib_until_dma_takes_their_pages():
    rules = vllm_rule.VLLM_RULES
    dma_from = path_policy.DMA_IN_PLACE_RUN_BYTES
    assert rules.gathered_store_passes(18 << 10, dma_from)  # MLA's blocks, measured
    assert not rules.gathered_store_passes(dma_from, dma_from)  # MHA's 32 KiB go by DMA
    assert not rules.gathered_store_passes(8 << 10, dma_from)  # not measured beside compute
    assert not rules.gathered_store_passes(18 << 10, 16 << 10)  # an operator's DMA from 16 KiB
    unset = replace(rules, stock_gathered_stores_from_page_bytes=None)
    assert not unset.gathered_store_passes(18 << 10, dma_from)


def _mla_cells(
    evidence: tuple[str, ...], op: str, situations: tuple[str, ...] = ("independent",)
) -> list[dict]:
    """The MLA 18 KiB cells of ``op`` in the ``evidence`` runs, in these situations."""
    root = Path(__file__).resolve().parents[2]
    return [
        row
        for cited in evidence
        for row in json.loads((root / cited).read_text())["rows"]
        if row["situation"] in situations
        and row["case"].split("/")[2] == "mla-18KiB"
        and row["case"].endswith("/" + op)
    ]


def _gathered_mla_cells(op: str) -> list[dict]:
    """The gather-rule runs' cells of ``op`` beside compute, where the rule-off side
    (``own``) gathered."""
    return _mla_cells(vllm_rule.GATHER_EVIDENCE, op)


def test_the_gather_rules_evidence_holds_against_the_json_it_cites():
    """In the cited runs, beside compute, kvcore's gathered stores slowed the other batch's
    forward beyond noise against stock's stores in most cells, while its gathered loads
    left that forward no slower than stock's loads did, each load faster than stock's."""
    stores, loads = _gathered_mla_cells("store"), _gathered_mla_cells("load")
    assert len(stores) >= 6 and len(loads) >= 12
    slowed = [
        r for r in stores if r["forward_with_own_ms"] > _FORWARD_NOISE * r["forward_with_stock_ms"]
    ]
    assert len(slowed) > len(stores) / 2
    for row in loads:
        assert row["forward_with_own_ms"] <= _FORWARD_NOISE * row["forward_with_stock_ms"], row
        assert row["own_speed_paired"][1] > 1, row
        assert row["identical"]


def test_vllm_stores_go_by_dma_into_place_from_16_kib_and_loads_from_32_kib():
    config = KVCoreConfig()
    store = path_policy.vllm_handler_policy(config, gpu_to_cpu=True, environ={})
    load = path_policy.vllm_handler_policy(config, gpu_to_cpu=False, environ={})
    assert store.long_run_bytes == path_policy.VLLM_STORE_DMA_IN_PLACE_RUN_BYTES == 16 << 10
    assert load.long_run_bytes == path_policy.DMA_IN_PLACE_RUN_BYTES
    # So MLA's 18 KiB stores are kvcore's by default; a gather of them would still pass.
    assert not vllm_rule.VLLM_RULES.gathered_store_passes(18 << 10, store.long_run_bytes)
    assert vllm_rule.VLLM_RULES.gathered_store_passes(18 << 10, load.long_run_bytes)
    # An operator's threshold stands for both.
    environ = {"KVCORE_LONG_RUN_BYTES": "64KiB"}
    configured = path_policy.policy_from_config(config)
    assert path_policy.vllm_handler_policy(config, gpu_to_cpu=True, environ=environ) == configured


def test_the_store_dma_thresholds_evidence_holds_against_the_json_it_cites():
    """In the cited runs, MLA's 18 KiB blocks went by DMA into place: every store at least
    0.96x stock's speed (most faster) with the other batch's forward no slower than beside
    stock's store; most loads slower than stock's, which keeps loads at 32 KiB."""
    stores = _mla_cells(vllm_rule.STORE_DMA_EVIDENCE, "store", ("alone", "independent"))
    loads = _mla_cells(vllm_rule.STORE_DMA_EVIDENCE, "load", ("independent",))
    assert len(stores) == 24 and len(loads) == 18
    assert all(row["kvcore_paths"] == ["batched_runs"] and row["identical"] for row in stores)
    speeds = [row["speed_paired"][0] for row in stores]
    assert min(speeds) >= 0.96 and sum(speed > 1 for speed in speeds) >= 0.75 * len(speeds)
    for row in stores:
        if row["situation"] == "independent":
            assert row["forward_with_kvcore_ms"] <= _FORWARD_NOISE * row["forward_with_stock_ms"]
    assert sum(row["speed_paired"][0] < 1 for row in loads) > len(loads) / 2


def _cells(cited: str, block: str, situations: tuple[str, ...] = ("independent",)) -> list[dict]:
    """The load cells of ``block`` (the case's block part, e.g. ``mla-18KiB``) in one run."""
    root = Path(__file__).resolve().parents[2]
    rows = json.loads((root / cited).read_text())["rows"]
    return [
        row
        for row in rows
        if row["situation"] in situations
        and row["case"].split("/")[2] == block
        and row["case"].endswith("/load")
    ]


def test_region_stagings_default_holds_against_the_json_it_cites():
    """At the default, MLA's loads from the shared region went staged, each faster than
    stock's (the paired interval's lower end) with the other forward no slower than beside
    stock's; under ``all`` against ``off`` on one machine, staging left that forward no
    slower than the gather did, and MHA's staged loads slowed it more than its DMA did in
    most cells, which keeps MHA's loads by DMA."""
    default, staged_all, off = path_policy.REGION_STAGING_EVIDENCE
    assert path_policy.PathPolicy().stage_regions == "gather"
    loads = _cells(default, "mla-18KiB", ("alone", "independent"))
    assert len(loads) == 12
    for row in loads:
        assert row["kvcore_paths"] == ["staged"] and row["identical"], row
        assert row["speed_paired"][1] > 1, row
        if row["situation"] == "independent":
            assert row["forward_with_kvcore_ms"] <= row["forward_with_stock_ms"], row
    assert all(row["kvcore_paths"] == ["batched_runs"] for row in _cells(default, "mha-32KiB"))
    for block, keeps in (("mla-18KiB", "gather"), ("mha-32KiB", "batched_runs")):
        staged, kept = _cells(staged_all, block), _cells(off, block)
        assert len(staged) == len(kept) == 6
        assert all(row["kvcore_paths"] == [keeps] for row in kept)
        forwards = [
            (
                a["forward_with_kvcore_ms"] / a["forward_alone_ms"],
                b["forward_with_kvcore_ms"] / b["forward_alone_ms"],
            )
            for a, b in zip(staged, kept, strict=True)
        ]
        if block == "mla-18KiB":
            assert all(s <= _FORWARD_NOISE * k for s, k in forwards), forwards
        else:
            assert sum(s > k for s, k in forwards) > len(forwards) / 2, forwards


def _large_page_cells() -> dict[tuple[str, str, str, str, int], list[dict]]:
    """The cited large-page runs' cells by (layout, block, host, op, tokens), every
    situation."""
    root = Path(__file__).resolve().parents[2]
    cells: dict[tuple[str, str, str, str, int], list[dict]] = {}
    for cited in vllm_rule.LARGE_PAGE_EVIDENCE:
        for row in json.loads((root / cited).read_text())["rows"]:
            layout, _, block, host, op = row["case"].split("/")
            cells.setdefault((layout, block, host, op, row["tokens"]), []).append(row)
    return cells


def test_the_large_page_rows_hold_against_the_json_they_cite():
    """Beside compute (H100): kvcore's own stores of 64 KiB per-layer pages were faster than
    stock's from 2048 pages with the other forward as fast, so only stores of 1 MiB pages and
    more stay stock, where kvcore's own gained nothing; jobs under ``few_pages`` ran slower
    on kvcore's own paths; scattered 1 MiB loads, left to stock's DMA, level."""
    cells = _large_page_cells()
    assert all(row["identical"] for rows in cells.values() for row in rows)
    rules = vllm_rule.VLLM_RULES
    assert not rules.store_passes(64 << 10) and rules.store_passes(1 << 20)
    for tokens in (1024, 8192):
        for row in cells[("per-layer", "mha-64KiB", "host-0%", "store", tokens)]:
            assert row["own_speed_paired"][0] >= 1.1, row
            if row["situation"] == "independent":
                assert row["forward_with_own_ms"] <= _FORWARD_NOISE * row["forward_with_stock_ms"]
    for tokens in (128, 1024, 8192, 32768):
        for block in ("mha-32KiB", "mla-18KiB"):
            stores = cells[("cross-layer", block, "host-0%", "store", tokens)]
            assert all(row["own_speed_paired"][0] <= 1.04 for row in stores), stores
    for block, tokens in (("mha-64KiB", 128), ("mha-32KiB", 128)):
        for op in ("load", "store"):
            passed = cells[("per-layer", block, "host-0%", op, tokens)]
            # 256 pages: under few_pages (the 64 KiB stores ran under the store rule then).
            assert all(row["kvcore_passes"] and not row["kvcore_paths"] for row in passed)
            assert all(row["own_speed_paired"][0] < 1 for row in passed), passed
    scattered = cells[("cross-layer", "mha-32KiB", "host-100%", "load", 32768)]
    assert all(row["kvcore_passes"] == {"stock_dma_large_pages": 1.0} for row in scattered)
    assert all(0.98 <= row["own_speed_paired"][0] <= 1.02 for row in scattered), scattered


def test_the_kernel_load_row_holds_against_the_json_it_cites():
    """Beside compute (H100), scattered loads of 24 KiB cross-layer blocks, which vLLM moves
    with its Triton kernel: kvcore's own copy slower in every cell, and the rule passed them
    all to stock; once they passed from two ids, no passed cell was resolvably under 0.97x
    stock's speed."""
    root = Path(__file__).resolve().parents[2]
    before, after = (
        json.loads((root / cited).read_text())["rows"] for cited in vllm_rule.KERNEL_LOAD_EVIDENCE
    )
    assert len(before) == len(after) == 8 and vllm_rule.VLLM_RULES.stock_kernel_loads
    for row in before + after:
        assert row["identical"] and row["stock_copy"] == "handler/triton-kernel", row
        assert row["kvcore_passes"] == {"stock_kernel_load": 1.0}, row
        assert row["own_speed_paired"][2] < 1, row
    assert any(row["speed_paired"][2] < 0.97 for row in before)
    assert all(row["speed_paired"][2] >= 0.97 for row in after)
