"""`pdserve bench` against a live gRPC endpoint: the workload it sends, the arrival processes, every mode,
and the report (percentiles, goodput, JSON). Against the in-process endpoint
(tests/router/inprocess_server.py: the real service with a stand-in decode pool streaming fixed tokens);
tests/e2e runs it on real engines."""

from __future__ import annotations

import itertools
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "router"))
from inprocess_server import endpoint

from bench.live.arrivals import Arrivals
from bench.live.report import summarize
from bench.live.runner import Timed
from bench.live.workload import Lengths, Workload
from bench.slo import Slo, percentile

PDSERVE = str(Path(sys.executable).with_name("pdserve"))


def test_lengths_parse_and_draw_around_their_mean() -> None:
    rng = random.Random(0)
    assert Lengths.parse("fixed:128").draw(rng) == 128
    draws = [Lengths.parse("lognormal:200,0.5").draw(rng) for _ in range(4000)]
    assert 180 < statistics.mean(draws) < 220 and min(draws) >= 1
    for bad in ("fixed", "normal:10", "uniform:3,4", "fixed:0", "lognormal:x,1"):
        with pytest.raises(ValueError, match="expected fixed:N"):
            Lengths.parse(bad)


def test_shared_prefix_groups_start_with_the_same_tokens_and_requests_fit_the_context() -> None:
    w = Workload(
        Lengths("fixed", 3000), Lengths("fixed", 64), prefix_groups=2, prefix_len=100, max_model_len=2048
    )
    reqs = w.requests(20, seed=1)
    by_group: dict[int, set[tuple[int, ...]]] = {}
    for r in reqs:
        by_group.setdefault(r.group, set()).add(tuple(r.token_ids[:100]))
        assert len(r.token_ids) + r.max_tokens <= 2048
    assert sorted(by_group) == [0, 1] and all(len(p) == 1 for p in by_group.values())
    assert w.requests(20, seed=1) == reqs  # seeded: the same workload every run


def test_arrival_processes_keep_their_rate_and_gamma_is_burstier() -> None:
    n, rate = 20_000, 4.0
    for text in ("poisson", "constant", "gamma:0.25"):
        offsets = Arrivals.parse(text).offsets(n, rate, seed=0)
        assert offsets[-1] / (n - 1) == pytest.approx(1 / rate, rel=0.05), text
    gaps = {
        text: statistics.pstdev(b - a for a, b in itertools.pairwise(o))
        for text in ("poisson", "gamma:0.25")
        for o in [Arrivals.parse(text).offsets(n, rate, seed=0)]
    }
    assert gaps["gamma:0.25"] > 1.5 * gaps["poisson"]
    with pytest.raises(ValueError):
        Arrivals.parse("gamma:0")


def test_the_report_times_every_token_and_counts_goodput_against_the_slo() -> None:
    fast = Timed(
        sent=0.0, first_token=0.1, end=0.4, messages=[(0.1, 1), (0.2, 2), (0.4, 1)], completion_tokens=4
    )
    slow = Timed(sent=0.0, first_token=3.0, end=3.3, messages=[(3.0, 1), (3.3, 3)], completion_tokens=4)
    failed = Timed(sent=0.0, status="UNAVAILABLE")
    r = summarize("x", None, [fast, slow, failed], 2.0, Slo(ttft_s=1.0, tpot_s=0.2))
    assert fast.itl() == pytest.approx([0.05, 0.05, 0.2]) and fast.tpot == pytest.approx(0.1)
    assert r.ttft_s["p50"] == pytest.approx(0.1) and r.ttft_s["p99"] == pytest.approx(3.0)
    assert r.goodput_share == pytest.approx(1 / 3) and r.goodput_rps == pytest.approx(0.5)
    assert r.failed == {"UNAVAILABLE": 1} and r.throughput_rps == pytest.approx(1.0)
    assert percentile([], 50) != percentile([], 50)  # NaN


@pytest.mark.parametrize("mode", ["sweep", "min-latency", "max-throughput", "concurrency"])
def test_each_mode_runs_against_a_live_endpoint_and_writes_its_json(mode: str, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    with endpoint(output=["a", "b", "c"]) as target:
        run = subprocess.run(
            [PDSERVE, "bench", "--target", target, "--mode", mode, "--rates", "5,10,20,40",
             "--num-requests", "8", "--input-len", "normal:64,8", "--prefix-groups", "2",
             "--prefix-len", "32", "--json", str(out)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    runs = report["results"]
    assert len(runs) == (4 if mode == "sweep" else 1)
    for r in runs:
        assert r["requests"] == 8 and not r["failed"]
        assert 0 < r["ttft_s"]["p50"] <= r["ttft_s"]["p99"] and r["e2e_s"]["p99"] >= r["ttft_s"]["p99"]
        assert r["throughput_rps"] > 0
    if mode == "sweep":
        assert [r["offered_rate"] for r in runs] == [5, 10, 20, 40]
    assert report["model"]["id"] == "tiny-llama" and report["machine"]["cpus"]
    assert "ttft p50/p95/p99 ms" in run.stdout  # the table


def test_an_unreachable_endpoint_is_one_line_and_exit_2() -> None:
    run = subprocess.run(
        [PDSERVE, "bench", "--target", "127.0.0.1:1", "--mode", "min-latency"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2 and "UNAVAILABLE" in run.stderr and "Traceback" not in run.stderr
