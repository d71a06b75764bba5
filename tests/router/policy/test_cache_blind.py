"""The cache-blind baselines (router.policy: round_robin, least_loaded) pick replicas by their rule alone."""

from policy_helpers import BS, FixedLookup, request, view

from router.policy.cache_blind import LeastLoadedPolicy, RoundRobinPolicy


def test_round_robin_cycles_and_skips_ineligible() -> None:
    pol = RoundRobinPolicy()
    pres = [view("p0"), view("p1", draining=True), view("p2")]
    decs = [view("d0", "decode"), view("d1", "decode")]
    got = [pol.choose(request(), pres, decs, FixedLookup()) for _ in range(4)]
    assert [d.prefill for d in got] == ["p0", "p2", "p0", "p2"]
    assert [d.decode for d in got] == ["d0", "d1", "d0", "d1"]
    assert not any(d.local_prefill for d in got)


def test_least_loaded_and_decode_by_least_load() -> None:
    d = LeastLoadedPolicy().choose(
        request(),
        [view("p0", queued=10), view("p1", queued=5)],
        [view("d0", "decode", active=2), view("d1", "decode", active=1, kv=0.9)],
        FixedLookup({"p1": 3}),
    )
    assert (d.prefill, d.decode, d.predicted_cached_tokens) == ("p1", "d1", 3 * BS)
