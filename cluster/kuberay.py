"""The Kubernetes side of an exported RayService (cluster/serve_config.py `export_rayservice`): its node
groups, the pod of each (resources, devices, the model volume, and where a router runs, the router's ports,
TLS files, token and readiness), and the Service in front of routers that run on nodes of their own."""

from __future__ import annotations

import math
from typing import Any

from cluster.topology import NodeGroup, Topology, TopologyError, selector_matches
from router.config import ServerConfig

HEAD_GROUP = "head"  # the inventory's node group of this name is the Ray head
# What an exported RayService expects to exist in its namespace: the server's TLS certificate (a
# kubernetes.io/tls Secret), the bearer token (an Opaque Secret, key `token`), the model (a PVC).
TLS_SECRET = "pdserve-tls"
TOKEN_SECRET = "pdserve-auth"
MODEL_CLAIM = "pdserve-model"
# Of each node's vCPUs, the share left to the kubelet, system daemons and device plugins.
_NODE_RESERVED_CPU = 0.1
ROUTER_GROUP = "routers"  # the worker group export derives for labelled routers when there is no inventory
# The derived router group's nodes. A router is one Python process: an event loop (the doors, intake, the
# policy, the output parsers), gRPC's threads and up to 8 prompts tokenized at once (router/intake/
# tokenizer.py: a tokenizer copy per core, at most 8), beside Ray's raylet and agents on the node. 16 vCPUs
# (14 for the pod) give each of those a core; past that the front end scales out (server.routers), not up,
# and no GPU node is spent on it.
ROUTER_GROUP_CPUS = 16
# Labels the export puts on every router pod (its template's labels, which KubeRay keeps beside its own
# ray.io/* ones): the routers' Service selects them. KubeRay's own pod labels would not do: ray.io/cluster
# names the RayCluster, which a RayService generates (<name>-<suffix>) and replaces on every upgrade, and
# the RayService's name (ray.io/originated-from-cr-name) labels the RayCluster and KubeRay's Services, not
# the pods; ray.io/group alone would match the pods of every RayService in the namespace.
ROLE_LABEL = "pdserve.io/role"
RAYSERVICE_LABEL = "pdserve.io/rayservice"
METRICS_PORT_NAME = "pdserve-metrics"  # not "metrics": KubeRay names Ray's own metrics port so


def router_service(topo: Topology, name: str) -> dict[str, Any] | None:
    """The Kubernetes Service (v1) clients reach the routers through when they run on nodes of their own
    (`server.router_node_labels`): `<name>-routers`, publishing the doors' ports (grpc, and http if set) of
    every router pod that is ready to serve. None when the routers run on the head, behind KubeRay's head
    Service. Not /metrics: a Service would answer for one router at a time; Prometheus scrapes each router
    pod's `pdserve-metrics` port."""
    server = topo.server
    if not server.router_node_labels:
        return None
    doors = [port for port in _router_ports(server) if port["name"] != METRICS_PORT_NAME]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": f"{name}-routers", "labels": {RAYSERVICE_LABEL: name}},
        "spec": {
            "selector": router_pod_labels(name),
            "ports": [
                {"name": p["name"], "port": p["containerPort"], "targetPort": p["name"]} for p in doors
            ],
        },
    }


def router_pod_labels(name: str) -> dict[str, str]:
    """The labels of a RayService's router pods (labelled routers), the same on every RayCluster it runs."""
    return {RAYSERVICE_LABEL: name, ROLE_LABEL: "router"}


def node_groups(topo: Topology) -> list[NodeGroup]:
    """The inventory's node groups, or, without one, a group per pool and one for labelled routers."""
    if topo.nodes is not None:
        return list(topo.nodes)
    groups = _groups_for_pools(topo)
    server = topo.server
    if server.router_node_labels:
        labels = _plain_labels("server.router_node_labels", server.router_node_labels)
        groups.append(
            NodeGroup(name=ROUTER_GROUP, labels=labels, cpus=ROUTER_GROUP_CPUS, count=server.routers)
        )
    return groups


def router_groups(server: ServerConfig, groups: list[NodeGroup]) -> set[str]:
    """The groups whose nodes may run a router: the head, or every group the routers' labels match (the
    topology checks make sure they have `server.routers` nodes)."""
    if not server.router_node_labels:
        return {HEAD_GROUP}
    return {g.name for g in groups if selector_matches(server.router_node_labels, g.labels)}


def _plain_labels(path: str, selector: dict[str, str]) -> dict[str, str]:
    """A label selector as the labels a derived node group starts with: plain values only."""
    for key, value in selector.items():
        if value.startswith("!") or value.startswith("in("):
            raise TopologyError(
                f"{path}.{key}", "export needs a node inventory (nodes) when a selector uses operators"
            )
    return dict(selector)


def _groups_for_pools(topo: Topology) -> list[NodeGroup]:
    groups = []
    for role, pool in topo.pools.items():
        if pool.replicas == 0:
            continue
        labels = _plain_labels(f"pools.{role}.node_labels", pool.node_labels)
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


