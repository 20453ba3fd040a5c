"""kvcore_sglang.pool_jobs: every release's MHA and MLA table row, on stand-in pools that
hold only what the row reads (no SGLang needed; 0.5.22's real pools are tested in
test_transfers.py where that release is installed)."""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch

from kvcore_sglang import pool_jobs
from kvcore_sglang.pool_jobs import Job, TokenPool

LAYERS, SLOTS, ROW = 3, 8, 4
ROWS = {
    ("mha", "0.5.22"): pool_jobs.MHA_0_5_22,
    ("mha", "0.5.23"): pool_jobs.MHA_0_5_23,
    ("mla", "0.5.22"): pool_jobs.MLA_0_5_22,
    ("mla", "0.5.23"): pool_jobs.MLA_0_5_23,
}


def tagged(component: int, layers: int = LAYERS) -> torch.Tensor:
    """A layer_first host buffer whose every element names its component, layer and slot."""
    layer, slot = torch.meshgrid(torch.arange(layers), torch.arange(SLOTS), indexing="ij")
    return (component * 10_000 + layer * 100 + slot).float()[:, :, None].expand(-1, -1, ROW)


class Pool:
    """The attributes both releases' MHA and MLA pools are read by, 0.5.22's layer sharding
    as a first owned layer, and 0.5.23's MLA layer maps as given."""

    def __init__(self, layers: int = LAYERS, device_layers: int = LAYERS, **changes: Any):
        self.layout, self.layer_num, self.page_size = "layer_first", layers, 1
        self.k_buffer, self.v_buffer, self.kv_buffer = (
            tagged(c, layers).contiguous() for c in (1, 2, 3)
        )
        self.device_k_buffers = [torch.zeros(SLOTS, ROW) for _ in range(device_layers)]
        self.device_v_buffers = [torch.zeros(SLOTS, ROW) for _ in range(device_layers)]
        self.device_kv_buffers = [torch.zeros(SLOTS, ROW) for _ in range(device_layers)]
        self.target_layer_num = layers
        self._is_dummy, self.dcp_size, self._native_buffers = False, 1, None
        self._host_layer_by_controller = {i: i for i in range(layers)}
        self._buffer_index_by_layer = {i: i for i in range(layers)}
        self._target_layer_indices = set(range(layers))
        self._layer_shard_enabled = False
        self.first_owned, self.sharded_for = 0, object()
        self.owned_by: list[tuple[Any, int]] = []
        vars(self).update(changes)

    def _is_device_layer_owned(self, device_pool: Any, layer: int) -> bool:
        self.owned_by.append((device_pool, layer))
        return self.first_owned <= layer < self.first_owned + self.layer_num

    def _host_layer_index(self, layer: int) -> int:
        return layer - self.first_owned

    def _is_device_layer_sharded(self, device_pool: Any) -> bool:
        return device_pool is self.sharded_for


def load(row: TokenPool, pool: Pool, layer: int, is_draft: bool = False) -> Job | str:
    slots = torch.arange(SLOTS)
    return row.load(pool, object(), layer, is_draft, slots, slots, "kernel")


