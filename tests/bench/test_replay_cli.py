"""`pdserve replay`'s command line: pdserve's settings reach the policy and the report names them."""

from __future__ import annotations

import pytest

from bench.replay.cli import main

SMALL = ["--trace", "mooncake", "--requests", "300", "--time-scale", "2.947", "--policies", "pdserve"]


def test_the_overflow_threshold_reaches_pdserve_and_the_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--prefill-overflow-queue-s", "5"]) == 0
    assert "prefill overflow at 5 s queued" in capsys.readouterr().out
    assert main([*SMALL, "--no-prefill-overflow"]) == 0
    assert "prefill overflow off" in capsys.readouterr().out
    assert main(SMALL) == 0
    assert "prefill overflow at 10 s queued" in capsys.readouterr().out


def test_a_threshold_and_no_overflow_together_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*SMALL, "--prefill-overflow-queue-s", "5", "--no-prefill-overflow"])
    assert exit_.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
