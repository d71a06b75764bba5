"""The cluster does not depend on the `pdserve up` that started it: the router is a Serve replica like the
engines, and `pdserve up` only starts and watches. Killed mid-stream (SIGKILL: no teardown), its streams
finish, the endpoint keeps serving, a second `pdserve up` says what runs instead of failing on a port, and
`pdserve status` and `pdserve down` work from another shell, leaving no process behind.

On engine doubles (`model.engine: double`): what is under test is the CLI, Ray and Serve, not the engine."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from e2e_support import PDSERVE, RunningCluster, alive, make_topology

pytestmark = pytest.mark.e2e

MAX_TOKENS = 150  # 3 s at the double's 20 ms a token: the kill lands mid-stream


def test_killing_pdserve_up_stops_nothing_and_down_still_stops_everything(tmp_path: Path) -> None:
    topology = make_topology(tmp_path, model__engine="double")
    cluster = RunningCluster(topology)
    processes: list[psutil.Process] = []
    try:
        cluster.wait_ready()
        processes = cluster.processes()
        command = [PDSERVE, "generate", "--target", cluster.target, "--max-tokens", str(MAX_TOKENS), "--json"]
        streams = [
            subprocess.Popen(
                [*command, f"stream {i}"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=cluster.env,
            )
            for i in range(4)
        ]
        time.sleep(1.0)
        cluster.proc.send_signal(signal.SIGKILL)
        cluster.proc.wait(timeout=10)

        for stream in streams:
            out, err = stream.communicate(timeout=60)
            assert stream.returncode == 0, err
            final = json.loads(out)
            assert final["usage"]["completionTokens"] == MAX_TOKENS
            assert "continued" not in final["servedBy"].get("note", "")  # the stream never moved

        after = cluster.cli("generate", "after", "--target", cluster.target, "--max-tokens", "4", "--json")
        assert after.returncode == 0, after.stderr
        assert json.loads(after.stdout)["usage"]["completionTokens"] == 4

        again = subprocess.run(
            [PDSERVE, "up", "-f", str(topology)], capture_output=True, text=True, timeout=60, env=cluster.env
        )
        assert again.returncode == 2
        assert f"still runs and serves gRPC at {cluster.target}" in again.stderr, again.stderr
        assert "pdserve down" in again.stderr and "Traceback" not in again.stderr

        status = cluster.cli("status", "--json", timeout=60)
        assert status.returncode == 0, status.stderr
        shown = json.loads(status.stdout)
        assert shown["deployments"]["router"] == "HEALTHY"
        assert sorted(r["role"] for r in shown["replicas"]) == ["decode", "prefill", "router"]
    finally:
        down = cluster.cli("down", timeout=300)
    assert down.returncode == 0, down.stderr
    deadline = time.monotonic() + 30
    while alive(processes) and time.monotonic() < deadline:
        time.sleep(1)
    assert alive(processes) == []
    assert cluster.cli("status").returncode != 0  # no cluster is up
