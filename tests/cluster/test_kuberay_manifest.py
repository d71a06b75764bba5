"""`pdserve export --format rayservice` output is a RayService the Kubernetes API server and the KubeRay
operator accept: it validates against the RayService CRD's own schema (data/kuberay/, strict: a key the
schema does not know is an error, as `kubectl apply --validate=strict` makes it) and passes the operator's
validation rules that apply to it (KubeRay's ray-operator/controllers/ray/utils/validation.go, restated).
With routers on nodes of their own, a Service (v1) follows it: no schema of it is in the repository, so its
structure is checked here (`service_violations`), and what it selects against the labels KubeRay gives each
group's pods (`pod_labels`, KubeRay's common/pod.go restated)."""

from __future__ import annotations

import copy
import json
import lzma
import re
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest
import yaml

from cluster.serve_config import export_rayservice, export_router_service, render_rayservice
from cluster.topology import Topology, TopologyError, selector_matches
from cluster.topology_file import load_topology, parse_topology
from router.metrics import RouterMetrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SCHEMA_FILE = Path(__file__).parent / "data" / "kuberay" / "rayservice_v1_openapi.json.xz"
_QUALIFIED_NAME = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_PORT_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")  # IANA_SVC_NAME, with at most 15 characters
MAX_RAYSERVICE_NAME = 47  # KubeRay's MaxRayServiceNameLength


