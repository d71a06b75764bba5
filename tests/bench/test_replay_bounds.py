"""Hit-ratio ceilings a replay's results are read against: pooled LRU and optimal replacement."""

from __future__ import annotations

import pytest
from test_replay_sim import make_trace

from bench.replay.bounds import belady_hit_ratio, pooled_lru_hit_ratio
from bench.replay.traces import infinite_cache_hit_ratio


def one_block_turns(blocks: list[int]) -> object:
    """One session whose turns are single blocks, in this order."""
    return make_trace([[[b] for b in blocks]], closed_loop=True)


def test_with_room_for_every_block_both_reach_the_infinite_cache_bound() -> None:
    trace = make_trace([[[1, 2], [1, 2, 3], [1, 2, 3, 4]], [[5], [5, 6]]], closed_loop=True)
    bound = infinite_cache_hit_ratio(trace)
    assert pooled_lru_hit_ratio(trace, 100) == pytest.approx(bound)
    assert belady_hit_ratio(trace, 100) == pytest.approx(bound)


def test_a_cyclic_pattern_defeats_lru_but_not_optimal_replacement() -> None:
    trace = one_block_turns([1, 2, 3, 1, 2, 3])
    assert pooled_lru_hit_ratio(trace, 2) == 0.0  # each block was evicted just before its reuse
    # Optimal: keep 1 and 2 (needed soonest), never admit 3: 1 and 2 hit on reuse.
    assert belady_hit_ratio(trace, 2) == pytest.approx(2 / 6)


def test_optimal_replacement_evicts_the_block_needed_furthest_ahead() -> None:
    # Capacity 2 after 1, 2: block 3 arrives; 1 is needed next, 2 much later, 3 in between: 2 goes.
    trace = one_block_turns([1, 2, 3, 1, 3, 2])
    assert belady_hit_ratio(trace, 2) == pytest.approx(2 / 6)  # 1 and 3 hit; 2 was evicted
    with pytest.raises(ValueError):
        belady_hit_ratio(trace, 0)
