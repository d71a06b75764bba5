"""A fake multi-node Ray cluster running the real pdserve application on the engine test double.

Shared by the cluster tests of apply, failures and status: labelled nodes on this one machine
(tests/cluster/ray_nodes.py), the application deployed through the dashboard's Serve REST API exactly as
`pdserve up` does it (compile_serve_config + ServeSubmissionClient), the real RouterProcess serving gRPC in
a thread, and `Streamer`s: clients that send Generate requests back to back and record how each one ended.
The engines are `model.engine: double` (engine/double.py): Serve, the registry, the router and gRPC are
real; only vLLM is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import msgspec
import ray
from ports import free_port
from ray_nodes import RayNodes

from cluster.bootstrap import deploy, router_process
from cluster.readiness import wait_until_running
from cluster.serve_config import compile_serve_config
from cluster.topology import Topology
from cluster.topology_file import parse_topology
from engine.model_source import resolve_model_dir
from pdserve_client.sdk import PdserveClient, PdserveError

APP = "pdserve"
OBJECT_STORE = 80 * 1024**2  # several raylets on one small host: keep each object store small
# Lost nodes are noticed after period x threshold instead of Ray's default ~30 s.
FAST_NODE_DEATH = {"health_check_period_ms": 1000, "health_check_failure_threshold": 10}


def double_topology(
    dashboard_port: int, router: dict[str, Any] | None = None, **pools: dict[str, Any]
) -> Topology:
    """A double-engine topology: prefill on `role: prefill` nodes, decode on `role: decode` nodes; `router`
    and `pools` override those sections' fields."""
    base: dict[str, Any] = {
        "model": {"engine": "double"},
        "pools": {
            "prefill": {"cpus_per_replica": 0.1, "node_labels": {"role": "prefill"}},
            "decode": {
                "cpus_per_replica": 0.1,
                "node_labels": {"role": "decode"},
                "graceful_shutdown_timeout_s": 30,
                "health_check_period_s": 1,
            },
        },
        "server": {"grpc_port": free_port(), "metrics_port": free_port()},
        "ray": {"dashboard_port": dashboard_port, "placement_timeout_s": 60},
    }
    for role, fields in pools.items():
        base["pools"][role].update(fields)
    if router is not None:
        base["router"] = router
    return parse_topology(base)


def with_pool(topo: Topology, role: str, **fields: Any) -> Topology:
    """The same topology with some of a pool's fields changed (what an operator edits in the file)."""
    raw = msgspec.to_builtins(topo)
    raw["pools"][role].update(fields)
    return parse_topology(raw)


