"""Every file in deploy/ is valid for the tool that reads it, and the files agree with each other."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.serve.schema import ServeDeploySchema

from cluster.serve_config import compile_serve_config, render_rayservice
from cluster.topology import Topology, selector_matches
from cluster.topology_file import load_topology
from router.config import RouterConfig

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def kind_of(document: dict[str, Any]) -> str:
    if document.get("kind") == "RayService":
        return "rayservice"
    if "cluster_name" in document:
        return "launcher"
    return "topology"  # anything else must parse as a topology (an unknown kind fails there)


def deploy_files(kind: str) -> list[Path]:
    """The files of a kind, by their first YAML document (an exported RayService may have its routers'
    Service after it)."""
    return [p for p in sorted(DEPLOY.rglob("*.yaml")) if kind_of(first_document(p)) == kind]


def first_document(path: Path) -> dict[str, Any]:
    return next(yaml.safe_load_all(path.read_text()), None) or {}


TOPOLOGIES = deploy_files("topology")
LAUNCHERS = deploy_files("launcher")
RAYSERVICES = deploy_files("rayservice")


def name(p: Path) -> str:
    return str(p.relative_to(DEPLOY))


def test_deploy_has_each_kind_of_file() -> None:
    assert {name(p) for p in TOPOLOGIES} >= {"local.yaml", "h200-kimi-k2.yaml"}
    assert LAUNCHERS and RAYSERVICES


@pytest.mark.parametrize("path", TOPOLOGIES, ids=name)
def test_topology_validates_and_compiles(path: Path) -> None:
    topo = load_topology(path)
    ServeDeploySchema.model_validate(compile_serve_config(topo))


@pytest.mark.parametrize("path", sorted(DEPLOY.rglob("*.yaml")), ids=name)
def test_every_file_is_documented(path: Path) -> None:
    assert path.read_text().startswith("#"), f"{name(path)} should open with a comment saying what it is"


def test_the_h200_example_routes_with_the_defaults_the_replay_evaluates() -> None:
    # The trace replay evaluates the router's defaults; the H200 example deploys them, costed for its model.
    h200 = load_topology(DEPLOY / "h200-kimi-k2.yaml")
    assert msgspec.structs.replace(
        h200.router, service_time=RouterConfig().service_time
    ) == msgspec.structs.replace(RouterConfig(), overload_queue_tokens=h200.router.overload_queue_tokens)
    assert h200.router.service_time.model.num_experts == 384  # Kimi-K2's shape, not DeepSeek-V3's
    # Local prefills are costed as chunked the way its decode engines chunk them.
    assert h200.router.service_time.decode_chunk_tokens == h200.pools.decode.engine.max_num_batched_tokens


def test_local_topology_is_the_defaults_written_out() -> None:
    local = load_topology(DEPLOY / "local.yaml")
    defaults = Topology()
    assert local.model == defaults.model
    assert local.server == defaults.server
    # The tiny model's 2048-token context: a smaller local-prefill threshold than the H200 default.
    assert local.router == msgspec.structs.replace(defaults.router, local_prefill_max_tokens=256)
    for (_, pool), (_, default) in zip(local.pools.items(), defaults.pools.items(), strict=True):
        assert (pool.replicas, pool.gpus_per_replica, pool.cpu_engine) == (
            default.replicas,
            default.gpus_per_replica,
            default.cpu_engine,
        )


def test_h200_example_spans_two_nodes_on_differently_labelled_pools() -> None:
    topo = load_topology(DEPLOY / "h200-kimi-k2.yaml")
    prefill, decode = topo.pools.prefill, topo.pools.decode
    assert decode.nodes_per_replica == 2 and decode.gpus_per_replica == 16
    assert prefill.node_labels != decode.node_labels
    assert topo.nodes is not None
    for _, pool in topo.pools.items():
        matching = [g for g in topo.nodes if selector_matches(pool.node_labels, g.labels)]
        assert matching and all(g.gpus == 8 for g in matching)
    # No node group serves both pools.
    assert not [
        g
        for g in topo.nodes
        if selector_matches(prefill.node_labels, g.labels) and selector_matches(decode.node_labels, g.labels)
    ]


@pytest.mark.parametrize("path", LAUNCHERS, ids=name)
def test_launcher_config_is_valid_for_ray_up(path: Path) -> None:
    validate_config(prepare_config(yaml.safe_load(path.read_text())))


def test_launcher_starts_the_h200_inventory_with_its_labels() -> None:
    launcher = yaml.safe_load((DEPLOY / "ray-cluster-h200.yaml").read_text())
    topo = load_topology(DEPLOY / "h200-kimi-k2.yaml")
    assert topo.nodes is not None
    node_types = launcher["available_node_types"]
    for group in topo.nodes:
        node_type = node_types[group.name]
        assert node_type["labels"] == group.labels
        assert node_type["resources"] == {"CPU": group.cpus, "GPU": group.gpus}
        if group.name == launcher["head_node_type"]:
            assert any(
                f"--labels={_ray_labels(group.labels)}" in c for c in launcher["head_start_ray_commands"]
            )
        else:
            assert node_type["min_workers"] == node_type["max_workers"] == group.count


def test_launcher_gives_gpu_and_rdma_devices_to_the_gpu_workers_only() -> None:
    # `--gpus all` or `--device /dev/infiniband` on a CPU node (the head, the routers') stops its container
    # from starting.
    launcher = yaml.safe_load((DEPLOY / "ray-cluster-h200.yaml").read_text())
    docker = launcher["docker"]
    everywhere = " ".join(docker.get("run_options", []) + docker.get("head_run_options", []))
    assert "--gpus" not in everywhere and "/dev/infiniband" not in everywhere
    for name, node_type in launcher["available_node_types"].items():
        if name == launcher["head_node_type"]:
            continue
        # What the launcher runs a worker with: a node type's own docker settings replace the top-level ones.
        workers = " ".join({**docker, **node_type.get("docker", {})}.get("worker_run_options", []))
        gpu = node_type["resources"]["GPU"] > 0
        assert ("--gpus all" in workers and "--device /dev/infiniband" in workers) == gpu, name
        assert gpu or ("--gpus" not in workers and "/dev/infiniband" not in workers), name


def test_h200_example_runs_its_routers_on_cpu_nodes_of_their_own() -> None:
    topo = load_topology(DEPLOY / "h200-kimi-k2.yaml")
    server = topo.server
    assert server.routers >= 2 and server.router_node_labels and topo.nodes is not None
    hosts = [g for g in topo.nodes if selector_matches(server.router_node_labels, g.labels)]
    assert sum(g.count for g in hosts) == server.routers
    assert all(g.gpus == 0 and g.name != "head" for g in hosts)
    # No engine is placed on a router node.
    for _, pool in topo.pools.items():
        assert not [g for g in hosts if selector_matches(pool.node_labels, g.labels)]


def _ray_labels(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


@pytest.mark.parametrize("path", RAYSERVICES, ids=name)
def test_rayservice_manifest_is_current(path: Path) -> None:
    match = re.match(r"# Generated from (\S+) by `pdserve export`", path.read_text())
    assert match, f"{name(path)} does not say which topology it was generated from"
    source = match[1]
    expected = render_rayservice(load_topology(ROOT / source), source=source)
    assert path.read_text() == expected, (
        f'{name(path)} is stale; regenerate: .venv/bin/python -c "from cluster.serve_config import '
        f"render_rayservice; from cluster.topology_file import load_topology; print(render_rayservice("
        f"load_topology('{source}'), source='{source}'), end='')\" > deploy/{name(path)}"
    )


DOCKERFILES = {"cuda": DEPLOY / "docker" / "Dockerfile.cuda", "cpu": DEPLOY / "docker" / "Dockerfile.cpu"}


def test_the_images_are_built_by_the_projects_own_install_and_named_as_exports_name_them() -> None:
    import tomllib

    from cluster.serve_config import DEFAULT_IMAGE

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert f"pdserve:{version}" == DEFAULT_IMAGE
    for kind, path in DOCKERFILES.items():
        text = path.read_text()
        assert re.search(r"^FROM python:3\.11-", text, re.M), kind  # the Python the project pins
        install = "scripts/install.sh gpu" if kind == "cuda" else "scripts/install.sh"
        assert re.search(rf"^RUN {re.escape(install)}$", text, re.M), kind
        # KubeRay and the launcher run `ray start` and `pdserve` in the container: the venv is on PATH.
        assert re.search(r"^ENV PATH=/opt/pdserve/\.venv/bin:\$PATH", text, re.M), kind
        tag = DEFAULT_IMAGE if kind == "cuda" else f"{DEFAULT_IMAGE}-cpu"
        assert f"docker build -f deploy/docker/{path.name} -t {tag} ." in text, kind
    (launcher,) = LAUNCHERS
    assert yaml.safe_load(launcher.read_text())["docker"]["image"] == DEFAULT_IMAGE
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored  # the build context never carries the host's venv


def test_the_install_script_knows_the_gpu_extra_and_refuses_an_unknown_one() -> None:
    import subprocess
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    engine_pin = {e.split("==")[1] for e in extras["gpu"] + extras["cpu"] if e.startswith("vllm")}
    assert len(engine_pin) == 1  # the CPU and GPU images run the same vLLM release
    wrong = subprocess.run(
        ["bash", str(ROOT / "scripts" / "install.sh"), "cuda"], capture_output=True, text=True
    )
    assert wrong.returncode == 2 and "usage: scripts/install.sh [test|gpu]" in wrong.stderr
