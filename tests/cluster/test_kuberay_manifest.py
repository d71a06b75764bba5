"""`pdserve export --format rayservice` output is a RayService the Kubernetes API server and the KubeRay
operator accept: it validates against the RayService CRD's own schema (data/kuberay/, strict: a key the
schema does not know is an error, as `kubectl apply --validate=strict` makes it) and passes the operator's
validation rules that apply to it (KubeRay's ray-operator/controllers/ray/utils/validation.go, restated)."""

from __future__ import annotations

import copy
import json
import lzma
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from cluster.serve_config import export_rayservice
from cluster.topology_file import load_topology, parse_topology

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SCHEMA_FILE = Path(__file__).parent / "data" / "kuberay" / "rayservice_v1_openapi.json.xz"
_QUALIFIED_NAME = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
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


def test_the_endpoints_certificate_and_token_come_from_secrets_and_the_model_from_a_volume() -> None:
    topo = load_topology(DEPLOY / "h200-kimi-k2.yaml")
    assert topo.server.tls is not None and topo.server.auth_token_env
    cluster = exported(DEPLOY / "h200-kimi-k2.yaml")["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]["template"]["spec"]
    (container,) = head["containers"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in head["volumes"] if "secret" in v}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    for path in (topo.server.tls.cert_file, topo.server.tls.key_file):
        assert secrets[mounts[path]["name"]] == "pdserve-tls" and mounts[path]["readOnly"]
    (token,) = [e for e in container["env"] if e["name"] == topo.server.auth_token_env]
    assert token["valueFrom"]["secretKeyRef"] == {"name": "pdserve-auth", "key": "token"}
    assert "value" not in token
    # Every pod (engines load the model, the head's tokenizer reads it) mounts the model read-only.
    for spec in [head, *(g["template"]["spec"] for g in cluster["workerGroupSpecs"])]:
        (pod_container,) = spec["containers"]
        claims = {
            v["name"]: v["persistentVolumeClaim"] for v in spec["volumes"] if "persistentVolumeClaim" in v
        }
        (model,) = [m for m in pod_container["volumeMounts"] if m["mountPath"] == topo.model.source]
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
    assert all(devices[g] for g in devices if g != "head")


def test_the_h200_export_is_a_whole_cluster_its_router_on_the_head_behind_the_grpc_port() -> None:
    topo = load_topology(DEPLOY / "h200-kimi-k2.yaml")
    manifest = exported(DEPLOY / "h200-kimi-k2.yaml")
    (app,) = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"]
    router = {d["name"]: d for d in app["deployments"]}["router"]
    assert app["args"]["router"] is True  # the application's ingress is its router
    assert router["ray_actor_options"]["resources"] == {"node:__internal_head__": 0.001}
    registry = {d["name"]: d for d in app["deployments"]}["registry"]
    server = registry["user_config"]["topology"]["server"]
    assert (server["grpc_host"], server["grpc_port"]) == ("0.0.0.0", topo.server.grpc_port)
    # KubeRay's head Service publishes the head container's ports: the router's gRPC port among them.
    (head,) = manifest["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert ports["grpc"] == topo.server.grpc_port
    assert ports["pdserve-metrics"] == topo.server.metrics_port
    assert "metrics" not in ports  # KubeRay's name for Ray's own metrics port
    # Ray's token auth is on, as on every cluster pdserve starts; KubeRay makes and hands out the token.
    assert manifest["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token"}
