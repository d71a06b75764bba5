"""An OpenAI chat body as the GenerateRequest the request path runs: every message, its parts and tool calls,
and the tools, carried over field by field (router/doors/openai_wire.py)."""

from __future__ import annotations

import json

import pytest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from pdserve_client.api import pdserve_pb2 as pb
from router.doors.openai_wire import BadRequest, chat_request

WEATHER = {
    "type": "function",
    "function": {"name": "weather", "description": "The forecast", "parameters": {"type": "object"}},
}


def _chat(**body: object) -> pb.GenerateRequest:
    return chat_request(ChatCompletionRequest.model_validate({"model": "m", **body}))


def test_messages_parts_and_tool_calls_are_carried_over() -> None:
    request = _chat(
        messages=[
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Lima?"}],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city": "Lima"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "19 C"},
        ],
        tools=[WEATHER],
        tool_choice="required",
    )
    assert [(m.role, m.content) for m in request.messages] == [
        ("system", "Be brief."),
        ("user", "Weather in Lima?"),
        ("assistant", ""),
        ("tool", "19 C"),
    ]
    (call,) = request.messages[2].tool_calls
    assert (call.id, call.name, json.loads(call.arguments_json)) == ("c1", "weather", {"city": "Lima"})
    assert request.messages[3].tool_call_id == "c1"
    (tool,) = request.tools
    assert (tool.name, tool.description, json.loads(tool.parameters_json)) == (
        "weather",
        "The forecast",
        {"type": "object"},
    )
    assert request.tool_choice.mode == pb.ToolChoice.MODE_REQUIRED


def test_a_long_message_arrives_whole() -> None:
    text = "word " * 400_000  # 2 MB
    request = _chat(messages=[{"role": "user", "content": text}])
    assert request.messages[0].content == text


def test_a_part_that_is_not_text_is_refused_naming_it() -> None:
    with pytest.raises(BadRequest) as refused:
        _chat(
            messages=[
                {"role": "user", "content": "hi"},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]},
            ]
        )
    assert refused.value.param == "messages[1].content[0]"
