"""The replay's autoscaling (bench/replay/autoscaler.py): the live policy on simulated replicas scales a pool
up through a burst and down after it, replicas take requests only once started and stop only once drained,
and the replay counts what each replica ran; and the Azure trace it is measured on."""

from __future__ import annotations

from typing import Any

import pytest

from bench.replay.autoscaler import Autoscaler, PoolScaling
from bench.replay.index_feed import KvIndexFeed
from bench.replay.metrics import summarize
from bench.replay.policies import available_policies
from bench.replay.sim import SimConfig, Simulator
from bench.replay.traces import BlockHasher, Session, Trace, TraceRequest, load_trace
from bench.slo import Slo
from cluster.autoscaling import ScaleTargets
from router.service_time import ServiceTimeModel

BLOCK = 512
PROMPT = 16_384
TIMING = ServiceTimeModel()


def burst_trace(quiet_rps: float, burst_rps: float) -> Trace:
    """Quiet for 120 s, a burst for 120 s, quiet again for 360 s; prompts of their own (no shared prefix)."""
    hasher = BlockHasher(BLOCK, 1)
    sessions, t, i = [], 0.0, 0
    for rate, until in ((quiet_rps, 120.0), (burst_rps, 240.0), (quiet_rps, 600.0)):
        while t < until:
            rid = f"r{i}"
            blocks = hasher.hashes(list(range(PROMPT // BLOCK)), PROMPT // BLOCK, i + 1)
            request = TraceRequest(
                request_id=rid,
                session_id=rid,
                arrival_s=t,
                gap_s=0.0,
                num_prompt_tokens=PROMPT,
                num_output_tokens=64,
                block_hashes=blocks,
            )
            sessions.append(Session(session_id=rid, requests=(request,)))
            t, i = t + 1 / rate, i + 1
    return Trace(name="azure", closed_loop=False, block_tokens=BLOCK, sessions=tuple(sessions), hasher=hasher)


def simulate(trace: Trace, prefill: int, scaling: list[PoolScaling]) -> Simulator:
    cfg = SimConfig(prefill_replicas=prefill, decode_replicas=1, capacity_blocks=100_000, timing=TIMING)
    feed = KvIndexFeed(trace, [])
    policy = available_policies()["pdserve"](TIMING)
    sim = Simulator(trace, policy, cfg, index_factory=lambda: (feed, feed.index))
    if scaling:
        Autoscaler(sim, scaling, tick_s=2.0)
    sim.run()
    return sim


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    prefill_s = TIMING.prefill_s(PROMPT, 0)
    # The quiet needs half a prefill replica; the burst five times that: two and a half.
    trace = burst_trace(quiet_rps=0.5 / prefill_s, burst_rps=2.5 / prefill_s)
    scaling = PoolScaling(
        role="prefill",
        targets=ScaleTargets(role="prefill", queue_s=1.0, ttft_s=4.0, hold_s=30.0),
        min_replicas=1,
        max_replicas=6,
        window_s=10.0,
        start_s=20.0,
    )
    return {
        "fixed at one": simulate(trace, 1, []),
        "fixed at the peak": simulate(trace, 4, []),
        "autoscaled": simulate(trace, 1, [scaling]),
    }


def test_a_burst_scales_the_pool_up_and_the_quiet_after_it_down(runs: dict[str, Any]) -> None:
    sim = runs["autoscaled"]
    in_burst = [s for s in sim.prefill if 120 <= s.started <= 240]
    assert len(in_burst) >= 2, "replicas start during the burst"
    stopped = [s for s in sim.prefill if s.stopped is not None]
    # Replicas started to drain the burst's backlog may stop before it ends, once the backlog is gone;
    # what the burst's own rate needs (2.5 replicas' worth) keeps running to its end.
    assert all(200 < s.stopped < 600 for s in stopped), "replicas stop once the backlog is gone"
    for t in range(200, 240, 2):
        serving = [s for s in sim.prefill if s.started + 20.0 <= t and (s.stopped is None or s.stopped > t)]
        assert len(serving) >= 3, f"at {t} s, during the burst"
    assert len(sim.prefill) - len(stopped) == 1, "down to min_replicas"
    assert len(sim.prefill) <= 6


def test_replicas_take_requests_only_once_started_and_stop_only_once_drained(runs: dict[str, Any]) -> None:
    sim = runs["autoscaled"]
    by_id = {s.replica_id: s for s in sim.prefill}
    assert all(r.finish > r.arrival for r in sim.records)  # every request ended
    for r in sim.records:
        server = by_id.get(r.prefill_replica or "")
        if server is None:
            continue  # prefilled on the decode replica
        assert r.prefill_start >= server.started + 20.0 or server.started == 0
        assert server.stopped is None or r.prefill_end <= server.stopped


def test_autoscaling_meets_the_slo_of_the_peak_deployment_for_less(runs: dict[str, Any]) -> None:
    slo = Slo(ttft_s=8.0, tpot_s=0.1)
    results = {name: summarize(name, sim, sim.records, 0.0, 0.0, slo=slo) for name, sim in runs.items()}
    one, peak, auto = results["fixed at one"], results["fixed at the peak"], results["autoscaled"]
    print({n: (round(r.goodput_share, 3), round(r.prefill_replica_s)) for n, r in results.items()})
    assert auto.goodput_share > one.goodput_share + 0.2
    assert auto.prefill_replica_s < 0.7 * peak.prefill_replica_s
    assert auto.prefill_replicas_peak > 1 and peak.prefill_replicas_peak == 4


def test_the_azure_trace_ships_with_the_repository_and_copies_raise_its_rate() -> None:
    one = load_trace("azure", limit=200)
    assert one.num_requests() == 200 and not one.closed_loop
    arrivals = [r.arrival_s for r in one.requests()]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    # No prefix information: no two requests share a block.
    assert one.unique_blocks() == sum(len(r.block_hashes) for r in one.requests())
    from bench.replay.traces import AZURE_FILE, DEFAULT_TRACES_DIR, load_azure

    three = load_azure(DEFAULT_TRACES_DIR / AZURE_FILE, max_requests=200, copies=3)
    assert three.num_requests() == 600 and three.unique_blocks() == 3 * one.unique_blocks()
    assert max(r.arrival_s for r in three.requests()) < max(arrivals) + 60


def test_a_warm_pool_starts_at_its_count_without_adding_a_replica_for_its_buffer() -> None:
    prefill_s = TIMING.prefill_s(PROMPT, 0)
    trace = burst_trace(quiet_rps=0.5 / prefill_s, burst_rps=2.5 / prefill_s)
    targets = ScaleTargets(role="prefill", queue_s=1.0, ttft_s=4.0, hold_s=30.0, warm_replicas=1)
    scaling = PoolScaling(
        role="prefill", targets=targets, min_replicas=1, max_replicas=6, window_s=10.0, start_s=20.0
    )
    sim = simulate(trace, 2, [scaling])
    # The quiet needs one replica: with one warm beside it, the two it starts with are the answer, as the
    # live policy seeds them (the count less the buffer is held as needed).
    assert [s.started for s in sim.prefill if s.started < 120.0] == [0.0, 0.0]
