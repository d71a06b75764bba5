"""The OpenAI-compatible HTTP door, driven by the official `openai` client: the same request path as gRPC
(here with a stand-in decode pool that streams a scripted output; tests/e2e/test_serving.py runs it on real
engines), OpenAI's response and chunk shapes, and OpenAI's error JSON with matching HTTP statuses."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from inprocess_server import endpoint
from ports import free_port

from engine.messages import EngineRequest

TOKEN = "s3cret-token"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The forecast",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ASK = [{"role": "user", "content": "Weather in Paris?"}]


class Door:
    def __init__(self, base_url: str, seen: list[EngineRequest]) -> None:
        self.base_url = base_url
        self.seen = seen
        self.client = openai.OpenAI(base_url=base_url + "/v1", api_key=TOKEN, max_retries=0)


@pytest.fixture
def door(request: pytest.FixtureRequest) -> Iterator[Door]:
    output = getattr(request, "param", ["It is ", "sunny."])
    seen: list[EngineRequest] = []
    port = free_port()
    with endpoint(output=output, seen=seen, http_port=port, auth_token=TOKEN):
        door = Door(f"http://127.0.0.1:{port}", seen)
        with door.client:
            yield door


@pytest.mark.parametrize("door", [["Let me look. ", CALL]], indirect=True)
def test_chat_with_tools_returns_the_parsed_call(door: Door) -> None:
    r = door.client.chat.completions.create(model="tiny-llama", messages=ASK, tools=[WEATHER], max_tokens=64)  # type: ignore[arg-type, list-item]
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls"
    assert (choice.message.content or "").strip() == "Let me look."
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    assert r.usage is not None and r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 0
    assert door.seen[0].sampling.max_tokens == 64
    # pdserve's extension field says how the request was served (clients ignore fields they do not know).
    assert (r.model_extra or {})["pdserve"]["decode_replica"] == "D1"


@pytest.mark.parametrize("door", [["Let me look. ", CALL[:30], CALL[30:]]], indirect=True)
def test_a_streamed_chat_carries_content_and_call_deltas_then_usage(door: Door) -> None:
    stream = door.client.chat.completions.create(
        model="tiny-llama",
        messages=ASK,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        stream=True,
        stream_options={"include_usage": True},
    )
    content, name, arguments, finish, usage = "", "", "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or ():
                name += (d.function.name or "") if d.function else ""
                arguments += (d.function.arguments or "") if d.function else ""
            finish = choice.finish_reason or finish
    assert content.strip() == "Let me look." and name == "get_weather"
    assert json.loads(arguments) == {"city": "Paris"} and finish == "tool_calls"
    assert usage is not None and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


@pytest.mark.parametrize(
    "door", [['[{"name": "get_weather", ', '"parameters": {"city": "Rome"}}]']], indirect=True
)
def test_a_required_tool_choice_reaches_the_engine_as_a_grammar(door: Door) -> None:
    r = door.client.chat.completions.create(
        model="tiny-llama",
        messages=ASK,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
    )
    (call,) = r.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome"}  # type: ignore[union-attr]
    constraint = door.seen[0].sampling.constraint
    assert (
        constraint is not None
        and constraint.json_schema is not None
        and constraint.json_schema["type"] == "array"
    )


def test_completions_stream_and_not(door: Door) -> None:
    r = door.client.completions.create(model="tiny-llama", prompt="The weather", max_tokens=8)
    assert r.choices[0].text == "It is sunny." and r.choices[0].finish_reason == "stop"
    text = "".join(
        c.choices[0].text
        for c in door.client.completions.create(
            model="tiny-llama", prompt="The weather", max_tokens=8, stream=True
        )
        if c.choices
    )
    assert text == "It is sunny."


def test_completions_return_token_ids_when_asked_as_vllm_does(door: Door) -> None:
    """vLLM's `return_token_ids`: each choice carries its tokens' ids (benchmarks count tokens with them)."""
    ask = {"return_token_ids": True}
    whole = door.client.completions.create(
        model="tiny-llama", prompt="The weather", max_tokens=8, extra_body=ask
    )
    ids = whole.choices[0].model_extra["token_ids"]
    assert ids and whole.usage is not None and len(ids) == whole.usage.completion_tokens
    chunks = door.client.completions.create(
        model="tiny-llama",
        prompt="The weather",
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=ask,
    )
    streamed = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert streamed == ids
    plain = door.client.completions.create(model="tiny-llama", prompt="The weather", max_tokens=8)
    assert "token_ids" not in (plain.choices[0].model_extra or {})


def test_models_and_health(door: Door) -> None:
    assert [m.id for m in door.client.models.list()] == ["tiny-llama"]
    with urllib.request.urlopen(door.base_url + "/health", timeout=10) as resp:  # no token needed
        assert resp.status == 200


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": 5.0}, "sampling.temperature"),
        ({"n": 2}, "n"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logprobs": True, "top_logprobs": 20, "extra_body": {"top_logprobs": 25}}, "logprobs"),
        ({"model": "gpt-4"}, "model"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
    ids=["temperature", "n", "logit bias", "too many logprobs", "unknown model", "tool choice without tools"],
)
def test_bad_requests_get_openai_errors_naming_the_field(
    door: Door, kwargs: dict[str, Any], param: str
) -> None:
    args: dict[str, Any] = {"model": "tiny-llama", "messages": ASK, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        door.client.chat.completions.create(**args)
    assert info.value.status_code == 400
    body = info.value.body
    assert isinstance(body, dict) and param in body["message"] and body["type"] == "invalid_request_error"
    assert "Traceback" not in body["message"]
    assert door.seen == [], "a refused request reached an engine"


def test_a_wrong_token_is_401(door: Door) -> None:
    client = openai.OpenAI(base_url=door.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_a_body_that_is_not_json_is_400(door: Door) -> None:
    req = urllib.request.Request(
        door.base_url + "/v1/chat/completions",
        data=b"{not json",
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=10)
    assert info.value.code == 400
    assert "not JSON" in json.loads(info.value.read())["error"]["message"]


def test_a_body_over_the_doors_cap_is_413_with_openai_json(door: Door) -> None:
    """The HTTP door caps bodies as gRPC caps messages (4 MiB): a 5 MB chat is refused as it arrives, never
    parsed; a prompt within the cap but far over the model's context is a 400 naming the field."""
    messages = [{"role": "user", "content": "word " * 1_000_000}]
    with pytest.raises(openai.APIStatusError) as info:
        door.client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=4)  # type: ignore[arg-type]
    assert info.value.status_code == 413
    body = info.value.body
    assert isinstance(body, dict) and "over 4194304 bytes" in body["message"]
    with pytest.raises(openai.BadRequestError) as too_long:
        door.client.completions.create(model="tiny-llama", prompt="word " * 400_000, max_tokens=4)
    assert "prompt: the prompt has at least" in str(too_long.value)
    assert door.seen == []


def test_the_door_speaks_tls_with_the_same_certificate_as_grpc(tmp_path: Any) -> None:
    import httpx
    from test_auth import self_signed

    key, cert = self_signed()
    (tmp_path / "cert.pem").write_bytes(cert)
    port = free_port()
    with endpoint(tls=(key, cert), auth_token=TOKEN, http_port=port):
        verified = httpx.Client(verify=str(tmp_path / "cert.pem"))
        with openai.OpenAI(
            base_url=f"https://127.0.0.1:{port}/v1", api_key=TOKEN, max_retries=0, http_client=verified
        ) as client:
            assert [m.id for m in client.models.list()] == ["tiny-llama"]
        plaintext = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=TOKEN, max_retries=0)
        with plaintext, pytest.raises(openai.APIConnectionError):
            plaintext.models.list()