def _strict(node: Any) -> Any:
    """The CRD schema, with objects closed to keys it does not name (unless it preserves unknown fields)."""
    if isinstance(node, dict):
        node = {k: _strict(v) for k, v in node.items()}
        if (
            "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
        return node
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


SCHEMA = _strict(json.loads(lzma.decompress(SCHEMA_FILE.read_bytes())))


def kuberay_rule_violations(manifest: dict[str, Any]) -> list[str]:
    """What the KubeRay operator refuses, of the rules a pdserve manifest can break."""
    errors = []
    name = manifest["metadata"]["name"]
    if len(name) > MAX_RAYSERVICE_NAME or not _DNS1035.match(name):
        errors.append(f"name {name!r}: at most {MAX_RAYSERVICE_NAME} characters, a DNS-1035 label")
    cluster = manifest["spec"]["rayClusterConfig"]
    groups = [("Head", cluster["headGroupSpec"])] + [(g["groupName"], g) for g in cluster["workerGroupSpecs"]]
    for group, spec in groups:
        params = spec.get("rayStartParams") or {}
        if "labels" in params:
            errors.append(f"{group}: rayStartParams['labels'] is not supported; use the group's labels")
        for key, value in (spec.get("labels") or {}).items():
            if len(key.split("/")[-1]) > 63 or not _QUALIFIED_NAME.match(key):
                errors.append(f"{group}: invalid label key {key!r}")
            if len(value) > 63 or not _LABEL_VALUE.match(value):
                errors.append(f"{group}: invalid label value {value!r}")
        if any(params.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources")) and spec.get(
            "resources"
        ):
            errors.append(f"{group}: resources set both in rayStartParams and resources")
        if not spec["template"]["spec"].get("containers"):
            errors.append(f"{group}: no container")
        if group != "Head":
            lo, hi = spec.get("minReplicas"), spec.get("maxReplicas")
            if lo is None or hi is None or lo < 0 or hi < 0 or lo > hi:
                errors.append(f"{group}: minReplicas/maxReplicas must be set, non-negative, min <= max")
    return errors


def service_violations(service: dict[str, Any]) -> list[str]:
    """What the API server refuses in a Service (core/v1), of what pdserve's can get wrong."""
    errors = []
    if (service.get("apiVersion"), service.get("kind")) != ("v1", "Service"):
        errors.append("not a v1 Service")
    name = (service.get("metadata") or {}).get("name", "")
    if len(name) > 63 or not _DNS1035.match(name):
        errors.append(f"name {name!r}: a DNS-1035 label")
    spec = service.get("spec") or {}
    errors += [f"spec.{key}: not a field pdserve sets" for key in set(spec) - {"selector", "ports", "type"}]
    selector = spec.get("selector")
    if not isinstance(selector, dict) or not selector:
        errors.append("spec.selector: a Service without one selects no pod")
    for key, value in (selector or {}).items():
        if len(key.split("/")[-1]) > 63 or not _QUALIFIED_NAME.match(key):
            errors.append(f"spec.selector: invalid label key {key!r}")
        if len(value) > 63 or not _LABEL_VALUE.match(value):
            errors.append(f"spec.selector: invalid label value {value!r}")
    ports = spec.get("ports") or []
    if not ports:
        errors.append("spec.ports: none")
    names = [port.get("name") for port in ports]
    if len(ports) > 1 and (None in names or len(set(names)) != len(names)):
        errors.append("spec.ports: several ports need unique names")
    for port in ports:
        unknown = set(port) - {"name", "port", "targetPort", "protocol"}
        errors += [f"spec.ports[{port.get('name')}].{key}: unknown" for key in unknown]
        if "name" in port and not _is_port_name(port["name"]):
            errors.append(f"spec.ports: invalid name {port['name']!r}")
        if not isinstance(port.get("port"), int) or not 1 <= port["port"] <= 65535:
            errors.append(f"spec.ports[{port.get('name')}].port: 1-65535")
        target = port.get("targetPort")
        if not (isinstance(target, int) and 1 <= target <= 65535) and not (
            isinstance(target, str) and _is_port_name(target)
        ):
            errors.append(
                f"spec.ports[{port.get('name')}].targetPort: a port number or a container port's name"
            )
    return errors


def _is_port_name(name: Any) -> bool:
    return (
        isinstance(name, str)
        and len(name) <= 15
        and bool(_PORT_NAME.match(name))
        and "--" not in name
        and any(c.isalpha() for c in name)
    )


def groups_of(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every group of the RayService by name, the head's too ("head")."""
    cluster = manifest["spec"]["rayClusterConfig"]
    return {"head": cluster["headGroupSpec"], **{g["groupName"]: g for g in cluster["workerGroupSpecs"]}}


def pod_labels(manifest: dict[str, Any], group: str) -> dict[str, str]:
    """The Kubernetes labels KubeRay gives the pods of a group (common/pod.go `labelPod`): the pod template's,
    the group's `labels` over them, then its own, of which ray.io/node-type, ray.io/group and ray.io/cluster
    (the RayCluster's generated name) cannot be overridden."""
    spec = groups_of(manifest)[group]
    labels = {**((spec["template"].get("metadata") or {}).get("labels") or {}), **(spec.get("labels") or {})}
    head = group == "head"
    return {
        "ray.io/is-ray-node": "yes",
        "app.kubernetes.io/name": "kuberay",
        "app.kubernetes.io/created-by": "kuberay-operator",
        **labels,
        "ray.io/node-type": "head" if head else "worker",
        "ray.io/group": "headgroup" if head else group,
        "ray.io/cluster": f"{manifest['metadata']['name']}-x7k2q",
    }


def router_deployment(manifest: dict[str, Any]) -> dict[str, Any]:
    (app,) = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"]
    return next(d for d in app["deployments"] if d["name"] == "router")


def the_container(group: dict[str, Any]) -> dict[str, Any]:
    (container,) = group["template"]["spec"]["containers"]
    return container


H200 = load_topology(DEPLOY / "h200-kimi-k2.yaml")


def _routed_topologies() -> dict[str, Topology]:
    """Routers on nodes of their own: the H200 example (an inventory with a router group); the same without
    an inventory (export derives the groups); routers on two groups of an inventory, with the HTTP door."""
    assert H200.nodes is not None and H200.server.router_node_labels
    zones = [g for g in H200.nodes if g.name != "router"] + [
        msgspec.structs.replace(g, name=f"router-{zone}", labels={**g.labels, "zone": zone}, count=1)
        for g in H200.nodes
        if g.name == "router"
        for zone in ("a", "b")
    ]
    return {
        "h200": H200,
        "h200-no-inventory": msgspec.structs.replace(H200, nodes=None),
        "two-router-groups-http": msgspec.structs.replace(
            H200, nodes=zones, server=msgspec.structs.replace(H200.server, http_port=8080)
        ),
    }


ROUTED = _routed_topologies()


def test_both_example_topologies_are_checked() -> None:
    assert {p.name for p in TOPOLOGIES} == {"local.yaml", "h200-kimi-k2.yaml"}


def exported(path: Path) -> dict[str, Any]:
    return export_rayservice(load_topology(path))


# The topology files in deploy/ (not the Ray launcher file, which has a cluster_name).
TOPOLOGIES = [p for p in sorted(DEPLOY.glob("*.yaml")) if "cluster_name" not in yaml.safe_load(p.read_text())]


@pytest.mark.parametrize("path", TOPOLOGIES, ids=lambda p: p.name)
def test_every_deploy_topology_exports_a_rayservice_the_crd_and_the_operator_accept(path: Path) -> None:
    manifest = exported(path)
    jsonschema.validate(manifest, SCHEMA)
    assert kuberay_rule_violations(manifest) == []


def test_the_checks_catch_what_the_api_server_and_the_operator_would_refuse() -> None:
    manifest = exported(DEPLOY / "h200-kimi-k2.yaml")
    typo = copy.deepcopy(manifest)
    typo["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["minReplica"] = 1
    with pytest.raises(jsonschema.ValidationError, match="minReplica"):
        jsonschema.validate(typo, SCHEMA)
    old_labels = copy.deepcopy(manifest)
    old_labels["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["rayStartParams"]["labels"] = "role=decode"
    assert any("rayStartParams['labels']" in e for e in kuberay_rule_violations(old_labels))


def test_worker_groups_carry_the_labels_the_pools_select_as_group_labels() -> None:
    manifest = exported(DEPLOY / "h200-kimi-k2.yaml")
    topo = load_topology(DEPLOY / "h200-kimi-k2.yaml")
    groups = {g["groupName"]: g for g in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    for role, pool in topo.pools.items():
        assert any(
            all(g.get("labels", {}).get(k) == v for k, v in pool.node_labels.items()) for g in groups.values()
        ), role


def test_pods_ask_for_less_cpu_than_their_node_has() -> None:
    # A pod requesting every vCPU of its node never schedules: the kubelet and daemons reserve some.
    topo = load_topology(DEPLOY / "h200-kimi-k2.yaml")
    assert topo.nodes is not None
    node_cpus = {g.name: g.cpus for g in topo.nodes}
    cluster = exported(DEPLOY / "h200-kimi-k2.yaml")["spec"]["rayClusterConfig"]
    for group in [{"groupName": "head", **cluster["headGroupSpec"]}, *cluster["workerGroupSpecs"]]:
        (container,) = group["template"]["spec"]["containers"]
        cpu = float(container["resources"]["requests"]["cpu"])
        assert 0 < cpu < node_cpus[group["groupName"]], group["groupName"]
        assert container["resources"]["limits"]["cpu"] == container["resources"]["requests"]["cpu"]


def test_replicas_sharing_gpus_share_pods_with_one_gpu_each() -> None:
    # No inventory: each pool gets pods of one GPU, as many replicas on each as fit its GPU.
    topo = parse_topology(
        "model: {block_size: 16}\nray: {address: auto}\n"
        "pools: {prefill: {replicas: 3, gpus_per_replica: 0.5}, decode: {gpus_per_replica: 0.25}}"
    )
    manifest = export_rayservice(topo)
    jsonschema.validate(manifest, SCHEMA)
    assert kuberay_rule_violations(manifest) == []
    groups = {g["groupName"]: g for g in manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert {name: g["replicas"] for name, g in groups.items()} == {"prefill": 2, "decode": 1}
    for group in groups.values():
        (container,) = group["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_engines_in_an_exported_cluster_bind_their_pod_address_not_loopback() -> None:
    # deploy/local.yaml starts a local head (ray.address null): its engines bind 127.0.0.1. In a RayService
    # every engine is in its own pod, so the export's engines bind the pod's address.
    manifest = export_rayservice(parse_topology("{}"))
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    for deployment in serve_config["applications"][0]["deployments"]:
        env = (deployment.get("ray_actor_options") or {}).get("runtime_env", {}).get("env_vars", {})
        if "PDSERVE_ENGINE_SPEC" in env:
            assert json.loads(env["PDSERVE_ENGINE_SPEC"])["bind_host"] is None, deployment["name"]


@pytest.mark.parametrize("topo", ROUTED.values(), ids=ROUTED.keys())
def test_the_routers_certificate_and_token_come_from_secrets_and_the_model_from_a_volume(
    topo: Topology,
) -> None:
    tls = topo.server.tls
    assert tls is not None and topo.server.auth_token_env
    manifest = export_rayservice(topo)
    selector = router_deployment(manifest)["ray_actor_options"]["label_selector"]
    groups = groups_of(manifest)
    routers = [name for name, g in groups.items() if selector_matches(selector, g.get("labels") or {})]
    assert routers and "head" not in routers
    for name in routers:
        pod = groups[name]["template"]["spec"]
        container = the_container(groups[name])
        secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        for path in (tls.cert_file, tls.key_file):
            assert secrets[mounts[path]["name"]] == "pdserve-tls" and mounts[path]["readOnly"]
        (token,) = [e for e in container["env"] if e["name"] == topo.server.auth_token_env]
        assert token["valueFrom"]["secretKeyRef"] == {"name": "pdserve-auth", "key": "token"}
        assert "value" not in token
    # No other pod holds the endpoint's key or the clients' token: the head runs no router here.
    for name in set(groups) - set(routers):
        container = the_container(groups[name])
        assert tls.key_file not in {m["mountPath"] for m in container.get("volumeMounts", [])}, name
        assert "env" not in container, name
    # Every pod (engines load the model, the routers' tokenizers read it) mounts the model read-only.
    for group in groups.values():
        spec = group["template"]["spec"]
        claims = {
            v["name"]: v["persistentVolumeClaim"] for v in spec["volumes"] if "persistentVolumeClaim" in v
        }
        (model,) = [m for m in the_container(group)["volumeMounts"] if m["mountPath"] == topo.model.source]
        assert claims[model["name"]] == {"claimName": "pdserve-model", "readOnly": True}


def test_gpu_pods_ask_for_the_rdma_devices_the_inventory_names() -> None:
    topo = load_topology(DEPLOY / "h200-kimi-k2.yaml")
    assert topo.nodes is not None
    devices = {g.name: g.devices for g in topo.nodes}
    for group in exported(DEPLOY / "h200-kimi-k2.yaml")["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        for name, count in devices[group["groupName"]].items():
            assert (
                container["resources"]["requests"][name]
                == container["resources"]["limits"][name]
                == str(count)
            )
    assert all(devices[g.name] for g in topo.nodes if g.gpus) and not any(
        devices[g.name] for g in topo.nodes if not g.gpus
    )


def test_without_router_labels_the_routers_run_on_the_head_behind_its_service() -> None:
    # The H200 example with its routers on the head: both share the head's ports, and KubeRay's head Service
    # publishes the head container's ports, the routers' gRPC port among them.
    assert H200.nodes is not None
    topo = msgspec.structs.replace(
        H200,
        server=msgspec.structs.replace(H200.server, router_node_labels={}),
        nodes=[g for g in H200.nodes if g.name != "router"],
    )
    manifest = export_rayservice(topo)
    jsonschema.validate(manifest, SCHEMA)
    assert kuberay_rule_violations(manifest) == []
    (app,) = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"]
    router = {d["name"]: d for d in app["deployments"]}["router"]
    assert app["args"]["router"] is True  # the application's ingress is its router
    assert router["num_replicas"] == 2
    assert router["ray_actor_options"]["resources"] == {"node:__internal_head__": 0.001}
    registry = {d["name"]: d for d in app["deployments"]}["registry"]
    server = registry["user_config"]["topology"]["server"]
    assert (server["grpc_host"], server["grpc_port"]) == ("0.0.0.0", topo.server.grpc_port)
    head = the_container(manifest["spec"]["rayClusterConfig"]["headGroupSpec"])
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert ports["grpc"] == topo.server.grpc_port
    assert ports["pdserve-metrics"] == topo.server.metrics_port
    assert "metrics" not in ports  # KubeRay's name for Ray's own metrics port
    assert "readinessProbe" not in head  # KubeRay's own: it waits for the head before it deploys Serve
    tls = topo.server.tls
    assert tls is not None and tls.cert_file in {m["mountPath"] for m in head["volumeMounts"]}
    # No Service of pdserve's: a single document, and its header says where clients connect.
    assert export_router_service(topo) is None
    text = render_rayservice(topo, source="deploy/h200-kimi-k2.yaml")
    assert list(yaml.safe_load_all(text)) == [manifest]
    assert (
        "through the head's Service (pdserve-head-svc, port `grpc`). Its 2 routers share the head's ports"
        in (" ".join(line.removeprefix("# ") for line in text.splitlines() if line.startswith("#")))
    )
    # Ray's token auth is on, as on every cluster pdserve starts; KubeRay makes and hands out the token.
    assert manifest["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token"}


@pytest.mark.parametrize("topo", ROUTED.values(), ids=ROUTED.keys())
def test_labelled_routers_export_a_rayservice_and_a_service_the_api_server_and_the_operator_accept(
    topo: Topology,
) -> None:
    manifest = export_rayservice(topo)
    jsonschema.validate(manifest, SCHEMA)
    assert kuberay_rule_violations(manifest) == []
    service = export_router_service(topo)
    assert service is not None and service_violations(service) == []
    assert service["metadata"]["name"] == "pdserve-routers"
    # The labels the Service selects are valid pod labels too.
    for group in groups_of(manifest).values():
        for key, value in ((group["template"].get("metadata") or {}).get("labels") or {}).items():
            assert len(key.split("/")[-1]) <= 63 and _QUALIFIED_NAME.match(key), key
            assert len(value) <= 63 and _LABEL_VALUE.match(value), value


@pytest.mark.parametrize("topo", ROUTED.values(), ids=ROUTED.keys())
def test_the_routers_service_selects_the_pods_of_the_groups_the_routers_run_on_and_no_other(
    topo: Topology,
) -> None:
    manifest = export_rayservice(topo)
    service = export_router_service(topo)
    assert service is not None
    router = router_deployment(manifest)
    groups = groups_of(manifest)
    # Where Serve places the routers: nodes started with labels (the group's) the label selector matches.
    selector = router["ray_actor_options"]["label_selector"]
    assert selector == topo.server.router_node_labels
    hosts = {name for name, g in groups.items() if selector_matches(selector, g.get("labels") or {})}
    selected = {
        name
        for name in groups
        if all(pod_labels(manifest, name).get(k) == v for k, v in service["spec"]["selector"].items())
    }
    assert selected == hosts and "head" not in selected
    # No engine pod: no GPU among them.
    assert not any(
        "nvidia.com/gpu" in the_container(groups[name])["resources"]["limits"] for name in selected
    )
    # Its selector does not depend on the RayCluster's generated name, which an upgrade replaces.
    assert not any(key.startswith("ray.io/") for key in service["spec"]["selector"])
    # One router per node, as many as asked, on nodes enough for them.
    assert router["num_replicas"] == topo.server.routers and router["max_replicas_per_node"] == 1
    assert sum(groups[name]["replicas"] for name in hosts) >= topo.server.routers
    if topo.nodes is None:
        assert {name: groups[name]["replicas"] for name in hosts} == {"routers": topo.server.routers}
        assert the_container(groups["routers"])["resources"]["limits"] == {"cpu": "14"}  # 16 vCPUs, no GPU


@pytest.mark.parametrize("topo", ROUTED.values(), ids=ROUTED.keys())
def test_the_routers_service_publishes_the_router_containers_doors_and_the_head_does_not(
    topo: Topology,
) -> None:
    manifest = export_rayservice(topo)
    service = export_router_service(topo)
    assert service is not None
    groups = groups_of(manifest)
    selector = router_deployment(manifest)["ray_actor_options"]["label_selector"]
    doors = {"grpc": topo.server.grpc_port} | (
        {"http": topo.server.http_port} if topo.server.http_port else {}
    )
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == doors
    for name, group in groups.items():
        ports = {p["name"]: p["containerPort"] for p in the_container(group).get("ports", [])}
        if selector_matches(selector, group.get("labels") or {}):
            for port in service["spec"]["ports"]:
                assert ports[port["targetPort"]] == port["port"], (name, port)
            # /metrics is scraped per pod, not through the Service.
            assert ports["pdserve-metrics"] == topo.server.metrics_port
        else:
            # The head's Service publishes the head container's ports: no router, so no door there.
            assert not set(ports) & {"grpc", "http", "pdserve-metrics"}, name


def test_the_export_writes_the_rayservice_then_the_routers_service_and_says_how_clients_reach_them() -> None:
    text = render_rayservice(H200, source="deploy/h200-kimi-k2.yaml")
    assert list(yaml.safe_load_all(text)) == [export_rayservice(H200), export_router_service(H200)]
    assert "\n---\n" in text
    header = " ".join(line.removeprefix("# ") for line in text.splitlines() if line.startswith("#"))
    assert "Clients reach them through the Service pdserve-routers (port `grpc`)" in header
    assert "pdserve.io/rayservice=pdserve,pdserve.io/role=router" in header


def test_a_router_pod_is_ready_while_its_router_can_serve(tmp_path: Path) -> None:
    """The readiness probe, run as the kubelet runs it, against a router's own /metrics server: without a
    ready router pod the Service has no endpoint, and KubeRay's default probe for RayService workers waits for
    a Serve HTTP proxy that pdserve never starts."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    topo = msgspec.structs.replace(H200, server=msgspec.structs.replace(H200.server, metrics_port=port))
    groups = groups_of(export_rayservice(topo))
    probe = the_container(groups["router"])["readinessProbe"]
    command = probe["exec"]["command"]
    assert command[0] == "python"  # the image's PATH starts with pdserve's venv

    def ready() -> bool:
        run = subprocess.run(
            [sys.executable, *command[1:]], capture_output=True, timeout=probe["timeoutSeconds"]
        )
        return run.returncode == 0

    assert not ready()  # no router listens yet
    metrics = RouterMetrics()
    metrics.serve("0.0.0.0", port)
    assert not ready()  # listening, but no decode replica can serve
    metrics.serving.set(1)
    assert ready()
    metrics.serving.set(0)
    assert not ready()


def test_the_service_checks_catch_what_the_api_server_would_refuse() -> None:
    service = export_router_service(H200)
    assert service is not None
    bad = copy.deepcopy(service)
    bad["spec"]["ports"][0]["targetPort"] = "pdserve-grpc-door"  # over 15 characters
    bad["spec"]["selector"] = {}
    bad["metadata"]["name"] = "Pdserve_routers"
    assert len(service_violations(bad)) == 3


def test_labelled_routers_without_an_inventory_need_plain_label_values() -> None:
    # Export starts the derived router group's nodes with the selector's labels: an operator names none.
    topo = msgspec.structs.replace(
        H200,
        nodes=None,
        server=msgspec.structs.replace(H200.server, router_node_labels={"role": "in(router,edge)"}),
    )
    with pytest.raises(TopologyError) as info:
        export_rayservice(topo)
    assert info.value.path == "server.router_node_labels.role"
