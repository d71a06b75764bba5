"""`pdserve apply` on a running cluster while clients stream without pause: the diff, scaling the decode
pool 1 -> 3 -> 1 (scale-down drains), rolling changed engine args one replica at a time, and the changes
apply refuses. A fake multi-node Ray cluster runs the real Serve application, registry and gRPC router on
the engine test double (tests/cluster/fake_cluster.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import msgspec
import pytest
from fake_cluster import (
    Env,
    Streamer,
    double_topology,
    running,
    serve_replicas,
    wait_until,
    with_pool,
)

from cluster.apply import ApplyError, apply_topology, diff_topologies, plan_actions, restart_reasons
from cluster.topology_file import parse_topology

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    with running(lambda cluster: double_topology(cluster.dashboard_port), decode_nodes=2) as env:
        yield env


def test_the_diff_names_field_paths_and_the_plan_says_what_serve_does() -> None:
    old = double_topology(8265)
    new = with_pool(old, "decode", replicas=3, node_labels={"role": "decode", "zone": "a"})
    assert [str(c) for c in diff_topologies(old, new)] == [
        "pools.decode.node_labels.zone: <unset> -> a",
        "pools.decode.replicas: 1 -> 3",
    ]
    actions = {a.deployment: a for a in plan_actions(old, with_pool(old, "decode", replicas=3))}
    assert actions["decode"].action == "scale"
    assert actions["decode"].detail == "scale 1 -> 3 replicas (start 2)"
    assert actions["prefill"].action == "unchanged"
    assert actions["registry"].action == "update in place"
    rolled = {
        a.deployment: a for a in plan_actions(old, with_pool(old, "decode", engine={"max_num_seqs": 8}))
    }
    assert rolled["decode"].action == "roll"
    assert "a replacement starts before each old replica drains" in rolled["decode"].detail
    assert rolled["prefill"].action == "unchanged"  # engine args of one pool never restart the other


def test_the_router_count_applies_live_serve_scales_the_router_deployment() -> None:
    old = double_topology(8265)
    raw = msgspec.to_builtins(old)
    raw["server"]["routers"] = 2
    new = parse_topology(raw)
    changes = diff_topologies(old, new)
    assert [str(c) for c in changes] == ["server.routers: 1 -> 2"]
    assert restart_reasons(old, changes) == []  # the rest of `server` is still read once
    actions = {a.deployment: a for a in plan_actions(old, new, serve_router=True)}
    assert actions["router"].detail == "scale 1 -> 2 replicas (start 1)"
    assert {a.action for name, a in actions.items() if name not in ("router", "registry")} == {"unchanged"}
    raw["server"]["grpc_port"] += 1
    assert restart_reasons(old, diff_topologies(old, parse_topology(raw)))


async def test_scale_decode_1_to_3_to_1_while_streaming_loses_no_request_and_drains_removed_replicas(
    env: Env,
) -> None:
    url = env.cluster.dashboard_url
    streamer = Streamer(env.router.target).start()
    try:
        await wait_until(lambda: streamer.count() >= 4, 30, "the first completions")
        lines: list[str] = []
        up = with_pool(env.topo, "decode", replicas=3)
        scaled_up = await apply_topology(up, dashboard_url=url, out=lines.append)
        assert "  pools.decode.replicas: 1 -> 3" in lines
        assert scaled_up.applied and scaled_up.running_s < 60
        three = {r["replica_id"] for r in await asyncio.to_thread(serve_replicas, url, "decode")}
        assert len(three) == 3
        after_up = time.monotonic()
        while len({o.decode_replica for o in streamer.outcomes if o.started > after_up} - {""}) < 2:
            assert time.monotonic() - after_up < 30, "the router never used the new replicas"
            await asyncio.sleep(0.2)

        scale_down_at = time.monotonic()
        scaled_down = await apply_topology(env.topo, dashboard_url=url, out=lines.append)
        (kept,) = {r["replica_id"] for r in await asyncio.to_thread(serve_replicas, url, "decode")}
        settled = time.monotonic()
        await asyncio.sleep(3)  # requests started after the drain must all go to the kept replica
    finally:
        outcomes = streamer.stop()
    removed = three - {kept}
    print(
        f"scale up {scaled_up.running_s:.1f} s; scale down {scaled_down.running_s:.1f} s, "
        f"{scaled_down.drained_replicas} drained in {scaled_down.drained_s:.1f} s; {len(outcomes)} requests"
    )
    assert [o for o in outcomes if o.code.name != "OK"] == []
    assert scaled_down.drained_replicas == 2
    # Streams in flight on a removed replica when the scale-down was deployed completed there.
    drained = [o for o in outcomes if o.decode_replica in removed and o.started < scale_down_at < o.ended]
    assert drained, "no stream was in flight on a removed replica"
    assert all(o.tokens == streamer.max_tokens for o in drained)
    assert all(o.decode_replica == kept for o in outcomes if o.started > settled)


async def test_an_engine_args_change_rolls_decode_one_replica_at_a_time_without_failing_a_request(
    env: Env,
) -> None:
    url = env.cluster.dashboard_url
    prefill_before = {r["replica_id"] for r in await asyncio.to_thread(serve_replicas, url, "prefill")}
    (decode_before,) = {r["replica_id"] for r in await asyncio.to_thread(serve_replicas, url, "decode")}
    running_counts: list[int] = []
    sampling = True

    async def sample() -> None:  # the 1-replica pool must never drop to zero running replicas
        while sampling:
            running_counts.append(len(await asyncio.to_thread(serve_replicas, url, "decode")))
            await asyncio.sleep(0.1)

    sampler = asyncio.create_task(sample())
    streamer = Streamer(env.router.target).start()
    try:
        await wait_until(lambda: streamer.count() >= 4, 30, "the first completions")
        changed = with_pool(env.topo, "decode", engine={"max_num_seqs": 32})
        lines: list[str] = []
        result = await apply_topology(changed, dashboard_url=url, out=lines.append)
        await asyncio.sleep(2)
    finally:
        outcomes = streamer.stop()
        sampling = False
        await sampler
    print(f"roll {result.running_s:.1f} s, old replica drained after {result.drained_s:.1f} s")
    assert "  pools.decode.engine.max_num_seqs: null -> 32" in lines
    assert {a.deployment: a.action for a in result.actions}["decode"] == "roll"
    assert [o for o in outcomes if o.code.name != "OK"] == []
    (decode_after,) = {r["replica_id"] for r in await asyncio.to_thread(serve_replicas, url, "decode")}
    assert decode_after != decode_before
    assert {o.decode_replica for o in outcomes} >= {decode_before, decode_after}  # both served meanwhile
    assert min(running_counts) >= 1
    # The prefill pool's replicas were not restarted.
    assert {
        r["replica_id"] for r in await asyncio.to_thread(serve_replicas, url, "prefill")
    } == prefill_before
    # Roll back to what the module runs, for the next test.
    await apply_topology(env.topo, dashboard_url=url, out=lambda line: None)


async def test_dry_run_shows_the_diff_and_changes_nothing(env: Env) -> None:
    url = env.cluster.dashboard_url
    before = await asyncio.to_thread(serve_replicas, url, "decode")
    lines: list[str] = []
    result = await apply_topology(
        with_pool(env.topo, "decode", replicas=2), dashboard_url=url, dry_run=True, out=lines.append
    )
    assert not result.applied
    assert lines[-1] == "dry run: nothing deployed"
    assert "  decode: scale 1 -> 2 replicas (start 1)" in lines
    await asyncio.sleep(1)
    assert await asyncio.to_thread(serve_replicas, url, "decode", ("STARTING", "RUNNING")) == before
    unchanged = await apply_topology(env.topo, dashboard_url=url, out=lines.append)
    assert not unchanged.applied and lines[-1] == "no changes: the running application already matches"


async def test_changes_that_need_a_restart_are_refused_with_the_field_and_why(env: Env) -> None:
    raw = msgspec.to_builtins(env.topo)
    raw["model"]["name"] = "other"
    raw["server"]["grpc_port"] = raw["server"]["grpc_port"] + 1
    raw["pools"]["prefill"]["replicas"] = 0
    raw["ray"]["placement_timeout_s"] = 30  # read by apply itself: fine
    with pytest.raises(ApplyError) as refused:
        await apply_topology(
            parse_topology(raw), dashboard_url=env.cluster.dashboard_url, out=lambda line: None
        )
    message = str(refused.value)
    assert "need a restart of pdserve" in message
    assert "model.name: tiny-llama -> other" in message
    assert "server.grpc_port" in message
    assert "pools.prefill.replicas: 1 -> 0: turning disaggregation on or off" in message
    assert "placement_timeout_s" not in message
