"""Fuzzing the public gRPC endpoint: whatever a client sends (random fields, huge and negative numbers,
invalid UTF-8, a 10 MB prompt, deeply nested tool JSON, random bytes), the call ends promptly with one of
the documented status codes, and no message carries a traceback.

The server is pdserve's own (tests/inprocess_server.py), so what is fuzzed is everything before and
around the engines (tests/e2e runs the real ones)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from inprocess_server import endpoint

from pdserve_client.api import pdserve_pb2 as pb

# The codes a client can get (docs/api.md, "Errors a client can get"): anything else is a bug.
DOCUMENTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.INTERNAL,
}
GENERATE = "/pdserve.v1.Pdserve/Generate"
TOKENIZE = "/pdserve.v1.Pdserve/Tokenize"


@pytest.fixture(scope="module")
def target() -> Iterator[str]:
    with endpoint() as address:
        yield address


def call(target: str, method: str, payload: bytes) -> tuple[grpc.StatusCode, str]:
    """Send raw request bytes; the final status and its message."""
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        if method == GENERATE:
            stream = channel.unary_stream(method)(payload, timeout=60)
            try:
                for _ in stream:
                    pass
            except grpc.RpcError as exc:
                return exc.code(), exc.details() or ""
            return grpc.StatusCode.OK, ""
        try:
            channel.unary_unary(method)(payload, timeout=60)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
        return grpc.StatusCode.OK, ""


def assert_documented(code: grpc.StatusCode, message: str) -> None:
    assert code in DOCUMENTED, (code, message)
    assert "Traceback" not in message and 'File "' not in message, message


numbers = st.one_of(
    st.integers(min_value=-(2**31), max_value=2**31 - 1), st.sampled_from([0, -1, 1, 2**31 - 1, -(2**31)])
)
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, -1.0, 2.0, 1e30])
)
texts = st.text(max_size=200)


def nested_json(depth: int) -> str:
    return "[" * depth + "]" * depth if depth % 2 else '{"a":' * depth + "1" + "}" * depth


sampling = st.builds(
    pb.SamplingParams,
    max_tokens=numbers,
    temperature=floats,
    top_p=floats,
    top_k=numbers,
    seed=st.integers(min_value=-(2**63), max_value=2**63 - 1),
    stop=st.lists(texts, max_size=20),
    ignore_eos=st.booleans(),
    stop_token_ids=st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=20),
    frequency_penalty=floats,
    repetition_penalty=floats,
    min_p=floats,
    logprobs=numbers,
)
tool_calls = st.builds(
    pb.ToolCall, id=texts, name=texts, arguments_json=st.one_of(texts, st.integers(1, 5000).map(nested_json))
)
messages = st.builds(
    pb.ChatMessage,
    role=st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), texts),
    content=texts,
    tool_calls=st.lists(tool_calls, max_size=3),
    tool_call_id=texts,
    name=texts,
)
tools = st.builds(
    pb.Tool,
    name=texts,
    description=texts,
    parameters_json=st.one_of(texts, st.integers(1, 5000).map(nested_json)),
)
schemas = st.one_of(texts, st.integers(1, 5000).map(nested_json), st.just('{"type": "object"}'))
response_formats = st.one_of(
    st.builds(pb.ResponseFormat, json_schema=schemas),
    st.builds(pb.ResponseFormat, json_object=st.booleans()),
    st.builds(pb.ResponseFormat, regex=texts),
    st.builds(
        pb.ResponseFormat, choice=st.builds(pb.ResponseFormat.Choices, choices=st.lists(texts, max_size=5))
    ),
    st.just(pb.ResponseFormat()),
)
tool_choices = st.builds(pb.ToolChoice, mode=st.integers(0, 7), function_name=texts)
requests = st.builds(
    pb.GenerateRequest,
    model=st.one_of(st.just(""), st.just("tiny-llama"), texts),
    prompt=texts,
    messages=st.lists(messages, max_size=4),
    prompt_token_ids=st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=50),
    tools=st.lists(tools, max_size=3),
    sampling=sampling,
    session_id=texts,
    request_id=texts,
    tool_choice=st.one_of(st.none(), tool_choices),
    parallel_tool_calls=st.one_of(st.none(), st.booleans()),
    response_format=st.one_of(st.none(), response_formats),
    chat_template_kwargs_json=st.one_of(st.just(""), texts, st.just('{"enable_thinking": false}')),
)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(request=requests)
def test_any_generate_request_ends_with_a_documented_code(target: str, request: pb.GenerateRequest) -> None:
    assert_documented(*call(target, GENERATE, request.SerializeToString()))


@FUZZ
@given(payload=st.binary(max_size=300))
def test_any_bytes_end_with_a_documented_code(target: str, payload: bytes) -> None:
    for method in (GENERATE, TOKENIZE):
        assert_documented(*call(target, method, payload))


def test_invalid_utf8_in_a_string_field_is_invalid_argument(target: str) -> None:
    # Field 2 (prompt), length-delimited, with bytes that are not UTF-8.
    payload = b"\x12\x04\xff\xfe\xfd\xfc"
    code, message = call(target, GENERATE, payload)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, message)


def test_a_10_mb_prompt_is_refused_before_it_is_read(target: str) -> None:
    """gRPC's 4 MiB message limit answers first (a 2048-token model's prompt is a few KiB)."""
    request = pb.GenerateRequest(prompt="word " * (2 << 20))
    code, message = call(target, GENERATE, request.SerializeToString())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in message, (code, message)


def test_a_prompt_too_long_for_the_model_is_invalid_argument(target: str) -> None:
    request = pb.GenerateRequest(prompt="word " * 200_000)  # 1 MB: within gRPC's limit, far over the model's
    code, message = call(target, GENERATE, request.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and message.startswith("prompt"), (code, message)


def test_deeply_nested_tool_json_is_answered(target: str) -> None:
    deep = nested_json(100_000)
    request = pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content="hi")],
        tools=[pb.Tool(name="t", parameters_json=deep)],
    )
    assert_documented(*call(target, GENERATE, request.SerializeToString()))
