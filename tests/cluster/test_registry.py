"""The replica registry (plain object: no Ray): failure reports reach every router's poll, per-replica slots
(CPU cores) go to the replica that needs them most, and the routers read each other's load there."""

from __future__ import annotations

import pytest
from replicas import replica_info

from cluster import registry as registry_module
from cluster.registry import Registry
from engine.messages import DispatchedLoad, ReplicaInfo, RouterReport


def info(rid: str, role: str = "decode", failed: str = "") -> ReplicaInfo:
    return replica_info(rid, role, failed=failed)


def test_a_reported_failure_is_in_every_snapshot_until_the_entry_goes() -> None:
    reg = Registry()
    reg.publish(info("d1"))
    reg.publish(info("d2"))
    reg.report_failed("d1", "its replica process died")
    reg.report_failed("gone", "never registered")  # nothing to mark
    failed = {i.replica_id: i.failed for i in reg.snapshot()}
    assert failed == {"d1": "its replica process died", "d2": ""}
    reg.publish(info("d1"))  # a late heartbeat does not clear it
    assert {i.replica_id: i.failed for i in reg.snapshot()}["d1"] == "its replica process died"
    reg.withdraw("d1")
    assert [i.replica_id for i in reg.snapshot()] == ["d2"]


def test_a_replicas_own_failure_report_wins() -> None:
    reg = Registry()
    reg.publish(info("d1", failed="its vLLM engine core died"))
    reg.report_failed("d1", "its replica process died")
    assert reg.snapshot()[0].failed == "its vLLM engine core died"


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The registry's monotonic clock, which a test moves on (`clock[0] += seconds`)."""
    now = [1000.0]
    monkeypatch.setattr(registry_module.time, "monotonic", lambda: now[0])
    return now


def test_slots_go_to_the_least_used_entry_and_free_up_when_a_replica_goes(clock: list[float]) -> None:
    reg = Registry()
    assert [reg.claim_slot("decode", rid, 2) for rid in ("a", "b")] == [0, 1]
    assert reg.claim_slot("prefill", "p", 2) == 0  # roles count apart
    for rid in ("a", "b"):
        reg.publish(info(rid))
    reg.withdraw("a")
    assert reg.claim_slot("decode", "c", 2) == 0  # a's slot, free again
    reg.publish(info("c"))
    # b stops heartbeating and expires: its slot is free for its replacement.
    clock[0] += registry_module.EXPIRY_S + 1
    reg.publish(info("c"))
    reg.snapshot()
    assert reg.claim_slot("decode", "d", 2) == 1
    # A replica that claimed and died before publishing holds its slot only for CLAIM_TTL_S.
    assert reg.claim_slot("decode", "e", 2) == 0  # tie 1-1 with c and d: the lowest
    clock[0] += registry_module.CLAIM_TTL_S + 1
    reg.publish(info("c"))
    assert reg.claim_slot("decode", "f", 2) == 1  # d and e never published: only c's slot is held


def test_a_failed_replicas_slot_goes_to_its_replacement_before_the_entry_expires() -> None:
    """A killed replica's entry lives until it expires, while Serve already starts its replacement: the
    replacement must get the dead replica's cores, not share the survivor's."""
    reg = Registry()
    assert [reg.claim_slot("decode", rid, 2) for rid in ("a", "b")] == [0, 1]
    for rid in ("a", "b"):
        reg.publish(info(rid))
    reg.report_failed("b", "its replica process died")  # a router saw its actor die
    assert reg.claim_slot("decode", "c", 2) == 1
    reg.publish(info("c"))
    reg.publish(info("a", failed="its vLLM engine core died"))  # the replica's own report
    assert reg.claim_slot("decode", "d", 2) == 0


def test_on_a_tie_the_slot_of_the_replica_heard_from_least_recently_goes_first(clock: list[float]) -> None:
    """A replica that died unseen (no stream on it) stops heartbeating before its entry expires."""
    reg = Registry()
    assert [reg.claim_slot("decode", rid, 2) for rid in ("a", "b")] == [0, 1]
    reg.publish(info("b"))
    clock[0] += 1
    reg.publish(info("a"))
    clock[0] += 3  # b has missed a heartbeat, a has not: b's cores go to the newcomer
    assert reg.claim_slot("decode", "c", 2) == 1


def test_status_shows_a_failed_replica_with_its_reason() -> None:
    from cluster.status import Published, build_status, render_table

    details = {
        "applications": {
            "pdserve": {
                "status": "RUNNING",
                "deployments": {
                    "decode": {
                        "status": "HEALTHY",
                        "replicas": [
                            {"replica_id": "d1", "state": "RUNNING", "node_id": "n", "node_ip": "1.2.3.4"}
                        ],
                    }
                },
            }
        }
    }
    published = [Published.of_info(info("d1", failed="its vLLM engine core died"))]
    status = build_status("pdserve", details, {}, published)
    (row,) = status.replicas
    assert row.registry == "failed: its vLLM engine core died"
    assert "failed: its vLLM engine core died" in render_table(status)


def test_routers_meet_at_the_registry_each_reads_the_others_and_a_silent_one_expires(
    clock: list[float],
) -> None:
    reg = Registry()
    reg.publish(info("d1"))
    load = {"d1": DispatchedLoad(active_seqs=3, active_context_tokens=900)}
    first = reg.sync(RouterReport(router_id="r1", admitted_tokens=900, replicas=load))
    assert [i.replica_id for i in first.replicas] == ["d1"] and first.routers == []
    second = reg.sync(RouterReport(router_id="r2"))
    assert [(r.router_id, r.admitted_tokens, r.replicas) for r in second.routers] == [("r1", 900, load)]
    assert {r.router_id for r in reg.sync(RouterReport(router_id="r1")).routers} == {"r2"}
    # r2 stops polling (its process died): after ROUTER_EXPIRY_S its load no longer counts.
    clock[0] += registry_module.ROUTER_EXPIRY_S + 0.5
    assert reg.sync(RouterReport(router_id="r1")).routers == []
    assert [r.router_id for r in reg.routers()] == ["r1"]
    reg.withdraw_router("r1")  # a router stopping leaves at once
    assert reg.routers() == []


def test_each_poll_carries_the_deployed_router_settings() -> None:
    reg = Registry()
    assert reg.sync(RouterReport(router_id="r1")).router_settings is None  # deployed by hand, no topology
    reg.reconfigure({"topology": {"router": {"stream_batch_tokens": 4}}})  # what `pdserve apply` deploys
    assert reg.sync(RouterReport(router_id="r1")).router_settings == {"stream_batch_tokens": 4}
