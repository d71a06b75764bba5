"""The replay simulator's invariants, on tiny synthetic traces."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import msgspec
import pytest

from bench.replay.cache import LruBlockCache
from bench.replay.index_feed import KvIndexFeed
from bench.replay.load import refine
from bench.replay.metrics import summarize
from bench.replay.policies import available_policies
from bench.replay.runner import replay_policy
from bench.replay.sim import SimConfig, Simulator
from bench.replay.traces import (
    BlockHasher,
    Session,
    Trace,
    TraceRequest,
    infinite_cache_hit_ratio,
    load_trace,
)
from router.messages import Decision, Readback, ReplicaView, RouteRequest
from router.policy.types import PrefixLookup
from router.service_time import ServiceTimeModel

BLOCK = 16


class Events:
    """Records the cache's KV events."""

    def __init__(self) -> None:
        self.stored: list[tuple[str, list[int], int | None]] = []
        self.removed: list[tuple[str, list[int]]] = []

    def on_stored(self, replica_id: str, block_hashes: list[int], parent_hash: int | None) -> None:
        self.stored.append((replica_id, list(block_hashes), parent_hash))

    def on_removed(self, replica_id: str, block_hashes: list[int]) -> None:
        self.removed.append((replica_id, list(block_hashes)))


class FirstReplicaPolicy:
    """Always prefill on the first prefill replica (or locally when none) and decode on the first decode."""

    name = "first"

    def __init__(self) -> None:
        self.finished: list[str] = []

    def choose(
        self,
        req: RouteRequest,
        prefill: Sequence[ReplicaView],
        decode: Sequence[ReplicaView],
        cache: PrefixLookup,
    ) -> Decision:
        p = prefill[0].replica_id if prefill else None
        ids = [decode[0].replica_id] + ([p] if p else [])
        matched = cache.matched_blocks(req.block_hashes, ids)
        return Decision(
            prefill=p,
            decode=decode[0].replica_id,
            local_prefill=p is None,
            predicted_cached_tokens=matched[p or decode[0].replica_id] * req.block_size,
            predicted_decode_cached_tokens=matched[decode[0].replica_id] * req.block_size,
            cost=0.0,
            reason="first",
        )

    def on_finish(self, req: RouteRequest, d: Decision) -> None:
        self.finished.append(req.request_id)


def make_trace(
    prompts: list[list[list[int]]],
    *,
    closed_loop: bool,
    gaps: float = 0.0,
    arrivals: list[float] | None = None,
    outputs: list[int] | None = None,
) -> Trace:
    """`prompts[s][t]`: trace ids of session s, turn t (one id per block); `arrivals` and `outputs` (default
    4 tokens) per request, in the same order."""
    hasher = BlockHasher(BLOCK, 1)
    sessions = []
    k = 0
    for s, turns in enumerate(prompts):
        reqs = []
        for t, ids in enumerate(turns):
            reqs.append(
                TraceRequest(
                    request_id=f"s{s}/{t}",
                    session_id=f"s{s}",
                    arrival_s=arrivals[k] if arrivals else 0.0,
                    gap_s=gaps if t else 0.0,
                    num_prompt_tokens=len(ids) * BLOCK + 1,
                    num_output_tokens=outputs[k] if outputs else 4,
                    block_hashes=hasher.hashes(ids, len(ids), s),
                )
            )
            k += 1
        sessions.append(Session(session_id=f"s{s}", requests=tuple(reqs)))
    return Trace(
        name="claude-code",
        closed_loop=closed_loop,
        block_tokens=BLOCK,
        sessions=tuple(sessions),
        hasher=hasher,
    )


def simulate(
    trace: Trace, cfg: SimConfig, policy: FirstReplicaPolicy | Sequence[FirstReplicaPolicy] | None = None
) -> Simulator:
    replica_ids = [f"p{i}" for i in range(cfg.prefill_replicas)] + [
        f"d{i}" for i in range(cfg.decode_replicas)
    ]

    def index_factory() -> tuple[KvIndexFeed, PrefixLookup]:
        feed = KvIndexFeed(trace, replica_ids)
        return feed, feed.index

    sim = Simulator(trace, policy or FirstReplicaPolicy(), cfg, index_factory=index_factory)
    sim.run()
    return sim


