"""A stream whose router goes away: the SDK reconnects and continues it from what it already received.

The routers are in-process fake servers (they record what arrives and answer canned tokens; they are not
pdserve's router). The first is stopped mid-stream, a real lost connection; the second listens on the same
port, as Serve's replacement router does. The continuation against real routers and engines:
the `router` fault of tests/e2e/test_faults.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from ports import free_port

from pdserve_client.api import pdserve_pb2 as pb
from pdserve_client.api import pdserve_pb2_grpc
from pdserve_client.sdk import AsyncPdserveClient, PdserveClient, PdserveError

PROMPT_IDS = [1, 2, 3]


class DyingRouter(pdserve_pb2_grpc.PdserveServicer):
    """Streams three tokens (`silent`: none), then hangs until it is stopped."""

    def __init__(self, silent: bool = False) -> None:
        self.sent = threading.Event()
        self.silent = silent

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        for t in () if self.silent else (5, 6, 7):
            yield pb.GenerateResponse(request_id="r", token_ids=[t], text=f"<{t}>")
        self.sent.set()
        while context.is_active():
            time.sleep(0.01)


class NextRouter(pdserve_pb2_grpc.PdserveServicer):
    def __init__(self) -> None:
        self.requests: list[Any] = []

    def Tokenize(self, request: pb.TokenizeRequest, context: grpc.ServicerContext) -> pb.TokenizeResponse:
        self.requests.append(request)
        return pb.TokenizeResponse(token_ids=PROMPT_IDS, max_model_len=2048)

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        self.requests.append(request)
        yield pb.GenerateResponse(request_id="r.1", token_ids=[8, 9], text="<8><9>")
        yield pb.GenerateResponse(
            request_id="r.1",
            final=pb.Final(
                finish_reason=pb.FINISH_REASON_LENGTH,
                usage=pb.Usage(
                    prompt_tokens=len(request.prompt_token_ids), cached_tokens=6, completion_tokens=2
                ),
                served_by=pb.ServedBy(decode_replica="d-0"),
            ),
        )


def serve(servicer: Any, port: int) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pdserve_pb2_grpc.add_PdserveServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server


class Routers:
    """A router that dies once it has streamed three tokens, and (unless `replaced` is False) the one
    that takes its port a moment later."""

    def __init__(self, replaced: bool = True, silent: bool = False) -> None:
        self.port = free_port()
        self.dying, self.next = DyingRouter(silent), NextRouter()
        self._first = serve(self.dying, self.port)
        self._second: grpc.Server | None = None
        self._replaced = replaced
        threading.Thread(target=self._replace, daemon=True).start()

    def _replace(self) -> None:
        self.dying.sent.wait(30)
        self._first.stop(grace=None).wait()
        if self._replaced:
            time.sleep(0.5)  # nothing listens for a while, as while Serve starts the new router
            self._second = serve(self.next, self.port)

    def close(self) -> None:
        self._first.stop(grace=None)
        if self._second is not None:
            self._second.stop(grace=None)


@pytest.fixture
def routers() -> Iterator[Routers]:
    r = Routers()
    yield r
    r.close()


def assert_continued(routers: Routers, tokens: list[int], usage: pb.Usage, served_by: pb.ServedBy) -> None:
    assert tokens == [5, 6, 7, 8, 9]
    tokenize, generate = routers.next.requests
    assert tokenize.prompt == "hello"
    # The continuation: the prompt's ids and every token received, with what is left of max_tokens.
    assert list(generate.prompt_token_ids) == [*PROMPT_IDS, 5, 6, 7]
    assert generate.prompt == "" and generate.sampling.max_tokens == 2
    assert generate.session_id == "s1" and generate.sampling.temperature == 0
    # The final message is the whole request's.
    assert usage.prompt_tokens == 3 and usage.completion_tokens == 5 and usage.cached_tokens == 3
    assert "continued after 3 tokens: the router connection was lost" in served_by.note


def test_a_stream_whose_router_dies_continues_on_the_next_one(routers: Routers) -> None:
    with PdserveClient(f"127.0.0.1:{routers.port}") as client:
        responses = list(client.generate(prompt="hello", max_tokens=5, temperature=0, session_id="s1"))
    tokens = [t for r in responses for t in r.token_ids]
    final = responses[-1].final
    assert_continued(routers, tokens, final.usage, final.served_by)


async def test_the_async_client_continues_a_stream_the_same_way(routers: Routers) -> None:
    async with AsyncPdserveClient(f"127.0.0.1:{routers.port}") as client:
        done = await client.generate_text(prompt="hello", max_tokens=5, temperature=0, session_id="s1")
    assert done.text == "<5><6><7><8><9>"
    assert_continued(routers, done.token_ids, done.usage, done.served_by)


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        (
            {"tools": [{"name": "f", "parameters": {}}], "max_tokens": 5},
            "a request with tools or a response format cannot continue",
        ),
        ({}, "a request without max_tokens cannot continue"),
    ],
)
def test_a_stream_that_cannot_continue_fails_saying_why(
    routers: Routers, fields: dict[str, Any], why: str
) -> None:
    with PdserveClient(f"127.0.0.1:{routers.port}") as client, pytest.raises(PdserveError) as failed:
        list(client.generate(prompt="hello", **fields))
    assert failed.value.code == grpc.StatusCode.UNAVAILABLE
    assert f"(the stream was not continued: {why}" in failed.value.message
    assert routers.next.requests == []


def test_with_no_router_back_within_reconnect_s_the_stream_fails() -> None:
    routers = Routers(replaced=False)
    try:
        with PdserveClient(f"127.0.0.1:{routers.port}", reconnect_s=1.0) as client:
            started = time.monotonic()
            with pytest.raises(PdserveError) as failed:
                list(client.generate(prompt="hello", max_tokens=5))
        assert failed.value.code == grpc.StatusCode.UNAVAILABLE
        assert "no router answered within 1 s" in failed.value.message
        assert time.monotonic() - started < 10
    finally:
        routers.close()


def test_reconnect_s_0_fails_the_stream_at_once(routers: Routers) -> None:
    with PdserveClient(f"127.0.0.1:{routers.port}", reconnect_s=0) as client, pytest.raises(PdserveError):
        list(client.generate(prompt="hello", max_tokens=5))
    assert routers.next.requests == []


def test_a_stream_no_router_answered_yet_fails_at_once() -> None:
    """Not a lost router, as far as the client can tell: an address nothing serves or a failing TLS
    handshake look the same, and waiting reconnect_s for those would only delay their error."""
    routers = Routers(silent=True)
    try:
        with PdserveClient(f"127.0.0.1:{routers.port}") as client, pytest.raises(PdserveError) as failed:
            list(client.generate(prompt="hello", max_tokens=5))
        assert failed.value.code == grpc.StatusCode.UNAVAILABLE
        assert routers.next.requests == []
    finally:
        routers.close()
