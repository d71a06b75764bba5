"""bench/step_shapes.py: the counts it times as fresh are fresh (it times real engines: minutes, by hand)."""

from __future__ import annotations

import pytest

from bench.step_shapes import fresh_counts, main


def test_every_round_times_counts_no_round_and_not_the_repeated_size_used() -> None:
    rounds = [fresh_counts(1500, 40, r) for r in range(3)]
    seen = [n for counts in rounds for n in counts]
    assert len(seen) == len(set(seen)) == 120
    assert 1500 not in seen and min(seen) == 1501


def test_counts_past_the_models_context_are_refused_before_an_engine_starts() -> None:
    with pytest.raises(SystemExit):
        main(["--tokens", "2000", "--prompts", "40"])
