"""Decider: KV readback (a session's pinned decode blocks reach its next prefill leg, once), exports,
long local prefill, and prefill overflow driven by the router's own queue accounting."""

import pytest

from engine.messages import Sampling
from router.config import LiveConfig, RouterConfig
from router.decision.decider import Decider
from router.decision.readback import KvPulls, ReadbackTable
from router.errors import NoReplicaError
from router.metrics import RouterMetrics
from router.policy.cache_blind import RoundRobinPolicy
from router.policy.selector import PdservePolicy
from router.view.cluster_view import ClusterView

BS = 16


def make_view(*, prefill: bool = True, decode: tuple[str, ...] = ("d0",)) -> ClusterView:
    view = ClusterView(None, block_size=BS)
    for rid in (["p0"] if prefill else []) + list(decode):
        view.load.add_replica(rid, "prefill" if rid.startswith("p") else "decode")
        view.index.add_replica(rid)
    return view


def make_router(
    *, prefill: bool = True, readback: bool = True, exports: bool = False, view: ClusterView | None = None
) -> Decider:
    return Decider(
        view=view or make_view(prefill=prefill),
        policy=PdservePolicy(),
        block_size=BS,
        has_prefill_pool=prefill,
        config=(
            config := LiveConfig(RouterConfig(overload_queue_tokens=1_000_000, kv_readback_exports=exports))
        ),
        pulls=KvPulls(ReadbackTable(block_size=BS, ttl_s=480), config) if readback else None,
    )


