"""pdserve's gRPC server in this test process, on its own port: the real service (validation, the built-in
model's tokenizer and chat template, router, error mapping, TLS and token auth), with a stand-in decode pool
that streams two tokens for any request. For tests of the endpoint itself; tests/e2e runs real engines."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from grpc_health.v1 import health_pb2
from ports import free_port

from engine.messages import EngineRequest, TokenBatch
from engine.tiny_model import ensure_tiny_model
from router.api import pdserve_pb2 as pb
from router.chat_encoder import SessionChatEncoder
from router.cluster_view import ClusterView
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator
from router.policy.selector import PdservePolicy, PdservePolicyConfig
from router.routing import RequestRouter
from router.server import PdserveService, start_grpc_server
from router.tokenizer import PromptTokenizer
from router.validation import ModelLimits


class _Registry:
    """No replica registered: the router lets the (stand-in) pool choose."""

    class _Call:
        def __init__(self, value: Any) -> None:
            self.value = value

        def remote(self, *args: Any) -> Any:
            async def answer() -> Any:
                return self.value

            return answer()

    snapshot = _Call([])
    report_failed = _Call(None)


class _Decode:
    """Streams two tokens, then a final batch, for any request."""

    def options(self, stream: bool) -> _Decode:
        return self

    @property
    def generate(self) -> _Decode:
        return self

    def remote(
        self, req: EngineRequest, replica_hint: str | None = None, replica_avoid: tuple[str, ...] = ()
    ) -> Any:
        return _Stream(req)


class _Stream:
    def __init__(self, req: EngineRequest) -> None:
        self.req = req

    def __aiter__(self) -> AsyncIterator[TokenBatch]:
        return self._gen()

    async def _gen(self) -> AsyncIterator[TokenBatch]:
        yield TokenBatch(token_ids=[5], text="a", replica_id="D1")
        yield TokenBatch(
            token_ids=[6],
            text="b",
            finish_reason="length",
            num_prompt_tokens=len(self.req.prompt_token_ids),
            replica_id="D1",
            node_id="n1",
        )

    def cancel(self) -> None:
        return None


async def _no_replicas() -> list[pb.Replica]:
    return []


@contextmanager
def endpoint(*, tls: tuple[bytes, bytes] | None = None, auth_token: str | None = None) -> Iterator[str]:
    """Serve on 127.0.0.1 (in a thread with its own event loop) until the block ends; yields host:port."""
    model_dir = ensure_tiny_model()
    port = free_port()
    started = threading.Event()
    stop: list[asyncio.Event] = []

    async def serve() -> None:
        tokenizer = PromptTokenizer(model_dir)
        service = PdserveService(
            tokenizer=tokenizer,
            chat_encoder=SessionChatEncoder(tokenizer),
            limits=ModelLimits(served_name="tiny-llama", max_model_len=2048, vocab_size=tokenizer.vocab_size),
            block_size=32,
            orchestrator=Orchestrator(None, _Decode(), block_size=32),
            router=RequestRouter(
                view=ClusterView(_Registry(), block_size=32),
                policy=PdservePolicy(PdservePolicyConfig()),
                block_size=32,
                has_prefill_pool=False,
                overload_queue_tokens=65536,
            ),
            metrics=RouterMetrics(),
            cluster_status=_no_replicas,
        )
        server, health = await start_grpc_server(
            service, host="127.0.0.1", port=port, tls=tls, auth_token=auth_token
        )
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        stop.append(asyncio.Event())
        started.set()
        await stop[0].wait()
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