def head_group(head: NodeGroup, image: str, topo: Topology, name: str, *, router: bool) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "ray-head",
        "image": image,
        "resources": {"requests": _pod_cpu(head.cpus), "limits": _pod_cpu(head.cpus)},
        # KubeRay's head Service publishes these: the dashboard always, the routers' doors when they run here.
        "ports": [
            {"containerPort": 6379, "name": "gcs"},
            {"containerPort": topo.ray.dashboard_port, "name": "dashboard"},
        ],
    }
    pod: dict[str, Any] = {"containers": [container]}
    group: dict[str, Any] = {
        # The head runs Serve's controller, the dashboard and (unless they have nodes of their own)
        # pdserve's routers; no engine (num-gpus 0).
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-gpus": "0"},
        "template": {"spec": pod},
    }
    if head.labels:
        group["labels"] = dict(head.labels)
    _mount_model(pod, container, topo)
    if router:
        # The head's readiness stays KubeRay's (GCS and raylet): KubeRay waits on it to deploy Serve.
        _run_router(group, topo, name, readiness=False)
    return group


def _router_ports(server: ServerConfig) -> list[dict[str, Any]]:
    """The container ports of a pod running a router: the doors and /metrics."""
    ports: list[dict[str, Any]] = [
        {"containerPort": server.grpc_port, "name": "grpc"},
        {"containerPort": server.metrics_port, "name": METRICS_PORT_NAME},
    ]
    if server.http_port:
        ports.append({"containerPort": server.http_port, "name": "http"})
    return ports


def _run_router(group: dict[str, Any], topo: Topology, name: str, *, readiness: bool) -> None:
    """What a pod that runs a router needs, the head's or a router group's: the doors' and /metrics' ports,
    the endpoint's certificate and the clients' token (from Kubernetes Secrets, never from the manifest),
    and, for labelled routers, the labels their Service selects. `readiness`: the pod is ready while its
    router can serve (`_router_readiness`)."""
    server = topo.server
    template = group["template"]
    pod = template["spec"]
    container = pod["containers"][0]
    container.setdefault("ports", []).extend(_router_ports(server))
    tls = server.tls
    if tls is not None:
        files = {tls.cert_file: "tls.crt", tls.key_file: "tls.key"}  # a kubernetes.io/tls Secret's keys
        pod.setdefault("volumes", []).append({"name": "pdserve-tls", "secret": {"secretName": TLS_SECRET}})
        container.setdefault("volumeMounts", []).extend(
            {"name": "pdserve-tls", "mountPath": path, "subPath": key, "readOnly": True}
            for path, key in files.items()
        )
    if server.auth_token_env:
        env = {"secretKeyRef": {"name": TOKEN_SECRET, "key": "token"}}
        container.setdefault("env", []).append({"name": server.auth_token_env, "valueFrom": env})
    if server.router_node_labels:
        group["template"] = {"metadata": {"labels": router_pod_labels(name)}, **template}
    if readiness:
        container["readinessProbe"] = _router_readiness(server)


def _router_readiness(server: ServerConfig) -> dict[str, Any]:
    """A router pod is ready (in its Service) while its router can serve: while its /metrics says
    pdserve_serving 1, as the gRPC health service says SERVING (Kubernetes' own gRPC probe cannot speak
    TLS). It replaces KubeRay's default for a RayService's workers, which waits for a Serve HTTP proxy that
    pdserve never starts (proxy_location Disabled), so the Service would never have an endpoint."""
    host = server.metrics_host
    if host in ("0.0.0.0", "::", "127.0.0.1", "localhost"):
        host = "127.0.0.1"
    # http.client, not urllib: a pod's HTTP_PROXY must not catch a request to its own port.
    check = (
        "import http.client, sys; "
        f"c = http.client.HTTPConnection({host!r}, {server.metrics_port}, timeout=3); "
        "c.request('GET', '/metrics?name[]=pdserve_serving'); "
        "sys.exit(b'\\npdserve_serving 1.0\\n' not in c.getresponse().read())"
    )
    return {
        "exec": {"command": ["python", "-c", check]},
        "periodSeconds": 5,
        "timeoutSeconds": 5,
        "failureThreshold": 2,
    }


def _mount_model(pod: dict[str, Any], container: dict[str, Any], topo: Topology) -> None:
    """A model directory (not a built-in model) comes from a read-only volume mounted at its path in every
    pod: engines load it, the routers' tokenizers read it."""
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


def worker_group(group: NodeGroup, image: str, topo: Topology, name: str, *, router: bool) -> dict[str, Any]:
    requests = _pod_cpu(group.cpus)
    if group.gpus:
        requests["nvidia.com/gpu"] = str(group.gpus)
    requests.update((key, str(n)) for key, n in group.devices.items())
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
    if router:
        _run_router(out, topo, name, readiness=True)
    return out
