"""The live HiCache run's KV content: random-looking, never zero, and checked to the byte."""

from __future__ import annotations

import torch

from benchmarks.sglang.kv_content import KVContent

LAYERS, HEADS, DIM, SLOTS = 3, 2, 8, 64


def pool() -> tuple[KVContent, list[torch.Tensor], list[torch.Tensor]]:
    content = KVContent(LAYERS, HEADS, DIM, torch.device("cpu"), seed=7)
    keys = [torch.zeros(SLOTS, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    values = [torch.zeros(SLOTS, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
    return content, keys, values


def tokens(n: int, start: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(start, start + n), torch.arange(n)


def test_every_element_is_a_finite_non_zero_normal_bf16():
    content, _, _ = pool()
    rows = content.rows(*tokens(256))
    for layer in range(LAYERS):
        for kv in (0, 1):
            values = content.layer_rows(rows, layer, kv).view(torch.bfloat16).float()
            assert torch.isfinite(values).all()
            assert (values.abs() >= torch.finfo(torch.bfloat16).tiny).all()


def test_rows_depend_on_token_position_layer_and_kind_and_nothing_else():
    content, _, _ = pool()
    ids, places = tokens(4)
    rows = content.rows(ids, places)
    assert torch.equal(rows, content.rows(ids, places))
    assert torch.equal(
        rows, KVContent(LAYERS, HEADS, DIM, torch.device("cpu"), seed=7).rows(ids, places)
    )
    assert not torch.equal(rows[0], rows[1])
    assert not torch.equal(rows, content.rows(ids, places + 1))
    assert not torch.equal(rows, content.rows(ids + 1, places))
    assert not torch.equal(content.layer_rows(rows, 0, 0), content.layer_rows(rows, 0, 1))
    assert not torch.equal(content.layer_rows(rows, 0, 0), content.layer_rows(rows, 1, 0))
    # Random-looking: about half the bits of two rows differ.
    differ = (rows[0] ^ rows[1]).view(torch.uint8)
    bits = sum(int(byte).bit_count() for byte in differ)
    assert 0.3 < bits / (8 * differ.numel()) < 0.7


def test_what_was_filled_checks_clean_and_one_flipped_byte_is_one_mismatch():
    content, keys, values = pool()
    buffers = lambda layer: (keys[layer], values[layer])  # noqa: E731
    slots = torch.tensor([5, 9, 10, 40])
    ids, places = tokens(4)
    content.fill(buffers, slots, ids, places)
    assert content.mismatched_bytes(buffers, slots, ids, places) == 0
    values[2][10].view(torch.uint8).view(-1)[17] ^= 0x01
    assert content.mismatched_bytes(buffers, slots, ids, places) == 1
    assert content.mismatched_bytes(buffers, slots[:2], ids[:2], places[:2]) == 0


def test_rows_in_the_wrong_slots_or_never_written_fail_in_nearly_every_byte():
    content, keys, values = pool()
    buffers = lambda layer: (keys[layer], values[layer])  # noqa: E731
    ids, places = tokens(2)
    content.fill(buffers, torch.tensor([1, 2]), ids, places)
    row_bytes = 2 * LAYERS * HEADS * DIM * 2
    swapped = content.mismatched_bytes(buffers, torch.tensor([2, 1]), ids, places)
    assert swapped > 0.9 * 2 * row_bytes
    unwritten = content.mismatched_bytes(buffers, torch.tensor([3]), ids[:1], places[:1])
    assert unwritten == row_bytes, "zeros never pass"
    assert (
        content.mismatched_bytes(buffers, torch.tensor([], dtype=torch.int64), ids[:0], places[:0])
        == 0
    )
