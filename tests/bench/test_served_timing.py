"""Timing a cluster at the client (bench/served_timing.py): what each probe sends, where, and the fit.

The probes run against real clusters in `python -m bench.served_timing` (minutes: three clusters started);
here a recording stand-in for the client's target, placing sessions as `router.policy: session_hash` does,
shows what they send and to which replica, and the fit is checked on samples made from known
coefficients."""

from __future__ import annotations

import asyncio

import pytest

from bench.engine_timing import Plan
from bench.live.runner import Timed
from bench.live.workload import RAMP_STEPS, Request
from bench.served_timing import _Client, _step_s, _ttft_s, fit_contention, fit_served
from router.policy.cache_blind import session_replica
from router.service_time import MeasuredEngine, MeasuredTiming

ONE = ["decode#a"]
TWO = ["decode#b", "decode#a"]  # `home` is the first in sorted order: decode#a


class _Recorder:
    """A target that answers at once, decodes each session where session_hash would (or, `misplaced`,
    always on the first replica listed) and remembers every request with its replica."""

    address = "recorder"

    def __init__(self, replicas: list[str], misplaced: bool = False) -> None:
        self.replicas = replicas
        self.misplaced = misplaced
        self.sent: list[Request] = []
        self.on: list[str] = []

    async def send(self, req: Request, timeout_s: float) -> Timed:
        assert req.session_id is not None
        await asyncio.sleep(0)  # as a real answer does, other tasks run meanwhile
        replica = self.replicas[0] if self.misplaced else session_replica(req.session_id, self.replicas)
        self.sent.append(req)
        self.on.append(replica)
        t = Timed(sent=0.0, first_token=0.01, end=0.01 + 0.003 * (req.max_tokens - 1), decode_replica=replica)
        t.completion_tokens = req.max_tokens
        return t


def _client(target: _Recorder) -> _Client:
    return _Client(target, max_model_len=2048, decode_replicas=target.replicas)  # type: ignore[arg-type]


def test_a_prefill_probe_sends_the_cached_head_first_in_the_same_session() -> None:
    target = _Recorder(ONE)
    client = _client(target)
    ttft = asyncio.run(_ttft_s(client, new=32, cached=64))
    head, full = target.sent
    assert ttft == pytest.approx(0.01)
    assert head.session_id == full.session_id
    assert full.token_ids[:64] == head.token_ids and len(full.token_ids) == 96
    assert head.max_tokens == full.max_tokens == 1
    # Without a cached part, one request; every probe is a session of its own, with fresh ids.
    asyncio.run(_ttft_s(client, new=32, cached=0))
    assert len(target.sent) == 3 and target.sent[2].session_id != full.session_id
    assert target.sent[2].token_ids[:32] != full.token_ids[:32]


def test_a_decode_probe_caches_its_prompts_then_times_k_more_tokens_each() -> None:
    target = _Recorder(ONE)
    client = _client(target)
    step = asyncio.run(_step_s(client, batch=3, context=64, steps=8))
    assert step == pytest.approx(0.003)
    assert [r.max_tokens for r in target.sent] == [1, 1, 1, 9, 9, 9]
    assert [r.token_ids for r in target.sent[:3]] == [r.token_ids for r in target.sent[3:]]


# The coefficients the fits below must recover.
TRUTH = MeasuredTiming(
    prefill_fixed_s=0.008,
    prefill_token_s=20e-6,
    prefill_pair_s=0.0,
    decode_step_s=0.003,
    decode_seq_s=0.0005,
    decode_context_token_s=0.0,
    transfer_fixed_s=0.020,
    transfer_token_s=1e-6,
)


def test_the_fit_takes_a_step_from_each_time_to_first_token_and_the_prefill_from_each_pd_one() -> None:
    truth = TRUTH
    engine = MeasuredEngine(fit=truth)
    decode = [
        {"batch": b, "context": b * (c + 16), "s": engine.tpot_s(b, b * (c + 16))}
        for b in (1, 4, 16)
        for c in (64, 512)
    ]
    ttft = [
        {"new": n, "cached": c, "ttft": engine.prefill_s(n, c) + engine.tpot_s(1, n + c)}
        for n in (32, 256, 1024)
        for c in (0, 256)
    ]
    pd = [
        {"tokens": t, "ttft": engine.prefill_s(t, 0) + engine.transfer_s(t) + engine.tpot_s(1, t)}
        for t in (64, 256, 1024)
    ]
    _, fitted = fit_served({"decode": decode, "ttft": ttft}, pd)
    for name in truth.__struct_fields__:
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), abs=1e-7), name


def test_contention_is_fitted_against_the_quiet_turn_as_one_plus_x_root_k() -> None:
    samples = [
        {"others": k, "ttft": 0.012 * (1 + 0.3 * k**0.5), "tpot": 0.003 * (1 + 0.6 * k**0.5)}
        for k in (0, 1, 4, 9)
    ]
    assert fit_contention(samples) == pytest.approx((0.3, 0.6))
    # A turn that got faster with company is no contention, not a negative one.
    assert fit_contention(
        [{"others": 0, "ttft": 0.01, "tpot": 0.003}, {"others": 2, "ttft": 0.009, "tpot": 0.003}]
    ) == (
        0.0,
        0.0,
    )


def _one_point(batch: int, steps: int) -> Plan:
    """A plan of one point of each kind, timed once."""
    return Plan(
        prefill_new=(32,),
        prefill_cached=(0,),
        decode_batch=(batch,),
        decode_context=(64,),
        decode_steps=steps,
        transfer_tokens=(64,),
        repeats=1,
    )


