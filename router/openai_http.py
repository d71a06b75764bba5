"""pdserve's OpenAI-compatible HTTP door (topology `server.http_port`; off by default).

`/v1/chat/completions`, `/v1/completions`, `/v1/models` and `/health`, parsed with vLLM's own OpenAI protocol
models. A request's way: the OpenAI body -> a `pdserve.v1.GenerateRequest` -> the gRPC door's own path
(`PdserveService.run`: validation, routing, the prefill and decode legs, output parsing) -> its messages as
OpenAI responses or SSE chunks. Errors are OpenAI's error JSON with the HTTP status matching the gRPC code.
The session id comes from the `X-Session-Id` header, else the body's `user`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from vllm.exceptions import VLLMValidationError

from router.api import pdserve_pb2 as pb
from router.server import GenerateCall, ListenError, PdserveService, RequestFailed

log = logging.getLogger(__name__)

_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_FINISH = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
}
# Request fields pdserve does not serve: refused by name rather than ignored.
_UNSUPPORTED = {
    "n": lambda v: v not in (None, 1),
    "best_of": lambda v: v not in (None, 1),
    "prompt_logprobs": lambda v: v is not None,
    "logit_bias": lambda v: bool(v),
    "echo": lambda v: bool(v),
}


class _BadRequest(Exception):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def build_app(
    service: PdserveService,
    *,
    served_name: str,
    max_model_len: int,
    serving: Callable[[], bool],
    auth_token: str | None = None,
) -> FastAPI:
    """The door's FastAPI app. `serving`: whether a decode replica can take requests (for /health)."""
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    token = auth_token.encode() if auth_token else None

    @app.middleware("http")
    async def authenticate(request: Request, call_next: Any) -> Response:
        if token is not None and request.url.path != "/health":
            scheme, _, sent = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(sent.encode(), token):
                return _error(401, "missing or invalid bearer token", "authentication_error")
        response: Response = await call_next(request)
        return response

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

        return await _serve(service, request, ChatCompletionRequest, _chat_request, _ChatOutput)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        return await _serve(service, request, CompletionRequest, _completion_request, _CompletionOutput)

    return app


async def _serve(
    service: PdserveService,
    http: Request,
    model: Any,
    convert: Callable[..., pb.GenerateRequest],
    output: Any,
) -> Response:
    try:
        body = json.loads(await http.body())
        req = model.model_validate(body)
        _refuse_unsupported(req)
        grpc_request = convert(req)
    except json.JSONDecodeError as exc:
        return _error(400, f"the body is not JSON: {exc}")
    except ValidationError as exc:
        problem = exc.errors()[0]
        param = ".".join(str(p) for p in problem["loc"])
        return _error(400, f"{param}: {problem['msg']}", param=param)
    except _BadRequest as exc:
        return _error(400, str(exc), param=exc.param)
    except VLLMValidationError as exc:  # vLLM's cross-field checks (e.g. tool_choice without tools)
        return _error(400, str(exc), param=getattr(exc, "parameter", None))
    grpc_request.session_id = http.headers.get("x-session-id") or getattr(req, "user", None) or ""
    grpc_request.request_id = http.headers.get("x-request-id", "")
    call = GenerateCall(grpc_request, grpc_request.SerializeToString(), uuid.uuid4().hex)
    messages = service.run(call, lambda: None)
    out = output(
        model_name=req.model or "",
        include_usage=_include_usage(req),
        return_token_ids=bool(getattr(req, "return_token_ids", False)),
    )
    try:
        first = await anext(messages)  # validation and routing errors come before the first message
    except RequestFailed as exc:
        return _error(_STATUS.get(exc.code, 500), exc.message)
    if not req.stream:
        try:
            out.add(first)
            async for message in messages:
                out.add(message)
        except RequestFailed as exc:
            return _error(_STATUS.get(exc.code, 500), exc.message)
        return JSONResponse(out.whole())
    return StreamingResponse(_sse(out, first, messages), media_type="text/event-stream")