def pin(tokens: int) -> dict[str, object]:
    return {
        "do_remote_decode": True,
        "remote_engine_id": "decode-d0",
        "remote_block_ids": [list(range(-(-tokens // BS)))],
        "remote_num_tokens": tokens,
    }


PROMPT = list(range(1000, 3000))
OUTPUT = [7, 8, 9, 10]
NEXT = PROMPT + OUTPUT + list(range(5000, 6000))


def finish_turn(router: Decider, rid: str) -> None:
    router.turn_done("s", "d0", pin(len(PROMPT) + len(OUTPUT) - 1), PROMPT, OUTPUT)
    router.finish(rid)


def test_a_sessions_turn_asks_decode_to_pin_and_the_next_prefill_pulls_it_once() -> None:
    router = make_router()
    first = router.route("t1", "s", PROMPT, Sampling(max_tokens=4))
    assert first.pin_kv and first.readback_params is None and first.prefill
    finish_turn(router, "t1")
    second = router.route("t2", "s", NEXT, Sampling(max_tokens=4))
    assert second.prefill and second.readback_params is not None
    # Whole blocks of what the pin holds: the prompt and three of the four reply tokens.
    assert second.readback_params["remote_num_tokens"] == (len(PROMPT) + 3) // BS * BS
    assert second.predicted_cached_tokens == second.readback_tokens == (len(PROMPT) + 3) // BS * BS
    assert second.readback_replica == "d0"
    router.finish("t2")
    third = router.route("t3", "s", NEXT, Sampling(max_tokens=4))
    assert third.readback_params is None  # handed out once: the read unpins it


def test_requests_without_a_session_are_not_pinned() -> None:
    route = make_router().route("t1", None, PROMPT, Sampling(max_tokens=4))
    assert not route.pin_kv and route.readback_params is None


def test_readback_off_pins_nothing() -> None:
    router = make_router(readback=False)
    assert not router.route("t1", "s", PROMPT, Sampling(max_tokens=4)).pin_kv
    finish_turn(router, "t1")
    assert router.route("t2", "s", NEXT, Sampling(max_tokens=4)).readback_params is None


def test_a_turn_prefilled_on_decode_leaves_the_pin_for_a_later_prefill_leg() -> None:
    router = make_router(prefill=False)
    router.route("t1", "s", PROMPT, Sampling(max_tokens=4))
    finish_turn(router, "t1")
    second = router.route("t2", "s", NEXT, Sampling(max_tokens=4))
    assert not second.prefill and second.readback_params is None and second.pin_kv


def test_a_pin_on_a_decode_replica_that_is_gone_is_not_handed_out() -> None:
    router = make_router()
    router.route("t1", "s", PROMPT, Sampling(max_tokens=4))
    router.turn_done("s", "d9", pin(len(PROMPT) + len(OUTPUT) - 1), PROMPT, OUTPUT)  # d9: not a replica now
    router.finish("t1")
    second = router.route("t2", "s", NEXT, Sampling(max_tokens=4))
    assert second.prefill and second.readback_params is None and second.readback_tokens == 0


def test_a_prefix_cached_on_a_decode_replica_is_exported_to_the_prefill_leg() -> None:
    view = make_view(decode=("d0", "d1"))
    router = make_router(exports=True, view=view)
    # d1's engine reported the first 100 blocks of PROMPT stored in its prefix cache; no session, no pin.
    view.index.apply_stored("d1", list(range(1, 101)), None, PROMPT[: 100 * BS])
    route = router.route("t1", None, PROMPT + list(range(7000, 9000)), Sampling(max_tokens=4))
    assert route.prefill and route.readback_params is None
    assert route.export_replica == "d1" and route.export_tokens == 100 * BS == route.readback_tokens
    assert route.predicted_cached_tokens == 100 * BS
    assert route.reason == "disaggregated"


def test_a_long_suffix_on_a_long_cached_context_is_prefilled_by_the_decode_replica_holding_it() -> None:
    view = make_view(decode=("d0", "d1"))
    router = make_router(readback=False, view=view)
    context = list(range(10**6, 10**6 + 64_000))
    view.index.apply_stored("d0", list(range(1, 4001)), None, context)
    # 2000 new tokens, past the local threshold: d0 computes them over its cached context (~0.3 s) rather
    # than p0 computing all 66k (~5 s).
    route = router.route("t1", None, context + list(range(7000, 9000)), Sampling(max_tokens=4))
    assert not route.prefill and route.decode_replica == "d0" and route.reason == "long_local_prefill"
    assert route.predicted_cached_tokens == 64_000


def test_a_backed_up_prefill_pool_overflows_to_the_decode_replica_holding_the_prefix() -> None:
    view = make_view(decode=("d0", "d1"))
    router = make_router(readback=False, view=view)
    view.index.apply_stored("d0", list(range(1, 101)), None, PROMPT[: 100 * BS])
    prompt = PROMPT + list(range(7000, 9000))  # 2400 tokens beyond d0's prefix: past the local threshold
    # A 100k-token prompt dispatched to p0: the router's estimate puts p0 ~11 s behind (overflow at 10 s).
    big = router.route("big", None, list(range(10**6, 10**6 + 100_000)), Sampling(max_tokens=4))
    assert big.prefill_replica == "p0"
    route = router.route("t1", None, prompt, Sampling(max_tokens=4))
    assert not route.prefill and route.decode_replica == "d0" and route.reason == "prefill_overflow"
    assert route.predicted_cached_tokens == 100 * BS
    # p0's prompt done: its queue is empty again, and the same prompt goes through it.
    router.prefill_done("big")
    route = router.route("t2", None, prompt, Sampling(max_tokens=4))
    assert route.prefill_replica == "p0" and route.reason == "disaggregated"


def test_the_route_carries_the_winning_options_cost_terms_and_the_metrics_record_them() -> None:
    route = make_router(readback=False).route("t1", None, PROMPT, Sampling(max_tokens=4))
    assert route.terms is not None and route.terms.prefill > 0 and route.terms.decode > 0
    assert route.terms.stall == 0.0 if route.prefill else route.terms.transfer == 0.0
    metrics = RouterMetrics()
    metrics.on_decision(route.reason, route.terms)
    count = metrics.registry.get_sample_value
    assert count("pdserve_routing_decisions_total", {"reason": route.reason}) == 1
    for term in ("prefill", "queue", "pull", "balance", "churn", "decode", "transfer", "stall"):
        assert count("pdserve_routing_cost_term_seconds_count", {"term": term}) == 1
    assert count("pdserve_routing_cost_term_seconds_sum", {"term": "prefill"}) == route.terms.prefill


def test_with_no_decode_replica_registered_a_request_is_refused_as_unavailable() -> None:
    """Legs go to the replica the decision names: before any decode replica registers there is none."""
    router = make_router(prefill=False, view=make_view(prefill=False, decode=()))
    with pytest.raises(NoReplicaError, match="no decode replica is registered yet"):
        router.route("t1", None, PROMPT, Sampling(max_tokens=4))


def test_a_cache_blind_baseline_spreads_a_sessions_turns_and_a_switch_keeps_requests_in_flight() -> None:
    """`router.policy: round_robin` (benchmarks only): turns go round the decode replicas whatever they hold;
    switching back to pdserve's policy sends each request's end to the policy that decided it."""
    view = make_view(prefill=False, decode=("d0", "d1"))
    router = make_router(prefill=False, readback=False, view=view)
    blind = RoundRobinPolicy()
    router.use_policy(blind)
    first = router.route("t1", "s", PROMPT, Sampling(max_tokens=4))
    view.index.apply_stored(first.decode_replica, list(range(1, 126)), None, PROMPT)
    second = router.route("t2", "s", NEXT, Sampling(max_tokens=4))
    assert {first.decode_replica, second.decode_replica} == {"d0", "d1"}  # the held prefix did not count
    assert second.reason == "no_prefill_replica" and second.predicted_cached_tokens == 0

    finished: list[str] = []
    blind.on_finish = lambda req, d: finished.append(req.request_id)  # type: ignore[method-assign]
    pdserve = PdservePolicy()
    router.use_policy(pdserve)
    router.finish("t2")
    assert finished == ["t2"]
    third = router.route("t3", "s", NEXT + list(range(7000, 7100)), Sampling(max_tokens=4))
    assert third.decode_replica == first.decode_replica  # pdserve's again: to the replica holding the prefix
