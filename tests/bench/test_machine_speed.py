"""bench/machine_speed.py: how it reads a machine's swings, and that its measurements run and clean up."""

from __future__ import annotations

import os

import psutil
import pytest

from bench.machine_speed import main, relative, swings, waking, window_spread


def test_each_second_is_read_against_the_fastest_tenth() -> None:
    per_second = [2.0] * 8 + [1.0] * 3 + [4.0] * 9
    ratios = relative(per_second)
    assert min(ratios) == 1.0  # the tenth percentile second (the 3rd fastest of 20) is the reference
    assert ratios[:8] == [2.0] * 8 and ratios[-1] == 4.0
    assert relative([2.0] * 18 + [1.0] * 2) == [1.0] * 18 + [0.5] * 2  # one-off fast seconds do not set it


def test_two_stretches_differ_by_their_means() -> None:
    steady_then_slow = [1.0] * 30 + [1.6] * 30
    assert window_spread(steady_then_slow, 30) == pytest.approx(1.6)
    assert window_spread(steady_then_slow, 60) == pytest.approx(1.0)  # one stretch: nothing to compare
    assert window_spread([1.0] * 10, 30) == 1.0  # shorter than a window


def test_swings_report_every_second_of_every_core() -> None:
    core = sorted(os.sched_getaffinity(0))[0]
    per_second = swings(2.0, [core])
    assert list(per_second) == [core]
    assert len(per_second[core]) == 2 and all(s > 0 for s in per_second[core])


def test_waking_alternates_blocks_and_stops_its_busy_loop() -> None:
    affinity = os.sched_getaffinity(0)
    before = {p.pid for p in psutil.Process().children()}
    try:
        idle, awake = waking(2, sorted(affinity)[-1], 0.2)
    finally:
        os.sched_setaffinity(0, affinity)
    assert len(idle) == len(awake) == 2 and all(s > 0 for s in idle + awake)
    assert {p.pid for p in psutil.Process().children()} == before


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit):
        main(["--seconds", "0"])