async def _sse(
    out: Any, first: pb.GenerateResponse, rest: AsyncIterator[pb.GenerateResponse]
) -> AsyncIterator[str]:
    try:
        for chunk in out.chunks(first):
            yield f"data: {json.dumps(chunk)}\n\n"
        async for message in rest:
            for chunk in out.chunks(message):
                yield f"data: {json.dumps(chunk)}\n\n"
    except RequestFailed as exc:
        # The status line went out with the first chunk: the error travels as an event, as vLLM sends it.
        yield f"data: {json.dumps(_error_body(exc.message, _error_type(_STATUS.get(exc.code, 500))))}\n\n"
    yield "data: [DONE]\n\n"


def _include_usage(req: Any) -> bool:
    if not req.stream:
        return True
    return bool(req.stream_options and req.stream_options.include_usage)


def _refuse_unsupported(req: Any) -> None:
    for field, is_set in _UNSUPPORTED.items():
        if is_set(getattr(req, field, None)):
            raise _BadRequest(field, "not supported by pdserve")


# ---- OpenAI request -> pdserve.v1.GenerateRequest ----------------------------------------------------------


def _sampling(req: Any) -> pb.SamplingParams:
    stop = req.stop
    with warnings.catch_warnings():  # chat's max_tokens is deprecated in favour of max_completion_tokens
        warnings.simplefilter("ignore", DeprecationWarning)
        max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
    return pb.SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k if req.top_k not in (None, 0) else None,
        seed=req.seed,
        stop=[stop] if isinstance(stop, str) else list(stop or ()),
        ignore_eos=bool(req.ignore_eos),
        stop_token_ids=list(req.stop_token_ids or ()),
        frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty,
        repetition_penalty=req.repetition_penalty,
        min_p=req.min_p,
        logprobs=_logprobs(req),
    )


def _logprobs(req: Any) -> int | None:
    """Chat: `logprobs: true` and `top_logprobs: k`; completions: `logprobs: k`."""
    logprobs = req.logprobs
    if isinstance(logprobs, bool) or logprobs is None:  # chat
        if not logprobs:
            if getattr(req, "top_logprobs", None):
                raise _BadRequest("top_logprobs", "needs logprobs: true")
            return None
        return int(getattr(req, "top_logprobs", None) or 0)
    return int(logprobs)


def _chat_request(req: Any) -> pb.GenerateRequest:
    out = pb.GenerateRequest(model=_model(req), sampling=_sampling(req))
    for i, message in enumerate(req.messages):
        out.messages.append(_chat_message(message, f"messages[{i}]"))
    for tool in req.tools or ():
        out.tools.append(
            pb.Tool(
                name=tool.function.name,
                description=tool.function.description or "",
                parameters_json=json.dumps(tool.function.parameters or {}),
            )
        )
    if req.tools:
        choice = req.tool_choice
        if isinstance(choice, str):
            mode = {"auto": 0, "none": 1, "required": 2}[choice]
            out.tool_choice.CopyFrom(pb.ToolChoice(mode=mode))  # type: ignore[arg-type]
        elif choice is not None:
            out.tool_choice.CopyFrom(
                pb.ToolChoice(mode=pb.ToolChoice.MODE_FUNCTION, function_name=choice.function.name)
            )
        if req.parallel_tool_calls is False:
            out.parallel_tool_calls = False
    if req.chat_template_kwargs:
        out.chat_template_kwargs_json = json.dumps(req.chat_template_kwargs)
    _response_format(req, out)
    return out


def _completion_request(req: Any) -> pb.GenerateRequest:
    prompt = req.prompt
    out = pb.GenerateRequest(model=_model(req), sampling=_sampling(req))
    if isinstance(prompt, str):
        out.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        out.prompt_token_ids.extend(prompt)
    elif isinstance(prompt, list) and len(prompt) == 1:
        return _completion_request(req.model_copy(update={"prompt": prompt[0]}))
    else:
        raise _BadRequest("prompt", "one prompt per request: a string or a list of token ids")
    _response_format(req, out)
    return out


def _model(req: Any) -> str:
    return req.model or ""


