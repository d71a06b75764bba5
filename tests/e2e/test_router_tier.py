"""Several routers as an operator runs them: `pdserve up` with `server.routers: 2` serves both on one port
(the kernel gives each new connection to one of them), each reports to the registry and shows in `pdserve
status`, and `pdserve apply` scales the routers down and up while clients stream, losing no stream: the
router that Serve drains ends its streams or hands them to the SDK, which continues them on the other.

On engine doubles (`model.engine: double`): what is under test is the routers, Ray and Serve, not the engine
(tests/e2e/test_faults.py kills a router on real engines)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import yaml
from e2e_support import RunningCluster, make_topology

from pdserve_client.sdk import Completion, PdserveClient

pytestmark = pytest.mark.e2e

MAX_TOKENS = 400  # 8 s at the double's 20 ms a token: the scale-down lands mid-stream
STREAMS = 6


def answering_router(target: str) -> str:
    """The router a new connection reaches."""
    with PdserveClient(target, timeout=30) as client:
        return next(r.router_id for r in client.routers() if r.answering)


def streams(target: str, n: int) -> tuple[list[threading.Thread], list[Completion | BaseException | None]]:
    """`n` clients, each its own connection, streaming MAX_TOKENS tokens."""
    results: list[Completion | BaseException | None] = [None] * n

    def run(i: int) -> None:
        try:
            with PdserveClient(target, timeout=120) as client:
                results[i] = client.generate_text(
                    prompt=f"stream {i}", max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
                )
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, results


def test_two_routers_share_the_port_and_scaling_them_loses_no_stream(tmp_path: Path) -> None:
    topology = make_topology(tmp_path, model__engine="double", server__routers=2)
    cluster = RunningCluster(topology)
    try:
        cluster.wait_ready()  # `pdserve up` waits until both routers serve
        with PdserveClient(cluster.target, timeout=30) as client:
            routers = client.routers()
        assert len(routers) == 2 and all(r.serving for r in routers)
        assert len({r.metrics_address for r in routers}) == 2  # a metrics port each
        reached = {answering_router(cluster.target) for _ in range(24)}
        assert reached == {r.router_id for r in routers}  # new connections reach both

        status = cluster.cli("status", "--json", timeout=60)
        assert status.returncode == 0, status.stderr
        rows = [r for r in json.loads(status.stdout)["replicas"] if r["role"] == "router"]
        assert sorted(r["replica_id"] for r in rows) == sorted(r.router_id for r in routers)
        assert {r["registry"] for r in rows} == {"serving"}

        # Scale to one router while streams run through both: Serve drains the one it removes.
        threads, results = streams(cluster.target, STREAMS)
        time.sleep(1.0)
        one = yaml.safe_load(topology.read_text())
        one["server"]["routers"] = 1
        smaller = tmp_path / "one-router.yaml"
        smaller.write_text(yaml.safe_dump(one))
        applied = cluster.cli("apply", "-f", str(smaller), timeout=300)
        assert applied.returncode == 0, applied.stderr + applied.stdout
        assert "server.routers: 2 -> 1" in applied.stdout
        for t in threads:
            t.join(timeout=180)
        done = [r for r in results if isinstance(r, Completion)]
        assert len(done) == STREAMS, results
        assert all(len(c.token_ids) == MAX_TOKENS for c in done)
        with PdserveClient(cluster.target, timeout=30) as client:
            assert len(client.routers()) == 1

        # And back to two: the new router takes new connections, nothing fails meanwhile.
        threads, results = streams(cluster.target, STREAMS)
        applied = cluster.cli("apply", "-f", str(topology), timeout=300)
        assert applied.returncode == 0, applied.stderr + applied.stdout
        for t in threads:
            t.join(timeout=180)
        assert all(isinstance(r, Completion) and len(r.token_ids) == MAX_TOKENS for r in results), results
        deadline = time.monotonic() + 60
        while len({answering_router(cluster.target) for _ in range(24)}) < 2:
            assert time.monotonic() < deadline, "the second router takes no connection"
            time.sleep(1)
    finally:
        down = cluster.down()
    assert down.returncode == 0, down.stderr
