"""The live HiCache run's trace: its shape, and token ids that name their prefix."""

from __future__ import annotations

from collections import defaultdict

import pytest

from benchmarks.sglang.hicache_trace import (
    FIRST_TURN_TOKENS,
    TraceShape,
    last_token_id,
    make_trace,
)

SMALL = TraceShape(conversations=14, turns=3, page_size=4, scale=64)


def test_every_turn_is_sent_before_any_later_turn_and_each_conversation_once_a_turn():
    requests = make_trace(SMALL)
    assert [r.index for r in requests] == list(range(14 * 3))
    turns = [r.turn for r in requests]
    assert turns == sorted(turns)
    for turn in range(3):
        sent = [r.conversation for r in requests if r.turn == turn]
        assert sorted(sent) == list(range(14))
    assert [r.conversation for r in requests[:14]] != list(range(14)), "each turn is shuffled"


def test_first_turn_sizes_cycle_so_every_size_gets_the_same_share():
    requests = make_trace(TraceShape(conversations=21, turns=1))
    sizes = defaultdict(int)
    for r in requests:
        sizes[r.first_turn_tokens] += 1
    assert sizes == dict.fromkeys(FIRST_TURN_TOKENS, 3)
    for r in requests:
        assert r.prompt_tokens == r.first_turn_tokens
        assert len(r.tokens) == r.first_turn_tokens + 64


def test_a_later_turn_extends_the_whole_conversation_so_far_by_a_short_message():
    requests = make_trace(SMALL)
    last: dict[int, tuple[int, ...]] = {}
    for r in requests:
        if r.conversation in last:
            before = last[r.conversation]
            assert r.tokens[: len(before)] == before
            assert r.prompt_tokens == len(before) + SMALL.length(64)
        last[r.conversation] = r.tokens


def test_lengths_are_whole_pages_scaled_down():
    for r in make_trace(SMALL):
        assert len(r.tokens) % 4 == 0 and r.prompt_tokens % 4 == 0
    assert SMALL.length(32000) == 500 and SMALL.length(64) == 4 and SMALL.length(1) == 4
    assert TraceShape().length(32000) == 32000 and TraceShape().length(100) == 128


def test_a_token_id_names_its_whole_prefix():
    """Outside the shared system prompts, each id appears at one position after one history."""
    requests = make_trace(SMALL)
    prefix_of: dict[int, tuple[int, ...]] = {}
    for r in requests:
        for position, token in enumerate(r.tokens):
            seen = prefix_of.setdefault(token, r.tokens[:position])
            assert seen == r.tokens[:position]
    systems = {r.tokens[:2] for r in requests}
    assert 1 < len(systems) <= 3, "conversations share a few system prompts"


def test_the_same_seed_gives_the_same_trace_and_another_seed_another_order():
    assert make_trace(SMALL) == make_trace(SMALL)
    other = make_trace(TraceShape(conversations=14, turns=3, page_size=4, scale=64, seed=1))
    assert [r.conversation for r in other] != [r.conversation for r in make_trace(SMALL)]


def test_a_second_trace_can_start_past_the_first_ones_ids():
    first = make_trace(SMALL)
    second = make_trace(
        TraceShape(
            conversations=2, turns=2, page_size=4, scale=64, first_token_id=last_token_id(first) + 1
        )
    )
    assert not {t for r in first for t in r.tokens} & {t for r in second for t in r.tokens}


def test_an_empty_trace_is_refused():
    with pytest.raises(ValueError):
        make_trace(TraceShape(conversations=0))