class FakeCluster:
    def __init__(self, decode_nodes: int = 2, node_cpus: int = 1, decode_node_gpus: int = 0) -> None:
        self.dashboard_port = free_port()
        self.dashboard_url = f"http://127.0.0.1:{self.dashboard_port}"
        self.ray_nodes = RayNodes(
            {
                "num_cpus": 1,
                "labels": {"role": "head"},
                "include_dashboard": True,  # Serve's REST API and the state API live in the dashboard
                "dashboard_port": self.dashboard_port,
                "dashboard_agent_listen_port": free_port(),
                "ray_client_server_port": free_port(),
                "object_store_memory": OBJECT_STORE,
                "_system_config": FAST_NODE_DEATH,
            }
        )
        self.address = self.ray_nodes.address
        # Node name -> node id.
        self.nodes: dict[str, str] = {}
        try:
            self.nodes["prefill-0"] = self.add_node("prefill", node_cpus, min(decode_node_gpus, 1))
            for i in range(decode_nodes):
                self.nodes[f"decode-{i}"] = self.add_node("decode", node_cpus, decode_node_gpus)
            self.ray_nodes.wait_for_nodes()
            ray.init(address=self.address, namespace="pdserve", log_to_driver=False)
            self._wait_for_dashboard(timeout_s=60)
        except BaseException:
            self.shutdown()
            raise

    def _wait_for_dashboard(self, timeout_s: float) -> None:
        """The dashboard (Serve's REST API) starts listening a while after the head node is up."""
        from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                ServeSubmissionClient(self.dashboard_url)  # checks that the dashboard answers
                return
            except (ConnectionError, RuntimeError, OSError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def add_node(self, role: str, cpus: int, gpus: int = 0) -> str:
        """Start a labelled worker node; returns its node id."""
        return self.ray_nodes.add_node(
            num_cpus=cpus,
            num_gpus=gpus,  # fake GPUs: a resource count, no device
            labels={"role": role},
            object_store_memory=OBJECT_STORE,
            dashboard_agent_listen_port=free_port(),  # one host: each node's agent needs its own port
        )

    def node_name(self, node_id: str) -> str:
        return next(name for name, nid in self.nodes.items() if nid == node_id)

    def remove_node(self, name: str) -> None:
        self.ray_nodes.remove_node(self.nodes.pop(name))

    def deploy(self, topo: Topology) -> None:
        deploy(compile_serve_config(topo, app_name=APP), self.dashboard_url)

    def shutdown(self) -> None:
        from ray.serve import context

        # No serve.shutdown(): stopping the cluster ends every replica. Serve caches its controller client
        # per process and a fresh cluster's driver gets the same job id, so the next module's cluster
        # would be served the dead controller: drop the cache (Serve's own `_disconnect`).
        context._disconnect()
        ray.shutdown()
        self.ray_nodes.shutdown()


async def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.5) -> Any:
    """Poll a blocking predicate (in a thread) until it returns something truthy."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await asyncio.to_thread(predicate)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        await asyncio.sleep(poll_s)


class Router:
    """The real RouterProcess (gRPC endpoint, Serve handles), on its own event loop in a thread, as in
    `pdserve up`."""

    def __init__(self, topo: Topology) -> None:
        self.target = f"{topo.server.grpc_host}:{topo.server.grpc_port}"
        self._topo = topo
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="router", daemon=True)
        self._thread.start()
        if not self._ready.wait(120):
            raise RuntimeError("router did not start in 120 s")
        if self._error is not None:
            raise RuntimeError("router failed to start") from self._error
        with PdserveClient(self.target) as client:
            deadline = time.monotonic() + 30
            while client.health() != "SERVING" and time.monotonic() < deadline:
                time.sleep(0.2)

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            try:
                process = router_process(self._topo, resolve_model_dir(self._topo.model.source), APP)
                serving = asyncio.create_task(process.serve_until(self._stop))
                await asyncio.sleep(0.5)
            except BaseException as exc:
                self._error = exc
                raise
            finally:
                self._ready.set()
            await serving

        asyncio.run(main())

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)


@dataclass
class Outcome:
    started: float
    ended: float
    decode_replica: str  # "" when it failed
    tokens: int
    code: grpc.StatusCode  # OK, or the failure's status
    message: str = ""
    prompt: tuple[int, ...] = ()
    token_ids: tuple[int, ...] = ()


@dataclass
class Streamer:
    """`clients` threads, each sending Generate requests back to back without pause until stopped."""

    target: str
    clients: int = 4
    max_tokens: int = 60  # x 20 ms per token (the double's decode time): ~1.2 s a request
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Streamer:
        for i in range(self.clients):
            thread = threading.Thread(target=self._loop, args=(i,), name=f"streamer-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _loop(self, client_index: int) -> None:
        # reconnect_s=0: what the router answers is what is recorded, never the SDK's own continuation.
        with PdserveClient(self.target, reconnect_s=0) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                prompt = [10 + client_index, 20 + n % 50, *range(30, 60)]
                started = time.monotonic()
                try:
                    done = client.generate_text(
                        token_ids=prompt, max_tokens=self.max_tokens, ignore_eos=True, timeout=60
                    )
                    outcome = Outcome(
                        started,
                        time.monotonic(),
                        done.served_by.decode_replica,
                        len(done.token_ids),
                        grpc.StatusCode.OK,
                        prompt=tuple(prompt),
                        token_ids=tuple(done.token_ids),
                    )
                except PdserveError as exc:
                    outcome = Outcome(
                        started, time.monotonic(), "", 0, exc.code, exc.message, prompt=tuple(prompt)
                    )
                with self._lock:
                    self.outcomes.append(outcome)

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=90)
        with self._lock:
            return list(self.outcomes)

    def count(self) -> int:
        with self._lock:
            return len(self.outcomes)

    def failures(self) -> list[Outcome]:
        with self._lock:
            return [o for o in self.outcomes if o.code != grpc.StatusCode.OK]


def serve_replicas(
    dashboard_url: str, deployment: str, states: tuple[str, ...] = ("RUNNING",)
) -> list[dict[str, Any]]:
    """Serve's replicas of a deployment in these states (the dashboard's Serve view), blocking."""
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    details = ServeSubmissionClient(dashboard_url).get_serve_details()
    app = (details.get("applications") or {}).get(APP) or {}
    dep = (app.get("deployments") or {}).get(deployment) or {}
    return [r for r in dep.get("replicas") or [] if r.get("state") in states]


@dataclass
class Env:
    """A running fake cluster with pdserve deployed on engine doubles, and the real router in front."""

    cluster: FakeCluster
    router: Router
    topo: Topology  # what runs now; tests that change it put it back


@contextlib.contextmanager
def running(topology: Callable[[FakeCluster], Topology], **cluster_options: Any) -> Iterator[Env]:
    """Start a FakeCluster, deploy `topology(cluster)`, start the router; tear all of it down after."""
    cluster = FakeCluster(**cluster_options)
    router = None
    try:
        topo = topology(cluster)
        cluster.deploy(topo)
        wait_until_running(APP, 90)
        router = Router(topo)
        yield Env(cluster, router, topo)
    finally:
        if router is not None:
            router.stop()
        cluster.shutdown()
