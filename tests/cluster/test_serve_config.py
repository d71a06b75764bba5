"""Compiling a topology into Ray Serve's declarative config and a KubeRay RayService."""

from __future__ import annotations

import os
from typing import Any

import msgspec
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from cluster.serve_app import SERVING_ENV, build_app, engine_spec
from cluster.serve_config import (
    compile_serve_config,
    export_rayservice,
    in_cluster,
    render_rayservice,
    running_topology,
    serves_router,
)
from cluster.topology import Topology, TopologyError
from cluster.topology_file import parse_topology
from engine.spec import ENGINE_SPEC_ENV, EngineSpec

H200 = """
model: {block_size: 64, dtype: bfloat16}
pools:
  prefill:
    replicas: 2
    gpus_per_replica: 8
    cpus_per_replica: 4
    node_labels: {role: prefill}
    engine: {tensor_parallel_size: 8}
  decode:
    replicas: 3
    gpus_per_replica: 16
    nodes_per_replica: 2
    cpus_per_replica: 6
    node_labels: {role: decode}
    engine: {tensor_parallel_size: 16, enable_expert_parallel: true}
    max_ongoing_requests: 512
    graceful_shutdown_timeout_s: 600
    health_check_period_s: 5
    health_check_timeout_s: 45
"""


def deployments(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    (app,) = config["applications"]
    return {d["name"]: d for d in app["deployments"]}


def fits(options: dict[str, Any], bundle: dict[str, float]) -> bool:
    return options.get("num_cpus", 0) <= bundle.get("CPU", 0) and options.get("num_gpus", 0) <= bundle.get(
        "GPU", 0
    )


@pytest.mark.parametrize("text", ["", H200], ids=["local", "h200"])
def test_compiled_config_is_a_valid_serve_deploy_config(text: str) -> None:
    config = compile_serve_config(parse_topology(text))
    schema = ServeDeploySchema.model_validate(config)
    assert schema.proxy_location == "Disabled"
    (app,) = schema.applications
    assert app.name == "pdserve"
    assert app.route_prefix is None
    assert app.import_path == "cluster.serve_app:build_app"
    assert [d.name for d in app.deployments] == ["prefill", "decode", "registry"]


def test_args_hold_only_the_roles_and_the_registry_carries_the_whole_topology() -> None:
    # Serve versions every deployment by a hash of the args: anything more in them would restart all pools.
    topo = parse_topology(H200)
    (app,) = compile_serve_config(topo, app_name="agents")["applications"]
    assert app["name"] == "agents"
    assert app["args"] == {"roles": ["prefill", "decode"]}
    assert running_topology(app) == topo


def test_each_pool_gets_its_engine_spec_in_its_own_actor_options() -> None:
    topo = parse_topology(H200)
    decode = deployments(compile_serve_config(topo))["decode"]
    env = decode["ray_actor_options"]["runtime_env"]["env_vars"]
    assert msgspec.json.decode(env[ENGINE_SPEC_ENV], type=EngineSpec) == engine_spec(topo, "decode")


def test_a_decode_engine_args_change_touches_only_the_decode_deployment() -> None:
    topo = parse_topology(H200)
    raw = msgspec.to_builtins(topo)
    raw["pools"]["decode"]["engine"]["max_num_seqs"] = 8
    before, after = compile_serve_config(topo), compile_serve_config(parse_topology(raw))
    assert before["applications"][0]["args"] == after["applications"][0]["args"]
    assert deployments(before)["prefill"] == deployments(after)["prefill"]
    assert (
        deployments(before)["decode"]["ray_actor_options"]
        != deployments(after)["decode"]["ray_actor_options"]
    )


@pytest.mark.parametrize(("replicas", "surge_percent"), [(1, 100), (2, 50), (3, 33), (7, 14), (300, 1)])
def test_rollouts_start_one_replacement_before_stopping_one_old_replica(
    replicas: int, surge_percent: int
) -> None:
    topo = parse_topology(f"pools: {{decode: {{replicas: {replicas}, cpu: {{threads_bind: '1'}}}}}}")
    decode = deployments(compile_serve_config(topo))["decode"]
    assert decode["max_surge_percent"] == surge_percent
    # Serve's arithmetic: ceil(percent x replicas / 100) extra replicas,
    # max(int(fraction x replicas), 1) replaced at a time.
    assert max(int(decode["rolling_update_percentage"] * replicas), 1) == 1
    assert -(-surge_percent * replicas // 100) == (1 if replicas <= 100 else 3)
    no_surge = parse_topology("pools: {decode: {rollout_surge_replicas: 0, cpu: {threads_bind: '1'}}}")
    assert deployments(compile_serve_config(no_surge))["decode"]["max_surge_percent"] == 0


def test_pool_settings_reach_the_deployment() -> None:
    decode = deployments(compile_serve_config(parse_topology(H200)))["decode"]
    assert decode["num_replicas"] == 3
    assert decode["max_ongoing_requests"] == 512
    assert decode["graceful_shutdown_timeout_s"] == 600
    assert decode["health_check_period_s"] == 5
    assert decode["health_check_timeout_s"] == 45


def test_prefill_is_left_out_when_it_has_no_replicas() -> None:
    config = compile_serve_config(parse_topology("pools: {prefill: {replicas: 0}}"))
    assert list(deployments(config)) == ["decode", "registry"]
    ServeDeploySchema.model_validate(config)


def test_cpu_replica_is_one_bundle_with_its_cores_and_kv_space() -> None:
    prefill = deployments(compile_serve_config(Topology()))["prefill"]
    assert prefill["placement_group_bundles"] == [{"CPU": 1.0}]
    assert prefill["placement_group_strategy"] == "STRICT_PACK"
    assert prefill["ray_actor_options"]["num_cpus"] == 1.0
    assert prefill["ray_actor_options"]["num_gpus"] == 0
    assert "placement_group_bundle_label_selector" not in prefill


def test_multi_gpu_replica_has_one_bundle_per_gpu_and_an_actor_without_gpus() -> None:
    compiled = deployments(compile_serve_config(parse_topology(H200)))
    prefill, decode = compiled["prefill"], compiled["decode"]
    assert len(prefill["placement_group_bundles"]) == 8
    assert len(decode["placement_group_bundles"]) == 16
    for d in (prefill, decode):
        assert all(b["GPU"] == 1 for b in d["placement_group_bundles"])
        assert d["ray_actor_options"]["num_gpus"] == 0  # vLLM's Ray workers take the GPUs
        assert fits(d["ray_actor_options"], d["placement_group_bundles"][0])
    assert prefill["ray_actor_options"]["num_cpus"] == 4
    assert decode["ray_actor_options"]["num_cpus"] == 6


def test_single_gpu_replica_actor_holds_its_gpu() -> None:
    topo = parse_topology(
        "model: {block_size: 64}\npools: {prefill: {replicas: 0}, decode: {gpus_per_replica: 1}}"
    )
    decode = deployments(compile_serve_config(topo))["decode"]
    assert decode["placement_group_bundles"] == [{"GPU": 1.0, "CPU": 2.0}]
    assert decode["ray_actor_options"]["num_gpus"] == 1
    assert fits(decode["ray_actor_options"], decode["placement_group_bundles"][0])


def test_replicas_sharing_a_gpu_hold_their_share_and_ask_vllm_for_their_share_of_memory() -> None:
    topo = parse_topology(
        "model: {block_size: 16}\npools: {prefill: {gpus_per_replica: 0.5}, decode: {gpus_per_replica: 0.5}}"
    )
    compiled = deployments(compile_serve_config(topo))
    for role in ("prefill", "decode"):
        d = compiled[role]
        assert d["placement_group_bundles"] == [{"GPU": 0.5, "CPU": 2.0}]
        assert d["ray_actor_options"]["num_gpus"] == 0.5  # Ray sets CUDA_VISIBLE_DEVICES for a share too
        assert fits(d["ray_actor_options"], d["placement_group_bundles"][0])
        spec = engine_spec(topo, role)
        assert spec.device == "cuda" and spec.engine_args["gpu_memory_utilization"] == 0.45
        assert "distributed_executor_backend" not in spec.engine_args


def test_multi_gpu_engines_run_their_workers_in_the_replicas_placement_group() -> None:
    # vLLM's Ray executor, which takes the GPU bundles of the group the replica actor runs in; left to
    # choose, vLLM picks multiprocessing (no GPU in the actor) or refuses TP16 on 8-GPU nodes.
    topo = parse_topology(H200)
    assert engine_spec(topo, "prefill").engine_args["distributed_executor_backend"] == "ray"
    assert engine_spec(topo, "decode").engine_args["distributed_executor_backend"] == "ray"
    one_gpu = parse_topology(
        "model: {block_size: 64}\npools: {prefill: {replicas: 0}, decode: {gpus_per_replica: 1}}"
    )
    assert "distributed_executor_backend" not in engine_spec(one_gpu, "decode").engine_args
    assert "distributed_executor_backend" not in engine_spec(Topology(), "decode").engine_args


def test_an_application_that_serves_its_router_has_it_on_the_head_binding_the_registry() -> None:
    plain = compile_serve_config(Topology())
    assert "router" not in deployments(plain) and not serves_router(plain["applications"][0])
    config = compile_serve_config(Topology(), serve_router=True)
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert serves_router(app) and app["args"]["router"] is True
    router = deployments(config)["router"]
    assert router["num_replicas"] == 1
    assert router["ray_actor_options"]["resources"] == {"node:__internal_head__": 0.001}
    # Only the router is added: the pools and the registry are the same as `pdserve up` deploys.
    assert {k: v for k, v in deployments(config).items() if k != "router"} == deployments(plain)


def test_several_routers_share_the_head_or_run_one_per_labelled_node() -> None:
    on_head = deployments(compile_serve_config(parse_topology({"server": {"routers": 3}}), serve_router=True))
    router = on_head["router"]
    assert router["num_replicas"] == 3 and "max_replicas_per_node" not in router  # they share the ports
    serving = {"runtime_env": {"env_vars": SERVING_ENV}}
    assert router["ray_actor_options"] == {
        "num_cpus": 0,
        "resources": {"node:__internal_head__": 0.001},
        **serving,
    }
    spread = parse_topology({"server": {"routers": 2, "router_node_labels": {"role": "router"}}})
    config = compile_serve_config(spread, serve_router=True)
    ServeDeploySchema.model_validate(config)
    router = deployments(config)["router"]
    assert router["num_replicas"] == 2 and router["max_replicas_per_node"] == 1
    assert router["ray_actor_options"] == {"num_cpus": 0, "label_selector": {"role": "router"}, **serving}


def test_the_serving_replicas_run_at_the_nodes_normal_priority_not_rays_worker_niceness() -> None:
    # Ray would start them at niceness 15, behind everything else on a contended node.
    topo = parse_topology({"pools": {"prefill": {"replicas": 1}, "decode": {"replicas": 2}}})
    config = compile_serve_config(topo, serve_router=True)
    ServeDeploySchema.model_validate(config)
    assert set(deployments(config)) == {"prefill", "decode", "registry", "router"}
    for name in ("prefill", "decode", "router"):
        env = deployments(config)[name]["ray_actor_options"]["runtime_env"]["env_vars"]
        assert env["RAY_worker_niceness"] == "0", name
    # The registry's actor options are its code's, none here replace them: no CPU, and the same priority
    # (its heartbeats keep the replicas routable, so the engines must not starve it).
    assert "ray_actor_options" not in deployments(config)["registry"]
    registry = build_app({"roles": ["decode"]})._bound_deployment  # the application's ingress
    assert registry.name == "registry"
    assert registry.ray_actor_options == {"num_cpus": 0, "runtime_env": {"env_vars": SERVING_ENV}}
    # The engine pools keep their engine spec beside it.
    assert ENGINE_SPEC_ENV in deployments(config)["decode"]["ray_actor_options"]["runtime_env"]["env_vars"]


def test_in_cluster_the_router_listens_on_the_pods_interfaces_and_engines_on_the_pods_address() -> None:
    local = Topology()
    assert local.server.grpc_host == "127.0.0.1" and local.ray.address is None
    pod = in_cluster(local)
    assert (pod.server.grpc_host, pod.server.metrics_host, pod.ray.address) == ("0.0.0.0", "0.0.0.0", "auto")
    custom = parse_topology({"server": {"grpc_host": "10.0.0.5"}})
    assert in_cluster(custom).server.grpc_host == "10.0.0.5"  # an explicit address is kept


def test_strategy_single_node_strict_pack_multi_node_pack() -> None:
    compiled = deployments(compile_serve_config(parse_topology(H200)))
    assert compiled["prefill"]["placement_group_strategy"] == "STRICT_PACK"
    assert compiled["decode"]["placement_group_strategy"] == "PACK"


def test_label_selector_comes_from_node_labels() -> None:
    compiled = deployments(compile_serve_config(parse_topology(H200)))
    assert compiled["prefill"]["placement_group_bundle_label_selector"] == [{"role": "prefill"}]
    assert compiled["decode"]["placement_group_bundle_label_selector"] == [{"role": "decode"}]


def test_rayservice_embeds_the_serve_config_and_labelled_worker_groups() -> None:
    topo = parse_topology(H200)
    manifest = export_rayservice(topo, name="kimi", image="registry/pdserve:1")
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    assert manifest["metadata"]["name"] == "kimi"
    spec = manifest["spec"]
    # The topology's own Serve config as run inside the cluster (engines bind their pod's address), with
    # the router as a deployment: nobody runs `pdserve up` in a RayService.
    assert yaml.safe_load(spec["serveConfigV2"]) == compile_serve_config(in_cluster(topo), serve_router=True)
    cluster = spec["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    # Without an inventory: one group per pool, sized for its replicas.
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert groups["prefill"]["replicas"] == 2
    assert groups["decode"]["replicas"] == 6  # 3 replicas x 2 nodes
    assert (
        groups["decode"]["labels"] == {"role": "decode"}
        and "labels" not in groups["decode"]["rayStartParams"]
    )
    (container,) = groups["decode"]["template"]["spec"]["containers"]
    assert container["image"] == "registry/pdserve:1"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"


def test_rayservice_uses_the_inventory_when_there_is_one() -> None:
    topo = parse_topology(
        H200
        + """
nodes:
  - {name: head, labels: {role: head}, cpus: 32}
  - {name: p, labels: {role: prefill, zone: a}, gpus: 8, cpus: 96, count: 2}
  - {name: d, labels: {role: decode, zone: a}, gpus: 8, cpus: 96, count: 6}
"""
    )
    cluster = export_rayservice(topo)["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["labels"] == {"role": "head"}
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"p", "d"}
    assert groups["d"]["labels"] == {"role": "decode", "zone": "a"}
    assert groups["d"]["replicas"] == 6


def test_rayservice_without_inventory_needs_plain_label_values() -> None:
    topo = parse_topology("pools: {decode: {node_labels: {role: 'in(decode,both)'}}}")
    with pytest.raises(TopologyError) as info:
        export_rayservice(topo)
    assert info.value.path == "pools.decode.node_labels.role"


def test_rendered_rayservice_is_yaml_with_a_readable_serve_config() -> None:
    text = render_rayservice(parse_topology(H200), source="deploy/x.yaml")
    assert text.startswith("# Generated from deploy/x.yaml by `pdserve export`")
    assert "serveConfigV2: |\n" in text
    assert yaml.safe_load(text) == export_rayservice(parse_topology(H200))


def test_serve_reads_the_metrics_export_interval_the_serving_replicas_set() -> None:
    """Serve's per-actor metrics export (ten wake-ups a second by default) is slowed through an environment
    variable; a Ray upgrade that renamed it would bring the wake-ups back without a word."""
    import subprocess
    import sys

    env = {**os.environ, **SERVING_ENV}
    code = "from ray.serve._private import constants as c; print(c.RAY_SERVE_METRICS_EXPORT_INTERVAL_MS)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == SERVING_ENV["RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"] == "1000"