def copied(job: Job | str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each pair as (the host rows it copies, its device buffer)."""
    assert isinstance(job, Job), job
    return [(host[job.host_rows], device) for host, device in job.pairs]


def origin(rows: torch.Tensor, slots: int = SLOTS) -> tuple[int, int]:
    """The (component, host layer) the rows were read from (:func:`tagged`), checking that
    they are that layer's slots ``0 .. slots - 1``, in order."""
    tags = rows[:, 0].long()
    assert torch.equal(tags % 100, torch.arange(slots))
    assert bool((tags // 100 == tags[0] // 100).all())
    return int(tags[0]) // 10_000, int(tags[0]) // 100 % 100


def host_layer_of(rows: torch.Tensor) -> int:
    return origin(rows)[1]


def devices(pool: Pool, kind: str) -> list[list[torch.Tensor]]:
    if kind == "mha":
        return [pool.device_k_buffers, pool.device_v_buffers]
    return [pool.device_kv_buffers]


def components(kind: str) -> tuple[int, ...]:
    """The host buffers' tags (:func:`tagged`) in the order the copies name them: K then V."""
    return (1, 2) if kind == "mha" else (3,)


def are(found: list[torch.Tensor], expected: list[torch.Tensor]) -> bool:
    return len(found) == len(expected) and all(map(operator.is_, found, expected))


def test_every_release_is_served_by_its_table_row():
    for kind, jobs in (("mha", pool_jobs.MHA_JOBS), ("mla", pool_jobs.MLA_JOBS)):
        assert set(jobs) == {"0.5.22", "0.5.23"}
        for release, served in jobs.items():
            row = ROWS[kind, release]
            assert served.holds_layer is row.holds_layer
            assert served.load == row.load and served.backup == row.backup
            assert served.load_indices is pool_jobs.token_load_indices


@pytest.mark.parametrize(("kind", "release"), list(ROWS))
@pytest.mark.parametrize("is_draft", [False, True])
def test_an_unsharded_load_copies_host_layer_l_with_device_layer_l(kind, release, is_draft):
    pool = Pool()
    for layer in range(LAYERS):
        pairs = copied(load(ROWS[kind, release], pool, layer, is_draft))
        assert are([device for _, device in pairs], [each[layer] for each in devices(pool, kind)])
        assert [origin(rows) for rows, _ in pairs] == [(c, layer) for c in components(kind)]


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_0_5_22_maps_a_target_layer_through_its_sharding_and_a_draft_layer_as_is(kind):
    row = ROWS[kind, "0.5.22"]
    # Device layers 1 and 2 are this rank's: host layers 0 and 1; the list stays aligned.
    pool = Pool(layers=2, device_layers=3, first_owned=1)
    pairs = copied(load(row, pool, 2))
    assert are([device for _, device in pairs], [each[2] for each in devices(pool, kind)])
    assert {host_layer_of(rows) for rows, _ in pairs} == {1}
    draft = copied(load(row, pool, 1, is_draft=True))
    assert {host_layer_of(rows) for rows, _ in draft} == {1}
    assert load(row, pool, 0) == "sglang_layer_id"  # host layer -1
    assert load(row, pool, 2, is_draft=True) == "sglang_layer_id"  # host layer 2 of 2
    assert load(row, pool, 3) == "sglang_layer_id"  # past the device list


def test_0_5_22_mha_refuses_k_and_v_lists_of_different_lengths():
    pool = Pool()
    pool.device_v_buffers = pool.device_v_buffers[:-1]
    assert load(pool_jobs.MHA_0_5_22, pool, 0) == "sglang_layer_count"
    backup = pool_jobs.MHA_0_5_22.backup(pool, None, torch.arange(4), torch.arange(4), "kernel")
    assert backup == "sglang_layer_count"


def test_0_5_22_holds_the_layers_the_calls_device_pool_owns():
    pool, device_pool = Pool(first_owned=1), object()
    held = [pool_jobs.holds_owned_layer(pool, device_pool, layer) for layer in range(5)]
    assert held == [False, True, True, True, False]
    assert pool.owned_by == [(device_pool, layer) for layer in range(5)]


def test_0_5_23_mha_bounds_a_layer_by_its_devices_and_host_layers():
    assert load(pool_jobs.MHA_0_5_23, Pool(device_layers=2), 2) == "sglang_layer_id"
    assert load(pool_jobs.MHA_0_5_23, Pool(layers=2), 2) == "sglang_layer_id"
    assert load(pool_jobs.MHA_0_5_23, Pool(), -1) == "sglang_layer_id"
    pool = Pool(target_layer_num=2)
    held = [pool_jobs.mha_holds_layer(pool, None, layer) for layer in (-1, 0, 1, 2)]
    assert held == [False, True, True, False]


def test_0_5_23_mla_copies_between_the_layers_its_maps_name():
    pool = Pool(_host_layer_by_controller={5: 2}, _buffer_index_by_layer={5: 0, 6: 1})
    (pair,) = copied(load(pool_jobs.MLA_0_5_23, pool, 5))
    assert pair[1] is pool.device_kv_buffers[0] and host_layer_of(pair[0]) == 2
    assert load(pool_jobs.MLA_0_5_23, pool, 6) == "sglang_layer_id"  # no host layer
    pool._buffer_index_by_layer = {}
    assert load(pool_jobs.MLA_0_5_23, pool, 5) == "sglang_layer_id"  # no device buffer
    pool._host_layer_by_controller = {5: 3}
    assert load(pool_jobs.MLA_0_5_23, pool, 5) == "sglang_layer_id"  # past the host layers
    pool = Pool(_is_dummy=True, _target_layer_indices={1})
    held = [pool_jobs.mla_holds_layer(pool, None, layer) for layer in (0, 1)]
    assert held == [True, True]
    pool._is_dummy = False
    assert [pool_jobs.mla_holds_layer(pool, None, layer) for layer in (0, 1)] == [False, True]


@pytest.mark.parametrize(
    ("release", "changes", "reason"),
    [
        ("0.5.23", {"_is_dummy": True, "dcp_size": 2}, "sglang_dummy_pool"),
        ("0.5.23", {"dcp_size": 2, "_native_buffers": object()}, "sglang_dcp"),
        ("0.5.23", {"_native_buffers": object()}, "sglang_split_buffers"),
        ("0.5.22", {"_is_dummy": True, "dcp_size": 2}, "sglang_dummy_pool"),
        ("0.5.22", {"dcp_size": 2}, "sglang_dcp"),
        ("0.5.22", {"_native_buffers": object()}, None),  # 0.5.22's pools have no such buffers
    ],
)
def test_mla_refusals_in_order(release, changes, reason):
    row, pool = ROWS["mla", release], Pool(**changes)
    job = load(row, pool, 0)
    backup = row.backup(pool, None, torch.arange(4), torch.arange(4), "kernel")
    if reason is None:
        assert isinstance(job, Job) and isinstance(backup, Job)
    else:
        assert job == backup == reason


@pytest.mark.parametrize(("kind", "release"), list(ROWS))
def test_a_backup_pairs_host_layer_i_with_device_layer_i_component_by_component(kind, release):
    pool = Pool()
    job = ROWS[kind, release].backup(pool, object(), torch.arange(4), torch.arange(2, 6), "kernel")
    pairs = copied(job)
    assert are([device for _, device in pairs], [d for each in devices(pool, kind) for d in each])
    # K of every layer, then V: the order of SGLang's own all-layer copies.
    expected = [(c, layer) for c in components(kind) for layer in range(LAYERS)]
    assert [origin(rows, 4) for rows, _ in pairs] == expected


def test_mla_backups_leave_a_layer_sharded_device_pool_to_stock():
    indices = torch.arange(4)
    sharded = Pool(_layer_shard_enabled=True)
    assert pool_jobs.MLA_0_5_23.backup(sharded, None, indices, indices, "kernel") == (
        "sglang_layer_shard"
    )
    assert isinstance(pool_jobs.MLA_0_5_22.backup(sharded, None, indices, indices, "kernel"), Job)
    device_pool = object()
    pool = Pool(sharded_for=device_pool)
    assert pool_jobs.MLA_0_5_22.backup(pool, device_pool, indices, indices, "kernel") == (
        "sglang_layer_shard"
    )
    assert isinstance(pool_jobs.MLA_0_5_22.backup(pool, object(), indices, indices, "kernel"), Job)
    assert isinstance(
        pool_jobs.MLA_0_5_23.backup(pool, device_pool, indices, indices, "kernel"), Job
    )
    # MHA backs every layer up at once in both releases, whatever the sharding.
    for row in (pool_jobs.MHA_0_5_22, pool_jobs.MHA_0_5_23):
        both = Pool(_layer_shard_enabled=True, sharded_for=device_pool)
        assert isinstance(row.backup(both, device_pool, indices, indices, "kernel"), Job)