def test_on_two_decode_engines_a_decode_point_runs_its_batch_on_one_the_other_idle() -> None:
    from bench.served_timing import measure_aggregated

    target = _Recorder(TWO)
    client = _client(target)
    samples = asyncio.run(measure_aggregated(client, _one_point(batch=3, steps=8), lambda line: None))
    assert samples["decode"] == [{"batch": 3, "context": 3 * (64 + 4), "s": pytest.approx(0.003)}]
    timed = [on for r, on in zip(target.sent, target.on, strict=True) if r.max_tokens == 9]
    assert timed == ["decode#a"] * 3
    # The warm-up (RAMP_STEPS prompts) ran on both engines; everything timed after it, on the one.
    warm = 2 * RAMP_STEPS
    assert set(target.on[:warm]) == set(TWO) and set(target.on[warm:]) == {"decode#a"}


def test_contention_times_a_turn_on_one_engine_while_the_streams_run_on_the_other() -> None:
    from bench.served_timing import _contended_s

    target = _Recorder(TWO)
    client = _client(target)
    asyncio.run(_contended_s(client, others=2, repeats=2))
    turns = [on for r, on in zip(target.sent, target.on, strict=True) if r.max_tokens in (1, 33)]
    streams = [on for r, on in zip(target.sent, target.on, strict=True) if r.max_tokens == 200]
    assert turns == ["decode#a"] * 4 and len(streams) >= 2 and set(streams) == {"decode#b"}


def test_contention_needs_two_decode_replicas_and_a_cluster_that_places_by_session() -> None:
    from bench.served_timing import measure_contention

    with pytest.raises(RuntimeError, match="two decode replicas"):
        asyncio.run(measure_contention(_client(_Recorder(ONE)), (0,), 1, lambda line: None))
    # A router that places sessions its own way would time the wrong engine: the timing stops.
    with pytest.raises(RuntimeError, match="must route by session_hash"):
        asyncio.run(_contended_s_misplaced())


async def _contended_s_misplaced() -> None:
    from bench.served_timing import _contended_s

    target = _Recorder(["decode#b", "decode#a"], misplaced=True)  # everything decoded on decode#b
    await _contended_s(_client(target), others=0, repeats=1)


@pytest.mark.parametrize("part", ["aggregated", "pd", "contention"])
def test_each_part_warms_its_cluster_up_to_the_whole_context_before_it_times_anything(part: str) -> None:
    from bench.live.workload import RAMP_OUTPUT
    from bench.served_timing import measure_aggregated, measure_contention, measure_pd

    target = _Recorder(TWO if part == "contention" else ONE)
    client = _client(target)
    plan = _one_point(batch=1, steps=4)
    say = lambda line: None  # noqa: E731
    run = {
        "aggregated": lambda: measure_aggregated(client, plan, say),
        "pd": lambda: measure_pd(client, plan, say),
        "contention": lambda: measure_contention(client, (0,), 1, say),
    }[part]
    asyncio.run(run())
    for replica in target.replicas:  # each decode engine warmed, then the next
        n = target.on.index(replica)
        first = [len(r.token_ids) for r in target.sent[n : n + RAMP_STEPS]]
        assert first == sorted(first) and first[-1] == 2046 - RAMP_OUTPUT  # up to the context, longest last
    assert all(len(r.token_ids) < 2000 for r in target.sent[RAMP_STEPS * len(target.replicas) :])
    timed = [client.fresh(first[-1], first[-1])]  # the warm-up's counts are not handed out as fresh again
    assert timed != [first[-1]]


def test_contention_adds_the_engines_slowdown_and_leaves_the_batch_cost_of_the_decode_step_as_timed() -> None:
    # Each decode point was timed on one engine with the other idle: the contention samples (a turn on one
    # engine, streams on the other) must not be divided out of them (a batch costs its own members).
    quiet = MeasuredEngine(fit=TRUTH)
    contention = [{"others": 0, "ttft": 0.01, "tpot": 0.003}, {"others": 4, "ttft": 0.01, "tpot": 0.006}]
    decode = [
        {"batch": b, "context": b * c, "s": quiet.tpot_s(b, b * c)} for b in (1, 4, 16) for c in (100, 500)
    ]
    ttft = [
        {"new": n, "cached": 0, "ttft": quiet.prefill_s(n, 0) + quiet.tpot_s(1, n)} for n in (32, 256, 1024)
    ]
    pd = [
        {"tokens": t, "ttft": quiet.prefill_s(t, 0) + quiet.transfer_s(t) + quiet.tpot_s(1, t)}
        for t in (64, 256)
    ]
    samples, fitted = fit_served({"decode": decode, "ttft": ttft}, pd, contention)
    assert fitted.decode_step_s == pytest.approx(0.003) and fitted.decode_seq_s == pytest.approx(0.0005)
    assert (fitted.prefill_contention, fitted.decode_contention) == pytest.approx((0.0, 0.5))
    assert samples["contention"] == contention


def test_timed_prompts_never_repeat_a_token_count_and_stay_near_the_planned_one() -> None:
    # vLLM on a CPU steps a token count it has run lately faster than a new one, and agents' turns bring
    # new ones: repeats of one planned size must not all time the warm case.
    target = _Recorder(ONE)
    client = _client(target)
    for _ in range(5):
        asyncio.run(_ttft_s(client, new=32, cached=64))
    timed = [len(r.token_ids) - 64 for r in target.sent[1::2]]
    assert sorted(timed) == [30, 31, 32, 33, 34]
    # Near the context's end the counts go down only.
    edge = [client.fresh(2040, 2040) for _ in range(3)]
    assert edge == [2040, 2039, 2038]