# ---- LRU cache ---------------------------------------------------------------------------------------------


def test_lru_evicts_least_recently_used_block_first() -> None:
    ev = Events()
    c = LruBlockCache("r", 4, ev)
    assert c.access([1, 2]) == 0
    assert c.access([3, 4]) == 0
    assert c.access([1]) == 1  # 1 becomes most recent: order 2, 4, 3, 1
    c.access([5, 6])
    assert c.lru_order() == [3, 1, 6, 5]
    assert ev.removed == [("r", [2, 4])]


def test_a_prompts_tail_is_evicted_before_its_head() -> None:
    # vLLM frees a request's blocks tail first; evicting the head first would leave a tail no prefix reaches.
    c = LruBlockCache("r", 4)
    c.access([1, 2, 3, 4])
    assert c.lru_order() == [4, 3, 2, 1]
    c.access([9])
    assert c.prefix_hits([1, 2, 3, 4]) == 3


def test_hits_are_a_prefix_and_stop_at_the_first_missing_block() -> None:
    c = LruBlockCache("r", None)
    c.access([1, 2, 3])
    assert c.prefix_hits([1, 2, 9, 3]) == 2
    assert c.prefix_hits([9, 1, 2]) == 0
    assert c.access([1, 2, 3, 4]) == 3


def test_stored_events_are_contiguous_runs_with_their_parent() -> None:
    ev = Events()
    c = LruBlockCache("r", None, ev)
    c.access([1, 2])
    c.access([1, 2, 3, 4])
    assert ev.stored == [("r", [1, 2], None), ("r", [3, 4], 2)]


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError):
        LruBlockCache("r", 0)


# ---- hit accounting and the infinite-cache bound ---------------------------------------------------------


def test_unbounded_single_replica_hit_ratio_equals_the_bound() -> None:
    # Three sessions growing their context turn by turn, and one sharing nothing.
    prompts = [
        [[1, 2], [1, 2, 3], [1, 2, 3, 4, 5]],
        [[1, 7], [1, 7, 8]],
        [[9], [9, 10], [9, 10, 11]],
    ]
    trace = make_trace(prompts, closed_loop=True, gaps=1.0)
    sim = simulate(
        trace, SimConfig(prefill_replicas=1, decode_replicas=1, capacity_blocks=None, concurrency=3)
    )
    result = summarize("first", sim, sim.records, infinite_cache_hit_ratio(trace), 0.0)
    # Hand count: turns hit 0+2+3, 0+2, 0+1+2 of 2+3+5, 2+3, 1+2+3 blocks (session ids are namespaced).
    assert result.hit_ratio == pytest.approx(10 / 21)
    assert result.bound == pytest.approx(10 / 21)
    assert result.hit_vs_bound == pytest.approx(1.0)


def test_prefill_load_balance_is_reported_over_the_replay_the_window_and_busy_time() -> None:
    # Every prompt on the first of four prefill replicas: max/mean = 4 every way.
    trace = make_trace([[[1, 2], [1, 2, 3]], [[4], [4, 5]]], closed_loop=True, gaps=1.0)
    cfg = SimConfig(prefill_replicas=4, decode_replicas=1, capacity_blocks=None, concurrency=2)
    sim = simulate(trace, cfg)
    result = summarize("first", sim, sim.records, infinite_cache_hit_ratio(trace), 0.0)
    assert result.prefill_tokens[1:] == [0, 0, 0]
    assert result.load_max_over_mean == pytest.approx(4.0)
    assert result.load_max_over_mean_window == pytest.approx(4.0)
    assert result.busy_max_over_mean == pytest.approx(4.0)


