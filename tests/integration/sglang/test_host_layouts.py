"""kvcore_sglang.host_layouts: each served host layout as dense per-layer rows, checked
byte for byte against the layout's own addressing (no SGLang needed)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.runs import check_bounds
from kvcore_sglang.host_layouts import BlockRows, block_rows, is_paged

LAYOUTS = ("layer_first", "page_first", "page_first_direct")


class HostBuffer:
    """A random host buffer of one layout, its :class:`BlockRows`, and the addressing SGLang
    defines for the layout: (layer, slots) -> that layer's rows of those slots."""

    def __init__(self, layout: str, layers: int, pages: int, page: int, row: int, seed: int):
        self.layout, self.layers, self.page, self.slots = layout, layers, page, pages * page
        shape = {
            "layer_first": (layers, self.slots, row),
            "page_first": (self.slots, layers, row),
            "page_first_direct": (pages, layers, page, row),
        }[layout]
        self.buffer = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        self.rows = viewed(self.buffer, layout, layers, page)

    def address(self, layer: int, at: torch.Tensor) -> tuple[torch.Tensor | int, ...]:
        if self.layout == "layer_first":
            return layer, at
        if self.layout == "page_first":
            return at, layer
        return at // self.page, layer, at % self.page


def viewed(buffer: torch.Tensor, layout: str, layers: int, page: int) -> BlockRows:
    rows = block_rows(buffer, layout, layers, page, buffer.shape[-1:])
    assert isinstance(rows, BlockRows)
    return rows


cases = st.builds(
    HostBuffer,
    st.sampled_from(LAYOUTS),
    st.integers(1, 4),  # layers
    st.integers(1, 5),  # pages
    st.sampled_from([1, 2, 4]),  # page size
    st.integers(1, 3),  # row elements
    st.integers(0, 2**16),  # seed
)


@settings(max_examples=60, deadline=None)
@given(cases, st.data())
def test_layer_rows_hold_each_slots_own_bytes(host, data):
    at = data.draw(st.lists(st.integers(0, host.slots - 1), max_size=10))
    at = torch.tensor(at, dtype=torch.int64)
    for layer in range(host.layers):
        view = host.rows.layer(layer)
        assert view.is_contiguous() and view.shape[0] == host.rows.slot_map.span
        assert torch.equal(
            view[host.rows.slot_map.rows_of(at)], host.buffer[host.address(layer, at)]
        )


@settings(max_examples=60, deadline=None)
@given(cases, st.data())
def test_writes_to_a_layers_rows_leave_every_other_slot_and_layer_untouched(host, data):
    expected = host.buffer.clone()
    layer = data.draw(st.integers(0, host.layers - 1))
    at = torch.tensor(sorted(data.draw(st.sets(st.integers(0, host.slots - 1)))), dtype=torch.int64)
    host.rows.layer(layer)[host.rows.slot_map.rows_of(at)] = -1.0
    expected[host.address(layer, at)] = -1.0
    assert torch.equal(host.buffer, expected)


def test_where_rows_are_the_slots_the_bound_is_left_to_the_plan():
    """layer_first (or one layer): the rows are the slots and a layer view has exactly that
    many rows, so the plan against it checks the bound (one pass, not two)."""
    for layout, shape in (("layer_first", (3, 10, 8)), ("page_first", (10, 1, 8))):
        rows = viewed(torch.zeros(shape), layout, shape[0] if layout == "layer_first" else 1, 1)
        assert rows.layer(0).shape[0] == rows.slot_map.units == 10
        beyond = torch.tensor([3, 12])
        assert rows.slot_map.rows_of(beyond) is beyond
        with pytest.raises(ValueError, match="outside"):
            check_bounds(rows.slot_map.rows_of(beyond), rows.layer(0).shape[0])


def test_interleaved_layouts_refuse_a_slot_before_the_arithmetic_could_wrap():
    page_first = viewed(torch.zeros(5, 3, 8), "page_first", 3, 1)
    wraps = torch.tensor([(2**64 + 2) // 3], dtype=torch.int64)
    assert int((wraps * 3)[0]) == 2  # the product lands on a valid row
    for bad in (wraps, torch.tensor([5]), torch.tensor([-1])):
        with pytest.raises(ValueError, match="host_indices"):
            page_first.slot_map.rows_of(bad)
    assert page_first.slot_map.rows_of(torch.tensor([0, 4])).tolist() == [0, 12]
    direct = viewed(torch.zeros(2, 3, 4, 8), "page_first_direct", 3, 4)
    with pytest.raises(ValueError, match="host_indices"):
        direct.slot_map.rows_of(torch.tensor([8]))
    assert direct.slot_map.rows_of(torch.tensor([1, 5])).tolist() == [1, 13]


def test_a_layer_outside_the_buffer_is_refused():
    rows = viewed(torch.zeros(2, 3, 8), "page_first", 3, 1)
    for layer in (-1, 3):
        with pytest.raises(IndexError, match="outside"):
            rows.layer(layer)


def test_buffers_that_cannot_be_viewed_say_why():
    row = torch.Size([8])
    assert block_rows(torch.zeros(10, 3, 8).transpose(0, 1), "layer_first", 3, 1, row) == (
        "sglang_host_buffer_layout"
    )
    assert block_rows(torch.zeros(8), "layer_first", 1, 1, row) == "sglang_host_buffer_layout"
    assert block_rows(torch.zeros(2, 10, 8), "layer_first", 3, 1, row) == (
        "sglang_host_buffer_layout"
    )
    assert block_rows(torch.zeros(10, 2, 8), "page_first", 3, 1, row) == (
        "sglang_host_buffer_layout"
    )
    assert block_rows(torch.zeros(10, 3, 8), "page_head", 3, 1, row) == "sglang_layout_page_head"
    assert block_rows(torch.zeros(10, 3, 8), "page_first", 3, 1, torch.Size([4])) == (
        "row_shape_mismatch"
    )
    assert block_rows(torch.zeros(10, 3, 8), "page_first", 3, 1, torch.Size([0])) == (
        "row_shape_mismatch"
    )


def test_equal_shapes_share_a_geometry():
    k, v = torch.zeros(4, 3, 2, 8), torch.ones(4, 3, 2, 8)
    assert viewed(k, "page_first_direct", 3, 2).geometry == (
        viewed(v, "page_first_direct", 3, 2).geometry
    )
    assert viewed(k, "page_first_direct", 3, 2).geometry != (
        viewed(torch.zeros(5, 3, 2, 8), "page_first_direct", 3, 2).geometry
    )


@pytest.mark.parametrize(
    ("host", "device", "paged"),
    [
        ([4, 5, 6, 7, 0, 1, 2, 3], [9, 10, 11, 12, 1, 2, 3, 4], True),
        ([], [], True),
        ([5, 6, 7, 8], [0, 1, 2, 3], False),  # host page off its boundary
        ([4, 5, 7, 6], [0, 1, 2, 3], False),  # not consecutive within the page
        ([4, 5, 6, 7], [0, 1, 3, 2], False),
        ([4, 5, 6], [0, 1, 2], False),  # a partial page
        ([4, 5, 6, 7], [0, 1, 2], False),
    ],
)
def test_is_paged_accepts_whole_pages_only(host, device, paged):
    host_slots, device_slots = (torch.tensor(at, dtype=torch.int64) for at in (host, device))
    assert is_paged(host_slots, device_slots, 4) is paged
