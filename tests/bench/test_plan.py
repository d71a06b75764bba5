"""`pdserve plan`: the cheapest replica counts whose replay meets the SLOs, written as a topology that
validates; a replay of the written topology meets the SLOs it was planned for."""

from __future__ import annotations

import itertools
from pathlib import Path

import msgspec
import pytest
import yaml

from bench.plan import Planner, cheapest_pd, fewest, main, planned_topology
from bench.replay.traces import load_trace
from bench.slo import Slo
from cluster.topology_file import load_topology, parse_topology

H200 = Path(__file__).resolve().parents[2] / "deploy" / "h200-kimi-k2.yaml"


def test_the_staircase_finds_the_cheapest_pair_on_a_monotone_frontier_in_linear_calls() -> None:
    # Decode needs fewer replicas the more prefill there is (prefill overflow lands on decode), down to 2.
    def meets(p: int, d: int) -> bool:
        calls.append((p, d))
        return p >= 3 and d >= max(2, 9 - p)

    def cost(p: int, d: int) -> float:
        return 8 * p + 16 * d

    calls: list[tuple[int, int]] = []
    found = cheapest_pd(meets, 12, 12, cost)
    brute = min(
        ((p, d) for p, d in itertools.product(range(1, 13), repeat=2) if p >= 3 and d >= max(2, 9 - p)),
        key=lambda pd: cost(*pd),
    )
    assert found is not None and cost(*found) == cost(*brute)
    assert len(calls) <= 2 * 12 + 12
    assert cheapest_pd(lambda p, d: False, 4, 4, cost) is None


def test_fewest_is_a_binary_search_over_a_monotone_test() -> None:
    seen: list[int] = []

    def meets(n: int) -> bool:
        seen.append(n)
        return n >= 11

    assert fewest(meets, 32) == 11 and len(seen) <= 7
    assert fewest(lambda n: False, 8) is None


def test_the_planned_topology_sizes_the_inventory_to_hold_its_replicas() -> None:
    topo = load_topology(H200)
    planned = planned_topology(yaml.safe_load(H200.read_text()), topo, 3, 5)
    counts = {g["name"]: g["count"] for g in planned["nodes"]}
    # A prefill replica is one 8-GPU node, a decode replica two; the head and router groups stay.
    assert counts == {"head": 1, "router": 2, "prefill-h200": 3, "decode-h200": 10}
    checked = parse_topology(planned)
    assert (checked.pools.prefill.replicas, checked.pools.decode.replicas) == (3, 5)


def test_a_plan_on_the_claude_code_sessions_validates_and_its_replay_meets_the_slos(tmp_path: Path) -> None:
    out = tmp_path / "planned.yaml"
    argv = [
        "-f",
        str(H200),
        "-o",
        str(out),
        "--trace",
        "claude-code",
        "--concurrency",
        "8",
        "--sessions",
        "16",
    ]
    assert main([*argv, "--max-replicas", "4"]) == 0
    planned = load_topology(out)  # validates, as `pdserve apply` would
    text = out.read_text()
    assert text.startswith("# pdserve topology planned by `pdserve plan`") and "best aggregated" in text
    p, d = planned.pools.prefill.replicas, planned.pools.decode.replicas
    assert p >= 1 and d >= 1
    # A fresh replay of the file as written, on the same workload, meets what it was planned for.
    trace = load_trace("claude-code", block_tokens=512, limit=16, seed=0)
    slo = Slo(ttft_s=planned.router.ttft_slo_ms / 1e3, tpot_s=planned.router.tpot_slo_ms / 1e3)
    again = Planner(trace, planned, slo, {"concurrency": 8}, attainment=0.9)
    assert again.outcome(p, d).meets(0.9)
    # And it is the cheapest that does: one replica fewer in either pool misses.
    assert p == 1 or not again.meets(p - 1, d)
    assert d == 1 or not again.meets(p, d - 1)
    assert msgspec.to_builtins(planned.router) == msgspec.to_builtins(load_topology(H200).router)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trace", "claude-code"], "--trace claude-code: give --concurrency N"),
        (["--trace", "mooncake", "--concurrency", "4"], "--trace mooncake: give --time-scale X"),
        (["--trace", "claude-code", "--concurrency", "4", "--attainment", "1.5"], "--attainment: a share"),
        (["--trace", "claude-code", "--concurrency", "4", "--slo", "ttft=-1"], "--slo:"),
    ],
)
def test_bad_input_is_one_line_naming_the_argument(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["-f", str(H200), "-o", str(tmp_path / "x.yaml"), *args])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x.yaml").exists()
