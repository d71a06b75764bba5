"""A cluster nobody ran `pdserve up` on, as KubeRay or an operator's own scripts make one: a plain `ray start
--head`, then `serve deploy` of what `pdserve export` writes. The application serves its own router (a Serve
deployment on the head), and the CLI reaches the cluster only through `--address`, the Ray dashboard: status,
apply and down. Real Ray, Serve, vLLM engines on CPU and NIXL; the Ray token is one the operator chose."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_support import PDSERVE, UP_TIMEOUT_S, make_topology
from ports import free_port

from cluster.bootstrap import stop_local_ray

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

RAY = str(Path(sys.executable).with_name("ray"))
SERVE = str(Path(sys.executable).with_name("serve"))


class PlainCluster:
    def __init__(self, tmp_path: Path) -> None:
        self.topology = make_topology(tmp_path)
        topo = yaml.safe_load(self.topology.read_text())
        self.target = f"127.0.0.1:{topo['server']['grpc_port']}"
        self.dashboard_port = topo["ray"]["dashboard_port"]
        self.address = f"http://127.0.0.1:{self.dashboard_port}"
        self.gcs = f"127.0.0.1:{free_port()}"
        # The operator's token, in the environment of Ray and of every command that talks to it.
        self.env = {
            **os.environ,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(32),
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # a one-machine cluster on loopback
        }
        self.tmp = tmp_path

    def run(self, *cmd: str, env: dict[str, str] | None = None, timeout: float = 180) -> Any:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or self.env)

    def pdserve(self, *args: str, env: dict[str, str] | None = None, timeout: float = 180) -> Any:
        return self.run(PDSERVE, *args, env=env, timeout=timeout)

    def start(self) -> None:
        started = self.run(
            RAY,
            "start",
            "--head",
            "--node-ip-address=127.0.0.1",
            f"--port={self.gcs.rsplit(':', 1)[1]}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dashboard_port}",
            f"--ray-client-server-port={free_port()}",
            "--num-cpus=2",
            "--disable-usage-stats",
        )
        assert started.returncode == 0, started.stderr[-2000:]

    def deploy_export(self) -> dict[str, Any]:
        exported = self.pdserve("export", "-f", str(self.topology))
        assert exported.returncode == 0, exported.stderr
        config_file = self.tmp / "serve.yaml"
        config_file.write_text(exported.stdout)
        deployed = self.run(SERVE, "deploy", str(config_file), "--address", self.address)
        assert deployed.returncode == 0, deployed.stderr[-2000:]
        config: dict[str, Any] = yaml.safe_load(exported.stdout)
        return config

    def status(self, env: dict[str, str] | None = None) -> Any:
        return self.pdserve("status", "--address", self.address, "--json", env=env)

    def stop(self) -> None:
        stop_local_ray(self.gcs)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlainCluster]:
    cluster = PlainCluster(tmp_path_factory.mktemp("plain"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def serving(plain: PlainCluster) -> dict[str, Any]:
    """Wait until every engine replica is RUNNING and ready in the registry, and the router serves, as status
    reports them."""
    deadline = time.monotonic() + UP_TIMEOUT_S
    last: Any = None
    while time.monotonic() < deadline:
        last = plain.status()
        if last.returncode == 0:
            status = json.loads(last.stdout)
            engines = [r for r in status["replicas"] if r["role"] != "router"]
            routers = [r for r in status["replicas"] if r["role"] == "router"]
            ready = all(r["state"] == "RUNNING" and r["registry"] == "ready" for r in engines)
            serving = [r["registry"] for r in routers] == ["serving"]
            if status["app_status"] == "RUNNING" and len(engines) == 2 and ready and serving:
                return dict(status)
        time.sleep(3)
    raise AssertionError(f"not serving after {UP_TIMEOUT_S} s: {last.stdout[-1500:]} {last.stderr[-1500:]}")


def test_an_exported_application_serves_and_the_cli_runs_it_through_the_dashboard(
    plain: PlainCluster,
) -> None:
    config = plain.deploy_export()
    (app,) = config["applications"]
    assert "router" in {d["name"] for d in app["deployments"]}  # the export carries its own front end

    status = serving(plain)
    assert status["registry_unread"] == ""  # read through the router's endpoint
    assert sorted(r["role"] for r in status["replicas"]) == ["decode", "prefill", "router"]

    # A request through the router the application runs (no `pdserve up` anywhere).
    answer = plain.pdserve(
        "generate", "The plain cluster", "--target", plain.target, "--max-tokens", "8", "--json"
    )
    assert answer.returncode == 0, answer.stderr
    final = json.loads(answer.stdout)
    assert int(final["usage"]["completionTokens"]) == 8
    assert final["servedBy"]["decodeReplica"]

    # The table says where the registry was read from when it cannot be.
    elsewhere = plain.pdserve("status", "--address", plain.address, "--target", f"127.0.0.1:{free_port()}")
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert "readiness and load not shown: the router at" in elsewhere.stdout

    # A routing setting, applied in place through the dashboard: the application keeps its router.
    topo = yaml.safe_load(plain.topology.read_text())
    before = topo["router"]["local_prefill_max_tokens"]
    topo["router"]["local_prefill_max_tokens"] = before // 2
    changed = plain.tmp / "changed.yaml"
    changed.write_text(yaml.safe_dump(topo))
    applied = plain.pdserve("apply", "-f", str(changed), "--address", plain.address, timeout=300)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert f"router.local_prefill_max_tokens: {before} -> {before // 2}" in applied.stdout
    details = plain.run(SERVE, "status", "--address", plain.address)
    assert details.returncode == 0 and "router:" in details.stdout, details.stdout
    again = plain.pdserve("generate", "After apply", "--target", plain.target, "--max-tokens", "4", "--json")
    assert again.returncode == 0, again.stderr

    # Another cluster's token is refused, in one line.
    wrong = {**plain.env, "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    refused = plain.status(env=wrong)
    assert refused.returncode == 2
    assert "refused this machine's Ray auth token" in refused.stderr and "Traceback" not in refused.stderr

    # Down removes pdserve and leaves the operator's Ray running.
    down = plain.pdserve("down", "--address", plain.address, timeout=300)
    assert down.returncode == 0, down.stderr
    assert "removed" in down.stdout
    gone = plain.status()
    assert json.loads(gone.stdout)["app_status"] is None
    assert plain.run(RAY, "status", f"--address={plain.gcs}").returncode == 0
