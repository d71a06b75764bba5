"""The part of a prefill or decode Serve replica that both roles share: start the engine host with the
replica's identity, take legs from routers (engine/leg_server.py) and send their outcomes back
(engine/token_sender.py), answer health checks, report stats and registry info, drain and stop on shutdown."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import ClassVar

import msgspec
import ray
from opentelemetry.trace import Tracer
from ray import serve

from engine import start_phases
from engine.double import DoubleEngineHost
from engine.host import EngineHost
from engine.leg_server import Handler, LegServer
from engine.messages import DispatchedLoad, EngineStats, LegKind, ReplicaInfo, ReplicaLoad
from engine.spec import spec_from_env
from engine.token_sender import TokenSender
from engine.tracing import otlp_tracer

# How often a replica refreshes its registry entry (cluster/registry.py expires it after EXPIRY_S).
HEARTBEAT_S = 2.0
log = logging.getLogger(__name__)

# How often a replica looks at its engine's health between heartbeats.
WATCH_S = 0.25
# How long a stopping replica waits for the registry to take its `draining`.
DRAIN_PUBLISH_S = 2.0


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
        # Ray started the process, Serve the actor: the start's first phase.
        self._actor_s = start_phases.process_age_s()
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
        node_ip = spec.bind_host or ray.util.get_node_ip_address()
        self.host = host_class(
            spec,
            replica_id=context.replica_id.unique_id,
            node_id=ray.get_runtime_context().get_node_id(),
            node_ip=node_ip,
        )
        # Blocking on purpose: Serve marks the replica ready only once the constructor returns, so no
        # request is routed to an engine that is still loading.
        self.host.start()
        self.tokens = TokenSender()
        self._legs = LegServer(self.leg_handlers(), self.tokens, node_ip)
        self._legs.start()
        self._draining = False
        # What the routers have dispatched here and not seen end, as of the last heartbeat.
        self._routed = DispatchedLoad()
        self._heartbeat = asyncio.create_task(self._publish_forever())

    def leg_handlers(self) -> Mapping[LegKind, Handler]:
        """The legs this role runs (prefill/prefill_replica.py, decode/decode_replica.py)."""
        raise NotImplementedError

    async def _publish_forever(self) -> None:
        """Publish this replica's info to the registry, then refresh it: the heartbeat is what tells the
        registry the replica is still alive. An engine failure is published at once (within WATCH_S), so
        that every router stops routing here before Serve's health check replaces the replica."""
        while True:
            try:
                self._routed = await self._registry.publish.remote(self.info())
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

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve samples this for the pool's autoscaling policy (cluster/autoscaling.py) and averages it
        over the pool's window."""
        stats, routed = self.host.stats(), self._routed
        load = ReplicaLoad(
            queued_prefill_s=routed.queued_prefill_s,
            busy=float(bool(stats.running or stats.waiting or routed.queued_prefill_requests)),
            kv_usage=stats.kv_cache_usage,
            running=stats.running,
            waiting=stats.waiting,
            step_s=stats.step_s,
            start_s=self._actor_s + start_phases.start_s(self.host.start_phases),
        )
        return msgspec.structs.asdict(load)

    def info(self) -> ReplicaInfo:
        info = self.host.info(draining=self._draining)
        phases = {"actor": self._actor_s, **info.start_phases}
        return msgspec.structs.replace(info, legs_address=self._legs.address, start_phases=phases)

    async def __del__(self) -> None:
        # Serve awaits __del__ on graceful shutdown, after its own calls drained: tell the routers to stop
        # sending legs, let those in flight finish (Serve's graceful_shutdown_timeout_s bounds this), then
        # stop the engine core subprocess rather than leave it to notice its parent is gone.
        heartbeat = getattr(self, "_heartbeat", None)
        legs = getattr(self, "_legs", None)
        if heartbeat is not None and legs is not None:
            heartbeat.cancel()
            self._draining = True
            try:
                # Bounded: when the whole application is deleted, the registry may be stopping too.
                await asyncio.wait_for(self._registry.publish.remote(self.info()), DRAIN_PUBLISH_S)
            except Exception as exc:  # draining goes on: routers then learn of it as a lost replica
                log.warning("could not tell the registry that %s drains: %r", self.host.replica_id, exc)
            log.info("replica %s draining: %d legs running", self.host.replica_id, legs.running)
            await legs.drain()
            # The last legs' ends first, then the leg channel: its closing tells the routers to give up on
            # legs still open here (router/legs/leg_channel.py END_GRACE_S).
            await self.tokens.flush(DRAIN_PUBLISH_S)
            legs.close()
            self.tokens.close(linger_ms=1000)
            self._registry.withdraw.remote(self.host.replica_id)
        host = getattr(self, "host", None)
        if host is not None:
            host.shutdown()
