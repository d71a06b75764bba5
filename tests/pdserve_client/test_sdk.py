"""The client SDK against an in-process fake server: request conversion, auth metadata, streaming, errors.

The fake only records what arrives and answers canned messages; it is not pdserve's server.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve_client.api import pdserve_pb2 as pb
from pdserve_client.api import pdserve_pb2_grpc
from pdserve_client.sdk import AsyncPdserveClient, PdserveClient, PdserveError


class FakePdserve(pdserve_pb2_grpc.PdserveServicer):
    def __init__(self) -> None:
        self.requests: list[Any] = []
        self.metadata: list[dict[str, str]] = []
        self.cancelled = threading.Event()

    def _record(self, request: Any, context: grpc.ServicerContext) -> None:
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))

    def Generate(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        self._record(request, context)
        if request.prompt == "overload":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "cluster overloaded, retry later")
        context.add_callback(self.cancelled.set)
        yield pb.GenerateResponse(request_id="r-1", token_ids=[5, 6], text="Hel")
        if request.prompt == "endless":
            while context.is_active():
                yield pb.GenerateResponse(request_id="r-1", token_ids=[7], text=".")
            return
        yield pb.GenerateResponse(request_id="r-1", token_ids=[7], text="lo")
        yield pb.GenerateResponse(
            request_id="r-1",
            final=pb.Final(
                finish_reason=pb.FINISH_REASON_LENGTH,
                usage=pb.Usage(prompt_tokens=9, cached_tokens=4, completion_tokens=3),
                served_by=pb.ServedBy(path=pb.SERVING_PATH_DISAGGREGATED, decode_replica="d-0"),
                timings=pb.Timings(ttft_ms=12.5),
            ),
        )

    def Tokenize(self, request: pb.TokenizeRequest, context: grpc.ServicerContext) -> pb.TokenizeResponse:
        self._record(request, context)
        if not request.prompt and not request.messages:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt,messages: exactly one is required")
        return pb.TokenizeResponse(token_ids=[len(request.prompt), len(request.messages)], max_model_len=2048)

    def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.ServicerContext
    ) -> pb.ListModelsResponse:
        self._record(request, context)
        return pb.ListModelsResponse(models=[pb.Model(id="tiny-llama", max_model_len=2048, block_size=32)])

    def GetClusterStatus(
        self, request: pb.GetClusterStatusRequest, context: grpc.ServicerContext
    ) -> pb.GetClusterStatusResponse:
        self._record(request, context)
        return pb.GetClusterStatusResponse(
            replicas=[pb.Replica(replica_id="p-0", role="prefill", state="RUNNING")]
        )


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, FakePdserve]]:
    fake = FakePdserve()
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pdserve_pb2_grpc.add_PdserveServicer_to_server(fake, grpc_server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    yield f"127.0.0.1:{port}", fake
    grpc_server.stop(grace=None)


AGENT_TURN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Lima?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Lima"}}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "19 C"},
]
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}},
    {"name": "clock", "description": "Time now", "parameters": '{"type": "object"}'},
]


def test_generate_text_sends_converted_messages_and_gathers_the_stream(
    server: tuple[str, FakePdserve],
) -> None:
    target, fake = server
    with PdserveClient(target) as client:
        done = client.generate_text(
            messages=AGENT_TURN, tools=TOOLS, max_tokens=3, temperature=0.0, stop=["\n"], session_id="s-1"
        )
    request = fake.requests[-1]
    assert [m.role for m in request.messages] == ["system", "user", "assistant", "tool"]
    call = request.messages[2].tool_calls[0]
    assert (call.id, call.name, json.loads(call.arguments_json)) == ("c1", "weather", {"city": "Lima"})
    assert request.messages[2].content == ""
    assert request.messages[3].tool_call_id == "c1"
    assert [(t.name, json.loads(t.parameters_json)) for t in request.tools] == [
        ("weather", {"type": "object"}),
        ("clock", {"type": "object"}),
    ]
    assert request.tools[1].description == "Time now"
    assert request.sampling.max_tokens == 3 and request.sampling.HasField("temperature")
    assert list(request.sampling.stop) == ["\n"] and request.session_id == "s-1"
    # Unset sampling fields stay unset, so the server applies its defaults.
    assert not request.sampling.HasField("top_p") and not request.sampling.HasField("seed")

    assert (done.request_id, done.text, done.token_ids, done.finish_reason) == (
        "r-1",
        "Hello",
        [5, 6, 7],
        "length",
    )
    assert (done.usage.prompt_tokens, done.usage.cached_tokens, done.usage.completion_tokens) == (9, 4, 3)
    assert done.served_by.path == pb.SERVING_PATH_DISAGGREGATED and done.served_by.decode_replica == "d-0"
    assert done.timings.ttft_ms == 12.5


def test_generate_streams_each_message(server: tuple[str, FakePdserve]) -> None:
    target, fake = server
    with PdserveClient(target) as client:
        responses = list(client.generate(token_ids=[3, 4], top_k=5, seed=11, model="tiny-llama"))
    assert [r.text for r in responses] == ["Hel", "lo", ""]
    assert responses[-1].HasField("final") and not responses[0].HasField("final")
    request = fake.requests[-1]
    assert list(request.prompt_token_ids) == [3, 4] and request.model == "tiny-llama"
    assert (request.sampling.top_k, request.sampling.seed) == (5, 11)


def test_bearer_token_is_sent_only_when_given(server: tuple[str, FakePdserve]) -> None:
    target, fake = server
    with PdserveClient(target, token="s3cret") as client:
        client.list_models()
    assert fake.metadata[-1]["authorization"] == "Bearer s3cret"
    with PdserveClient(target) as client:
        client.list_models()
    assert "authorization" not in fake.metadata[-1]


def test_grpc_errors_become_pdserve_errors(server: tuple[str, FakePdserve]) -> None:
    target, _ = server
    with PdserveClient(target) as client:
        with pytest.raises(PdserveError) as info:
            client.generate_text(prompt="overload")
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert info.value.message == "cluster overloaded, retry later"
        with pytest.raises(PdserveError) as info:
            client.tokenize()
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_unreachable_server_is_unavailable() -> None:
    with PdserveClient("127.0.0.1:1", timeout=5) as client, pytest.raises(PdserveError) as info:
        client.list_models()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_leaving_the_stream_early_cancels_the_call(server: tuple[str, FakePdserve]) -> None:
    target, fake = server
    fake.cancelled.clear()
    with PdserveClient(target) as client:
        stream = client.generate(prompt="endless")
        assert next(stream).text == "Hel"
        stream.close()  # what leaving a for loop over the stream does, once the generator is dropped
    assert fake.cancelled.wait(timeout=5)


def test_message_dict_with_unknown_key_is_refused(server: tuple[str, FakePdserve]) -> None:
    target, _ = server
    with PdserveClient(target) as client, pytest.raises(ValueError, match="tool_call"):
        client.generate_text(messages=[{"role": "tool", "tool_call": "c1", "content": "x"}])


def test_tokenize_models_status_and_health(server: tuple[str, FakePdserve]) -> None:
    target, fake = server
    with PdserveClient(target) as client:
        tokenized = client.tokenize(messages=AGENT_TURN[:2], tools=TOOLS)
        assert (list(tokenized.token_ids), tokenized.max_model_len) == ([0, 2], 2048)
        assert len(fake.requests[-1].tools) == 2
        assert [m.id for m in client.list_models()] == ["tiny-llama"]
        assert [(r.replica_id, r.role) for r in client.cluster_status()] == [("p-0", "prefill")]
        assert client.health() == "SERVING"
        with pytest.raises(PdserveError) as info:
            client.health("no.such.Service")
        assert info.value.code == grpc.StatusCode.NOT_FOUND


async def test_async_client_same_conversion_metadata_and_errors(server: tuple[str, FakePdserve]) -> None:
    target, fake = server
    async with AsyncPdserveClient(target, token="t0k", timeout=10) as client:
        done = await client.generate_text(messages=AGENT_TURN, tools=TOOLS, max_tokens=3)
        assert (done.text, done.token_ids, done.finish_reason) == ("Hello", [5, 6, 7], "length")
        assert json.loads(fake.requests[-1].messages[2].tool_calls[0].arguments_json) == {"city": "Lima"}
        assert fake.metadata[-1]["authorization"] == "Bearer t0k"

        texts = [r.text async for r in client.generate(prompt="hi")]
        assert texts == ["Hel", "lo", ""]

        with pytest.raises(PdserveError) as info:
            await client.generate_text(prompt="overload")
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED

        assert (await client.tokenize(prompt="abc")).token_ids == [3, 0]
        assert [m.block_size for m in await client.list_models()] == [32]
        assert len(await client.cluster_status()) == 1
        assert await client.health() == "SERVING"


def test_every_sampling_field_of_the_proto_is_a_keyword_of_generate() -> None:
    from pdserve_client.sdk import _SAMPLING_FIELDS, GenerateFields, generate_request

    assert set(_SAMPLING_FIELDS) <= set(GenerateFields.__annotations__)
    request = generate_request(prompt="x", min_p=0.5, stop_token_ids=[3], logprobs=2)
    assert (request.sampling.min_p, list(request.sampling.stop_token_ids), request.sampling.logprobs) == (
        0.5,
        [3],
        2,
    )
    assert not request.sampling.HasField("temperature")  # unset stays unset: the server's default


def test_an_argument_generate_does_not_know_is_refused_not_silently_dropped() -> None:
    from pdserve_client.sdk import PdserveClient, generate_request

    with pytest.raises(
        TypeError, match=r"unknown argument 'prompt_token_ids' \(did you mean 'token_ids'\?\)"
    ):
        generate_request(prompt_token_ids=[1, 2], max_tokens=4)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"unknown argument 'temprature' \(did you mean 'temperature'\?\)"):
        generate_request(prompt="x", temprature=0.2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"^unknown argument 'zzz'$"):
        generate_request(prompt="x", zzz=1)  # type: ignore[call-arg]
    # Raised by the clients before anything is sent (nothing listens at this address).
    client = PdserveClient("127.0.0.1:9")
    try:
        with pytest.raises(TypeError, match="unknown argument 'max_token'"):
            next(iter(client.generate(prompt="x", max_token=4)))  # type: ignore[call-arg]
    finally:
        client.close()
