"""The gRPC door: `pdserve.v1.Pdserve` (plus grpc.health.v1 and reflection) on the request path.

Generate's bytes are parsed here (a request that does not parse is INVALID_ARGUMENT), run through
router/generate.py with its wire bytes (a token-id session's next turn is recognised by them), and each
`OutputDelta` / `Finished` goes out as a `GenerateResponse`. `RequestFailed` becomes the call's status.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.messages import TokenLogprob
from pdserve_client.api import pdserve_pb2 as pb
from pdserve_client.api import pdserve_pb2_grpc as pb_grpc
from router.doors.auth import BearerToken
from router.doors.limits import MAX_REQUEST_BYTES
from router.doors.listen import ListenError
from router.errors import RequestFailed
from router.generate import GeneratePath, internal_error, served_request_id
from router.messages import Finished, OutputDelta, ParsedDelta, RequestSummary

_FINISH = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "tool_calls": pb.FINISH_REASON_TOOL_CALLS,
}
_GENERATE_REQUEST = pb.GenerateRequest.DESCRIPTOR.full_name
_PATH = {
    "disaggregated": pb.SERVING_PATH_DISAGGREGATED,
    "local_prefill": pb.SERVING_PATH_LOCAL_PREFILL,
    "decode_full_prefill": pb.SERVING_PATH_DECODE_FULL_PREFILL,
}


class PdserveService(pb_grpc.PdserveServicer):
    def __init__(
        self,
        path: GeneratePath,
        *,
        block_size: int,
        cluster_status: Callable[[], Awaitable[pb.GetClusterStatusResponse]],
    ) -> None:
        self._path = path
        self._intake = path.intake
        self._limits = path.intake.limits
        self._block_size = block_size
        self._cluster_status = cluster_status

    async def Generate(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Takes the request's wire bytes (a token-id session's next turn is recognised by them)."""
        try:
            self._path.refuse_by_wire_size(raw)
        except RequestFailed as exc:
            await context.abort(exc.code, exc.message)
        request = await _parse_or_abort(raw, pb.GenerateRequest.FromString, _GENERATE_REQUEST, context)
        request_id = served_request_id(request.request_id)
        events = self._path.run(request, request_id, raw=raw, time_remaining=context.time_remaining)
        try:
            async for event in events:
                yield _response(request_id, event)
        except RequestFailed as exc:
            await context.abort(exc.code, exc.message)

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        try:
            ids = await self._intake.tokenize(request)
        except RequestFailed as exc:
            await context.abort(exc.code, exc.message)
        except Exception as exc:
            await _abort_internal(context, "Tokenize", exc)
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
            status = await self._cluster_status()
        except Exception as exc:
            await _abort_internal(context, "GetClusterStatus", exc)
        return status


async def _abort_internal(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
    failed = internal_error(method, uuid.uuid4().hex, exc)
    await context.abort(failed.code, failed.message)


def _response(request_id: str, event: OutputDelta | Finished) -> pb.GenerateResponse:
    final = _final(event.completion, event.finish_reason) if isinstance(event, Finished) else None
    return _message(request_id, event.parsed, event.token_ids, final, event.logprobs)


def _message(
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


def _final(c: RequestSummary, reason: str) -> pb.Final:
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
        timings=pb.Timings(
            ttft_ms=c.ttft_ms,
            prefill_ms=c.prefill_ms,
            e2e_ms=c.e2e_ms,
            timeline=[
                pb.Stage(name=s.name, start_ms=s.start_ms, duration_ms=s.duration_ms) for s in c.timeline
            ],
        ),
    )


class _TokenAuth(grpc.aio.ServerInterceptor):
    """Bearer-token auth: every call must carry `authorization: Bearer <token>` (health checks too,
    except grpc.health.v1 so that load balancers can probe without the secret)."""

    def __init__(self, token: BearerToken) -> None:
        self._token = token

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        if details.method.startswith("/grpc.health.v1.Health/"):
            return await continuation(details)
        if self._token.allows(dict(details.invocation_metadata or ()).get("authorization", "")):
            return await continuation(details)
        return _deny_handler()


def _deny_handler() -> grpc.RpcMethodHandler:
    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

    return grpc.unary_unary_rpc_method_handler(deny)


def add_pdserve_service(service: PdserveService, server: grpc.aio.Server) -> None:
    """What the generated `add_PdserveServicer_to_server` does, for every method of the service in the proto,
    except that requests arrive as wire bytes, parsed by the handler, so that a request that does not parse
    (corrupt bytes, invalid UTF-8 in a string) gets INVALID_ARGUMENT (gRPC's own deserializer would answer
    UNKNOWN with the parser's exception). Generate parses its own: it keeps the bytes, and a stream has no
    wrapper to pass each message through."""
    desc = pb.DESCRIPTOR.services_by_name["Pdserve"]
    handlers = {}
    for m in desc.methods:
        method = getattr(service, m.name)
        serialize = getattr(pb, m.output_type.name).SerializeToString
        if m.server_streaming:
            assert m.name == "Generate", f"{m.name}: a streaming method parses its own request"
            handlers[m.name] = grpc.unary_stream_rpc_method_handler(
                method, request_deserializer=None, response_serializer=serialize
            )
            continue
        parse = getattr(pb, m.input_type.name).FromString
        handlers[m.name] = grpc.unary_unary_rpc_method_handler(
            _parsed_unary(method, parse, m.input_type.full_name),
            request_deserializer=None,  # the raw bytes: parsed in the handler
            response_serializer=serialize,
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


async def start_grpc_server(
    service: PdserveService,
    *,
    host: str,
    port: int,
    tls: tuple[bytes, bytes] | None = None,
    auth_token: str | None = None,
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    interceptors = [_TokenAuth(BearerToken(auth_token))] if auth_token else []
    # SO_REUSEPORT (gRPC's default on Linux): the routers on one node share the port and the kernel spreads
    # connections among them. Only sockets of the same user that all set it can share a port; `pdserve up`
    # checks the port is free before it starts a cluster (cluster/cli.py), so no stranger's server shares it.
    options = [("grpc.so_reuseport", 1), ("grpc.max_receive_message_length", MAX_REQUEST_BYTES)]
    server = grpc.aio.server(interceptors=interceptors, options=options)
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
    # SERVING once the caller knows a replica can serve (router/process.py follows the cluster from then on).
    await health_servicer.set(service_name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    return server, health_servicer
