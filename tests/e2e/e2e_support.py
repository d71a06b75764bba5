"""Running a real pdserve cluster for end-to-end tests: `pdserve up` as a subprocess on a test topology (real
Ray, real Serve, real vLLM engines on CPU, real NIXL), torn down with `pdserve down`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import yaml
from ports import free_port

from cluster.bootstrap import RunState, cluster_processes
from cluster.cli import READY_LINE

REPO = Path(__file__).resolve().parents[2]
PDSERVE = str(Path(sys.executable).with_name("pdserve"))
UP_TIMEOUT_S = 420


def make_topology(tmp_path: Path, **overrides: object) -> Path:
    """deploy/local.yaml with ports of its own, so tests never collide with a developer's cluster."""
    topo = yaml.safe_load((REPO / "deploy" / "local.yaml").read_text())
    topo["server"]["grpc_port"] = free_port()
    topo["server"]["metrics_port"] = free_port()
    topo["ray"]["dashboard_port"] = free_port()
    for dotted, value in overrides.items():
        node = topo
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node[key]
        node[leaf] = value
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(topo))
    return path


def reference_outputs(requests: list[dict[str, object]], kv_cache_dtype: str = "auto") -> list[list[int]]:
    """Greedy outputs of one plain vLLM engine (tests/e2e/reference_engine.py) for `requests`
    ({prompt_token_ids, max_tokens[, ignore_eos]}); run it before a cluster starts (2 cores: a third engine
    would contend)."""
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests" / "e2e" / "reference_engine.py"),
            "--kv-cache-dtype",
            kv_cache_dtype,
        ],
        input=json.dumps(requests),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REFERENCE_OUTPUT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    outputs: list[list[int]] = json.loads(lines[0].removeprefix("REFERENCE_OUTPUT "))
    return outputs


def kv_bytes_per_token(element_bytes: int) -> int:
    """What one token's KV takes in the built-in model at `element_bytes` an element: K and V, per layer and
    KV head."""
    from engine.tiny_model import ensure_tiny_model

    config = json.loads((ensure_tiny_model() / "config.json").read_text())
    return (
        2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * element_bytes
    )


class RunningCluster:
    """`pdserve up` in a subprocess. `env` and `cwd`: the environment every `pdserve` command of this cluster
    runs in (default: the test process's), e.g. an empty HOME and a copy of the repository."""

    def __init__(self, topology: Path, *, env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        self.topology = topology
        self.env = dict(os.environ) if env is None else env
        self.cwd = cwd
        cfg = yaml.safe_load(topology.read_text())
        self.target = f"127.0.0.1:{cfg['server']['grpc_port']}"
        self.metrics_url = f"http://127.0.0.1:{cfg['server']['metrics_port']}/metrics"
        http_port = cfg["server"].get("http_port")
        self.http_url = f"http://127.0.0.1:{http_port}" if http_port else None
        self.log: list[str] = []
        self.proc = subprocess.Popen(
            [PDSERVE, "up", "-f", str(topology)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env,
            cwd=cwd,
        )
        self._ready = threading.Event()
        threading.Thread(target=self._read_output, daemon=True).start()

    def _read_output(self) -> None:
        assert self.proc.stdout is not None
        # Mirrored to a file next to the topology, for post-mortems of a cluster that died mid-test.
        with (self.topology.parent / "pdserve-up.log").open("w") as mirror:
            for line in self.proc.stdout:
                self.log.append(line)
                mirror.write(line)
                mirror.flush()
                if line.startswith(READY_LINE):
                    self._ready.set()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + UP_TIMEOUT_S
        while not self._ready.wait(1.0):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = "".join(self.log[-60:])
                raise RuntimeError(f"pdserve up did not come up (exit {self.proc.poll()}):\n{tail}")

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """A `pdserve` command against this cluster, in the cluster's environment."""
        return subprocess.run(
            [PDSERVE, *args], capture_output=True, text=True, timeout=timeout, env=self.env, cwd=self.cwd
        )

    def processes(self) -> list[psutil.Process]:
        """Every process of this cluster: `pdserve up` and its children, and the Ray cluster it started
        (daemons, replica actors, vLLM engine cores and workers), found as `pdserve down` finds them."""
        state = RunState.load(self.env)
        assert state is not None, f"pdserve up wrote no run state at {RunState.path(self.env)}"
        up = psutil.Process(self.proc.pid)
        found = {p.pid: p for p in [up, *up.children(recursive=True), *cluster_processes(state.ray_address)]}
        return list(found.values())

    def down(self) -> subprocess.CompletedProcess[str]:
        """`pdserve down`; if that fails, stop `pdserve up` directly so a test never hangs on teardown."""
        result = self.cli("down", timeout=300)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            self.proc.wait(timeout=120)
        return result


@contextmanager
def cluster_up(topology: Path) -> Iterator[RunningCluster]:
    """A ready cluster for the block (a module's fixture), stopped after it whatever happened."""
    running = RunningCluster(topology)
    try:
        running.wait_ready()
        yield running
    finally:
        if running.proc.poll() is None:
            running.down()


def alive(processes: list[psutil.Process]) -> list[str]:
    left = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            continue
    return left
