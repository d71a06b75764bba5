"""`pdserve up` as a user runs it: comes up, answers `pdserve generate` and `pdserve status`, and after
`pdserve down` leaves no Ray or vLLM process (nor leaked shared memory) behind."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from e2e_support import PDSERVE, RunningCluster, alive, make_topology

pytestmark = pytest.mark.e2e


def test_up_generate_status_down_leaves_nothing_behind(tmp_path: Path) -> None:
    shm_before = set(Path("/dev/shm").glob("psm_*"))
    cluster = RunningCluster(make_topology(tmp_path))
    try:
        started = time.monotonic()
        cluster.wait_ready()
        print(f"pdserve up: ready in {time.monotonic() - started:.1f} s")
        processes = cluster.processes()
        names = " ".join(" ".join(p.cmdline()) for p in processes)
        assert "gcs_server" in names and "raylet" in names
        assert len(processes) >= 6  # pdserve up, Ray daemons, replica actors, engine cores

        gen = subprocess.run(
            [PDSERVE, "generate", "Tell me about KV caches.", "--max-tokens", "8", "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert gen.returncode == 0, gen.stderr
        final = json.loads(gen.stdout)
        assert final["usage"]["completionTokens"] == 8
        # A 7-token prompt: the router may prefill it on the decode replica rather than move its KV.
        assert final["servedBy"]["path"] in ("SERVING_PATH_DISAGGREGATED", "SERVING_PATH_LOCAL_PREFILL")
        assert final["servedBy"]["decodeReplica"]

        status = subprocess.run([PDSERVE, "status", "--json"], capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        assert sorted(r["role"] for r in json.loads(status.stdout)["replicas"]) == ["decode", "prefill"]
    finally:
        down = cluster.down()
    assert down.returncode == 0, down.stderr
    assert cluster.proc.returncode == 0, "".join(cluster.log[-40:])
    deadline = time.monotonic() + 30
    while alive(processes) and time.monotonic() < deadline:
        time.sleep(1)
    assert alive(processes) == []
    assert set(Path("/dev/shm").glob("psm_*")) <= shm_before, "engine shared memory leaked"


def test_down_without_a_cluster_says_so() -> None:
    result = subprocess.run([PDSERVE, "down"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "no cluster is up" in result.stdout
