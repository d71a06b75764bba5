"""Cleanup after a cluster: only the shared-memory segments our engines leaked are removed."""

import mmap
import os
import time
from pathlib import Path

from cluster.bootstrap import RunState, remove_leaked_shm


def test_removes_new_unmapped_segments_and_keeps_old_or_mapped_ones(tmp_path: Path) -> None:
    old = tmp_path / "psm_old"
    old.write_bytes(b"x" * 4096)
    since = time.time() + 0.01
    time.sleep(0.05)
    leaked = tmp_path / "psm_leaked"
    leaked.write_bytes(b"x" * 4096)
    in_use = tmp_path / "psm_in_use"
    in_use.write_bytes(b"x" * 4096)
    unrelated = tmp_path / "other_segment"
    unrelated.write_bytes(b"x" * 4096)
    with in_use.open("r+b") as f, mmap.mmap(f.fileno(), 4096):
        removed = remove_leaked_shm(since, shm_dir=tmp_path)
    assert removed == ["psm_leaked"]
    assert not leaked.exists()
    assert old.exists() and in_use.exists() and unrelated.exists()


def test_run_state_round_trips(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert RunState.load() is None
    state = RunState(
        pid=123,
        ray_address="127.0.0.1:6379",
        dashboard_url="http://127.0.0.1:8265",
        started_ray=True,
        grpc_target="127.0.0.1:50051",
        metrics_url="http://127.0.0.1:9400/metrics",
        started_at=1.5,
    )
    state.save()
    assert RunState.load() == state
    RunState.clear()
    assert RunState.load() is None


def test_stopping_a_cluster_leaves_other_ray_clusters_on_the_machine_alone(tmp_path: Path) -> None:
    import os
    import socket
    import subprocess
    import sys

    from cluster.bootstrap import cluster_processes, stop_local_ray

    ray_bin = str(Path(sys.executable).with_name("ray"))
    env = {**os.environ, "RAY_AUTH_MODE": "token"}

    def start_head() -> str:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dashboard_port = s.getsockname()[1]
        subprocess.run(
            [ray_bin, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=0",
             "--include-dashboard=false", f"--dashboard-port={dashboard_port}", "--disable-usage-stats"],
            check=True, capture_output=True, env=env, timeout=120,
        )  # fmt: skip
        return f"127.0.0.1:{port}"

    ours, theirs = start_head(), start_head()
    try:
        assert cluster_processes(ours) and cluster_processes(theirs)
        assert not {p.pid for p in cluster_processes(ours)} & {p.pid for p in cluster_processes(theirs)}
        stop_local_ray(ours)
        assert cluster_processes(ours) == []
        assert all(p.is_running() for p in cluster_processes(theirs))
    finally:
        stop_local_ray(ours)
        stop_local_ray(theirs)


def test_an_exited_but_unreaped_process_counts_as_stopped() -> None:
    import subprocess
    import sys

    from cluster.bootstrap import process_alive

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while process_alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_alive(child.pid)  # a zombie until we wait for it
    child.wait()
    assert not process_alive(child.pid)
    assert process_alive(os.getpid())
