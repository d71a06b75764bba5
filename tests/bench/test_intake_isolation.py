"""`python -m bench.intake_isolation`'s systems and its one table (the run itself needs a cluster: the command
is in docs/benchmarks.md)."""

from __future__ import annotations

import argparse

import pytest

from bench.intake_isolation import Outcome, Refusals, report, systems


def test_systems_are_doubles_at_a_revision_or_this_tree() -> None:
    assert systems("doubles@5670910, doubles") == ["doubles@5670910", "doubles"]
    for wrong in ("pd", "doubles@", "vllm,doubles", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            systems(wrong)


def _outcome(loaded: list[float], unexpected: tuple[str, ...] = ()) -> Outcome:
    return Outcome(
        idle=[0.002, 0.002, 0.003],
        loaded=loaded,
        grpc=Refusals(seconds=[0.025, 0.030]),
        http=Refusals(seconds=[0.050], unexpected=list(unexpected)),
        how="4 at once (2 per door), 3 bursts",
    )


def test_the_table_has_a_row_per_system_and_fails_on_what_was_not_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert report([("doubles@abc", _outcome([0.020, 0.040])), ("doubles", _outcome([0.004]))]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows["doubles@abc"][:4] == ["2", "40", "40", "20.00x"]
    assert rows["doubles"][:4] == ["2", "4", "4", "2.00x"]
    assert rows["doubles"][4:] == ["30", "30", "50", "50"]
    assert report([("doubles", _outcome([0.004], ("http 200: accepted",)))]) == 1
    assert report([("doubles", _outcome([]))]) == 1
