"""`pdserve status`: one row per engine replica joining Serve's details, Ray's placement groups and the
registry, named as the Ray dashboard names them. A fake multi-node Ray cluster with fake GPUs runs the
real application on the engine test double (tests/cluster/fake_cluster.py)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator

import pytest
from fake_cluster import APP, Env, FakeCluster, Streamer, double_topology, running, wait_until
from ray import serve
from ray.dashboard.modules.serve.sdk import ServeSubmissionClient
from ray.util.state import list_placement_groups

from cluster import cli
from cluster.bootstrap import RunState
from cluster.status import ClusterStatus, Published, build_status, collect_status, render_table
from cluster.topology import Topology
from engine.messages import ReplicaInfo, RouterReport

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

ONE_GPU = {"gpus_per_replica": 1, "cpu": None}


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    # Fake GPUs: one on the prefill node, two on each decode node.
    def topology(cluster: FakeCluster) -> Topology:
        return double_topology(cluster.dashboard_port, prefill=ONE_GPU, decode={**ONE_GPU, "replicas": 2})

    with running(topology, decode_nodes=2, node_cpus=4, decode_node_gpus=2) as env:
        yield env


def current_status(env: Env) -> ClusterStatus:
    registry: list[ReplicaInfo] = (
        serve.get_deployment_handle("registry", APP).snapshot.remote().result(timeout_s=10)
    )
    return collect_status(env.cluster.dashboard_url, APP, [Published.of_info(i) for i in registry])


async def test_rows_carry_the_dashboards_names_nodes_gpus_and_load(env: Env) -> None:
    streamer = Streamer(env.router.target, clients=3, max_tokens=100).start()
    try:
        # Load shows once a heartbeat carries it (every 2 s).

        def loaded() -> ClusterStatus | None:
            status = current_status(env)
            return status if any((r.running or 0) > 0 for r in status.replicas) else None

        status = await wait_until(loaded, 30, "a replica reporting running requests")
    finally:
        streamer.stop()
    assert status.app_status == "RUNNING"
    assert status.deployments == {"prefill": "HEALTHY", "decode": "HEALTHY"}
    assert sorted(r.role for r in status.replicas) == ["decode", "decode", "prefill"]
    groups = {
        g.name: g
        for g in await asyncio.to_thread(
            list_placement_groups, address=env.cluster.dashboard_url, detail=True
        )
        if g.state != "REMOVED"
    }
    for row in status.replicas:
        assert row.state == "RUNNING" and row.registry == "ready"
        assert row.actor_name == f"SERVE_REPLICA::{APP}#{row.role}#{row.replica_id}"
        group = groups[row.actor_name]  # Serve names the replica's placement group like its actor
        assert row.placement_group_id == group.placement_group_id
        assert row.placement_group_state == "CREATED"
        assert (row.gpus, row.bundles) == (1.0, 1)
        assert row.node_id == (group.bundles or [{}])[0].get("node_id")
        assert env.cluster.node_name(row.node_id).startswith(f"{row.role}-")
        assert row.running is not None and row.waiting == 0 and row.kv_cache_usage is not None
    assert sum(r.running or 0 for r in status.replicas if r.role == "decode") >= 1

    table = render_table(status).splitlines()
    assert table[0] == f"application {APP}: RUNNING"
    header = next(line for line in table if line.startswith("REPLICA"))
    assert header.split() == [
        "REPLICA",
        "ROLE",
        "STATE",
        "REGISTRY",
        "NODE",
        "GPUS",
        "PLACEMENT",
        "GROUP",
        "ACTOR",
        "RUN/WAIT",
        "KV",
        "START",
    ]
    for row in status.replicas:
        line = next(line for line in table if line.startswith(row.replica_id))
        assert row.actor_name in line and str(row.placement_group_id) in line and row.node_id[:12] in line
        # Its start, phase by phase: the process to the constructor (actor), then the engine's.
        assert list(row.start_phases) == ["actor", "engine_other"] and row.start_phases["actor"] > 0
        assert "s (actor " in line


async def test_cli_status_json_reads_the_running_cluster(
    env: Env, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    RunState(
        pid=0,
        ray_address=env.cluster.address,
        dashboard_url=env.cluster.dashboard_url,
        started_ray=False,
        grpc_target=env.router.target,
        metrics_url="",
        started_at=0.0,
    ).save()
    assert await asyncio.to_thread(cli.main, ["status", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["replicas"]
    assert sorted(r["role"] for r in rows) == ["decode", "decode", "prefill"]
    assert all(r["actor_name"].startswith(f"SERVE_REPLICA::{APP}#") and r["gpus"] == 1.0 for r in rows)


async def test_a_replica_serve_no_longer_has_shows_as_gone_until_its_entry_expires(env: Env) -> None:
    status = await asyncio.to_thread(current_status, env)
    (prefill,) = [r for r in status.replicas if r.role == "prefill"]
    registry: list[ReplicaInfo] = await asyncio.to_thread(
        lambda: serve.get_deployment_handle("registry", APP).snapshot.remote().result(timeout_s=10)
    )
    details = await asyncio.to_thread(ServeSubmissionClient(env.cluster.dashboard_url).get_serve_details)
    details["applications"][APP]["deployments"]["prefill"]["replicas"] = []  # as right after a kill
    gone = build_status(APP, details, {}, [Published.of_info(i) for i in registry])
    (row,) = [r for r in gone.replicas if r.role == "prefill"]
    assert (row.replica_id, row.state, row.registry) == (prefill.replica_id, "GONE", "ready")


def test_each_router_is_a_row_with_what_it_last_reported() -> None:
    details = {
        "applications": {
            APP: {
                "status": "RUNNING",
                "deployments": {
                    "router": {
                        "status": "UNHEALTHY",
                        "message": "the router's endpoint stopped",
                        "replicas": [
                            {"replica_id": "r1", "state": "RUNNING", "node_id": "n" * 20},
                            {"replica_id": "r2", "state": "STARTING"},
                        ],
                    },
                    "registry": {"status": "HEALTHY", "replicas": [{"replica_id": "g1"}]},
                },
            }
        }
    }
    reports = [
        RouterReport(router_id="r1", node_id="n" * 20, serving=True, inflight_requests=7),
        RouterReport(router_id="r0", serving=True),  # killed: Serve has it no more, its report expires
    ]
    status = build_status(APP, details, {}, [Published.of_router(r) for r in reports])
    assert status.deployments == {"router": "UNHEALTHY: the router's endpoint stopped"}
    assert [(r.replica_id, r.role, r.state, r.registry, r.running) for r in status.replicas] == [
        ("r1", "router", "RUNNING", "serving", 7),
        ("r2", "router", "STARTING", "missing", None),
    ]
    table = render_table(status)
    assert "  router: UNHEALTHY: the router's endpoint stopped" in table
    assert re.search(r"^r1 +router +RUNNING +serving +nnnnnnnnnnnn .* 7/- ", table, re.MULTILINE)
