"""Starting and stopping the Ray side of a pdserve cluster, and deploying its Serve application.

`pdserve up` starts a local Ray head (dashboard on 127.0.0.1) unless the topology names an existing
cluster, then deploys the application declaratively through the dashboard's Serve REST API (the same
path as `serve deploy`), so that `pdserve apply` later updates it in place.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from cluster.ray_auth import use_loopback_ray, use_ray_token_auth
from cluster.topology import Topology, served_model

if TYPE_CHECKING:
    from router.process import RouterProcess

APP_NAME = "pdserve"


class BootstrapError(RuntimeError):
    pass


@dataclass
class RunState:
    """What a running `pdserve up` leaves for `pdserve down/status/apply` in other terminals."""

    pid: int
    ray_address: str
    dashboard_url: str
    started_ray: bool
    grpc_target: str
    metrics_url: str
    started_at: float

    @staticmethod
    def path(env: Mapping[str, str] | None = None) -> Path:
        """In pdserve's cache folder, of this process's environment or of `env`."""
        from engine.tiny_model import default_cache_dir

        return default_cache_dir(env) / "run" / "cluster.json"

    def save(self) -> None:
        p = self.path()
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(p)

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None) -> RunState | None:
        p = cls.path(env)
        if not p.exists():
            return None
        return cls(**json.loads(p.read_text()))

    @classmethod
    def clear(cls) -> None:
        cls.path().unlink(missing_ok=True)


def _ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


def start_local_head(topo: Topology) -> tuple[str, str]:
    """`ray start --head` on loopback; returns (gcs address, dashboard url)."""
    cfg = topo.ray
    from engine.ports import free_ports

    (port,) = free_ports(1)
    cmd = [
        _ray_bin(),
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        "--include-dashboard=true",
        f"--dashboard-host={cfg.dashboard_host}",
        f"--dashboard-port={cfg.dashboard_port}",
        "--disable-usage-stats",
    ]
    if cfg.num_cpus is not None:
        cmd.append(f"--num-cpus={cfg.num_cpus}")
    use_ray_token_auth()
    use_loopback_ray()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if proc.returncode != 0:
        stop_local_ray(f"127.0.0.1:{port}")  # whatever part of it did start
        raise BootstrapError(f"`ray start --head` failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return f"127.0.0.1:{port}", f"http://{cfg.dashboard_host}:{cfg.dashboard_port}"


def cluster_processes(gcs_address: str) -> list[psutil.Process]:
    """The processes of the Ray cluster whose GCS listens on `gcs_address`: its daemons (each names the GCS
    port on its command line) and everything they started (workers, replica actors, vLLM engines)."""
    port = gcs_address.rsplit(":", 1)[1]
    own = re.compile(rf"(--gcs_server_port=|--gcs-address=\S+:|--address=\S+:){port}(\s|$)")
    daemons = []
    for p in psutil.process_iter(["cmdline"]):
        if own.search(" ".join(p.info["cmdline"] or [])):
            daemons.append(p)
    found: dict[int, psutil.Process] = {}
    for daemon in daemons:
        with contextlib.suppress(psutil.NoSuchProcess):  # exited while we looked: nothing to stop
            for p in [daemon, *daemon.children(recursive=True)]:
                found[p.pid] = p
    return list(found.values())


def stop_local_ray(gcs_address: str, timeout_s: float = 30.0) -> None:
    """Stop the Ray cluster `pdserve up` started, and only it (`ray stop` would stop every Ray cluster on
    the machine): SIGTERM its processes, then SIGKILL what is left after `timeout_s`. The GCS goes last:
    terminated with the raylet still up it waits out its whole grace (~30 s), after it it exits in ~2 s."""
    processes = cluster_processes(gcs_address)
    gcs = [p for p in processes if _is_gcs(p)]
    deadline = time.monotonic() + timeout_s
    for group in ([p for p in processes if p not in gcs], gcs):
        for p in group:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.terminate()
        _, alive = psutil.wait_procs(group, timeout=max(deadline - time.monotonic(), 1.0))
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(alive, timeout=10)


def _is_gcs(p: psutil.Process) -> bool:
    try:
        return any("gcs_server" in part for part in p.cmdline()[:1])
    except psutil.NoSuchProcess:
        return False


def remove_leaked_shm(since: float, shm_dir: Path = Path("/dev/shm")) -> list[str]:
    """Remove the shared-memory segments our engines leaked, and only those.

    vLLM's engine processes talk through Python `SharedMemory` segments (`/dev/shm/psm_*`, ~160 MB each); an
    engine process killed before it unlinks them (vLLM force-kills workers that outlive the shutdown grace
    period) leaves them behind. A segment is ours if it appeared after this cluster started and no live
    process still maps it.
    """
    candidates = {p.name: p for p in shm_dir.glob("psm_*") if p.stat().st_mtime >= since}
    if not candidates:
        return []
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process exited or is not ours to read
            continue
        for name in [n for n in candidates if n in text]:
            del candidates[name]
    for path in candidates.values():
        path.unlink(missing_ok=True)
    return sorted(candidates)


def router_process(topo: Topology, model_dir: Path, app_name: str) -> RouterProcess:
    """The router of a deployed application (its Serve handles exist once the application runs)."""
    import ray

    from router.process import RouterProcess  # loads the tokenizer stack: only in the process that routes

    return RouterProcess(
        served_model(topo.model),
        topo.router,
        topo.server,
        model_dir=model_dir,
        app_name=app_name,
        has_prefill=topo.pools.prefill.replicas > 0,
        kv_readback_ttl_s=topo.pools.kv_readback_ttl_s,
        # As the engines' own sockets (cluster/serve_app.py): ipc on a cluster pdserve runs on this machine.
        token_host=None if topo.ray.address is None else ray.util.get_node_ip_address(),
    )


def deploy(serve_config: dict[str, Any], dashboard_url: str) -> None:
    """Declarative deploy/update through the dashboard (what `serve deploy` does): Serve's controller
    reconciles the running application to this config (scaling, rolling changed replicas)."""
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    ServeSubmissionClient(dashboard_url).deploy_applications(serve_config)


def delete_application(dashboard_url: str, app_name: str, timeout_s: float = 660.0) -> bool:
    """Remove the application from a Ray cluster pdserve did not start (its Ray keeps running), through the
    dashboard's Serve REST API, and wait until Serve has drained and stopped its replicas. False if it was
    not deployed. Other applications on the cluster are redeployed unchanged (Serve's config is the whole
    set of applications)."""
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    client = ServeSubmissionClient(dashboard_url)
    details = client.get_serve_details()
    apps = details.get("applications") or {}
    if app_name not in apps:
        return False
    others = [a["deployed_app_config"] for name, a in apps.items() if name != app_name]
    if others:
        config = {"applications": others}
        for key in ("proxy_location", "http_options", "grpc_options"):
            if details.get(key) is not None:
                config[key] = details[key]
        client.deploy_applications(config)
    else:
        client.delete_applications()
    deadline = time.monotonic() + timeout_s
    while app_name in (client.get_serve_details().get("applications") or {}):
        if time.monotonic() > deadline:
            raise BootstrapError(f"application {app_name} still stopping after {timeout_s:.0f} s")
        time.sleep(1.0)
    return True


def process_alive(pid: int) -> bool:
    """Running, as opposed to gone or exited-but-not-yet-reaped (a zombie: `pdserve up` started by a script
    that has not waited for it yet)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def signal_up_process(state: RunState, timeout_s: float = 120.0) -> bool:
    """Ask a running `pdserve up` to shut down (SIGTERM) and wait for it; False if it was not running."""
    try:
        os.kill(state.pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not process_alive(state.pid):
            return True
        time.sleep(0.5)
    raise BootstrapError(f"pdserve up (pid {state.pid}) did not stop within {timeout_s:.0f} s")