def test_a_small_cache_loses_hits_and_counts_them_where_the_prompt_is_computed() -> None:
    prompts = [[[1, 2, 3, 4], [1, 2, 3, 4, 5]], [[6, 7, 8, 9], [6, 7, 8, 9, 10]]]
    trace = make_trace(prompts, closed_loop=False, arrivals=[0.0, 100.0, 1.0, 101.0])
    # Capacity 4: session 1's first turn (t=1) evicts all of session 0's blocks before its second turn.
    sim = simulate(trace, SimConfig(prefill_replicas=1, decode_replicas=1, capacity_blocks=4))
    by_id = {r.request_id: r for r in sim.records}
    assert by_id["s0/1"].cached_blocks == 0
    assert by_id["s1/1"].cached_blocks == 0  # its blocks were evicted by s0/1 in turn
    assert sum(r.computed_tokens for r in sim.records) == sum(r.num_blocks * BLOCK + 1 for r in sim.records)


def test_the_router_index_matches_the_caches_after_every_event() -> None:
    prompts = [[[1, 2, 3], [1, 2, 3, 4]], [[1, 5], [1, 5, 6, 7]], [[2, 3], [2, 3, 4, 8, 9]]]
    trace = make_trace(prompts, closed_loop=True, gaps=0.5)
    sim = simulate(trace, SimConfig(prefill_replicas=2, decode_replicas=2, capacity_blocks=4, concurrency=3))
    all_hashes = [r.block_hashes for r in trace.requests()]
    servers = [*sim.prefill, *sim.decode]
    for hashes in all_hashes:
        got = sim.lookup.matched_blocks(list(hashes), [s.replica_id for s in servers])
        assert got == {s.replica_id: s.cache.prefix_hits(hashes) for s in servers}


# ---- closed and open loop --------------------------------------------------------------------------------


def test_closed_loop_sends_the_next_turn_a_gap_after_the_previous_reply() -> None:
    trace = make_trace([[[1], [1, 2], [1, 2, 3]]], closed_loop=True, gaps=7.0)
    policy = FirstReplicaPolicy()
    sim = simulate(
        trace, SimConfig(prefill_replicas=1, decode_replicas=1, concurrency=1, stagger_s=0.0), policy
    )
    recs = sorted(sim.records, key=lambda r: r.arrival)
    for prev, nxt in itertools.pairwise(recs):
        assert nxt.arrival == pytest.approx(prev.finish + 7.0)
    assert policy.finished == ["s0/0", "s0/1", "s0/2"]


def test_a_lone_sequence_decodes_at_the_models_single_sequence_pace() -> None:
    trace = make_trace([[[1, 2, 3]]], closed_loop=True)
    cfg = SimConfig(prefill_replicas=1, decode_replicas=1, concurrency=1, stagger_s=0.0)
    sim = simulate(trace, cfg)
    (rec,) = sim.records
    assert rec.output_tokens == 4
    assert rec.tpot == pytest.approx(cfg.timing.tpot_s(1, 3 * BLOCK + 1))
    result = summarize("first", sim, sim.records, infinite_cache_hit_ratio(trace), 0.0)
    assert result.tpot_p50_s == result.tpot_p99_s == pytest.approx(rec.tpot)


def test_gaps_are_capped_and_scaled() -> None:
    trace = make_trace([[[1], [1, 2]]], closed_loop=True, gaps=1000.0)
    cfg = SimConfig(
        prefill_replicas=1, decode_replicas=1, concurrency=1, stagger_s=0.0, max_gap_s=50, gap_scale=0.5
    )
    recs = sorted(simulate(trace, cfg).records, key=lambda r: r.arrival)
    assert recs[1].arrival == pytest.approx(recs[0].finish + 25.0)


def test_concurrency_bounds_sessions_in_flight() -> None:
    trace = make_trace([[[i], [i, 100 + i]] for i in range(6)], closed_loop=True, gaps=3.0)
    sim = simulate(trace, SimConfig(prefill_replicas=1, decode_replicas=1, concurrency=2, stagger_s=0.0))
    spans: dict[str, tuple[float, float]] = {}
    for r in sim.records:
        lo, hi = spans.get(r.session_id, (r.arrival, r.finish))
        spans[r.session_id] = (min(lo, r.arrival), max(hi, r.finish))
    for t in sorted({lo for lo, _ in spans.values()}):
        in_flight = sum(lo <= t < hi for lo, hi in spans.values())
        assert in_flight <= 2
    assert len(spans) == 6


