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


def test_deploy_progress_names_each_starting_replica_its_age_and_what_it_waits_for() -> None:
    from cluster.bootstrap import deploy_progress

    now = 1000.0
    no_gpu = "Resources required for each replica: {'GPU': 8}, total resources available: {}."
    decode = {
        "status": "UPDATING",
        "target_num_replicas": 2,
        "message": "",
        "replicas": [
            {"replica_id": "d1", "state": "RUNNING", "start_time_s": 900.0},
            {"replica_id": "d2", "state": "STARTING", "start_time_s": 955.0, "node_ip": "10.0.0.7"},
        ],
    }
    prefill = {"status": "UPDATING", "target_num_replicas": 1, "message": no_gpu, "replicas": []}
    registry = {"status": "HEALTHY", "target_num_replicas": 1, "replicas": [{"state": "RUNNING"}]}
    router = {
        "status": "UPDATING",
        "target_num_replicas": 1,
        "replicas": [{"replica_id": "r1", "state": "STARTING", "start_time_s": 990.0}],
    }
    deployments = {"decode": decode, "prefill": prefill, "registry": registry, "router": router}
    details = {"applications": {"pdserve": {"deployments": deployments}}}
    assert deploy_progress(details, "pdserve", 61.2, now) == (
        "waiting for replicas (61 s): decode 1/2 running (replica d2 STARTING 45 s on 10.0.0.7: loading the "
        f"model and starting its vLLM engine); prefill 0/1 running [Serve: {no_gpu}]; router 0/1 running "
        "(replica r1 STARTING 10 s: loading the tokenizer and opening its endpoint)"
    )
    assert "not created" in deploy_progress({"applications": {}}, "pdserve", 3, now)
    assert "Serve status unavailable (TimeoutError: slow)" in deploy_progress(
        {"error": "TimeoutError: slow"}, "pdserve", 3, now
    )


def test_up_waits_until_every_router_says_it_can_serve() -> None:
    """The application runs before the routers have read the engines from the registry (every second):
    `pdserve up` says it is up only once every router reports to the registry that it serves."""
    import pytest

    from cluster.bootstrap import BootstrapError, wait_until_serving
    from engine.messages import RouterReport

    def reports(*serving: bool) -> list[RouterReport]:
        return [RouterReport(router_id=f"r{i}", serving=s) for i, s in enumerate(serving)]

    answers = iter([[], reports(False, True), reports(True)])
    asked: list[int] = []

    def routers() -> list[RouterReport]:
        asked.append(1)
        answer = next(answers, reports(True, True))
        if not answer and len(asked) == 1:
            raise TimeoutError("the registry is starting")
        return answer

    wait_until_serving(routers, 2, timeout_s=10, poll_s=0.01)
    assert len(asked) == 4  # no answer, one of two, one of two (the other not reporting yet), both
    with pytest.raises(BootstrapError, match="1 of 2 routers see a decode replica that can serve"):
        wait_until_serving(lambda: reports(True, False), 2, timeout_s=0.1, poll_s=0.01)
