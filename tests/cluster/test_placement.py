"""Placement on a fake multi-node Ray cluster: labelled nodes with fake GPUs, a stand-in engine deployment
given the compiled placement options, and `wait_for_placement` reading the dashboard's state API.

Nodes: one prefill node and two decode nodes (8 fake GPUs each), and a decoy with 16 GPUs labelled for
another role, which PACK would otherwise prefer for a 16-GPU replica.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from fake_cluster import OBJECT_STORE
from ports import free_port
from ray import serve
from ray.util.state import list_placement_groups
from ray_nodes import RayNodes

from cluster.placement import INFEASIBLE, NO_RESOURCES, PlacementReport, placement_specs, wait_for_placement
from cluster.serve_config import compile_serve_config
from cluster.topology import Topology
from cluster.topology_file import parse_topology

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

PLACEABLE = """
model: {block_size: 64}
pools:
  prefill:
    gpus_per_replica: 8
    node_labels: {role: prefill}
    engine: {tensor_parallel_size: 8}
  decode:
    gpus_per_replica: 16
    nodes_per_replica: 2
    node_labels: {role: decode}
    engine: {tensor_parallel_size: 16, enable_expert_parallel: true}
"""

# Valid without an inventory, but this cluster cannot hold it: prefill fits the prefill node, which the
# placeable app already fills (NO_RESOURCES); no decode node has 16 GPUs for a one-node replica (INFEASIBLE).
UNPLACEABLE = """
model: {block_size: 64}
pools:
  prefill:
    gpus_per_replica: 8
    node_labels: {role: prefill}
    engine: {tensor_parallel_size: 8}
  decode:
    gpus_per_replica: 16
    node_labels: {role: decode}
    engine: {tensor_parallel_size: 16}
"""


@pytest.fixture(scope="module")
def dashboard_url() -> Iterator[str]:
    port = free_port()
    nodes = RayNodes(
        {
            "num_cpus": 2,
            "labels": {"role": "head"},
            "include_dashboard": True,  # the state API and Serve's REST API live in the dashboard
            "dashboard_port": port,
            "dashboard_agent_listen_port": free_port(),
            "ray_client_server_port": free_port(),
            "object_store_memory": OBJECT_STORE,
        }
    )
    try:
        for role, gpus, count in (("prefill", 8, 1), ("decode", 8, 2), ("batch", 16, 1)):
            for _ in range(count):
                nodes.add_node(
                    num_cpus=2 * gpus + 2,
                    num_gpus=gpus,
                    labels={"role": role},
                    object_store_memory=OBJECT_STORE,
                    dashboard_agent_listen_port=free_port(),  # one host: each node's agent needs its own port
                )
        ray.init(address=nodes.address)
        serve.start(proxy_location="Disabled")
        yield f"http://127.0.0.1:{port}"
    finally:
        # No serve.shutdown(): it waits on replicas that never started; stopping the cluster ends them all.
        # Serve caches its controller client; drop it, or the next module's cluster gets this dead one.
        from ray.serve import context

        context._disconnect()
        ray.shutdown()
        nodes.shutdown()


def deploy(topo: Topology, app_name: str) -> None:
    """Run a stand-in engine per pool with exactly the compiled Serve options (bundles, strategy, labels)."""

    # Defined here so that Ray pickles the class by value: workers need not import this test module.
    class FakeEngine:
        def __init__(self, *peers: Any) -> None:
            self.peers = peers

        def node(self) -> str:
            return str(ray.get_runtime_context().get_node_id())

        def vllm_parallel(self) -> dict[str, Any]:
            """What vLLM's engine would be given in this replica: pdserve's engine args (from the replica's
            EngineSpec) and the placement group vLLM finds as EngineArgs.create_engine_config does, turned
            into vLLM's own ParallelConfig."""
            from vllm.config import ParallelConfig
            from vllm.ray.lazy_utils import is_in_ray_actor

            from engine.spec import spec_from_env

            args = spec_from_env().engine_args
            group = ray.util.get_current_placement_group() if is_in_ray_actor() else None
            keys = (
                "tensor_parallel_size",
                "pipeline_parallel_size",
                "data_parallel_size",
                "enable_expert_parallel",
                "distributed_executor_backend",
            )
            config = ParallelConfig(**{k: args[k] for k in keys}, placement_group=group)
            return {
                "world_size": config.world_size,
                "backend": config.distributed_executor_backend,
                "expert_parallel": config.enable_expert_parallel,
                "group_id": group.id.hex() if group else None,
                "bundles": group.bundle_specs if group else [],
            }

    (app,) = compile_serve_config(topo, app_name=app_name)["applications"]
    engine = serve.deployment()(FakeEngine)
    # The placement options only (rollout settings and the registry exist only on the config path).
    placement_keys = (
        "name",
        "num_replicas",
        "ray_actor_options",
        "placement_group_bundles",
        "placement_group_strategy",
        "placement_group_bundle_label_selector",
    )
    bound = {
        d["name"]: engine.options(**{k: d[k] for k in placement_keys if k in d})
        for d in app["deployments"]
        if d["name"] in ("prefill", "decode")
    }
    ingress = bound["decode"].bind(bound["prefill"].bind()) if "prefill" in bound else bound["decode"].bind()
    serve._run(ingress, name=app_name, route_prefix=None, _blocking=False)


