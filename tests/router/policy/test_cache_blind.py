"""The cache-blind baselines (router.policy: round_robin, least_loaded, session_hash) pick replicas by their
rule alone."""

import pytest
from policy_helpers import BS, FixedLookup, request, view

from router.errors import NoReplicaError
from router.policy.cache_blind import LeastLoadedPolicy, RoundRobinPolicy, SessionHashPolicy, session_replica


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


def test_session_hash_keeps_a_session_on_the_replica_its_id_hashes_to() -> None:
    pol = SessionHashPolicy()
    decs = [view("d0", "decode"), view("d1", "decode", active=9)]  # load is not looked at
    pres = [view("p0"), view("p1")]
    placed = {}
    for i in range(40):
        s = f"s{i}"
        first = pol.choose(request(session=s, rid=f"{s}-1"), pres, decs, FixedLookup())
        second = pol.choose(request(session=s, rid=f"{s}-2"), pres, decs, FixedLookup({"d0": 9, "d1": 9}))
        assert (first.decode, first.prefill) == (second.decode, second.prefill)
        assert first.decode == session_replica(s, ["d1", "d0"])  # the order replicas are listed in is not
        placed[s] = first.decode
    assert set(placed.values()) == {"d0", "d1"}  # sessions spread over both


def test_session_hash_rehashes_over_the_eligible_replicas_only() -> None:
    decs = [view("d0", "decode"), view("d1", "decode", draining=True), view("d2", "decode")]
    pol = SessionHashPolicy()
    got = {pol.choose(request(session=f"s{i}"), [], decs, FixedLookup()).decode for i in range(40)}
    assert got == {"d0", "d2"}
    with pytest.raises(NoReplicaError):
        pol.choose(request(session="s"), [], [view("d0", "decode", ready=False)], FixedLookup())
