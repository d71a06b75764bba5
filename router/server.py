"""pdserve's public gRPC endpoint (`pdserve.v1.Pdserve`, plus grpc.health.v1 and reflection).

A request's way through this process:
    Generate -> validate (INVALID_ARGUMENT, nothing reaches an engine) -> tokenize (chat template)
             (a session's next turn: only what it appended, router/chat_encoder.py, router/token_sessions.py)
             -> length check -> route (router/routing.py) -> Orchestrator.run (prefill leg, decode leg)
             -> stream token batches -> one final message with usage and the serving replicas.
Every accepted request ends with exactly one terminal status, counted in pdserve_requests{code}.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NamedTuple

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.messages import Sampling, TokenBatch, TokenLogprob
from router.api import pdserve_pb2 as pb
from router.api import pdserve_pb2_grpc as pb_grpc
from router.block_hash import PromptReuse
from router.chat_encoder import SessionChatEncoder
from router.config import LiveConfig
from router.metrics import RouterMetrics
from router.orchestrator import Completion, NoReplicaError, Orchestrator, Route
from router.output_parser import OutputParser, OutputParsers, ParsedDelta
from router.policy.types import NoReplicaError as NoEligibleReplica
from router.routing import Overloaded, RequestRouter
from router.sessions import Sessions
from router.token_sessions import SessionTokenIds, TokenIdsTurn
from router.tokenizer import ChatInputError, PromptTokenizer
from router.validation import (
    InvalidRequest,
    ModelLimits,
    PromptInput,
    check_constraint,
    check_prompt_length,
    validate_generate,
    validate_tokenize,
)

log = logging.getLogger(__name__)

_FINISH = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "tool_calls": pb.FINISH_REASON_TOOL_CALLS,
}
_PATH = {
    "disaggregated": pb.SERVING_PATH_DISAGGREGATED,
    "local_prefill": pb.SERVING_PATH_LOCAL_PREFILL,
    "decode_full_prefill": pb.SERVING_PATH_DECODE_FULL_PREFILL,
}


class GenerateCall(NamedTuple):
    """A Generate request as received: parsed, its wire bytes (`router.token_sessions` compares a token-id
    session's packed ids in them with the previous turn's), and the id it is served and logged under."""

    request: pb.GenerateRequest
    raw: bytes
    request_id: str

    @classmethod
    def parse(cls, raw: bytes) -> GenerateCall:
        return cls(pb.GenerateRequest.FromString(raw), raw, uuid.uuid4().hex)


class RequestFailed(Exception):
    """How a request ends when it does not succeed: a documented gRPC status and a message fit for a client
    (the HTTP door maps both to OpenAI's error shape)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class PdserveService(pb_grpc.PdserveServicer):
    def __init__(
        self,
        *,
        tokenizer: PromptTokenizer,
        chat_encoder: SessionChatEncoder,
        parsers: OutputParsers,
        limits: ModelLimits,
        block_size: int,
        orchestrator: Orchestrator,
        router: RequestRouter,
        metrics: RouterMetrics,
        cluster_status: Callable[[], Awaitable[list[pb.Replica]]],
        config: LiveConfig | None = None,
        sessions: Sessions | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._chat = chat_encoder
        self._parsers = parsers
        self._limits = limits
        self._block_size = block_size
        self._orchestrator = orchestrator
        self._router = router
        self._metrics = metrics
        self._cluster_status = cluster_status
        self._config = config or LiveConfig()
        self._token_sessions = SessionTokenIds(sessions)

    async def Generate(
        self, call: GenerateCall, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            async for message in self.run(call, context.time_remaining):
                yield message
        except RequestFailed as exc:
            await context.abort(exc.code, exc.message)

    async def run(
        self, call: GenerateCall, time_remaining: Callable[[], float | None]
    ) -> AsyncIterator[pb.GenerateResponse]:
        """One Generate request, whichever door it came in by: its messages, or RequestFailed. Counted once in
        pdserve_requests{code}. `time_remaining`: the call's deadline, to tell an expiry from a cancel."""
        code = grpc.StatusCode.OK
        self._metrics.inflight.inc()
        try:
            async for message in self._generate(call):
                yield message
        except RequestFailed as exc:
            code = exc.code
            raise
        except Exception as exc:
            code = grpc.StatusCode.INTERNAL
            raise _internal("Generate", _request_id_of(call), exc) from exc
        except asyncio.CancelledError:
            # Client cancelled or the deadline passed: the door cancels this task; the orchestrator's
            # cleanup cancelled the engine legs on the way out.
            remaining = time_remaining()
            code = (
                grpc.StatusCode.DEADLINE_EXCEEDED
                if remaining is not None and remaining <= 0
                else grpc.StatusCode.CANCELLED
            )
            raise
        finally:
            self._metrics.inflight.dec()
            self._metrics.requests.labels(code=code.name).inc()

    async def _generate(self, call: GenerateCall) -> AsyncIterator[pb.GenerateResponse]:
        # A session's token ids that extend its previous turn's: only the new ones are converted and checked.
        turn = self._token_sessions.start(call.request, call.raw)
        try:
            valid = validate_generate(call.request, self._limits, None if turn is None else turn.prior)
            tool_use = valid.tool_use
            if tool_use is not None and tool_use.choice == "auto" and not self._parsers.parses_tools:
                raise InvalidRequest(
                    "tool_choice",
                    "auto needs model.tool_call_parser in the topology; use none, required or a function",
                )
            sampling = self._parsers.engine_sampling(valid.sampling, tool_use)
            if sampling.constraint is not None:
                await asyncio.to_thread(check_constraint, sampling)
            prompt_ids, reuse = await self._encode(valid.input, valid.session_id or None, turn)
            check_prompt_length(len(prompt_ids), sampling, self._limits, input_field=valid.input.kind)
        except (InvalidRequest, ChatInputError) as exc:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, f"{exc.field}: {exc.message}") from exc
        output = self._parsers.parser(tool_use)
        if turn is not None:
            self._token_sessions.finish(turn, prompt_ids)
            self._metrics.on_token_ids(len(turn.prior or ()), len(prompt_ids) - len(turn.prior or ()))
        request_id = _request_id_of(call)
        session_id = valid.session_id or None

        def route(prompt: list[int], sampling: Sampling, reuse: PromptReuse | None = None) -> Route:
            try:
                began = time.perf_counter()
                chosen = self._router.route(request_id, session_id, prompt, sampling, reuse)
                self._metrics.decision_seconds.observe(time.perf_counter() - began)
            except Overloaded as exc:
                raise RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from exc
            except NoEligibleReplica as exc:
                raise RequestFailed(grpc.StatusCode.UNAVAILABLE, f"no ready replica: {exc}") from exc
            self._metrics.on_decision(chosen.reason, chosen.terms)
            if chosen.readback_tokens:
                self._metrics.readback_tokens.labels(decode_replica=chosen.readback_replica).inc(
                    chosen.readback_tokens
                )
            return chosen

        async def reroute(prompt: list[int], sampling: Sampling) -> Route:
            """A failed leg's continuation: released from its first admission, routed again. With no replica
            left in this router's view, the view is refreshed once first: a replacement may have registered
            since the last poll (the registry is polled every second)."""
            self._router.finish(request_id)
            self._metrics.failovers.inc()
            try:
                return route(prompt, sampling)
            except RequestFailed as exc:
                if exc.code != grpc.StatusCode.UNAVAILABLE:
                    raise
            await self._router.refresh()
            return route(prompt, sampling)

        first_route = route(prompt_ids, sampling, reuse)
        first_token_at: float | None = None
        started = time.monotonic()
        try:
            events = self._orchestrator.serve(
                request_id,
                prompt_ids,
                sampling,
                first_route,
                reroute=reroute,
                on_replica_failed=self._router.replica_failed,
                attempts=self._config.current.failover_attempts,
                on_prefill_done=lambda: self._router.prefill_done(request_id),
            )
            last_batch_at: float | None = None
            async for event in events:
                if isinstance(event, TokenBatch):
                    if event.token_ids:
                        now = time.monotonic()
                        if first_token_at is None:
                            first_token_at = now
                        else:
                            self._metrics.observe_itl(now - (last_batch_at or now), len(event.token_ids))
                        last_batch_at = now
                    parsed = output.feed(event.token_ids, event.text)
                    yield _response(request_id, parsed, token_ids=event.token_ids, logprobs=event.logprobs)
                else:
                    self._record(event, first_token_at, started)
                    self._router.turn_done(
                        session_id,
                        event.decode_replica,
                        event.pinned_kv,
                        prompt_ids,
                        event.output_token_ids,
                    )
                    rest = output.finish()  # before _final: it tells whether the model called tools
                    yield _response(request_id, rest, final=_final(event, output))
        except NoReplicaError as exc:
            raise RequestFailed(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc
        finally:
            self._router.finish(request_id)

    async def _encode(
        self, prompt: PromptInput, session_id: str | None = None, turn: TokenIdsTurn | None = None
    ) -> tuple[list[int], PromptReuse | None]:
        """The prompt's ids, and which of them a session reused from its previous turn."""
        # Tokenizing a long prompt takes milliseconds of CPU: keep it off the event loop.
        if prompt.kind == "prompt_token_ids":
            # Validation built this request's own list (from the previous turn's when `turn` extends it).
            return prompt.prompt_token_ids, None if turn is None else turn.reuse
        if prompt.kind == "prompt":
            return await asyncio.to_thread(self._tokenizer.encode_text, prompt.prompt), None
        # A session's chat is encoded incrementally: only the text its new turn appended.
        return await asyncio.to_thread(
            self._chat.encode_reusing, session_id, prompt.messages, prompt.tools, prompt.template_kwargs
        )

    def _record(self, c: Completion, first_token_at: float | None, started: float) -> None:
        m = self._metrics
        m.ttft.labels(path=c.path).observe(c.ttft_ms / 1e3)
        m.e2e.labels(path=c.path).observe(c.e2e_ms / 1e3)
        if first_token_at is not None and c.completion_tokens > 1:
            tpot = (time.monotonic() - first_token_at) / (c.completion_tokens - 1)
            m.tpot.labels(decode_replica=c.decode_replica).observe(tpot)
        if c.prefill_replica:
            m.prefill.labels(prefill_replica=c.prefill_replica).observe(c.prefill_ms / 1e3)
            m.kv_transfer_tokens.labels(
                prefill_replica=c.prefill_replica, decode_replica=c.decode_replica
            ).inc(c.kv_transferred_tokens)
        m.prompt_tokens.inc(c.prompt_tokens)
        m.completion_tokens.inc(c.completion_tokens)
        m.cached_tokens.inc(c.cached_tokens)
        m.predicted_cached_tokens.inc(c.predicted_cached_tokens)
        m.cache_prediction_error.observe(c.cached_tokens - c.predicted_cached_tokens)
        m.paths.labels(path=c.path).inc()
        if c.export:
            m.exports.labels(outcome=c.export).inc()

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        try:
            prompt = validate_tokenize(request, self._limits)
            ids, _ = await self._encode(prompt)
        except (InvalidRequest, ChatInputError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{exc.field}: {exc.message}")
        except Exception as exc:
            await _abort_internal(context, "Tokenize", uuid.uuid4().hex, exc)
        return pb.TokenizeResponse(token_ids=ids, max_model_len=self._limits.max_model_len)

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        model = pb.Model(
            id=self._limits.served_name, max_model_len=self._limits.max_model_len, block_size=self._block_size
        )
        return pb.ListModelsResponse(models=[model])

    async def GetClusterStatus(
        self, request: pb.GetClusterStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetClusterStatusResponse:
        try:
            replicas = await self._cluster_status()
        except Exception as exc:
            await _abort_internal(context, "GetClusterStatus", uuid.uuid4().hex, exc)
        return pb.GetClusterStatusResponse(replicas=replicas)


def _request_id_of(call: GenerateCall) -> str:
    """The id the client knows the request by: its own when it sent a usable one, else the server's."""
    rid = call.request.request_id
    return rid if rid and len(rid) <= 128 and rid.isprintable() else call.request_id


def _internal(method: str, request_id: str, exc: Exception) -> RequestFailed:
    """A bug or an unexpected failure: the client gets INTERNAL and an id to quote, never a traceback, a
    path or an address (the log has them, under the same id). gRPC itself would answer UNKNOWN with the
    exception's text."""
    log.error("%s %s failed", method, request_id, exc_info=exc)
    return RequestFailed(
        grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); request id {request_id}"
    )


async def _abort_internal(
    context: grpc.aio.ServicerContext, method: str, request_id: str, exc: Exception
) -> None:
    failed = _internal(method, request_id, exc)
    await context.abort(failed.code, failed.message)


def _response(
    request_id: str,
    parsed: ParsedDelta,
    token_ids: list[int] | None = None,
    final: pb.Final | None = None,
    logprobs: list[TokenLogprob] | None = None,
) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        logprobs=[
            pb.TokenLogprob(
                token_id=lp.token_id,
                token=lp.token,
                logprob=lp.logprob,
                top=[pb.TopLogprob(token_id=t, token=tok, logprob=p) for t, tok, p in lp.top],
            )
            for lp in logprobs or ()
        ],
        request_id=request_id,
        token_ids=token_ids,
        text=parsed.content,
        reasoning_text=parsed.reasoning,
        tool_calls=[
            pb.ToolCallDelta(index=c.index, id=c.id, name=c.name, arguments_json=c.arguments)
            for c in parsed.tool_calls
        ],
        final=final,
    )


def _final(c: Completion, output: OutputParser) -> pb.Final:
    reason = "tool_calls" if output.tools_called and c.finish_reason == "stop" else c.finish_reason
    return pb.Final(
        finish_reason=_FINISH.get(reason, pb.FINISH_REASON_UNSPECIFIED),
        stop_reason=c.stop_reason or "",
        usage=pb.Usage(
            prompt_tokens=c.prompt_tokens,
            cached_tokens=c.cached_tokens,
            completion_tokens=c.completion_tokens,
            kv_transferred_tokens=c.kv_transferred_tokens,
            predicted_cached_tokens=c.predicted_cached_tokens,
        ),
        served_by=pb.ServedBy(
            path=_PATH[c.path],
            prefill_replica=c.prefill_replica,
            decode_replica=c.decode_replica,
            prefill_node=c.prefill_node,
            decode_node=c.decode_node,
            note=c.note,
        ),
        timings=pb.Timings(ttft_ms=c.ttft_ms, prefill_ms=c.prefill_ms, e2e_ms=c.e2e_ms),
    )


class _TokenAuth(grpc.aio.ServerInterceptor):
    """Bearer-token auth: every call must carry `authorization: Bearer <token>` (health checks too,
    except grpc.health.v1 so that load balancers can probe without the secret)."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        if details.method.startswith("/grpc.health.v1.Health/"):
            return await continuation(details)
        sent = dict(details.invocation_metadata or ()).get("authorization", "")
        if isinstance(sent, bytes):
            sent = sent.decode(errors="replace")
        scheme, _, token = sent.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), self._token):
            return await continuation(details)
        return _deny_handler()


def _deny_handler() -> grpc.RpcMethodHandler:
    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

    return grpc.unary_unary_rpc_method_handler(deny)


def add_pdserve_service(service: PdserveService, server: grpc.aio.Server) -> None:
    """What the generated `add_PdserveServicer_to_server` does, for every method of the service in the proto,
    except that Generate's requests arrive as `GenerateCall` (parsed, with their wire bytes), and that a
    request that does not parse (corrupt bytes, invalid UTF-8 in a string) gets INVALID_ARGUMENT: gRPC's own
    deserializer would answer UNKNOWN with the parser's exception."""
    desc = pb.DESCRIPTOR.services_by_name["Pdserve"]
    handlers = {}
    for m in desc.methods:
        parse = GenerateCall.parse if m.name == "Generate" else getattr(pb, m.input_type.name).FromString
        method = getattr(service, m.name)
        wrap = _parsed_stream if m.server_streaming else _parsed_unary
        make = (
            grpc.unary_stream_rpc_method_handler
            if m.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[m.name] = make(
            wrap(method, parse, m.input_type.full_name),
            request_deserializer=None,  # the raw bytes: parsed in the handler
            response_serializer=getattr(pb, m.output_type.name).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(desc.full_name, handlers),))
    server.add_registered_method_handlers(desc.full_name, handlers)


async def _parse_or_abort(
    raw: bytes, parse: Callable[[bytes], Any], type_name: str, context: grpc.aio.ServicerContext
) -> Any:
    try:
        return parse(raw)
    except DecodeError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid {type_name} ({exc})")


def _parsed_unary(method: Any, parse: Callable[[bytes], Any], type_name: str) -> Any:
    async def handler(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await method(await _parse_or_abort(raw, parse, type_name, context), context)

    return handler


def _parsed_stream(method: Any, parse: Callable[[bytes], Any], type_name: str) -> Any:
    async def handler(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        request = await _parse_or_abort(raw, parse, type_name, context)
        async for message in method(request, context):
            yield message

    return handler


class ListenError(OSError):
    """A configured endpoint cannot be listened on; the message names the topology field."""

    def __init__(self, field: str, address: str, reason: str) -> None:
        super().__init__(f"{field}: cannot listen on {address} ({reason})")


def check_listen(field: str, host: str, port: int) -> None:
    """Raise ListenError unless `host:port` can be bound now (so `pdserve up` fails before its engines
    spend minutes starting). SO_REUSEADDR as the servers set it: a port in TIME_WAIT from a previous run is
    free."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
    except OSError as exc:
        raise ListenError(field, f"{host}:{port}", exc.strerror or str(exc)) from exc


async def start_grpc_server(
    service: PdserveService,
    *,
    host: str,
    port: int,
    tls: tuple[bytes, bytes] | None = None,
    auth_token: str | None = None,
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    interceptors = [_TokenAuth(auth_token)] if auth_token else []
    # gRPC sets SO_REUSEPORT by default: a second server on the same port would then bind too and silently
    # take half of the connections. Off, it fails to bind instead.
    server = grpc.aio.server(interceptors=interceptors, options=[("grpc.so_reuseport", 0)])
    add_pdserve_service(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    service_name = pb.DESCRIPTOR.services_by_name["Pdserve"].full_name
    reflection.enable_server_reflection((service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{host}:{port}"
    try:
        if tls is not None:
            key, cert = tls
            bound = server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError:  # grpcio's "Failed to bind" (older versions return 0 instead)
        bound = 0
    if bound == 0:
        raise ListenError("server.grpc_port", address, "in use, or not an address of this machine")
    await server.start()
    # SERVING once the caller knows a replica can serve (router/app.py follows the cluster from then on).
    await health_servicer.set(service_name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    return server, health_servicer
