"""`pdserve bench --side-by-side --rounds N`: systems in alternating order, ratios read within a round."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench.live import side_by_side
from bench.live.report import RunResult, ratio_rows, summarize
from bench.live.runner import Timed
from bench.live.side_by_side import SystemDidNotStart, measure_systems, round_orders, summary
from bench.live.targets import Served
from bench.slo import Slo

SLO = Slo(ttft_s=10.0, tpot_s=10.0)


def _result(ttft: float) -> RunResult:
    timed = Timed(sent=0.0, first_token=ttft, end=ttft + 1.0, messages=[(ttft, 1)], completion_tokens=2)
    return summarize("8 sessions", None, [timed], 2.0, SLO)


def test_rounds_alternate_the_order_of_the_systems() -> None:
    assert round_orders(["a", "b", "vllm"], 3) == [["a", "b", "vllm"], ["vllm", "b", "a"], ["a", "b", "vllm"]]
    assert round_orders(["a", "b"], 1) == [["a", "b"]]


def test_each_system_is_started_afresh_every_round_and_its_results_carry_the_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    starts: list[str] = []

    @contextmanager
    def started(system: str, base: Path) -> Iterator[str]:
        starts.append(system)
        yield f"addr-{system}-{len(starts)}"

    def measure(address: str) -> tuple[Served, str, list[RunResult]]:
        # The second system to start in each round is the slower: what alternating the order cancels.
        slow = len(starts) % 2 == 0
        return Served(model="m", max_model_len=2048), "w", [_result(0.2 if slow else 0.1)]

    monkeypatch.setattr(side_by_side, "started", started)
    measured, workload = measure_systems(["pd", "base"], 2, Path("t.yaml"), measure)
    assert starts == ["pd", "base", "base", "pd"] and workload == "w"
    runs = {s: rs for s, (_, rs) in measured.items()}
    assert [r.round for r in runs["pd"]] == [1, 2] and [r.round for r in runs["base"]] == [1, 2]
    # Round 1: pd first (faster), round 2: pd second (slower): 0.5 and 2.0, each against its own round.
    assert [row["ttft p50"] for row in ratio_rows(runs, "base")] == pytest.approx([0.5, 2.0])
    text = summary(runs, "base", 2)
    assert "median of 2 rounds in alternating order" in text and "1.25 (0.50-2.00)" in text
    assert "pd 8 sessions r2" in text


def test_a_system_that_does_not_start_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    @contextmanager
    def started(system: str, base: Path) -> Iterator[str]:
        raise TimeoutError("not ready in 600 s")
        yield ""

    monkeypatch.setattr(side_by_side, "started", started)
    with pytest.raises(SystemDidNotStart, match="pd did not start: not ready in 600 s"):
        measure_systems(["pd"], 1, Path("t.yaml"), lambda address: pytest.fail("measured"))


def test_one_round_prints_no_medians() -> None:
    runs = {"pd": [_result(0.1)], "base": [_result(0.2)]}
    text = summary(runs, "base", 1)
    assert "ratios to base" in text and "median" not in text and " r1" not in text


def test_rounds_need_a_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.live.cli import main

    assert main(["--rounds", "2"]) == 2
    assert "--rounds: only with --side-by-side" in capsys.readouterr().err
    assert main(["--side-by-side", "pd,vllm", "--rounds", "2", "--plots", "p"]) == 2
    assert "without --plots" in capsys.readouterr().err
