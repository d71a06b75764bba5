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


def _trace(requests: list[tuple[float, int, int]]) -> Trace:
    """An open-loop trace of (arrival_s, prompt tokens, output tokens)."""
    sessions = tuple(
        Session(
            session_id=str(i),
            requests=(
                TraceRequest(
                    request_id=str(i),
                    session_id=str(i),
                    arrival_s=t,
                    gap_s=0.0,
                    num_prompt_tokens=prompt,
                    num_output_tokens=output,
                    block_hashes=(),
                ),
            ),
        )
        for i, (t, prompt, output) in enumerate(requests)
    )
    hasher = BlockHasher(16, 1)
    return Trace(name="azure", closed_loop=False, block_tokens=16, sessions=sessions, hasher=hasher)


def test_the_oracle_scales_each_minute_to_its_work() -> None:
    # Prompt tokens by minute: 10, 40, 20 x 100. With 4 prefill replicas at the busiest minute, the others
    # need ceil(4 x 10/40) = 1 and ceil(4 x 20/40) = 2: 7 replica-minutes of 12.
    arrivals = (
        [i * 6.0 for i in range(10)] + [60 + i * 1.5 for i in range(40)] + [120 + i * 3 for i in range(20)]
    )
    assert per_minute_bound(_trace([(t, 100, 5) for t in arrivals]), 4, "prefill") == 7 / 12
    assert per_minute_bound(_trace([(t, 100, 5) for t in arrivals]), 4, "decode") == 7 / 12


def test_each_pool_follows_its_own_work_not_the_arrivals() -> None:
    # As on the Azure hour: the busy minute brings many short replies, so decode's work stays flat. Minute
    # 0: 10 requests x 40 output tokens; minute 1: 40 x 10. Decode needs all 4 replicas both minutes, and
    # prefill (100-token prompts) 1 then 4.
    trace = _trace([(i * 6.0, 100, 40) for i in range(10)] + [(60 + i * 1.5, 100, 10) for i in range(40)])
    assert per_minute_bound(trace, 4, "decode") == 1.0
    assert per_minute_bound(trace, 4, "prefill") == 5 / 8
