"""The part of a prefill or decode Serve replica that both roles share: start the engine host with the
replica's identity, answer health checks, report stats and registry info, stop the engine on shutdown."""

from __future__ import annotations

import asyncio
import logging
from typing import ClassVar

import msgspec
import ray
from opentelemetry.trace import Tracer
from ray import serve

from engine.double import DoubleEngineHost
from engine.host import EngineHost
from engine.messages import EngineStats, ReplicaInfo
from engine.spec import spec_from_env
from engine.tracing import otlp_tracer

# How often a replica refreshes its registry entry (cluster/registry.py expires it after EXPIRY_S).
HEARTBEAT_S = 2.0
log = logging.getLogger(__name__)

# How often a replica looks at its engine's health between heartbeats.
WATCH_S = 0.25


class EngineReplica:
    # The role's engine (prefill/engine.py, decode/engine.py); `model.engine: double` replaces it with the
    # test double, which speaks both roles.
    HOST: ClassVar[type[EngineHost]] = EngineHost
    host: EngineHost | DoubleEngineHost
    # Where this replica's spans of a request go (engine/tracing.py); None: tracing off.
    tracer: Tracer | None = None

    # Serve awaits async constructors; the replica is routed to only once this returns. The spec comes from
    # the replica's environment, not an init argument: see engine/spec.py for why.
    async def __init__(self) -> None:  # type: ignore[misc]
        spec = spec_from_env()
        context = serve.get_replica_context()
        self._registry = serve.get_deployment_handle("registry", context.app_name)
        if len(spec.cpu_threads_bind) > 1:
            slot = await self._registry.claim_slot.remote(
                spec.role, context.replica_id.unique_id, len(spec.cpu_threads_bind)
            )
            spec = msgspec.structs.replace(spec, cpu_threads_bind=[spec.cpu_threads_bind[slot]])
            log.info(
                "replica %s binds its engine to cores %s",
                context.replica_id.unique_id,
                spec.cpu_threads_bind[0],
            )
        self.tracer = otlp_tracer(spec.otlp_traces_endpoint, f"pdserve-{spec.role}")
        host_class = DoubleEngineHost if spec.engine == "double" else self.HOST
        self.host = host_class(
            spec,
            replica_id=context.replica_id.unique_id,
            node_id=ray.get_runtime_context().get_node_id(),
            node_ip=spec.bind_host or ray.util.get_node_ip_address(),
        )
        # Blocking on purpose: Serve marks the replica ready only once the constructor returns, so no
        # request is routed to an engine that is still loading.
        self.host.start()
        self._heartbeat = asyncio.create_task(self._publish_forever())

    async def _publish_forever(self) -> None:
        """Publish this replica's info to the registry, then refresh it: the heartbeat is what tells the
        registry the replica is still alive. An engine failure is published at once (within WATCH_S), so
        that every router stops routing here before Serve's health check replaces the replica."""
        while True:
            try:
                await self._registry.publish.remote(self.host.info())
            except Exception as exc:  # the registry restarting must not kill the engine replica
                log.warning("registry publish failed (will retry): %s", exc)
            failed_before = self.host.failure() is not None
            for _ in range(int(HEARTBEAT_S / WATCH_S)):
                await asyncio.sleep(WATCH_S)
                if not failed_before and (reason := self.host.failure()) is not None:
                    log.error("replica %s failed: %s", self.host.replica_id, reason)
                    break

    async def check_health(self) -> None:
        """Called by Serve's controller; raising marks the replica unhealthy and Serve replaces it."""
        await self.host.check_health()

    def stats(self) -> EngineStats:
        return self.host.stats()

    def info(self) -> ReplicaInfo:
        return self.host.info()

    def __del__(self) -> None:
        # Serve calls __del__ on graceful shutdown (after in-flight requests drained): stop the engine
        # core subprocess now rather than leaving it to notice its parent is gone.
        heartbeat = getattr(self, "_heartbeat", None)
        if heartbeat is not None:
            heartbeat.cancel()
            self._registry.withdraw.remote(self.host.replica_id)
        host = getattr(self, "host", None)
        if host is not None:
            host.shutdown()
