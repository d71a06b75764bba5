"""The OpenAI-compatible HTTP door (topology `server.http_port`; off by default).

`/v1/chat/completions`, `/v1/completions`, `/v1/models` and `/health`. A request's way: the body, parsed by
vLLM's own OpenAI protocol models -> a `GenerateRequest` (router/doors/openai_wire.py) -> the request path
(router/generate.py), as the gRPC door runs it -> its output as OpenAI responses or SSE chunks. Errors are
OpenAI's error JSON with the HTTP status matching the gRPC code. The session id comes from the
`X-Session-Id` header, else the body's `user`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from vllm.exceptions import VLLMValidationError

from pdserve_client.api import pdserve_pb2 as pb
from router.doors.auth import BearerToken
from router.doors.limits import MAX_REQUEST_BYTES
from router.doors.listen import ListenError, bind
from router.doors.openai_wire import (
    BadRequest,
    ChatOutput,
    CompletionOutput,
    Output,
    chat_request,
    completion_request,
    include_usage,
    refuse_unsupported,
)
from router.errors import RequestFailed
from router.generate import GeneratePath, served_request_id
from router.messages import Finished, OutputDelta

log = logging.getLogger(__name__)

_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def build_app(
    path: GeneratePath,
    *,
    served_name: str,
    max_model_len: int,
    serving: Callable[[], bool],
    auth_token: str | None = None,
) -> FastAPI:
    """The door's FastAPI app. `serving`: whether a decode replica can take requests (for /health)."""
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    if auth_token:
        app.add_middleware(_RequireToken, token=BearerToken(auth_token))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if serving() else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": served_name, "object": "model", "created": 0, "owned_by": "pdserve"}
        return {"object": "list", "data": [{**card, "max_model_len": max_model_len}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        return await _serve(path, request, ChatCompletionRequest, chat_request, ChatOutput)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        return await _serve(path, request, CompletionRequest, completion_request, CompletionOutput)

    return app


async def _serve(
    path: GeneratePath,
    http: Request,
    model: Any,
    convert: Callable[..., pb.GenerateRequest],
    output: type[Output],
) -> Response:
    try:
        body = msgspec.json.decode(await _body(http))
        req = model.model_validate(body)
        refuse_unsupported(req)
        request = convert(req)
    except _TooLarge as exc:
        return _error(413, str(exc))
    except msgspec.DecodeError as exc:
        return _error(400, f"the body is not JSON: {exc}")
    except ValidationError as exc:
        problem = exc.errors()[0]
        param = ".".join(str(p) for p in problem["loc"])
        return _error(400, f"{param}: {problem['msg']}", param=param)
    except BadRequest as exc:
        return _error(400, str(exc), param=exc.param)
    except VLLMValidationError as exc:  # vLLM's cross-field checks (e.g. tool_choice without tools)
        return _error(400, str(exc), param=getattr(exc, "parameter", None))
    request.session_id = http.headers.get("x-session-id") or getattr(req, "user", None) or ""
    request.request_id = http.headers.get("x-request-id", "")
    events = path.run(request, served_request_id(request.request_id))
    out = output(
        model_name=req.model or "",
        include_usage=include_usage(req),
        return_token_ids=bool(getattr(req, "return_token_ids", False)),
    )
    try:
        first = await anext(events)  # validation and routing errors come before the first event
    except RequestFailed as exc:
        return _error(_STATUS.get(exc.code, 500), exc.message)
    if not req.stream:
        try:
            out.add(first)
            async for event in events:
                out.add(event)
        except RequestFailed as exc:
            return _error(_STATUS.get(exc.code, 500), exc.message)
        return JSONResponse(out.whole())
    return StreamingResponse(_sse(out, first, events), media_type="text/event-stream")


class _RequireToken:
    """Refuses every path but /health without the bearer token. Plain ASGI: Starlette's `BaseHTTPMiddleware`
    would relay every body chunk and every streamed SSE event through a memory stream of its own."""

    def __init__(self, app: Any, token: BearerToken) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            sent = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            if not self.token.allows(sent):
                response = _error(401, "missing or invalid bearer token", "authentication_error")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _TooLarge(Exception):
    pass


async def _body(http: Request) -> bytes:
    """The request's body, read only up to MAX_REQUEST_BYTES."""
    too_large = _TooLarge(f"the request body is over {MAX_REQUEST_BYTES} bytes, the limit of both doors")
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_REQUEST_BYTES:
        raise too_large
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > MAX_REQUEST_BYTES:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def _sse(
    out: Output, first: OutputDelta | Finished, rest: AsyncIterator[OutputDelta | Finished]
) -> AsyncIterator[bytes]:
    try:
        for chunk in out.chunks(first):
            yield _event(chunk)
        async for event in rest:
            for chunk in out.chunks(event):
                yield _event(chunk)
    except RequestFailed as exc:
        # The status line went out with the first chunk: the error travels as an event, as vLLM sends it.
        yield _event(_error_body(exc.message, _error_type(_STATUS.get(exc.code, 500))))
    yield b"data: [DONE]\n\n"


def _event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(chunk) + b"\n\n"


def _error_type(status: int) -> str:
    return {
        400: "invalid_request_error",
        401: "authentication_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
    }.get(status, "server_error")


def _error_body(message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def _error(status: int, message: str, kind: str | None = None, *, param: str | None = None) -> JSONResponse:
    return JSONResponse(_error_body(message, kind or _error_type(status), param), status_code=status)


class HttpServer:
    """The door's app served by uvicorn on this process's event loop, on a socket bound here first (uvicorn
    would exit the process on a port in use), leaving signals to pdserve."""

    def __init__(self, app: FastAPI, host: str, port: int, *, tls: tuple[str, str] | None = None) -> None:
        import uvicorn

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:  # pdserve handles Ctrl-C and SIGTERM itself
                yield

        key, cert = tls if tls else (None, None)
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            ssl_keyfile=key,
            ssl_certfile=cert,
            timeout_graceful_shutdown=10,  # as the gRPC server's grace: in-flight streams get 10 s to finish
        )
        self._server = _Server(config)
        self._address = (host, port)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        host, port = self._address
        sock = bind("server.http_port", host, port, shared=True)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="openai-http")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise ListenError("server.http_port", f"{host}:{port}", "the HTTP server did not start")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await self._task
