"""The Python SDK for agent backends: pdserve's gRPC API with plain-dict chat messages.

`PdserveClient` is synchronous (a `grpc.Channel`), `AsyncPdserveClient` uses `grpc.aio`; both have the same
methods. Chat messages and tools are plain dicts in the OpenAI shape:

    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}
    {"role": "tool", "tool_call_id": "call_1", "content": "42"}
    {"type": "function", "function": {"name": "f", "description": "...", "parameters": {...json schema...}}}

(tool calls and tools may also be flat: {"id", "name", "arguments"} / {"name", "description", "parameters"};
arguments and parameters may be dicts or JSON text). Every gRPC failure surfaces as `PdserveError`.

    with PdserveClient("127.0.0.1:50051") as client:
        done = client.generate_text(messages=[{"role": "user", "content": "hi"}], max_tokens=32)
        print(done.text, done.finish_reason, done.usage.cached_tokens)
"""

from __future__ import annotations

import asyncio
import difflib
import json
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, TypedDict, Unpack

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve_client.api import pdserve_pb2 as pb
from pdserve_client.api import pdserve_pb2_grpc
from pdserve_client.continuation import CHANNEL_OPTIONS, RECONNECT_S, StreamContinuation

_MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", "tool_call_id", "name"})

FinishReason = Literal["stop", "length", "tool_calls", "unspecified"]
_FINISH_REASONS: dict[int, FinishReason] = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
}


class PdserveError(Exception):
    """A failed call: its gRPC status code (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...) and server message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class GenerateFields(TypedDict, total=False):
    """Keyword arguments of `generate` / `generate_text`: exactly one of prompt, messages, token_ids."""

    prompt: str
    messages: Sequence[Mapping[str, Any]]
    token_ids: Sequence[int]
    tools: Sequence[Mapping[str, Any]]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: Sequence[str]
    ignore_eos: bool
    stop_token_ids: Sequence[int]
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    min_p: float
    logprobs: int
    # Template variables, e.g. {"enable_thinking": False}.
    chat_template_kwargs: Mapping[str, Any]
    # "auto", "none", "required", or a function's name.
    tool_choice: str
    parallel_tool_calls: bool
    # OpenAI's shape: {"type": "json_schema", "json_schema": {"schema": {...}}} or {"type": "json_object"};
    # and vLLM's extras {"type": "regex", "regex": "..."}, {"type": "choice", "choice": [...]}.
    response_format: Mapping[str, Any]
    session_id: str
    request_id: str
    model: str


@dataclass(frozen=True)
class Completion:
    """A whole Generate stream, gathered."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    # The model's tool calls, whole: {"id", "name", "arguments"} (arguments: JSON text).
    tool_calls: list[dict[str, str]]
    reasoning_text: str
    # With `logprobs` asked for: one per token id.
    logprobs: list[pb.TokenLogprob]
    # The stop string that ended generation ("" if none).
    stop_reason: str
    usage: pb.Usage
    served_by: pb.ServedBy
    timings: pb.Timings


# Sorted: the suggestion among equally close names does not depend on the hash seed.
_GENERATE_FIELDS = sorted(GenerateFields.__optional_keys__ | GenerateFields.__required_keys__)


def _unknown_argument(name: str) -> str:
    # The proto's name for a field the SDK names otherwise; else the closest spelling.
    close = {"prompt_token_ids": ["token_ids"]}.get(name) or difflib.get_close_matches(
        name, _GENERATE_FIELDS, n=1
    )
    return f"unknown argument {name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


# GenerateFields that are pdserve.v1.SamplingParams fields, by the same names.
_SAMPLING_FIELDS = tuple(f.name for f in pb.SamplingParams.DESCRIPTOR.fields)


