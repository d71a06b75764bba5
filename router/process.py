"""The router process: holds Serve deployment handles to the engine pools and serves the gRPC endpoint.

It runs in the `pdserve up` process, or in a Serve replica of its own on the Ray head
(cluster/router_replica.py, whose health check and shutdown follow this endpoint) on a cluster nobody runs
`pdserve up` on. It owns no KV bytes: only handles, tokens and text. It follows the deployed topology's
`router` section (the registry carries it): `pdserve apply` of a routing setting reconfigures it in place.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from grpc_health.v1.health_pb2 import HealthCheckResponse
from ray import serve
from ray.serve.exceptions import RayServeException

from engine.messages import ReplicaInfo, RouterReport
from engine.tracing import otlp_tracer
from pdserve_client.api import pdserve_pb2 as pb
from router.config import LiveConfig, RouterConfig, ServedModel, ServerConfig
from router.decision.decider import Decider
from router.decision.readback import KvPulls, ReadbackTable
from router.doors.grpc_service import PdserveService, start_grpc_server
from router.doors.listen import ListenError
from router.doors.openai_http import HttpServer, build_app
from router.generate import GeneratePath
from router.intake.chat_encoder import SessionChatEncoder
from router.intake.output_parser import OutputParsers
from router.intake.prompt import PromptIntake
from router.intake.tokenizer import PromptTokenizer
from router.intake.validation import ModelLimits
from router.legs.leg_channel import LegChannel
from router.legs.orchestrator import Orchestrator
from router.legs.token_receiver import TokenReceiver
from router.metrics import RouterMetrics
from router.policy.cache_blind import LeastLoadedPolicy, RoundRobinPolicy, SessionHashPolicy
from router.policy.selector import PdservePolicy
from router.policy.types import Policy
from router.sessions import Sessions
from router.view.cluster_view import ClusterView

log = logging.getLogger(__name__)


class RouterProcess:
    def __init__(
        self,
        model: ServedModel,
        router: RouterConfig,
        server: ServerConfig,
        *,
        model_dir: Path,
        app_name: str,
        has_prefill: bool,
        kv_readback_ttl_s: int = 0,
        token_host: str | None = None,
    ) -> None:
        """`kv_readback_ttl_s`: how long decode engines keep a finished turn's KV pinned (0: no readback).
        `token_host`: the address decode replicas send this router's tokens to (None: all on this machine,
        over an ipc socket)."""
        self.model = model
        self.server = server
        self.config = LiveConfig(router)
        self.app_name = app_name
        self.metrics = RouterMetrics()
        self._serving: bool | None = None  # what grpc.health.v1 says now (None: not yet set)
        tokenizer = PromptTokenizer(model_dir, trust_remote_code=model.trust_remote_code)
        decode = serve.get_deployment_handle("decode", app_name)
        self._registry = serve.get_deployment_handle("registry", app_name)
        # Everything kept about a session between its turns, by every part of the router, one bound.
        self.sessions = Sessions.of(router)
        self.policy = PdservePolicy(router, sessions=self.sessions)
        # The policy deciding: pdserve's, or a cache-blind baseline the topology asks for (benchmarks only).
        self._policies: dict[str, Policy] = {
            "pdserve": self.policy,
            "round_robin": RoundRobinPolicy(),
            "least_loaded": LeastLoadedPolicy(),
            "session_hash": SessionHashPolicy(),
        }
        self.view = ClusterView(
            self._registry,
            block_size=model.block_size,
            timing=self.policy.weights.timing,
            router_id=_replica_id(),
        )
        self.view.report = self._report
        self._deployed: dict[str, Any] | None = None  # the deployed router section last applied
        self.view.on_router_settings = self._follow_deployed
        self._node_id = _node_id()
        self._metrics_address = ""  # where /metrics listens, once it does
        self.metrics.watch(model.name, lambda: self.view.replicas, self.view.load)
        # Read secrets and certificates now, not on the event loop; the token's value is never logged.
        self._tls = None
        if server.tls is not None:
            self._tls = (Path(server.tls.key_file).read_bytes(), Path(server.tls.cert_file).read_bytes())
        self._token = None
        if server.auth_token_env:
            self._token = os.environ.get(server.auth_token_env)
            if not self._token:
                raise RuntimeError(f"server.auth_token_env names {server.auth_token_env}, which is not set")
        self.tokens = TokenReceiver(token_host)
        self.leg_channel = LegChannel(self.tokens, self.view.legs_address)
        self.legs = Orchestrator(
            self.leg_channel, decode, tokens=self.tokens, block_size=model.block_size, config=self.config
        )
        self.decider = Decider(
            view=self.view,
            policy=self._policies[router.policy],
            block_size=model.block_size,
            has_prefill_pool=has_prefill,
            config=self.config,
            pulls=KvPulls(
                ReadbackTable(block_size=model.block_size, ttl_s=kv_readback_ttl_s, sessions=self.sessions),
                self.config,
            )
            if has_prefill and kv_readback_ttl_s > 0
            else None,
            sessions=self.sessions,
        )
        self.path = GeneratePath(
            intake=PromptIntake(
                tokenizer=tokenizer,
                chat_encoder=SessionChatEncoder(
                    tokenizer, self.sessions, on_encoded=self.metrics.on_chat_encoded
                ),
                parsers=OutputParsers(tokenizer.hf_tokenizer, model.tool_call_parser, model.reasoning_parser),
                limits=ModelLimits(
                    served_name=model.name, max_model_len=model.max_model_len, vocab_size=tokenizer.vocab_size
                ),
                block_size=model.block_size,
                metrics=self.metrics,
                sessions=self.sessions,
            ),
            decider=self.decider,
            legs=self.legs,
            metrics=self.metrics,
            config=self.config,
            tracer=otlp_tracer(server.otlp_traces_endpoint, "pdserve-router"),
        )
        self.service = PdserveService(
            self.path, block_size=model.block_size, cluster_status=self.cluster_status
        )

    def reconfigure(self, router: RouterConfig) -> None:
        """Apply a new `router` section to the running router: the next request sees it (every part reads
        `self.config.current`; what is derived from it is rebuilt here). Sessions, the KV index and load
        accounting are kept."""
        old = self.config.current
        if router == old:
            return
        self.config.current = router
        self.sessions.resize(router.max_sessions, router.max_session_tokens)
        self.policy.reconfigure(router)
        self.view.load.timing = self.policy.weights.timing
        if router.policy != old.policy:
            self.decider.use_policy(self._policies[router.policy])
        log.info("router settings applied in place: %s", _changed(old, router))

    def _follow_deployed(self, raw: dict[str, Any]) -> None:
        """The deployed `router` section, as the view's registry poll read it (the registry holds the
        topology `pdserve apply` deployed): applied when it changed."""
        if raw == self._deployed:
            return
        self._deployed = raw
        try:
            self.reconfigure(msgspec.convert(raw, RouterConfig))
        except msgspec.ValidationError as exc:  # validated by apply; only a hand-made deploy gets here
            log.error("deployed router settings refused, keeping the current ones: %s", exc)

    async def _follow_health(self, health: Any, every_s: float = 0.25) -> None:
        while True:
            await asyncio.sleep(every_s)
            await self._update_health(health)

    async def _update_health(self, health: Any) -> None:
        """grpc.health.v1 says SERVING while a decode replica can take requests and NOT_SERVING while none
        can (all failed, draining or starting), so a load balancer in front sends traffic elsewhere."""
        now = self.view.serving("decode") > 0
        if now == self._serving:
            return
        if self._serving is not None:
            log.warning("health: %s", "SERVING again" if now else "NOT_SERVING: no decode replica can serve")
        status = HealthCheckResponse.SERVING if now else HealthCheckResponse.NOT_SERVING
        for name in ("", pb.DESCRIPTOR.services_by_name["Pdserve"].full_name):
            await health.set(name, status)
        self.metrics.serving.set(1 if now else 0)
        self._serving = now

    def _report(self) -> RouterReport:
        """What this router tells the registry at each poll: its endpoint and its load in flight."""
        server = self.server
        return RouterReport(
            router_id=self.view.router_id,
            node_id=self._node_id,
            grpc_address=f"{server.grpc_host}:{server.grpc_port}",
            metrics_address=self._metrics_address,
            serving=bool(self._serving),
            routable={role: self.view.serving(role) for role in ("prefill", "decode")},
            inflight_requests=self.view.load.inflight(),
            admitted_tokens=self.decider.admitted_tokens,
            replicas=self.view.load.dispatched(),
        )

    async def cluster_status(self) -> pb.GetClusterStatusResponse:
        """The registry's replicas (their latest stats), in the state this router sees them: READY only once
        it routes to them (its view polls the registry every second), FAILED as soon as it saw one fail;
        and every live router, this one marked as the one answering."""
        infos: list[ReplicaInfo]
        routers: list[RouterReport]
        infos, routers = await asyncio.gather(
            self._registry.snapshot.remote(), self._registry.routers.remote()
        )
        known, failed = self.view.replicas, set(self.view.failed_ids())
        me = self.view.router_id
        if me not in {r.router_id for r in routers}:
            routers = [self._report(), *routers]  # not yet reported (its first poll is under way)
        return pb.GetClusterStatusResponse(
            replicas=[
                _replica_status(i, routed=i.replica_id in known, failed=i.replica_id in failed) for i in infos
            ],
            routers=[_router_status(r, answering=r.router_id == me) for r in routers],
        )

    async def serve_until(self, stop: asyncio.Event, on_ready: Callable[[], None] = lambda: None) -> None:
        cfg = self.server
        await self.view.refresh()
        view_task = asyncio.create_task(self.view.run(), name="cluster-view")
        self._metrics_address = self._serve_metrics()
        server, health = await start_grpc_server(
            self.service, host=cfg.grpc_host, port=cfg.grpc_port, tls=self._tls, auth_token=self._token
        )
        log.info("gRPC endpoint on %s:%d", cfg.grpc_host, cfg.grpc_port)
        http = await self._start_http() if cfg.http_port is not None else None
        await self._update_health(health)
        health_task = asyncio.create_task(self._follow_health(health), name="health")
        on_ready()
        try:
            await stop.wait()
        finally:
            health_task.cancel()
            if http is not None:
                await http.stop()
            await health.enter_graceful_shutdown()
            # In-flight streams get a grace period to finish; new calls are refused meanwhile.
            await server.stop(grace=10.0)
            view_task.cancel()
            self.leg_channel.close()
            self.tokens.close()
            await self._withdraw()

    def _serve_metrics(self) -> str:
        """Serve /metrics on the first free port of this node's routers' (`server.metrics_port` up: routers
        sharing a node take one each); its host:port."""
        cfg = self.server
        span = 1 if cfg.router_node_labels else cfg.routers
        error: OSError | None = None
        for port in range(cfg.metrics_port, cfg.metrics_port + span):
            try:
                self.metrics.serve(cfg.metrics_host, port)
            except OSError as exc:
                error = exc
                continue
            return f"{cfg.metrics_host}:{port}"
        assert error is not None
        last = cfg.metrics_port + span - 1
        ports = f"{cfg.metrics_port}" if span == 1 else f"{cfg.metrics_port}-{last}"
        raise ListenError("server.metrics_port", f"{cfg.metrics_host}:{ports}", error.strerror or str(error))

    async def _withdraw(self) -> None:
        """Leave the registry's routers: the others stop counting this one's load at once."""
        try:
            await self._registry.withdraw_router.remote(self.view.router_id)
        except Exception as exc:  # the registry away: the entry expires on its own within seconds
            log.warning("could not withdraw router %s from the registry: %s", self.view.router_id, exc)

    async def _start_http(self) -> HttpServer:
        cfg = self.server
        assert cfg.http_port is not None
        app = build_app(
            self.path,
            served_name=self.model.name,
            max_model_len=self.model.max_model_len,
            serving=lambda: bool(self._serving),
            auth_token=self._token,
        )
        tls = cfg.tls
        server = HttpServer(
            app, cfg.http_host, cfg.http_port, tls=(tls.key_file, tls.cert_file) if tls else None
        )
        await server.start()
        log.info("OpenAI HTTP endpoint on %s:%d", cfg.http_host, cfg.http_port)
        return server


def _replica_id() -> str | None:
    """This router's Serve replica id (None outside a Serve replica: a random one is drawn)."""
    try:
        return str(serve.get_replica_context().replica_id.unique_id)
    except RayServeException:
        return None


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