def test_open_loop_arrivals_follow_the_time_scale() -> None:
    trace = make_trace([[[1]], [[2]], [[3]]], closed_loop=False, arrivals=[0.0, 10.0, 40.0])
    sim = simulate(trace, SimConfig(prefill_replicas=1, decode_replicas=1, time_scale=4.0))
    assert sorted(r.arrival for r in sim.records) == pytest.approx([0.0, 2.5, 10.0])


def test_fifo_prefill_queue_and_ttft_include_queueing() -> None:
    timing = ServiceTimeModel()
    trace = make_trace([[[1, 2, 3]], [[4, 5, 6]]], closed_loop=False, arrivals=[0.0, 0.0])
    sim = simulate(trace, SimConfig(prefill_replicas=1, decode_replicas=1, timing=timing))
    a, b = sorted(sim.records, key=lambda r: r.prefill_start)
    assert b.prefill_start == pytest.approx(a.prefill_end)
    assert b.queue_wait == pytest.approx(a.prefill_end - a.arrival)
    assert b.ttft > b.queue_wait + timing.prefill_s(3 * BLOCK + 1, 0)


def test_local_prefill_uses_the_decode_replicas_cache() -> None:
    trace = make_trace([[[1, 2], [1, 2, 3]]], closed_loop=True, gaps=1.0)
    sim = simulate(trace, SimConfig(prefill_replicas=0, decode_replicas=1, concurrency=1))
    second = max(sim.records, key=lambda r: r.arrival)
    assert second.local_prefill and second.cached_blocks == 2
    assert sim.decode[0].computed_tokens == sum(r.computed_tokens for r in sim.records)
    # A cluster without prefill replicas (every request aggregated on decode) is summarized, not a crash.
    result = summarize("first", sim, sim.records, infinite_cache_hit_ratio(trace), 0.0)
    assert result.prefill_util == 0.0 and result.local_prefill_share == 1.0


def test_a_local_prefill_is_chunked_between_the_running_sequences_decode_steps() -> None:
    # B's prompt (600 blocks) is prefilled on the decode replica where A is decoding: vLLM's chunked prefill
    # mixes it into A's steps (64-token budget: ~150 steps), so A keeps generating, at one token per mixed
    # step, and finishes long before B's prefill ends, rather than waiting for all of it.
    timing = msgspec.structs.replace(ServiceTimeModel(), chunk_tokens=64)
    trace = make_trace([[[1]], [list(range(100, 700))]], closed_loop=False, arrivals=[0.0, 0.0])
    sim = simulate(trace, SimConfig(prefill_replicas=0, decode_replicas=1, timing=timing))
    a, b = sorted(sim.records, key=lambda r: r.num_blocks)
    assert b.local_prefill and b.prefill_start == pytest.approx(a.prefill_end)
    steps, step = timing.mixed_prefill(b.computed_tokens, 0, 1, a.cached_tokens + a.computed_tokens)
    assert steps > 100
    assert b.prefill_end - b.prefill_start == pytest.approx(steps * step)
    assert a.finish < b.prefill_end
    assert a.first_token - a.prefill_end == pytest.approx(timing.tpot_s(1, 1 * BLOCK + 1))
    assert a.finish - a.first_token == pytest.approx(3 * step)  # its other tokens, at the mixed pace


# ---- load setting ----------------------------------------------------------------------------------------


