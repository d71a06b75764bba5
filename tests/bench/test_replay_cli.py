"""`pdserve replay`'s command line: pdserve's settings reach the policy and the report names them."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.replay.cli import main

SMALL = ["--trace", "mooncake", "--requests", "300", "--time-scale", "2.947", "--policies", "pdserve"]


def test_the_local_prefill_settings_reach_pdserve_and_the_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--prefill-overflow-queue-s", "5"]) == 0
    assert "prefill overflow at 5 s queued" in capsys.readouterr().out
    assert main([*SMALL, "--no-prefill-overflow"]) == 0
    assert "prefill overflow off" in capsys.readouterr().out
    assert main(SMALL) == 0
    assert "long local prefill stall x20, prefill overflow at 10 s queued" in capsys.readouterr().out
    assert main([*SMALL, "--no-long-local-prefill"]) == 0
    assert "long local prefill off, prefill overflow at 10 s queued" in capsys.readouterr().out


def test_the_cost_weights_reach_pdserve_and_the_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--prefill-weight", "20", "--long-stall-weight", "5"]) == 0
    out = capsys.readouterr().out
    assert "prefill weight 20, balance 0.2" in out and "long local prefill stall x5," in out
    assert main([*SMALL, "--long-stall-weight", "1"]) == 0
    out = capsys.readouterr().out
    assert "prefill weight 5, balance 0.2" in out and "long local prefill stall x1," in out


def test_a_threshold_and_no_overflow_together_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*SMALL, "--prefill-overflow-queue-s", "5", "--no-prefill-overflow"])
    assert exit_.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_trace_folder_without_sessions_is_refused_with_what_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "claude-code" / "sessions").mkdir(parents=True)
    with pytest.raises(SystemExit) as exit_:
        main(["--trace", "claude-code", "--traces-dir", str(tmp_path), "--concurrency", "4"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    wanted = f"no sessions (*.json, *.json.gz, *.json.xz) in {tmp_path}/claude-code/sessions"
    assert f"argument --traces-dir: {wanted}" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cache-frac", "-1"], "argument --cache-frac: must be > 0 and <= 1, got -1"),
        (["--cache-frac", "1.5"], "argument --cache-frac: must be > 0 and <= 1, got 1.5"),
        (["--time-scale", "0"], "argument --time-scale: must be > 0, got 0"),
        (["--requests", "0"], "argument --requests: must be >= 1, got 0"),
        (["--local-prefill-max-tokens", "-5"], "argument --local-prefill-max-tokens: must be >= 0, got -5"),
        (["--prefill-weight", "-1"], "argument --prefill-weight: must be >= 0, got -1"),
        (["--readback-ttl-s", "ten"], "argument --readback-ttl-s: expected float, got 'ten'"),
        (["--policies", "pdserve,sglang"], "argument --policies: unknown policies ['sglang']; known: ["),
        (["--traces-dir", "/nonexistent"], "argument --traces-dir: No such file or directory: /nonexistent/"),
    ],
)
def test_bad_arguments_are_refused_naming_the_argument(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*SMALL, *args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err
