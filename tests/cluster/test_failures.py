"""Failures on a running cluster while clients stream: a killed replica actor is replaced by Serve, and the
registry and router follow; a removed node's replicas come back on another labelled node when there is
room, and are reported pending with the reason when there is not. Real Serve, registry and gRPC router on
the engine test double, on a fake multi-node Ray cluster (tests/cluster/fake_cluster.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import ray
from fake_cluster import APP, Env, Streamer, double_topology, running, serve_replicas, wait_until
from ray import serve

from cluster.placement import INFEASIBLE, placement_specs, wait_for_placement
from cluster.registry import EXPIRY_S
from engine.double import double_tokens
from engine.messages import ReplicaInfo
from pdserve_client.sdk import PdserveClient

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    with running(
        lambda cluster: double_topology(cluster.dashboard_port, decode={"replicas": 2}), decode_nodes=2
    ) as env:
        yield env


def running_decode(env: Env) -> dict[str, dict]:
    return {r["replica_id"]: r for r in serve_replicas(env.cluster.dashboard_url, "decode")}


def health(env: Env) -> str:
    with PdserveClient(env.router.target) as client:
        return client.health()


def registry_ids(role: str) -> set[str]:
    infos: list[ReplicaInfo] = (
        serve.get_deployment_handle("registry", APP).snapshot.remote().result(timeout_s=10)
    )
    return {i.replica_id for i in infos if i.role == role}


async def test_a_killed_replica_is_replaced_and_the_registry_and_router_follow(env: Env) -> None:
    before = await asyncio.to_thread(running_decode, env)
    assert len(before) == 2
    streamer = Streamer(env.router.target).start()
    try:
        await wait_until(lambda: streamer.count() >= 4, 30, "the first completions")
        victim_id, victim = next(iter(before.items()))
        assert victim["actor_name"] == f"SERVE_REPLICA::{APP}#decode#{victim_id}"
        killed_at = time.monotonic()
        ray.kill(ray.get_actor(victim["actor_name"], namespace="serve"), no_restart=True)

        def replaced() -> set[str] | None:
            ids = set(running_decode(env))
            return ids if len(ids) == 2 and victim_id not in ids else None

        now = await wait_until(replaced, 60, "Serve to replace the killed replica")
        replaced_s = time.monotonic() - killed_at
        # The dead replica's entry expires (it never withdrew); the new one has published.
        await wait_until(lambda: registry_ids("decode") == now, EXPIRY_S + 20, "the registry to follow")
        registry_s = time.monotonic() - killed_at
        (new_id,) = now - set(before)
        await wait_until(
            lambda: any(o.decode_replica == new_id for o in streamer.outcomes), 30, "the router to use it"
        )
        served_after = time.monotonic()
        await asyncio.sleep(2)
    finally:
        outcomes = streamer.stop()
    print(f"replaced after {replaced_s:.1f} s, registry followed after {registry_s:.1f} s")
    # Nothing lost: the streams on the killed replica went on elsewhere, and each client got the very
    # tokens an unbroken run gives (the double decodes like greedy sampling: see engine/double.py).
    assert [o for o in outcomes if o.code.name != "OK"] == []
    for o in outcomes:
        assert list(o.token_ids) == double_tokens(list(o.prompt), streamer.max_tokens), o
    assert any(o.started < killed_at < o.ended for o in outcomes)
    later = [o for o in outcomes if o.started > served_after]
    assert later and all(o.code.name == "OK" for o in later)


async def test_a_removed_nodes_replicas_come_back_elsewhere_or_are_reported_pending(env: Env) -> None:
    url = env.cluster.dashboard_url
    specs = placement_specs(env.topo)
    before = await asyncio.to_thread(running_decode, env)
    lost_node = next(iter(before.values()))["node_id"]
    lost_name = env.cluster.node_name(lost_node)
    removed_at = time.monotonic()
    await asyncio.to_thread(env.cluster.remove_node, lost_name)

    # Room on the other decode node: Serve brings the replicas back there.
    def moved() -> dict[str, dict] | None:
        now = running_decode(env)
        return now if len(now) == 2 and all(r["node_id"] != lost_node for r in now.values()) else None

    now = await wait_until(moved, 90, "the replicas to come back on another node")
    print(f"replicas back on another node after {time.monotonic() - removed_at:.1f} s")
    (remaining,) = {r["node_id"] for r in now.values()}
    assert env.cluster.node_name(remaining).startswith("decode-")
    report = await wait_for_placement(APP, specs, 30, url)
    assert report.ok, report.summary()

    # No decode node left: the replicas are pending, and the report says why; the endpoint's health says
    # no request can be served, so a load balancer in front sends traffic elsewhere.
    await asyncio.to_thread(env.cluster.remove_node, env.cluster.node_name(remaining))
    await wait_until(lambda: not running_decode(env), 60, "Serve to lose the decode replicas")
    await wait_until(lambda: health(env) == "NOT_SERVING" or None, EXPIRY_S + 20, "health to say NOT_SERVING")
    report = await wait_for_placement(APP, specs, 60, url, infeasible_grace_s=3)
    (decode,) = [p for p in report.pools if p.spec.deployment == "decode"]
    assert not decode.placed
    assert decode.reason == INFEASIBLE, report.summary()
    assert "NOT placed: decode" in report.summary()
    assert "labelled {role: decode}" in report.summary()

    # Capacity returns: so do the replicas.
    # On the test's thread: Ray's node startup installs signal handlers, which only the main thread may.
    env.cluster.nodes["decode-new"] = env.cluster.add_node("decode", 1)
    await wait_until(lambda: len(running_decode(env)) == 2, 90, "the replicas on the new node")
    await wait_until(lambda: health(env) == "SERVING" or None, 30, "health to say SERVING again")
    report = await wait_for_placement(APP, specs, 30, url)
    assert report.ok, report.summary()