def _chat_message(message: Any, field: str) -> pb.ChatMessage:
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if part.get("type") != "text":
                raise _BadRequest(
                    f"{field}.content[{j}]", f"only text parts are supported; got {part.get('type')}"
                )
            parts.append(part["text"])
        content = "".join(parts)
    out = pb.ChatMessage(
        role=message["role"],
        content=content or "",
        tool_call_id=message.get("tool_call_id") or "",
        name=message.get("name") or "",
    )
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        arguments = function.get("arguments", "")
        out.tool_calls.append(
            pb.ToolCall(
                id=call.get("id") or "",
                name=function.get("name") or "",
                arguments_json=arguments if isinstance(arguments, str) else json.dumps(arguments),
            )
        )
    return out


def _response_format(req: Any, out: pb.GenerateRequest) -> None:
    fmt = getattr(req, "response_format", None)
    structured = getattr(req, "structured_outputs", None)
    if fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.json_schema if fmt.json_schema else None
        if schema is None:
            raise _BadRequest("response_format.json_schema.schema", "a JSON Schema is required")
        out.response_format.json_schema = json.dumps(schema)
    elif fmt is not None and fmt.type == "json_object":
        out.response_format.json_object = True
    elif fmt is not None and fmt.type != "text":
        raise _BadRequest("response_format.type", f"{fmt.type} is not supported by pdserve")
    elif structured is not None:  # vLLM's extension: {"regex": ...} or {"choice": [...]}
        if structured.regex:
            out.response_format.regex = structured.regex
        elif structured.choice:
            out.response_format.choice.choices.extend(structured.choice)
        elif structured.json is not None:
            schema = structured.json
            out.response_format.json_schema = schema if isinstance(schema, str) else json.dumps(schema)
        else:
            raise _BadRequest("structured_outputs", "pdserve serves regex, choice and json")


# ---- pdserve.v1.GenerateResponse stream -> OpenAI responses ------------------------------------------------


class _Output:
    """Gathers a Generate stream for one OpenAI response, or turns each message into chunks."""

    prefix = ""
    object_whole = ""
    object_chunk = ""

    def __init__(self, *, model_name: str, include_usage: bool, return_token_ids: bool = False) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model_name
        self.include_usage = include_usage
        # vLLM's extension: each choice carries the ids of its tokens (benchmarks count tokens with it).
        self.return_token_ids = return_token_ids
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.logprobs: list[pb.TokenLogprob] = []
        self.final: pb.Final | None = None
        self.started = False

    def add(self, m: pb.GenerateResponse) -> None:
        self.text.append(m.text)
        self.token_ids.extend(m.token_ids)
        self.reasoning.append(m.reasoning_text)
        self.logprobs.extend(m.logprobs)
        for d in m.tool_calls:
            call = self.calls.setdefault(
                d.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            )
            call["id"] = call["id"] or d.id
            call["function"]["name"] = call["function"]["name"] or d.name
            call["function"]["arguments"] += d.arguments_json
        if m.HasField("final"):
            self.final = m.final

    def usage(self) -> dict[str, Any]:
        assert self.final is not None
        u = self.final.usage
        return {
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        }

    def served_by(self) -> dict[str, Any]:
        """pdserve's extension field (clients ignore unknown fields): how the request was served."""
        assert self.final is not None
        by, usage = self.final.served_by, self.final.usage
        return {
            "path": pb.ServingPath.Name(by.path).removeprefix("SERVING_PATH_").lower(),
            "prefill_replica": by.prefill_replica,
            "decode_replica": by.decode_replica,
            "kv_transferred_tokens": usage.kv_transferred_tokens,
            "predicted_cached_tokens": usage.predicted_cached_tokens,
            "note": by.note,
        }

    def finish_reason(self) -> str | None:
        return None if self.final is None else _FINISH.get(self.final.finish_reason, "stop")

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunks(self, m: pb.GenerateResponse) -> list[dict[str, Any]]:
        """The SSE chunks for one streamed message: its choice delta (if it has any), the usage at the end."""
        fields, has_content = self.piece(m)
        self.add(m)
        out = []
        if has_content or self.final is not None or (self.return_token_ids and m.token_ids):
            choice = {
                "index": 0,
                **fields,
                "logprobs": self.logprobs_json(m.logprobs) if m.logprobs else None,
                "finish_reason": self.finish_reason(),
            }
            if self.return_token_ids:
                choice["token_ids"] = list(m.token_ids)
            chunk = self.envelope(self.object_chunk, [choice])
            if self.final is not None:
                chunk["pdserve"] = self.served_by()
            out.append(chunk)
        if self.final is not None and self.include_usage:
            out.append({**self.envelope(self.object_chunk, []), "usage": self.usage()})
        return out

    def whole(self) -> dict[str, Any]:
        """The non-streaming response, once every message was added."""
        choice = {
            "index": 0,
            **self.whole_fields(),
            "logprobs": self.logprobs_json(self.logprobs) if self.logprobs else None,
            "finish_reason": self.finish_reason(),
        }
        if self.return_token_ids:
            choice["token_ids"] = self.token_ids
        return {
            **self.envelope(self.object_whole, [choice]),
            "usage": self.usage(),
            "pdserve": self.served_by(),
        }

    def whole_fields(self) -> dict[str, Any]:
        """The whole output's part of the response's choice."""
        raise NotImplementedError

    def piece(self, m: pb.GenerateResponse) -> tuple[dict[str, Any], bool]:
        """This message's part of a chunk's choice, and whether it carries anything."""
        raise NotImplementedError

    def logprobs_json(self, logprobs: Any) -> dict[str, Any]:
        raise NotImplementedError