def test_refine_backs_off_a_saturated_pool_and_bisects_to_the_target() -> None:
    # Utilisation of a pool that saturates (a cache cliff) above 60 sessions.
    def util(k: float) -> float:
        return min(1.0, k / 100) if k <= 60 else 1.0

    seen: list[float] = []

    def measure(k: float) -> float:
        seen.append(k)
        return util(k)

    knob, got = refine(188, 0.55, measure, rounds=8, integer=True)
    assert seen[:2] == [188, 94]  # saturated: halve
    assert abs(got - 0.55) <= 0.05 and got == util(knob) and knob < 60


def test_the_policy_sees_queued_prefill_seconds_from_the_routers_load_accounting() -> None:
    class Recording(FirstReplicaPolicy):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[float | None] = []

        def choose(self, req, prefill, decode, cache):  # type: ignore[no-untyped-def]
            self.seen.append(prefill[0].queued_prefill_s)
            return super().choose(req, prefill, decode, cache)

    timing = ServiceTimeModel()
    trace = make_trace([[[1, 2, 3]], [[4, 5]]], closed_loop=False, arrivals=[0.0, 0.0])
    policy = Recording()
    simulate(trace, SimConfig(prefill_replicas=1, decode_replicas=1, timing=timing), policy)
    # The second arrival finds the first prompt (3 blocks + 1 token, nothing cached) queued or running.
    assert policy.seen == [0.0, pytest.approx(timing.prefill_s(3 * BLOCK + 1, 0))]


# ---- KV readback ------------------------------------------------------------------------------------------


class AlternatingPolicy(FirstReplicaPolicy):
    """Turn t of a session prefills on p{t % 2}, decodes on d0: every turn lands on a P without its prefix."""

    def __init__(self) -> None:
        super().__init__()
        self.readbacks: dict[str, object] = {}

    def choose(
        self,
        req: RouteRequest,
        prefill: Sequence[ReplicaView],
        decode: Sequence[ReplicaView],
        cache: PrefixLookup,
    ) -> Decision:
        self.readbacks[req.request_id] = req.readback
        d = super().choose(req, prefill, decode, cache)
        turn = int(req.request_id.rsplit("/", 1)[1])
        return msgspec.structs.replace(d, prefill=prefill[turn % 2].replica_id)


def readback_run(
    ttl: float | None, gap: float = 1.0, capacity: int | None = None
) -> tuple[Simulator, AlternatingPolicy]:
    trace = make_trace([[[1, 2, 3], [1, 2, 3, 4, 5]]], closed_loop=True, gaps=gap)
    policy = AlternatingPolicy()
    cfg = SimConfig(
        prefill_replicas=2,
        decode_replicas=1,
        capacity_blocks=capacity,
        concurrency=1,
        stagger_s=0.0,
        readback_ttl_s=ttl,
    )
    return simulate(trace, cfg, policy), policy


def test_readback_pulls_the_previous_turns_prefix_from_its_decode_replica() -> None:
    sim, policy = readback_run(ttl=60.0)
    second = {r.request_id: r for r in sim.records}["s0/1"]
    assert policy.readbacks["s0/1"] == Readback("d0", 3 * BLOCK, expires_in_s=pytest.approx(59.0))
    assert second.prefill_replica == "p1" and second.pulled_tokens == 3 * BLOCK
    assert second.cached_blocks == 3 and second.computed_tokens == 2 * BLOCK + 1
    timing = ServiceTimeModel()
    pulled = timing.prefill_s(2 * BLOCK + 1, 3 * BLOCK) + timing.transfer_s(3 * BLOCK)
    assert second.prefill_end - second.prefill_start == pytest.approx(pulled)


@pytest.mark.parametrize("ttl", [None, 0.5], ids=["off", "expired"])
def test_no_readback_when_off_or_expired(ttl: float | None) -> None:
    sim, policy = readback_run(ttl, gap=1.0)
    second = {r.request_id: r for r in sim.records}["s0/1"]
    assert policy.readbacks["s0/1"] is None
    assert second.pulled_tokens == 0 and second.cached_blocks == 0


