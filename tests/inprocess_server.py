"""pdserve's gRPC server in this test process, on its own port: the real service (validation, the built-in
model's tokenizer and chat template, router, error mapping, TLS and token auth), with a stand-in decode
replica, D1, that streams two tokens for any request. For tests of the endpoint itself; tests/e2e runs real
engines."""

from __future__ import annotations

import asyncio
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from decode_pool import StandInLegs, token_receiver
from grpc_health.v1 import health_pb2
from ports import free_port
from replicas import replica_info

from engine.messages import ClusterState, EngineRequest, ReplicaInfo, RouterReport, TokenBatch
from engine.tiny_model import ensure_tiny_model
from pdserve_client.api import pdserve_pb2 as pb
from router.config import LiveConfig
from router.decision.decider import Decider
from router.doors.grpc_service import PdserveService, start_grpc_server
from router.doors.openai_http import HttpServer, build_app
from router.generate import GeneratePath
from router.intake.chat_encoder import SessionChatEncoder
from router.intake.output_parser import OutputParsers
from router.intake.prompt import PromptIntake
from router.intake.tokenizer import PromptTokenizer
from router.intake.validation import ModelLimits
from router.legs.orchestrator import Orchestrator
from router.metrics import RouterMetrics
from router.policy.selector import PdservePolicy
from router.view.cluster_view import ClusterView


class StandInRegistry:
    """The registry's snapshot lists `entries` (default: one decode replica, D1), and a poll also reads back
    `routers` (the other routers' reports) and `router_settings` (the deployed router section); a test may
    change them between polls. `reports`: what the router reported at each poll."""

    class _Call:
        def __init__(self, answer: Any) -> None:
            self._answer = answer

        def remote(self, *args: Any) -> Any:
            async def answer() -> Any:
                return self._answer(*args)

            return answer()

    def __init__(self, entries: list[ReplicaInfo] | None = None) -> None:
        self.entries = [replica_info("D1")] if entries is None else entries
        self.routers: list[RouterReport] = []
        self.router_settings: dict[str, Any] | None = None
        self.reports: list[RouterReport] = []
        self.snapshot = self._Call(lambda: list(self.entries))
        self.sync = self._Call(self._sync)
        self.report_failed = self._Call(lambda *_: None)
        self.withdraw_router = self._Call(lambda *_: None)

    def _sync(self, report: RouterReport) -> ClusterState:
        self.reports.append(report)
        return ClusterState(
            replicas=list(self.entries), routers=list(self.routers), router_settings=self.router_settings
        )


async def listed_view(registry: StandInRegistry | None = None) -> ClusterView:
    """The router's view of `registry`'s replicas (default: D1), as its first poll leaves it."""
    view = ClusterView(registry or StandInRegistry(), block_size=32)
    await view.refresh()
    return view


def _decode_pool(
    tokenizer: PromptTokenizer, output: list[str] | None, seen: list[EngineRequest]
) -> StandInLegs:
    """Streams `output` (text pieces, one batch each; default "a", "b" as ids 5, 6) for any request, and
    records the requests it got in `seen`."""
    if output is None:
        pieces = [([5], "a"), ([6], "b")]
    else:
        pieces = [(tokenizer.encode_rendered(text), text) for text in output]

    async def batches(req: EngineRequest, replica_id: str) -> AsyncIterator[TokenBatch]:
        seen.append(req)
        *first, (last_ids, last_text) = pieces
        for ids, text in first:
            yield TokenBatch(token_ids=ids, text=text, replica_id="D1")
            await asyncio.sleep(0.005)  # an engine step: the router sends each batch as it comes
        yield TokenBatch(
            token_ids=last_ids,
            text=last_text,
            finish_reason="stop",
            num_prompt_tokens=len(req.prompt_token_ids),
            replica_id="D1",
            node_id="n1",
        )

    return StandInLegs(batches)


async def _no_replicas() -> pb.GetClusterStatusResponse:
    return pb.GetClusterStatusResponse()


def generate_path(
    tokenizer: PromptTokenizer,
    legs: StandInLegs,
    view: ClusterView,
    *,
    tool_parser: str | None = None,
    metrics: RouterMetrics | None = None,
) -> GeneratePath:
    """The request path as the router process builds it, with no prefill pool: legs go to `legs`."""
    metrics = metrics or RouterMetrics()
    return GeneratePath(
        intake=PromptIntake(
            tokenizer=tokenizer,
            chat_encoder=SessionChatEncoder(tokenizer),
            parsers=OutputParsers(tokenizer.hf_tokenizer, tool_parser, None),
            limits=ModelLimits(served_name="tiny-llama", max_model_len=2048, vocab_size=tokenizer.vocab_size),
            block_size=32,
            metrics=metrics,
        ),
        decider=Decider(
            view=view, policy=PdservePolicy(), block_size=32, has_prefill_pool=False, config=LiveConfig()
        ),
        legs=Orchestrator(
            legs,  # type: ignore[arg-type]
            None,  # no prefill pool: no KV to export or release
            tokens=token_receiver(),
            block_size=32,
            config=LiveConfig(),
        ),
        metrics=metrics,
    )


@contextmanager
def endpoint(
    *,
    tls: tuple[bytes, bytes] | None = None,
    auth_token: str | None = None,
    output: list[str] | None = None,
    seen: list[EngineRequest] | None = None,
    http_port: int | None = None,
) -> Iterator[str]:
    """Serve on 127.0.0.1 (in a thread with its own event loop) until the block ends; yields host:port. The
    stand-in decode pool streams `output` and appends the engine requests it gets to `seen`. With
    `http_port`, the OpenAI HTTP door listens there too."""
    model_dir = ensure_tiny_model()
    port = free_port()
    started = threading.Event()
    stop: list[asyncio.Event] = []

    async def serve() -> None:
        tokenizer = PromptTokenizer(model_dir)
        decode = _decode_pool(tokenizer, output, [] if seen is None else seen)
        view = await listed_view()
        path = generate_path(tokenizer, decode, view, tool_parser="hermes")
        service = PdserveService(path, block_size=32, cluster_status=_no_replicas)
        server, health = await start_grpc_server(
            service, host="127.0.0.1", port=port, tls=tls, auth_token=auth_token
        )
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        http = None
        if http_port is not None:
            app = build_app(
                path,
                served_name="tiny-llama",
                max_model_len=2048,
                serving=lambda: True,
                auth_token=auth_token,
            )
            files = None
            if tls is not None:  # uvicorn reads the key and certificate from files
                folder = Path(tempfile.mkdtemp(prefix="pdserve-tls-"))
                (folder / "key.pem").write_bytes(tls[0])
                (folder / "cert.pem").write_bytes(tls[1])
                files = (str(folder / "key.pem"), str(folder / "cert.pem"))
            http = HttpServer(app, "127.0.0.1", http_port, tls=files)
            await http.start()
        stop.append(asyncio.Event())
        started.set()
        await stop[0].wait()
        if http is not None:
            await http.stop()
        await server.stop(grace=None)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(120), "the in-process server did not start"
    try:
        yield f"127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(stop[0].set)
        thread.join(timeout=30)
