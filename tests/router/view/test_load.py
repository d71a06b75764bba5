"""Router-side load accounting."""

import pytest

from engine.messages import DispatchedLoad
from router.messages import Decision, RouteRequest
from router.service_time import ServiceTimeModel
from router.view.load import LoadTracker


def _req(rid: str, n: int = 1000) -> RouteRequest:
    return RouteRequest(
        request_id=rid, session_id=None, num_prompt_tokens=n, block_hashes=[], block_size=16, max_tokens=10
    )


def _dec(prefill: str | None, decode: str, cached: int = 0) -> Decision:
    return Decision(
        prefill=prefill,
        decode=decode,
        local_prefill=prefill is None,
        predicted_cached_tokens=cached,
        predicted_decode_cached_tokens=0,
        cost=0.0,
        reason="t",
    )


def _tracker() -> LoadTracker:
    t = LoadTracker()
    t.add_replica("p0", "prefill", node_id="n0")
    t.add_replica("d0", "decode", node_id="n0")
    return t


def _view(t: LoadTracker, role: str, rid: str):  # type: ignore[no-untyped-def]
    return next(v for v in t.views(role) if v.replica_id == rid)  # type: ignore[arg-type]


def test_dispatch_queues_uncached_tokens_and_a_decode_sequence() -> None:
    t = _tracker()
    t.on_dispatch(_req("r1", 1000), _dec("p0", "d0", cached=600))
    p, d = _view(t, "prefill", "p0"), _view(t, "decode", "d0")
    assert (p.queued_prefill_tokens, p.queued_prefill_requests) == (400, 1)
    assert (d.active_seqs, d.queued_prefill_tokens) == (1, 0)
    assert p.node_id == "n0"


def test_prefill_done_then_finish_releases_everything() -> None:
    t = _tracker()
    t.on_dispatch(_req("r1"), _dec("p0", "d0"))
    t.on_prefill_done("r1")
    assert _view(t, "prefill", "p0").queued_prefill_tokens == 0
    assert _view(t, "decode", "d0").active_seqs == 1
    t.on_prefill_done("r1")  # idempotent
    t.on_finish("r1")
    assert _view(t, "decode", "d0").active_seqs == 0
    assert _view(t, "prefill", "p0").queued_prefill_tokens == 0
    assert t.inflight() == 0


def test_finish_without_prefill_done_releases_prefill_work() -> None:
    t = _tracker()
    t.on_dispatch(_req("r1"), _dec("p0", "d0"))
    t.on_finish("r1")  # e.g. aborted while queued
    assert _view(t, "prefill", "p0").queued_prefill_tokens == 0
    assert _view(t, "prefill", "p0").queued_prefill_requests == 0


def test_local_prefill_queues_on_the_decode_replica() -> None:
    t = _tracker()
    t.on_dispatch(_req("r1", 500), _dec(None, "d0", cached=400))
    assert _view(t, "decode", "d0").queued_prefill_tokens == 100
    assert _view(t, "prefill", "p0").queued_prefill_tokens == 0


def test_stats_flags_and_removal() -> None:
    t = _tracker()
    t.update_kv_usage("d0", 1.7)
    t.set_draining("d0", True)
    t.set_ready("p0", False)
    d, p = _view(t, "decode", "d0"), _view(t, "prefill", "p0")
    assert d.kv_usage == 1.0 and d.draining and not d.eligible
    assert not p.ready and not p.eligible
    t.on_dispatch(_req("r1"), _dec("p0", "d0"))
    t.remove_replica("p0")
    assert [v.replica_id for v in t.views("prefill")] == []
    t.on_finish("r1")  # a removed replica's request still finishes cleanly
    assert _view(t, "decode", "d0").active_seqs == 0