def test_a_running_sequences_blocks_stay_on_decode_beyond_its_capacity_and_are_pulled_whole() -> None:
    # Capacity 2 blocks, a 3-block prompt: allocated while it decodes and pinned after, so all of it is
    # pulled; the cache reports the block it held above its capacity.
    sim, policy = readback_run(ttl=60.0, capacity=2)
    second = {r.request_id: r for r in sim.records}["s0/1"]
    assert policy.readbacks["s0/1"] == Readback("d0", 3 * BLOCK, expires_in_s=pytest.approx(59.0))
    assert second.pulled_tokens == 3 * BLOCK
    assert sim.decode[0].cache.overflow >= 1


def test_the_largest_allocated_footprint_on_a_decode_replica_is_reported() -> None:
    # Turn 1 runs with 5 blocks allocated: half of d0's 10 blocks.
    assert readback_run(ttl=None, capacity=10)[0].pinned_peak == pytest.approx(0.5)
    # Turn 0 then pins 3 blocks, read by turn 1's prefill before turn 1's blocks are allocated; turn 1 pins 5.
    assert readback_run(ttl=60.0, capacity=10)[0].pinned_peak == pytest.approx(0.5)


def test_pinned_blocks_stay_cached_take_capacity_and_rejoin_the_lru_when_unpinned() -> None:
    events = Events()
    cache = LruBlockCache("d0", 4, events)
    cache.access([1, 2])
    assert cache.pin([1, 2, 9]) == [1, 2]  # 9 is not cached: nothing to pin
    cache.access([3, 4])
    cache.access([5, 6])  # full: only unpinned blocks are evicted
    assert 1 in cache and 2 in cache and 3 not in cache and 4 not in cache
    assert cache.prefix_hits([1, 2]) == 2 and cache.pinned_blocks == 2
    cache.unpin([1, 2])
    assert cache.pinned_blocks == 0 and cache.lru_order()[-2:] == [2, 1]  # most recently freed
    cache.access([7, 8])
    assert 5 not in cache and 6 not in cache and 1 in cache
    cache.pin([1, 2])
    cache.pin([7, 8])
    cache.access([10])  # every block pinned: a new prompt's blocks are not kept
    assert 10 not in cache and len(cache) == 4
    assert [h for _, hs in events.removed for h in hs] == [4, 3, 6, 5, 10]  # a tail before its head


class ExportingPolicy(FirstReplicaPolicy):
    """Turn 0 prefills on p0; turn 1 on p1, pulling what d0 holds of its prompt through an export."""

    def __init__(self) -> None:
        super().__init__()
        self.export_ttls: list[float | None] = []

    def choose(
        self,
        req: RouteRequest,
        prefill: Sequence[ReplicaView],
        decode: Sequence[ReplicaView],
        cache: PrefixLookup,
    ) -> Decision:
        self.export_ttls.append(req.export_ttl_s)
        d = super().choose(req, prefill, decode, cache)
        if req.request_id.endswith("/0"):
            return d
        held = cache.matched_blocks(req.block_hashes, ["d0"])["d0"] * req.block_size
        return msgspec.structs.replace(
            d,
            prefill="p1",
            predicted_cached_tokens=held,
            readback_tokens=held,
            readback_replica="d0",
            readback_export=True,
        )


def export_run(ttl: float, exports: bool = True) -> tuple[Simulator, ExportingPolicy]:
    trace = make_trace([[[1, 2, 3], [1, 2, 3, 4, 5]]], closed_loop=True, gaps=1.0)
    policy = ExportingPolicy()
    cfg = SimConfig(
        prefill_replicas=2,
        decode_replicas=1,
        concurrency=1,
        stagger_s=0.0,
        readback_ttl_s=ttl,
        readback_exports=exports,
    )
    return simulate(trace, cfg, policy), policy


def test_an_exported_prefix_is_pinned_at_the_decision_and_pulled_one_decode_step_later() -> None:
    sim, policy = export_run(ttl=60.0)
    assert policy.export_ttls == [60.0, 60.0]
    second = {r.request_id: r for r in sim.records}["s0/1"]
    assert second.prefill_replica == "p1" and second.pulled_tokens == 3 * BLOCK
    assert second.cached_blocks == 3 and second.computed_tokens == 2 * BLOCK + 1
    # The router waits for the decode replica to pin the prefix: one decode step on its (idle) batch.
    assert second.prefill_start - second.arrival == pytest.approx(ServiceTimeModel().tpot_s(0, 0))