def generate_request(**fields: Unpack[GenerateFields]) -> pb.GenerateRequest:
    """The GenerateRequest for these arguments (unset sampling fields stay unset: the server's defaults).
    An argument it does not know is a TypeError: a misspelt one would otherwise be silently not applied."""
    if unknown := [name for name in fields if name not in _GENERATE_FIELDS]:
        raise TypeError("; ".join(_unknown_argument(name) for name in unknown))
    # None leaves a field unset.
    given: dict[str, Any] = dict(fields)
    sampling = pb.SamplingParams(**{name: given.get(name) for name in _SAMPLING_FIELDS})
    choice = fields.get("tool_choice")
    template_kwargs = fields.get("chat_template_kwargs")
    fmt = fields.get("response_format")
    request = pb.GenerateRequest(
        model=fields.get("model", ""),
        prompt=fields.get("prompt", ""),
        prompt_token_ids=list(fields.get("token_ids", ())),
        tools=[tool(t) for t in fields.get("tools", ())],
        sampling=sampling,
        session_id=fields.get("session_id", ""),
        request_id=fields.get("request_id", ""),
        tool_choice=None if choice is None else tool_choice(choice),
        parallel_tool_calls=fields.get("parallel_tool_calls"),
        response_format=None if fmt is None else response_format(fmt),
        chat_template_kwargs_json=json.dumps(template_kwargs) if template_kwargs else "",
    )
    for m in fields.get("messages", ()):
        _fill_message(request.messages.add(), m)
    return request


def tool_choice(choice: str) -> pb.ToolChoice:
    """ "auto", "none", "required", or the name of the function to call."""
    modes = {
        "auto": pb.ToolChoice.MODE_AUTO,
        "none": pb.ToolChoice.MODE_NONE,
        "required": pb.ToolChoice.MODE_REQUIRED,
    }
    if choice in modes:
        return pb.ToolChoice(mode=modes[choice])
    return pb.ToolChoice(mode=pb.ToolChoice.MODE_FUNCTION, function_name=choice)


def response_format(fmt: Mapping[str, Any]) -> pb.ResponseFormat:
    kind = fmt.get("type")
    if kind == "json_schema":
        spec = fmt.get("json_schema", {})
        return pb.ResponseFormat(json_schema=_json_text(spec.get("schema", spec)))
    if kind == "json_object":
        return pb.ResponseFormat(json_object=True)
    if kind == "regex":
        return pb.ResponseFormat(regex=fmt["regex"])
    if kind == "choice":
        return pb.ResponseFormat(choice=pb.ResponseFormat.Choices(choices=list(fmt["choice"])))
    raise ValueError(f"response_format type must be json_schema, json_object, regex or choice; got {kind!r}")


