"""pdserve as a new user meets it: a copy of the repository with nothing beside it (no `shared/`), an empty
HOME (no `~/.ray`, no auth token, no built model, no caches) and none of the test session's settings. From
there `pdserve up` comes up, answers `pdserve generate` and `pdserve status`, and after `pdserve down` leaves
no Ray or vLLM process (nor leaked shared memory) behind; `pdserve bench` replays agent sessions and
`pdserve replay` runs on the traces the repository carries.

What this does not redo is the install: it runs the copy's code with this machine's virtual environment
(PYTHONPATH puts the copy first). CI installs from a clean clone with the README's own command."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from e2e_support import PDSERVE, REPO, RunningCluster, alive, make_topology

pytestmark = pytest.mark.e2e

LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")
# Settings of this machine's platform, not of pdserve or of the test session: a user has them too.
_PLATFORM_ENV = ("PATH", "LANG", "LC_ALL", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "TMPDIR")


def copy_of_repository(dest: Path) -> Path:
    """The files a clone has (tracked, and new files not ignored), without the virtual environment."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture
def fresh(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    repo = copy_of_repository(tmp_path / "alone" / "pdserve")
    home = tmp_path / "home"
    home.mkdir()
    env = {k: os.environ[k] for k in _PLATFORM_ENV if k in os.environ}
    env |= {"HOME": str(home), "PYTHONPATH": str(repo)}
    assert list((repo.parent).iterdir()) == [repo]  # nothing beside it: no shared/
    return repo, env


def test_a_fresh_machine_starts_serves_and_stops_a_cluster(fresh: tuple[Path, dict[str, str]]) -> None:
    repo, env = fresh
    home = Path(env["HOME"])
    # The copy's code is the code that runs (not the checkout's, through the editable install).
    where = subprocess.run(
        [sys.executable, "-c", "import cluster, bench; print(cluster.__file__)"],
        capture_output=True,
        text=True,
        env=env,
        cwd=repo,
        timeout=60,
        check=True,
    )
    assert where.stdout.startswith(str(repo)), where.stdout

    shm_before = set(Path("/dev/shm").glob("psm_*"))
    cluster = RunningCluster(make_topology(repo.parent.parent), env=env, cwd=repo)
    try:
        started = time.monotonic()
        cluster.wait_ready()
        print(f"pdserve up (fresh machine): ready in {time.monotonic() - started:.1f} s")
        token = home / ".ray" / "auth_token"
        assert stat.S_IMODE(token.stat().st_mode) == 0o600, "the generated Ray token is readable by others"
        log = "".join(cluster.log)
        assert "made a Ray auth token for this cluster" in log
        assert "waiting for replicas (" in log and "loading the model and starting its vLLM engine" in log
        processes = cluster.processes()
        names = " ".join(" ".join(p.cmdline()) for p in processes)
        assert "gcs_server" in names and "raylet" in names
        assert len(processes) >= 6  # pdserve up, Ray daemons, replica actors, engine cores
        # A local cluster is reachable from this machine only: Ray, its client server, vLLM and NIXL.
        pids = {p.pid for p in processes}
        listening = [
            (c.pid, c.laddr.ip, c.laddr.port)
            for c in psutil.net_connections(kind="inet")
            if c.pid in pids and c.status == psutil.CONN_LISTEN
        ]
        assert listening, "no listening socket found for the cluster's processes"
        exposed = [(psutil.Process(pid).name(), ip) for pid, ip, _ in listening if ip not in LOOPBACK]
        # The one exception, Ray Serve's own: every Serve replica serves its inter-deployment gRPC on
        # [::] (ray/serve/_private/replica.py binds "[::]:0"; nothing configures it). Nothing else may.
        serve_replicas = [p for p in processes if p.name().startswith("ray::ServeRepli")]
        assert [e for e in exposed if e[1] != "::" or not e[0].startswith("ray::ServeRepli")] == [], exposed
        assert len(exposed) <= len(serve_replicas), exposed

        gen = cluster.cli("generate", "Tell me about KV caches.", "--max-tokens", "8", "--json")
        assert gen.returncode == 0, gen.stderr
        final = json.loads(gen.stdout)
        assert final["usage"]["completionTokens"] == 8
        # A 7-token prompt: the router may prefill it on the decode replica rather than move its KV.
        assert final["servedBy"]["path"] in ("SERVING_PATH_DISAGGREGATED", "SERVING_PATH_LOCAL_PREFILL")
        assert final["servedBy"]["decodeReplica"]

        # Agent sessions from the traces the repository carries, and plots, with nothing else installed.
        plots = repo.parents[1] / "plots"
        bench = cluster.cli(
            "bench", "--target", cluster.target, "--mode", "sessions", "--sessions", "2", "--max-turns", "2",
            "--gap-scale", "0", "--output-len", "fixed:4", "--warmup", "0", "--plots", str(plots),
            timeout=300,
        )  # fmt: skip
        assert bench.returncode == 0, bench.stdout + bench.stderr
        assert f"from {repo}/bench/data/traces" in bench.stdout and (plots / "latency_cdf.png").exists()

        status = cluster.cli("status", "--json", timeout=60)
        assert status.returncode == 0, status.stderr
        assert status.stderr == ""  # no Ray INFO lines around the answer
        assert sorted(r["role"] for r in json.loads(status.stdout)["replicas"]) == [
            "decode",
            "prefill",
            "router",
        ]
    finally:
        down = cluster.down()
    assert down.returncode == 0, down.stderr
    assert cluster.proc.returncode == 0, "".join(cluster.log[-40:])
    deadline = time.monotonic() + 30
    while alive(processes) and time.monotonic() < deadline:
        time.sleep(1)
    assert alive(processes) == []
    assert set(Path("/dev/shm").glob("psm_*")) <= shm_before, "engine shared memory leaked"

    # The traces and calibration the replay needs come with the repository.
    for trace, sizing in (
        ("claude-code", ["--sessions", "3", "--concurrency", "2"]),
        ("mooncake", ["--requests", "200", "--time-scale", "2.947"]),
    ):
        replay = subprocess.run(
            [PDSERVE, "replay", "--trace", trace, *sizing, "--policies", "pdserve,round_robin"],
            capture_output=True,
            text=True,
            env=env,
            cwd=repo,
            timeout=300,
        )
        assert replay.returncode == 0, replay.stderr
        assert f"data: {repo}/bench/data/traces/" in replay.stdout
        assert "pdserve: hit/bound" in replay.stdout


def test_down_without_a_cluster_says_so() -> None:
    result = subprocess.run([PDSERVE, "down"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "no cluster is up" in result.stdout
