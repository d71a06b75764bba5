"""`python -m bench.autoscaling_effect`'s workloads: the Claude Code arrival pattern with a burst, and the
per-minute oracle it measures the Azure replay against."""

from __future__ import annotations

from bench.autoscaling_effect import BURST_FACTOR, BURST_S, QUIET_S, bursty_starts, per_minute_bound
from bench.replay.traces import BlockHasher, Session, Trace, TraceRequest


def test_sessions_start_five_times_as_often_during_the_burst() -> None:
    starts = bursty_starts(4000, 1.0, seed=0)
    assert len(starts) == 4000 and starts == sorted(starts)
    before = sum(1 for t in starts if t < QUIET_S) / QUIET_S
    during = sum(1 for t in starts if QUIET_S <= t < QUIET_S + BURST_S) / BURST_S
    assert 0.85 < before < 1.15
    assert 0.85 * BURST_FACTOR < during < 1.15 * BURST_FACTOR


def test_the_oracle_scales_each_minute_to_its_arrivals() -> None:
    # Minute 0: 10 arrivals, minute 1: 40, minute 2: 20. With 4 replicas at the busiest minute, the others
    # need ceil(4 x 10/40) = 1 and ceil(4 x 20/40) = 2: 7 replica-minutes of 12.
    arrivals = (
        [i * 6.0 for i in range(10)] + [60 + i * 1.5 for i in range(40)] + [120 + i * 3 for i in range(20)]
    )
    hasher = BlockHasher(16, 1)
    sessions = tuple(
        Session(
            session_id=str(i),
            requests=(
                TraceRequest(
                    request_id=str(i),
                    session_id=str(i),
                    arrival_s=t,
                    gap_s=0.0,
                    num_prompt_tokens=16,
                    num_output_tokens=1,
                    block_hashes=(),
                ),
            ),
        )
        for i, t in enumerate(arrivals)
    )
    trace = Trace(name="azure", closed_loop=False, block_tokens=16, sessions=sessions, hasher=hasher)
    assert per_minute_bound(trace, 4) == 7 / 12