def test_an_export_that_expires_before_the_prefill_starts_is_not_pulled() -> None:
    sim, _ = export_run(ttl=ServiceTimeModel().tpot_s(0, 0) / 2)
    second = {r.request_id: r for r in sim.records}["s0/1"]
    assert second.pulled_tokens == 0 and second.computed_tokens == 5 * BLOCK + 1


def test_without_exports_the_policy_is_not_offered_them() -> None:
    assert export_run(ttl=60.0, exports=False)[1].export_ttls == [None, None]


def test_prompts_behind_an_export_on_the_same_prefill_replica_keep_their_decision_order() -> None:
    class Both(ExportingPolicy):
        def choose(self, req, prefill, decode, cache):  # type: ignore[no-untyped-def]
            d = super().choose(req, prefill, decode, cache)
            return msgspec.structs.replace(d, prefill="p1") if req.request_id == "s1/0" else d

    # s0/1 (exported prefix) and s1/0 reach p1 at the same instant, s0/1 decided first.
    trace = make_trace(
        [[[1, 2, 3], [1, 2, 3, 4, 5]], [[7, 8]]], closed_loop=False, arrivals=[0.0, 10.0, 10.0]
    )
    cfg = SimConfig(prefill_replicas=2, decode_replicas=1, readback_ttl_s=60.0)
    recs = {r.request_id: r for r in simulate(trace, cfg, Both()).records}
    exported, behind = recs["s0/1"], recs["s1/0"]
    assert exported.pulled_tokens == 3 * BLOCK
    assert exported.prefill_start > 10.0 and behind.prefill_start == pytest.approx(exported.prefill_end)


# ---- several routers --------------------------------------------------------------------------------------