def tokenize_request(
    *,
    prompt: str = "",
    messages: Sequence[Mapping[str, Any]] = (),
    tools: Sequence[Mapping[str, Any]] = (),
    model: str = "",
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> pb.TokenizeRequest:
    request = pb.TokenizeRequest(
        model=model,
        prompt=prompt,
        tools=[tool(t) for t in tools],
        chat_template_kwargs_json=json.dumps(chat_template_kwargs) if chat_template_kwargs else "",
    )
    for m in messages:
        _fill_message(request.messages.add(), m)
    return request


def chat_message(message: Mapping[str, Any]) -> pb.ChatMessage:
    """A chat message dict as the proto message; unknown keys are refused (they would be lost silently)."""
    return _fill_message(pb.ChatMessage(), message)


def _fill_message(out: pb.ChatMessage, message: Mapping[str, Any]) -> pb.ChatMessage:
    """`chat_message` into `out`, in place: a request's messages are added to it, not built apart and
    appended, since protobuf copies an appended message (a 4 MB one in ~6 ms, 20x the time to build it)."""
    unknown = set(message) - _MESSAGE_KEYS
    if unknown:
        raise ValueError(f"unknown chat message keys {sorted(unknown)}; allowed: {sorted(_MESSAGE_KEYS)}")
    out.role = message["role"]
    out.content = message.get("content") or ""
    out.tool_call_id = message.get("tool_call_id") or ""
    out.name = message.get("name") or ""
    for call in message.get("tool_calls") or ():
        function = call.get("function", call)
        arguments = _json_text(function.get("arguments"))
        out.tool_calls.add(id=call.get("id") or "", name=function["name"], arguments_json=arguments)
    return out


def tool(definition: Mapping[str, Any]) -> pb.Tool:
    """A tool dict (OpenAI {"type": "function", "function": {...}} or flat) as the proto message."""
    function = definition.get("function", definition)
    return pb.Tool(
        name=function["name"],
        description=function.get("description") or "",
        parameters_json=_json_text(function.get("parameters")),
    )


def _json_text(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value)


class CompletionBuilder:
    """Gathers a Generate stream into a Completion, for a caller that also reads the stream as it comes."""

    def __init__(self) -> None:
        self.request_id = ""
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.token_ids: list[int] = []
        self.calls: dict[int, dict[str, str]] = {}
        self.logprobs: list[pb.TokenLogprob] = []
        self.final: pb.Final | None = None

    def add(self, response: pb.GenerateResponse) -> None:
        self.request_id = response.request_id or self.request_id
        self.text.append(response.text)
        self.reasoning.append(response.reasoning_text)
        self.token_ids.extend(response.token_ids)
        self.logprobs.extend(response.logprobs)
        for delta in response.tool_calls:
            call = self.calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            call["id"] = call["id"] or delta.id
            call["name"] = call["name"] or delta.name
            call["arguments"] += delta.arguments_json
        if response.HasField("final"):
            self.final = response.final

    def build(self) -> Completion:
        if self.final is None:
            raise PdserveError(grpc.StatusCode.INTERNAL, "the Generate stream ended without a final message")
        return Completion(
            request_id=self.request_id,
            text="".join(self.text),
            token_ids=self.token_ids,
            finish_reason=_FINISH_REASONS.get(self.final.finish_reason, "unspecified"),
            tool_calls=[self.calls[i] for i in sorted(self.calls)],
            reasoning_text="".join(self.reasoning),
            logprobs=self.logprobs,
            stop_reason=self.final.stop_reason,
            usage=self.final.usage,
            served_by=self.final.served_by,
            timings=self.final.timings,
        )


def _error(exc: grpc.RpcError, why_not_continued: str = "") -> PdserveError:
    code = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    details = (exc.details() if callable(getattr(exc, "details", None)) else str(exc)) or ""
    if why_not_continued:
        details += f" (the stream was not continued: {why_not_continued})"
    return PdserveError(code, details)


@contextmanager
def _grpc_errors() -> Iterator[None]:
    """Turn gRPC failures (sync and aio alike) into PdserveError."""
    try:
        yield
    except grpc.RpcError as exc:
        raise _error(exc) from exc


@dataclass(frozen=True)
class _CallOptions:
    metadata: tuple[tuple[str, str], ...]
    # The client's default deadline (seconds) for calls that give none.
    timeout: float | None

    # How long a stream whose router connection was lost keeps trying to continue (0: never).
    reconnect_s: float = RECONNECT_S

    def deadline(self, timeout: float | None) -> float | None:
        return timeout if timeout is not None else self.timeout

    def ends_at(self, timeout: float | None) -> float | None:
        """A call's deadline as a time.monotonic() instant: the continuations of a stream share it."""
        limit = self.deadline(timeout)
        return None if limit is None else time.monotonic() + limit


def _left(ends_at: float | None) -> float | None:
    return None if ends_at is None else max(ends_at - time.monotonic(), 0.0)


def _call_options(token: str | None, timeout: float | None, reconnect_s: float) -> _CallOptions:
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    return _CallOptions(metadata=metadata, timeout=timeout, reconnect_s=reconnect_s)


class PdserveClient:
    """Synchronous client. `timeout` (seconds) is the default deadline of every call. `reconnect_s`: how long
    a stream whose router connection is lost keeps trying to continue on a router (pdserve_client/
    continuation.py; 0: never, the stream fails with UNAVAILABLE)."""

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        token: str | None = None,
        root_certificates: bytes | None = None,
        tls: bool = False,
        timeout: float | None = None,
        reconnect_s: float = RECONNECT_S,
    ) -> None:
        # `tls` without `root_certificates`: the system's trusted roots (or GRPC_DEFAULT_SSL_ROOTS_FILE_PATH).
        if root_certificates is not None or tls:
            credentials = grpc.ssl_channel_credentials(root_certificates)
            self._channel = grpc.secure_channel(target, credentials, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = pdserve_pb2_grpc.PdserveStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._options = _call_options(token, timeout, reconnect_s)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> PdserveClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self, *, timeout: float | None = None, **fields: Unpack[GenerateFields]
    ) -> Iterator[pb.GenerateResponse]:
        """Stream the response messages; the last has `final` set. Leaving the loop early cancels the call.
        A lost router connection is continued on a router (`reconnect_s`)."""
        stream = StreamContinuation(generate_request(**fields), self._options.reconnect_s)
        ends_at, request = self._options.ends_at(timeout), stream.request
        while True:
            call = self._stub.Generate(request, metadata=self._options.metadata, timeout=_left(ends_at))
            try:
                for response in call:
                    yield stream.seen(response)
                return
            except grpc.RpcError as exc:
                wait = stream.may_continue(exc)
                if wait is None:
                    raise _error(exc, stream.cannot_continue()) from exc
                lost = exc
            finally:
                call.cancel()
            time.sleep(wait)
            try:
                grpc.channel_ready_future(self._channel).result(timeout=stream.reconnect_left_s())
            except grpc.FutureTimeoutError:
                raise _error(lost, f"no router answered within {stream.reconnect_s:.0f} s") from lost
            prompt_ids = None
            if stream.needs_prompt_ids():
                with _grpc_errors():
                    tokenized = self._stub.Tokenize(
                        stream.tokenize_request(),
                        metadata=self._options.metadata,
                        timeout=stream.reconnect_left_s(),
                    )
                prompt_ids = list(tokenized.token_ids)
            request = stream.continue_with(prompt_ids, lost)

    def generate_text(self, *, timeout: float | None = None, **fields: Unpack[GenerateFields]) -> Completion:
        builder = CompletionBuilder()
        for response in self.generate(timeout=timeout, **fields):
            builder.add(response)
        return builder.build()

    def tokenize(
        self,
        *,
        prompt: str = "",
        messages: Sequence[Mapping[str, Any]] = (),
        tools: Sequence[Mapping[str, Any]] = (),
        model: str = "",
        chat_template_kwargs: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> pb.TokenizeResponse:
        request = tokenize_request(
            prompt=prompt,
            messages=messages,
            tools=tools,
            model=model,
            chat_template_kwargs=chat_template_kwargs,
        )
        with _grpc_errors():
            response: pb.TokenizeResponse = self._stub.Tokenize(
                request, metadata=self._options.metadata, timeout=self._options.deadline(timeout)
            )
        return response

    def list_models(self, *, timeout: float | None = None) -> list[pb.Model]:
        with _grpc_errors():
            response = self._stub.ListModels(
                pb.ListModelsRequest(),
                metadata=self._options.metadata,
                timeout=self._options.deadline(timeout),
            )
        return list(response.models)

    def cluster_status(self, *, timeout: float | None = None) -> list[pb.Replica]:
        return list(self._status(timeout).replicas)

    def routers(self, *, timeout: float | None = None) -> list[pb.Router]:
        """The cluster's routers; `answering` marks the one this client's calls reach now."""
        return list(self._status(timeout).routers)

    def _status(self, timeout: float | None) -> pb.GetClusterStatusResponse:
        with _grpc_errors():
            response: pb.GetClusterStatusResponse = self._stub.GetClusterStatus(
                pb.GetClusterStatusRequest(),
                metadata=self._options.metadata,
                timeout=self._options.deadline(timeout),
            )
        return response

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The standard grpc.health.v1 status of `service` ("" = the whole server), e.g. "SERVING"."""
        with _grpc_errors():
            response = self._health.Check(
                health_pb2.HealthCheckRequest(service=service),
                metadata=self._options.metadata,
                timeout=self._options.deadline(timeout),
            )
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))


class AsyncPdserveClient:
    """asyncio client (grpc.aio), the same methods as PdserveClient. Create it inside the event loop.

    `timeout` arguments are gRPC deadlines, not local timeouts: the server sees them and aborts the
    request on every engine when they pass, which `asyncio.timeout` around a call could not do (hence
    the ASYNC109 exemptions below).
    """

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        token: str | None = None,
        root_certificates: bytes | None = None,
        tls: bool = False,
        timeout: float | None = None,
        reconnect_s: float = RECONNECT_S,
    ) -> None:
        # `tls` without `root_certificates`: the system's trusted roots (or GRPC_DEFAULT_SSL_ROOTS_FILE_PATH).
        if root_certificates is not None or tls:
            credentials = grpc.ssl_channel_credentials(root_certificates)
            self._channel = grpc.aio.secure_channel(target, credentials, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = pdserve_pb2_grpc.PdserveStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._options = _call_options(token, timeout, reconnect_s)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncPdserveClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def generate(
        self,
        *,
        timeout: float | None = None,  # noqa: ASYNC109
        **fields: Unpack[GenerateFields],
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream the response messages; the last has `final` set. Leaving the loop early cancels the call.
        A lost router connection is continued on a router (`reconnect_s`)."""
        stream = StreamContinuation(generate_request(**fields), self._options.reconnect_s)
        ends_at, request = self._options.ends_at(timeout), stream.request
        while True:
            call = self._stub.Generate(request, metadata=self._options.metadata, timeout=_left(ends_at))
            try:
                async for response in call:
                    yield stream.seen(response)
                return
            except grpc.RpcError as exc:
                wait = stream.may_continue(exc)
                if wait is None:
                    raise _error(exc, stream.cannot_continue()) from exc
                lost = exc
            finally:
                call.cancel()
            await asyncio.sleep(wait)
            try:
                await asyncio.wait_for(self._channel.channel_ready(), stream.reconnect_left_s())
            except TimeoutError:
                raise _error(lost, f"no router answered within {stream.reconnect_s:.0f} s") from lost
            prompt_ids = None
            if stream.needs_prompt_ids():
                with _grpc_errors():
                    tokenized = await self._stub.Tokenize(
                        stream.tokenize_request(),
                        metadata=self._options.metadata,
                        timeout=stream.reconnect_left_s(),
                    )
                prompt_ids = list(tokenized.token_ids)
            request = stream.continue_with(prompt_ids, lost)

    async def generate_text(
        self,
        *,
        timeout: float | None = None,  # noqa: ASYNC109
        **fields: Unpack[GenerateFields],
    ) -> Completion:
        builder = CompletionBuilder()
        async for response in self.generate(timeout=timeout, **fields):
            builder.add(response)
        return builder.build()

    async def tokenize(
        self,
        *,
        prompt: str = "",
        messages: Sequence[Mapping[str, Any]] = (),
        tools: Sequence[Mapping[str, Any]] = (),
        model: str = "",
        chat_template_kwargs: Mapping[str, Any] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> pb.TokenizeResponse:
        request = tokenize_request(
            prompt=prompt,
            messages=messages,
            tools=tools,
            model=model,
            chat_template_kwargs=chat_template_kwargs,
        )
        with _grpc_errors():
            response: pb.TokenizeResponse = await self._stub.Tokenize(
                request, metadata=self._options.metadata, timeout=self._options.deadline(timeout)
            )
        return response

    async def list_models(self, *, timeout: float | None = None) -> list[pb.Model]:  # noqa: ASYNC109
        with _grpc_errors():
            response = await self._stub.ListModels(
                pb.ListModelsRequest(),
                metadata=self._options.metadata,
                timeout=self._options.deadline(timeout),
            )
        return list(response.models)

    async def cluster_status(self, *, timeout: float | None = None) -> list[pb.Replica]:  # noqa: ASYNC109
        return list((await self._status(timeout)).replicas)

    async def routers(self, *, timeout: float | None = None) -> list[pb.Router]:  # noqa: ASYNC109
        """The cluster's routers; `answering` marks the one this client's calls reach now."""
        return list((await self._status(timeout)).routers)

    async def _status(self, timeout: float | None) -> pb.GetClusterStatusResponse:  # noqa: ASYNC109
        with _grpc_errors():
            response: pb.GetClusterStatusResponse = await self._stub.GetClusterStatus(
                pb.GetClusterStatusRequest(),
                metadata=self._options.metadata,
                timeout=self._options.deadline(timeout),
            )
        return response

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:  # noqa: ASYNC109
        """The standard grpc.health.v1 status of `service` ("" = the whole server), e.g. "SERVING"."""
        with _grpc_errors():
            response = await self._health.Check(
                health_pb2.HealthCheckRequest(service=service),
                metadata=self._options.metadata,
                timeout=self._options.deadline(timeout),
            )
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))