def test_queued_prefill_seconds_follow_the_service_time_model() -> None:
    timing = ServiceTimeModel()
    t = LoadTracker(timing)
    t.add_replica("p0", "prefill")
    t.add_replica("d0", "decode")
    t.on_dispatch(_req("r1", 10_000), _dec("p0", "d0", cached=6_000))
    t.on_dispatch(_req("r2", 2_000), _dec("p0", "d0"))
    p = _view(t, "prefill", "p0")
    assert p.queued_prefill_s == pytest.approx(timing.prefill_s(4_000, 6_000) + timing.prefill_s(2_000, 0))
    t.on_prefill_done("r1")
    assert _view(t, "prefill", "p0").queued_prefill_s == pytest.approx(timing.prefill_s(2_000, 0))
    t.on_finish("r2")
    assert _view(t, "prefill", "p0").queued_prefill_s == 0.0  # exactly empty, no float residue


def test_decode_context_tokens_count_active_prompts() -> None:
    t = _tracker()
    t.on_dispatch(_req("r1", 1000), _dec("p0", "d0"))
    t.on_dispatch(_req("r2", 3000), _dec(None, "d0", cached=2900))
    assert _view(t, "decode", "d0").active_context_tokens == 4000
    t.on_finish("r1")
    assert _view(t, "decode", "d0").active_context_tokens == 3000


def test_views_are_reused_until_a_replica_of_that_role_changes() -> None:
    t = _tracker()
    t.add_replica("p1", "prefill")
    pre, dec = t.views("prefill"), t.views("decode")
    assert t.views("prefill") is pre and t.views("decode") is dec  # nothing changed: no rebuild
    t.on_dispatch(_req("r1", 1000), _dec("p0", "d0"))
    pre2, dec2 = t.views("prefill"), t.views("decode")
    assert pre2 is not pre and dec2 is not dec
    assert [v.queued_prefill_tokens for v in pre2] == [1000, 0]
    assert pre2[1] is pre[1]  # the unchanged replica keeps its view
    t.update_kv_usage("d0", 0.5)
    assert t.views("prefill") is pre2  # a decode replica's change leaves the prefill views alone
    assert t.views("decode")[0].kv_usage == 0.5
    t.set_ready("p1", False)
    assert not t.views("prefill")[1].ready
    t.add_replica("p2", "prefill")
    assert [v.replica_id for v in t.views("prefill")] == ["p0", "p1", "p2"]


def test_the_other_routers_load_adds_to_this_ones_own_until_they_report_again() -> None:
    t = _tracker()
    t.on_dispatch(_req("r1", 1000), _dec("p0", "d0", cached=600))
    own_s = _view(t, "prefill", "p0").queued_prefill_s
    assert own_s is not None and own_s > 0
    assert t.dispatched() == {
        "p0": DispatchedLoad(queued_prefill_tokens=400, queued_prefill_requests=1, queued_prefill_s=own_s),
        "d0": DispatchedLoad(active_seqs=1, active_context_tokens=1000),
    }
    other = {"p0": DispatchedLoad(queued_prefill_tokens=50, queued_prefill_requests=2, queued_prefill_s=1.5)}
    third = {
        "d0": DispatchedLoad(active_seqs=4, active_context_tokens=4000),
        "gone": DispatchedLoad(active_seqs=9),
    }
    t.set_peers([other, third, other])
    p, d = _view(t, "prefill", "p0"), _view(t, "decode", "d0")
    assert (p.queued_prefill_tokens, p.queued_prefill_requests) == (500, 5)
    assert p.queued_prefill_s == pytest.approx(own_s + 3.0)
    assert (d.active_seqs, d.active_context_tokens) == (5, 5000)
    # What this router reports is its own only: the others count theirs themselves.
    assert t.dispatched()["d0"] == DispatchedLoad(active_seqs=1, active_context_tokens=1000)
    t.set_peers([])  # they finished (or are gone)
    assert (_view(t, "decode", "d0").active_seqs, _view(t, "prefill", "p0").queued_prefill_requests) == (1, 1)
    t.on_finish("r1")
    assert t.dispatched() == {}