class SeeingPolicy(FirstReplicaPolicy):
    """Records, per request it decides, the active sequences its views show on d0."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, int] = {}

    def choose(self, req, prefill, decode, cache):  # type: ignore[no-untyped-def]
        self.seen[req.request_id] = decode[0].active_seqs
        return super().choose(req, prefill, decode, cache)


def test_each_router_decides_its_share_and_sees_the_others_work_from_the_sync_after_it() -> None:
    # A long request at t=0 decodes on d0 for ~10 s; short probes (done in ~60 ms each) arrive before the
    # routers' first sync (t=1) and after it. A probe at A's router sees A at once (its own dispatch); a probe
    # at the other router sees it only once a sync has passed.
    before = [0.2 + 0.1 * i for i in range(7)]
    after = [1.2 + 0.1 * i for i in range(7)]
    arrivals = [0.0, *before, *after]
    trace = make_trace(
        [[[1, 2, 3]]] + [[[100 + i]] for i in range(14)],
        closed_loop=False,
        arrivals=arrivals,
        outputs=[1000] + [4] * 14,
    )
    policies = [SeeingPolicy(), SeeingPolicy()]
    cfg = SimConfig(prefill_replicas=1, decode_replicas=1, routers=2, router_sync_s=1.0)
    sim = simulate(trace, cfg, policies)
    recs = {r.request_id: r for r in sim.records}
    long_router = recs["s0/0"].router
    assert recs["s0/0"].finish > 5.0  # in flight through every probe
    other = [r for r in sim.records if r.router != long_router]
    # Both routers decide requests, on both sides of the sync (seeded: the draw is the same every run).
    assert any(r.arrival < 1.0 for r in other) and any(r.arrival > 1.0 for r in other)
    assert any(r.router == long_router and r.request_id != "s0/0" for r in sim.records)
    for i, policy in enumerate(policies):
        mine = sorted(r.request_id for r in sim.records if r.router == i)
        assert sorted(policy.seen) == mine  # each request decided by the router it reached
        assert sorted(policy.finished) == mine  # and its on_finish back to that router
    for r in sim.records:
        if r.request_id == "s0/0":
            continue
        sees_long = r.router == long_router or r.arrival > 1.0
        assert policies[r.router].seen[r.request_id] == int(sees_long), r


def test_a_router_sees_the_others_work_only_as_of_the_last_sync() -> None:
    # The long request finishes at ~10 s; with a sync every 4 s, the other router still counts it until the
    # sync after its end.
    arrivals = [0.0, *(0.25 * i + 0.1 for i in range(1, 60))]
    trace = make_trace(
        [[[1, 2, 3]]] + [[[100 + i]] for i in range(59)],
        closed_loop=False,
        arrivals=arrivals,
        outputs=[1000] + [4] * 59,
    )
    policies = [SeeingPolicy(), SeeingPolicy()]
    cfg = SimConfig(prefill_replicas=1, decode_replicas=1, routers=2, router_sync_s=4.0)
    sim = simulate(trace, cfg, policies)
    recs = {r.request_id: r for r in sim.records}
    long = recs["s0/0"]
    end = long.finish
    synced_after_end = 4.0 * (end // 4.0 + 1)
    checked = 0
    for r in sim.records:
        if r.router == long.router or r.request_id == "s0/0":
            continue
        expected = int(4.0 < r.arrival < synced_after_end)
        assert policies[r.router].seen[r.request_id] == expected, (r, end)
        checked += end < r.arrival < synced_after_end  # stale: finished, not yet reported
    assert checked > 0


def test_one_router_is_the_plain_replay() -> None:
    # No syncs and no draws with one router: the records are the same whatever the sync period, and the
    # policy may be given alone or as a list of one.
    prompts = [[[1, 2, 3], [1, 2, 3, 4]], [[1, 5], [1, 5, 6, 7]], [[2, 3], [2, 3, 4, 8, 9]]]
    trace = make_trace(prompts, closed_loop=True, gaps=0.5)
    cfg = SimConfig(prefill_replicas=2, decode_replicas=2, capacity_blocks=4, concurrency=3)
    plain = simulate(trace, cfg).records
    for other in (
        simulate(trace, msgspec.structs.replace(cfg, router_sync_s=0.01)).records,
        simulate(trace, cfg, [FirstReplicaPolicy()]).records,
    ):
        assert msgspec.json.encode(other) == msgspec.json.encode(plain)
    assert {r.router for r in plain} == {0}


def test_a_policy_per_router_is_required() -> None:
    trace = make_trace([[[1]]], closed_loop=False)
    with pytest.raises(ValueError, match="2 routers"):
        simulate(trace, SimConfig(prefill_replicas=1, decode_replicas=1, routers=2))
    with pytest.raises(ValueError, match="routers >= 1"):
        SimConfig(routers=0)


def test_pdserve_behind_two_and_four_routers_keeps_the_hit_ratio_of_one() -> None:
    # 24 Claude Code sessions on 4 + 4 replicas; every turn reaches a router drawn at random, so most of a
    # session's turns reach a router that did not decide its previous one. Each router still finds the
    # session's prefix in the shared KV index.
    trace = load_trace("claude-code", block_tokens=512, limit=24, seed=3)
    cfg = SimConfig(
        prefill_replicas=4,
        decode_replicas=4,
        capacity_blocks=int(0.1 * trace.unique_blocks()),
        concurrency=12,
        gap_scale=0.4,
        seed=3,
    )
    bound = infinite_cache_hit_ratio(trace)
    pdserve = available_policies()["pdserve"]
    one = replay_policy(trace, "pdserve", pdserve, cfg, bound)[0].hit_ratio
    assert one > 0.95
    for routers in (2, 4):
        result, records = replay_policy(
            trace, "pdserve", pdserve, msgspec.structs.replace(cfg, routers=routers), bound
        )
        assert {r.router for r in records} == set(range(routers))
        assert result.hit_ratio == pytest.approx(one, rel=0.01)