class _ChatOutput(_Output):
    prefix = "chatcmpl"
    object_whole = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def whole_fields(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.text) or None}
        if any(self.reasoning):
            message["reasoning"] = "".join(self.reasoning)
        if self.calls:
            message["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        return {"message": message}

    def piece(self, m: pb.GenerateResponse) -> tuple[dict[str, Any], bool]:
        delta: dict[str, Any] = {}
        if not self.started:
            delta["role"] = "assistant"
            self.started = True
        if m.text:
            delta["content"] = m.text
        if m.reasoning_text:
            delta["reasoning"] = m.reasoning_text
        if m.tool_calls:
            delta["tool_calls"] = [_delta_call(d) for d in m.tool_calls]
        return {"delta": delta}, bool(delta)

    def logprobs_json(self, logprobs: Any) -> dict[str, Any]:
        return _chat_logprobs(logprobs)


class _CompletionOutput(_Output):
    prefix = "cmpl"
    object_whole = "text_completion"
    object_chunk = "text_completion"

    def whole_fields(self) -> dict[str, Any]:
        return {"text": "".join(self.text)}

    def piece(self, m: pb.GenerateResponse) -> tuple[dict[str, Any], bool]:
        return {"text": m.text}, bool(m.text)

    def logprobs_json(self, logprobs: Any) -> dict[str, Any]:
        return _completion_logprobs(logprobs)


def _chat_logprobs(logprobs: Any) -> dict[str, Any]:
    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t.token, t.logprob) for t in lp.top]}
            for lp in logprobs
        ]
    }


def _completion_logprobs(logprobs: Any) -> dict[str, Any]:
    return {
        "tokens": [lp.token for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{t.token: t.logprob for t in lp.top} for lp in logprobs],
    }


def _delta_call(d: pb.ToolCallDelta) -> dict[str, Any]:
    function: dict[str, str] = {"arguments": d.arguments_json}
    call: dict[str, Any] = {"index": d.index, "function": function}
    if d.id:
        call["id"], call["type"] = d.id, "function"
    if d.name:
        function["name"] = d.name
    return call


def _error_type(status: int) -> str:
    return {400: "invalid_request_error", 401: "authentication_error", 429: "rate_limit_error"}.get(
        status, "server_error"
    )


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
        try:
            family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
            sock = socket.socket(family, kind, proto)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
        except OSError as exc:
            raise ListenError("server.http_port", f"{host}:{port}", exc.strerror or str(exc)) from exc
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
