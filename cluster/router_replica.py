"""pdserve's front end as a Serve deployment: `server.routers` routers (router/process.py), a Serve replica
each, on the Ray head or one per node labelled for them.

Every cluster runs its routers this way: `pdserve up` deploys them with the engines and only watches the
cluster (its death stops nothing), and a cluster nobody runs `pdserve up` on (a KubeRay RayService, `serve
deploy` of `pdserve export` on a `ray start` cluster) gets the same application. The topology comes from
the registry, which holds the deployed one. Each router is a whole front end: the routers of one node share
the doors' ports (the kernel spreads connections among them), each follows every engine's KV events, and
they read each other's load in flight at the registry.
- with no `server.router_node_labels`, the routers run on the head node (Ray's `node:__internal_head__`
  resource), where the head's Service or port publishes server.grpc_port, and where the TLS files and the
  token's environment variable are; with them, one per matching node (their pods' Service publishes it);
- Serve's health check asks whether the endpoint is still serving, so Serve replaces a router whose server
  stopped or whose process died; on shutdown the server drains its streams (router/process.py's grace)
  before the replica exits.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster.bootstrap import router_process
from cluster.topology import Topology
from engine.model_source import resolve_model_dir
from router.config import ServerConfig

log = logging.getLogger(__name__)

ROUTER = "router"  # the deployment's name
# A fraction of the head node's marker resource: pins the replica to the head without taking a CPU there
# (the head runs Serve's controller and the dashboard, no engine).
ON_HEAD = {"node:__internal_head__": 0.001}


def router_deployment_config(server: ServerConfig) -> dict[str, Any]:
    """The router's entry in the Serve config: `server.routers` replicas, on the head (sharing its ports) or
    one per node matching `server.router_node_labels`."""
    if server.router_node_labels:
        placement: dict[str, Any] = {
            "max_replicas_per_node": 1,  # every router of a node would want the same metrics port
            "ray_actor_options": {"num_cpus": 0, "label_selector": dict(server.router_node_labels)},
        }
    else:
        placement = {"ray_actor_options": {"num_cpus": 0, "resources": dict(ON_HEAD)}}
    return {
        "name": ROUTER,
        "num_replicas": server.routers,
        **placement,
        # Streams in flight get the router's own 10 s grace to finish (RouterProcess.serve_until).
        "graceful_shutdown_timeout_s": 30,
        "health_check_period_s": 5,
    }


class RouterReplica:
    # Serve awaits async constructors and marks the replica ready once this returns: after the endpoint
    # accepts calls.
    async def __init__(self, registry: DeploymentHandle) -> None:  # type: ignore[misc]
        raw = await registry.topology.remote()
        if raw is None:
            raise RuntimeError("the registry holds no topology: deploy the config `pdserve export` writes")
        topo = msgspec.convert(raw, Topology)
        app_name = serve.get_replica_context().app_name
        model_dir = await asyncio.to_thread(resolve_model_dir, topo.model.source)
        # Loads the tokenizer and reads TLS files: off the event loop.
        self._router = await asyncio.to_thread(router_process, topo, model_dir, app_name)
        self._stop = asyncio.Event()
        ready = asyncio.Event()
        self._serving = asyncio.create_task(self._router.serve_until(self._stop, on_ready=ready.set))
        ready_wait = asyncio.create_task(ready.wait())
        await asyncio.wait((self._serving, ready_wait), return_when=asyncio.FIRST_COMPLETED)
        ready_wait.cancel()
        if self._serving.done():
            self._serving.result()  # raises why the endpoint could not start (e.g. its port is taken)
            raise RuntimeError("the router's endpoint stopped while starting")
        server = topo.server
        log.info("router serving gRPC on %s:%d", server.grpc_host, server.grpc_port)

    async def check_health(self) -> None:
        """Serve replaces the replica when this raises: the endpoint stopped serving."""
        if self._serving.done():
            error = self._serving.exception() if not self._serving.cancelled() else None
            raise RuntimeError(f"the router's endpoint stopped: {error!r}")

    async def __del__(self) -> None:
        # Serve calls this on graceful shutdown: refuse new calls, let streams finish, then stop.
        stop = getattr(self, "_stop", None)
        if stop is None:
            return
        stop.set()
        await asyncio.wait((self._serving,), timeout=20)
