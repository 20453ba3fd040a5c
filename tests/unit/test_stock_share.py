"""kvcore.stock_share: which reloads kvcore would serve go to the engine's copy instead."""

from __future__ import annotations

from kvcore.stock_share import REASON, StockShare


def test_no_share_draws_nothing_and_a_whole_share_draws_everything():
    assert not any(StockShare(0.0).drawn() for _ in range(100))
    assert all(StockShare(1.0).drawn() for _ in range(100))
    assert REASON == "stock_share"


def test_a_share_draws_about_its_part_and_the_same_reloads_for_the_same_seed():
    first, again = StockShare(0.5, seed=3), StockShare(0.5, seed=3)
    draws = [first.drawn() for _ in range(400)]
    assert draws == [again.drawn() for _ in range(400)]
    assert 150 < sum(draws) < 250
    assert draws != [StockShare(0.5, seed=4).drawn() for _ in range(400)]
