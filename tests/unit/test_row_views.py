"""kvcore.row_views: dense rows of strided buffers and where each unit lies in them,
checked byte for byte against the strided buffers themselves."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.row_views import RowMap, dense_rows


def grouped_buffer(
    groups: int, group: int, width: int, pad: int, row: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, RowMap]:
    """A buffer of ``groups`` groups, each ``group`` units of ``width`` rows then ``pad``
    rows of padding; a ``[groups, group, width, row]`` view of its units; their map."""
    period = group * width + pad
    buffer = torch.randn(groups, period, row, generator=torch.Generator().manual_seed(seed))
    units = buffer[:, : group * width].unflatten(1, (group, width))
    return buffer, units, RowMap(groups * group, group=group, period=period, width=width)


def unit(units: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``[groups, group, ...]`` position of each unit ``index`` names."""
    return index // units.shape[1], index % units.shape[1]


geometries = st.tuples(
    st.integers(1, 4),  # groups
    st.integers(1, 4),  # units a group
    st.integers(1, 3),  # rows a unit
    st.integers(0, 3),  # padding rows a group
    st.integers(1, 3),  # elements a row
    st.integers(0, 2**16),  # seed
)


def indices(data: st.DataObject, row_map: RowMap) -> torch.Tensor:
    named = data.draw(st.lists(st.integers(0, row_map.units - 1), max_size=12))
    return torch.tensor(named, dtype=torch.int64)


@settings(max_examples=60, deadline=None)
@given(geometries, st.data())
def test_rows_of_address_each_units_own_bytes(geometry, data):
    buffer, units, row_map = grouped_buffer(*geometry)
    rows = dense_rows(buffer, buffer.shape[2:])
    assert dense_rows(units, units.shape[3:]).shape[0] == row_map.span
    index = indices(data, row_map)
    expected = units[unit(units, index)].flatten(0, 1)
    assert torch.equal(rows[row_map.rows_of(index)], expected)
    array_rows = row_map.rows_of_array(index.numpy())
    assert array_rows.dtype == np.int64
    assert torch.equal(rows[torch.from_numpy(array_rows)], expected)


@settings(max_examples=60, deadline=None)
@given(geometries, st.data())
def test_writes_through_the_rows_touch_only_the_units_named(geometry, data):
    buffer, units, row_map = grouped_buffer(*geometry)
    expected, expected_units, _ = grouped_buffer(*geometry)  # the same seed: the same bytes
    rows = dense_rows(units, units.shape[3:])
    index = indices(data, row_map)
    rows[row_map.rows_of(index)] = -1.0
    expected_units[unit(units, index)] = -1.0  # through the strided view
    assert torch.equal(buffer, expected)


def test_dense_rows_view_the_span_from_the_first_element_to_the_last():
    base = torch.arange(64, dtype=torch.int32)
    strided = base[3:].as_strided((4, 6), (14, 1))  # rows of 6 every 14 elements
    rows = dense_rows(strided, (2,))
    assert rows.shape == (((4 - 1) * 14 + 6) // 2, 2) and rows.is_contiguous()
    assert torch.equal(rows.flatten(), base[3 : 3 + 48])
    rows[0, 0] = -7
    assert int(base[3]) == -7  # a view, not a copy
    shaped = dense_rows(torch.zeros(3, 4, 6), (2, 3))
    assert shaped.shape == (12, 2, 3)
    assert dense_rows(torch.zeros(0, 6), (6,)).shape == (0, 6)


def test_dense_rows_refuse_a_span_that_is_not_whole_rows():
    with pytest.raises(ValueError, match="not whole rows"):
        dense_rows(torch.zeros(4, 6), (5,))
    with pytest.raises(ValueError, match="not whole rows"):
        dense_rows(torch.zeros(4, 6), (0,))


def test_units_out_of_range_are_refused_before_the_arithmetic_could_wrap():
    row_map = RowMap(10, group=2, period=8, index_name="host_indices")
    for bad in ([10], [-1], [0, 3, 10]):
        with pytest.raises(ValueError, match="host_indices"):
            row_map.rows_of(torch.tensor(bad))
    spread = RowMap(10, group=1, period=4)
    wraps = torch.tensor([2**62 + 1], dtype=torch.int64)
    assert int((wraps * 4)[0]) == 4  # the product lands on a valid row
    with pytest.raises(ValueError, match="outside"):
        spread.rows_of(wraps)
    with pytest.raises(TypeError, match="integer dtype"):
        spread.rows_of(torch.tensor([1.0]))


def test_out_of_range_array_units_land_outside_the_view():
    row_map = RowMap(12, group=3, period=10, width=2)
    rows = row_map.rows_of_array(np.array([-1, 12, 13, -4], dtype=np.int64))
    assert ((rows < 0) | (rows >= row_map.span)).all()


@pytest.mark.parametrize(
    "row_map",
    [
        RowMap(8, group=8, period=24),  # one group
        RowMap(8, group=1, period=1),  # groups that abut
        RowMap(8, group=4, period=4),
        RowMap(0, group=1, period=3),  # no units
    ],
)
def test_where_rows_are_the_units_the_index_comes_back_unchecked(row_map):
    # The plan made against a view of span rows checks this very bound: one pass, not two.
    assert row_map.identity and row_map.span == row_map.units
    beyond = torch.tensor([3, 12])
    assert row_map.rows_of(beyond) is beyond
    narrow = torch.tensor([1, 2], dtype=torch.int32)
    widened = row_map.rows_of(narrow)
    assert widened.dtype == torch.int64 and widened.tolist() == [1, 2]


@pytest.mark.parametrize(
    "row_map",
    [
        RowMap(8, group=4, period=12),
        RowMap(8, group=1, period=3),
        RowMap(8, group=8, period=16, width=2),
    ],
)
def test_other_maps_compute_new_rows(row_map):
    assert not row_map.identity
    index = torch.tensor([0, 1, 5])
    assert row_map.rows_of(index) is not index


def test_span_counts_the_rows_up_to_the_last_units_last_row():
    assert RowMap(6, group=2, period=7, width=3).span == 2 * 7 + 1 * 3 + 3
    assert RowMap(5, group=2, period=7, width=3).span == 2 * 7 + 0 * 3 + 3
    assert RowMap(0, group=0, period=0).span == 0


@pytest.mark.parametrize("width", [2, 16, 17, 40])
def test_units_of_many_rows_map_to_the_same_rows_either_way(width):
    # Up to 16 rows a unit are added row by row, wider units by broadcast.
    *_, row_map = grouped_buffer(3, 4, width, 1, 1, width)
    index = torch.tensor([11, 0, 5, 6, 3], dtype=torch.int64)
    starts = [(i // 4) * row_map.period + (i % 4) * width for i in index.tolist()]
    expected = [start + row for start in starts for row in range(width)]
    assert row_map.rows_of(index).tolist() == expected
    assert row_map.rows_of_array(index.numpy()).tolist() == expected
    with torch.inference_mode():
        inferred = index.clone()
    assert row_map.rows_of(inferred).tolist() == expected