def _changed(old: RouterConfig, new: RouterConfig) -> str:
    a, b = msgspec.to_builtins(old), msgspec.to_builtins(new)
    return ", ".join(f"{k}: {a[k]} -> {b[k]}" for k in b if a.get(k) != b[k]) or "none"


def _router_status(report: RouterReport, *, answering: bool) -> pb.Router:
    return pb.Router(
        router_id=report.router_id,
        node_id=report.node_id,
        grpc_address=report.grpc_address,
        metrics_address=report.metrics_address,
        serving=report.serving,
        inflight_requests=report.inflight_requests,
        answering=answering,
    )


def _replica_status(info: ReplicaInfo, *, routed: bool = True, failed: bool = False) -> pb.Replica:
    replica = pb.Replica(
        replica_id=info.replica_id,
        role=info.role,
        state="FAILED"
        if info.failed or failed
        else "DRAINING"
        if info.draining
        else "READY"
        if info.ready and routed
        else "STARTING",
        node_id=info.node_id,
        start_phases_s=info.start_phases,
    )
    s = info.stats
    if s is not None:
        replica.running_requests = s.running
        replica.waiting_requests = s.waiting
        replica.kv_cache_usage = s.kv_cache_usage
        replica.prompt_tokens_computed = s.prompt_tokens_computed
        replica.prompt_tokens_local_cache_hit = s.prompt_tokens_local_cache_hit
        replica.prompt_tokens_external_kv = s.prompt_tokens_external_kv
        replica.nixl_bytes_transferred = s.nixl_bytes_transferred
        replica.requests_finished = s.requests_finished
        replica.spec_drafts = s.spec_drafts
        replica.spec_draft_tokens = s.spec_draft_tokens
        replica.spec_accepted_tokens = s.spec_accepted_tokens
    return replica