def node_labels(report: PlacementReport, node_id: str) -> dict[str, str]:
    return {k: v for k, v in report.nodes[node_id].labels.items() if not k.startswith("ray.io/")}


async def test_replicas_land_on_their_labelled_nodes_and_span_distinct_nodes(dashboard_url: str) -> None:
    topo = parse_topology(PLACEABLE)
    deploy(topo, "placed")
    report = await wait_for_placement("placed", placement_specs(topo), 90, dashboard_url)
    assert report.placed, report.summary()
    assert report.ok, report.summary()
    assert not report.timed_out

    prefill, decode = report.pools
    (p_replica,) = prefill.replicas
    assert len(p_replica.bundle_nodes) == 8
    (p_node,) = p_replica.nodes
    assert node_labels(report, p_node) == {"role": "prefill"}
    assert report.nodes[p_node].gpus == 8

    (d_replica,) = decode.replicas
    assert len(d_replica.bundle_nodes) == 16
    assert len(d_replica.nodes) == 2  # one engine over two distinct nodes, never the 16-GPU decoy
    for node in d_replica.nodes:
        assert node_labels(report, node) == {"role": "decode"}
        assert report.nodes[node].gpus == 8
        assert d_replica.bundle_nodes.count(node) == 8

    # The same, read straight from Ray's state API rather than through the report.
    groups = await asyncio.to_thread(list_placement_groups, address=dashboard_url, detail=True)
    (decode_group,) = [g for g in groups if g.name.startswith("SERVE_REPLICA::placed#decode#")]
    assert decode_group.state == "CREATED"
    bundles = decode_group.bundles or []
    assert len(bundles) == 16
    assert {b["node_id"] for b in bundles} == set(d_replica.nodes)
    assert all(b["unit_resources"]["GPU"] == 1 for b in bundles)

    # The replica actor runs on bundle 0's node.
    handle = serve.get_deployment_handle("decode", app_name="placed")
    assert await handle.node.remote() == d_replica.bundle_nodes[0]

    # vLLM is given the replica's own group: its Ray executor puts one worker on each of the 16 GPU bundles
    # (8 on each decode node), which is what it checks before it starts them (one GPU per bundle, as many
    # GPU bundles as ranks).
    parallel = await handle.vllm_parallel.remote()
    assert parallel["group_id"] == decode_group.placement_group_id
    assert (parallel["world_size"], parallel["backend"], parallel["expert_parallel"]) == (16, "ray", True)
    gpu_bundles = [b for b in parallel["bundles"] if b.get("GPU")]
    assert len(gpu_bundles) == parallel["world_size"] and all(b["GPU"] == 1 for b in gpu_bundles)


async def test_unplaceable_pools_are_reported_with_their_reason_within_the_timeout(
    dashboard_url: str,
) -> None:
    topo = parse_topology(UNPLACEABLE)
    deploy(topo, "unplaceable")
    timeout_s = 12.0
    started = time.monotonic()
    report = await wait_for_placement("unplaceable", placement_specs(topo), timeout_s, dashboard_url)
    took = time.monotonic() - started
    assert took < timeout_s + 5
    assert report.timed_out
    assert not report.placed
    prefill, decode = report.pools
    assert prefill.reason == NO_RESOURCES
    assert decode.reason == INFEASIBLE
    summary = report.summary()
    assert "NOT placed: prefill, decode" in summary
    assert "INFEASIBLE: asks 16 bundles (GPU 16, CPU 17) on one node labelled {role: decode}" in summary
    assert "NO_RESOURCES: asks 8 bundles (GPU 8, CPU 9) on one node labelled {role: prefill}" in summary


async def test_only_infeasible_pools_return_before_the_timeout(dashboard_url: str) -> None:
    topo = parse_topology(
        "model: {block_size: 64}\npools:\n  prefill: {replicas: 0}\n"
        "  decode: {gpus_per_replica: 16, node_labels: {role: decode}, engine: {tensor_parallel_size: 16}}"
    )
    deploy(topo, "infeasible")
    started = time.monotonic()
    report = await wait_for_placement(
        "infeasible", placement_specs(topo), 60, dashboard_url, infeasible_grace_s=2
    )
    assert time.monotonic() - started < 30
    assert not report.timed_out
    (decode,) = report.pools
    assert decode.reason == INFEASIBLE


async def test_unreachable_dashboard_is_reported_not_hung() -> None:
    topo = parse_topology(PLACEABLE)
    started = time.monotonic()
    report = await wait_for_placement(
        "nothing", placement_specs(topo), 2, f"http://127.0.0.1:{free_port()}", poll_s=0.5
    )
    assert time.monotonic() - started < 5
    assert report.timed_out
    assert report.errors
    assert all(p.reason == "WAITING_FOR_SERVE" for p in report.pools)
