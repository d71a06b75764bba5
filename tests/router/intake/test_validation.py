"""Edge validation: each rule rejects with the offending field's path; valid requests come out typed."""

from __future__ import annotations

import math
from typing import Any

import pytest

from engine.messages import Constraint, Sampling
from pdserve_client.api import pdserve_pb2 as pb
from router.intake.validation import (
    InvalidRequest,
    ModelLimits,
    check_constraint,
    check_prompt_length,
    validate_generate,
    validate_tokenize,
)

LIMITS = ModelLimits(served_name="tiny-llama", max_model_len=2048, vocab_size=2048)


def generate(**fields: Any) -> pb.GenerateRequest:
    """A valid prompt request, with `fields` replacing or adding to it."""
    sampling = fields.pop("sampling", {})
    request = {"prompt": "Hello", **fields}
    return pb.GenerateRequest(**request, sampling=pb.SamplingParams(**sampling))


def user(content: str = "hi") -> pb.ChatMessage:
    return pb.ChatMessage(role="user", content=content)


TOOL = pb.Tool(name="f", parameters_json='{"type": "object", "properties": {"x": {"type": "integer"}}}')


def chat_with_tools(**fields: Any) -> pb.GenerateRequest:
    return generate(prompt="", messages=[user()], tools=[TOOL], **fields)


INVALID: list[tuple[str, pb.GenerateRequest, str]] = [
    ("no input", generate(prompt=""), "prompt,messages,prompt_token_ids"),
    ("prompt and messages", generate(messages=[user()]), "prompt,messages"),
    ("prompt and token ids", generate(prompt_token_ids=[1, 2]), "prompt,prompt_token_ids"),
    (
        "messages and token ids",
        generate(prompt="", messages=[user()], prompt_token_ids=[5]),
        "messages,prompt_token_ids",
    ),
    ("tools without messages", generate(tools=[pb.Tool(name="f")]), "tools"),
    (
        "unknown role",
        generate(prompt="", messages=[user(), user(), pb.ChatMessage(role="bot")]),
        "messages[2].role",
    ),
    (
        "tool result without call id",
        generate(prompt="", messages=[user(), pb.ChatMessage(role="tool", content="42")]),
        "messages[1].tool_call_id",
    ),
    (
        "tool calls from a user",
        generate(prompt="", messages=[pb.ChatMessage(role="user", tool_calls=[pb.ToolCall(name="f")])]),
        "messages[0].tool_calls",
    ),
    (
        "tool call without a name",
        generate(
            prompt="",
            messages=[user(), pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="c", name="")])],
        ),
        "messages[1].tool_calls[0].name",
    ),
    (
        "tool call arguments not JSON",
        generate(
            prompt="",
            messages=[
                user(),
                pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(name="f", arguments_json="{")]),
            ],
        ),
        "messages[1].tool_calls[0].arguments_json",
    ),
    (
        "tool schema not JSON",
        generate(prompt="", messages=[user()], tools=[pb.Tool(name="f", parameters_json="nope")]),
        "tools[0].parameters_json",
    ),
    (
        "token id past the vocabulary",
        generate(prompt="", prompt_token_ids=[5, 2047, 2048]),
        "prompt_token_ids[2]",
    ),
    (
        "the first of several token ids past the vocabulary is named",
        generate(prompt="", prompt_token_ids=[5, 9000, 2048]),
        "prompt_token_ids[1]",
    ),
    ("unknown model", generate(model="gpt-5"), "model"),
    ("max_tokens zero", generate(sampling={"max_tokens": 0}), "sampling.max_tokens"),
    ("max_tokens negative", generate(sampling={"max_tokens": -4}), "sampling.max_tokens"),
    ("max_tokens past the context", generate(sampling={"max_tokens": 2049}), "sampling.max_tokens"),
    ("temperature negative", generate(sampling={"temperature": -0.1}), "sampling.temperature"),
    ("temperature above 2", generate(sampling={"temperature": 2.5}), "sampling.temperature"),
    ("temperature NaN", generate(sampling={"temperature": math.nan}), "sampling.temperature"),
    ("temperature infinite", generate(sampling={"temperature": math.inf}), "sampling.temperature"),
    ("top_p zero", generate(sampling={"top_p": 0.0}), "sampling.top_p"),
    ("top_p above 1", generate(sampling={"top_p": 1.5}), "sampling.top_p"),
    ("top_p NaN", generate(sampling={"top_p": math.nan}), "sampling.top_p"),
    ("top_k zero", generate(sampling={"top_k": 0}), "sampling.top_k"),
    ("top_k below -1", generate(sampling={"top_k": -2}), "sampling.top_k"),
    ("17 stop strings", generate(sampling={"stop": [f"s{i}" for i in range(17)]}), "sampling.stop"),
    ("empty stop string", generate(sampling={"stop": ["END", ""]}), "sampling.stop[1]"),
    ("session id too long", generate(session_id="s" * 257), "session_id"),
    ("17 stop token ids", generate(sampling={"stop_token_ids": list(range(17))}), "sampling.stop_token_ids"),
    ("stop token id too big", generate(sampling={"stop_token_ids": [1, 2048]}), "sampling.stop_token_ids[1]"),
    ("frequency penalty", generate(sampling={"frequency_penalty": 2.5}), "sampling.frequency_penalty"),
    ("presence penalty NaN", generate(sampling={"presence_penalty": math.nan}), "sampling.presence_penalty"),
    (
        "repetition penalty zero",
        generate(sampling={"repetition_penalty": 0.0}),
        "sampling.repetition_penalty",
    ),
    ("min_p above 1", generate(sampling={"min_p": 1.5}), "sampling.min_p"),
    ("tool choice without tools", generate(tool_choice=pb.ToolChoice(mode=2)), "tool_choice"),
    ("parallel calls without tools", generate(parallel_tool_calls=False), "parallel_tool_calls"),
    (
        "tool choice names no tool",
        chat_with_tools(tool_choice=pb.ToolChoice(mode=3, function_name="g")),
        "tool_choice.function_name",
    ),
    (
        "function name without mode",
        chat_with_tools(tool_choice=pb.ToolChoice(function_name="f")),
        "tool_choice.function_name",
    ),
    (
        "required call and a response format",
        chat_with_tools(
            tool_choice=pb.ToolChoice(mode=2), response_format=pb.ResponseFormat(json_object=True)
        ),
        "response_format",
    ),
    (
        "schema not JSON",
        generate(response_format=pb.ResponseFormat(json_schema="{")),
        "response_format.json_schema",
    ),
    (
        "schema not an object",
        generate(response_format=pb.ResponseFormat(json_schema="[1]")),
        "response_format.json_schema",
    ),
    (
        "json_object false",
        generate(response_format=pb.ResponseFormat(json_object=False)),
        "response_format.json_object",
    ),
    ("empty regex", generate(response_format=pb.ResponseFormat(regex="")), "response_format.regex"),
    (
        "no choices",
        generate(response_format=pb.ResponseFormat(choice=pb.ResponseFormat.Choices())),
        "response_format.choice",
    ),
    ("format unset", generate(response_format=pb.ResponseFormat()), "response_format"),
    ("logprobs above 20", generate(sampling={"logprobs": 21}), "sampling.logprobs"),
    ("negative logprobs", generate(sampling={"logprobs": -1}), "sampling.logprobs"),
    ("template kwargs with a prompt", generate(chat_template_kwargs_json="{}x"), "chat_template_kwargs_json"),
    ("template kwargs not JSON", chat_with_tools(chat_template_kwargs_json="{"), "chat_template_kwargs_json"),
    ("template kwargs a list", chat_with_tools(chat_template_kwargs_json="[]"), "chat_template_kwargs_json"),
    (
        "template kwargs override the renderer",
        chat_with_tools(chat_template_kwargs_json='{"tokenize": true}'),
        "chat_template_kwargs_json",
    ),
    ("request id too long", generate(request_id="r" * 257), "request_id"),
]


@pytest.mark.parametrize(
    ("request_", "field"), [case[1:] for case in INVALID], ids=[case[0] for case in INVALID]
)
def test_invalid_generate_request_names_the_field(request_: pb.GenerateRequest, field: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        validate_generate(request_, LIMITS)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
    assert info.value.message


def test_prompt_request_gets_server_defaults() -> None:
    validated = validate_generate(pb.GenerateRequest(prompt="Hello"), LIMITS)
    assert validated.input.kind == "prompt"
    assert validated.input.prompt == "Hello"
    assert validated.sampling == Sampling()
    assert validated.sampling.max_tokens == 16
    assert (validated.session_id, validated.request_id) == ("", "")


def test_sampling_values_pass_through() -> None:
    sampling = {
        "max_tokens": 2048,
        "temperature": 0.0,
        "top_p": 0.5,
        "top_k": 40,
        "seed": -7,
        "stop": ["\n\n", "END"],
        "ignore_eos": True,
    }
    validated = validate_generate(
        generate(model="tiny-llama", sampling=sampling, session_id="s" * 256, request_id="req-1"), LIMITS
    )
    assert validated.sampling == Sampling(
        max_tokens=2048, temperature=0.0, top_p=0.5, top_k=40, seed=-7, stop=("\n\n", "END"), ignore_eos=True
    )
    assert (validated.session_id, validated.request_id) == ("s" * 256, "req-1")


def test_edge_values_are_accepted() -> None:
    validated = validate_generate(generate(sampling={"temperature": 2.0, "top_p": 1.0, "top_k": -1}), LIMITS)
    assert (validated.sampling.temperature, validated.sampling.top_p, validated.sampling.top_k) == (
        2.0,
        1.0,
        -1,
    )
    assert validate_generate(generate(sampling={"stop": ["x"] * 16}), LIMITS).sampling.stop == ("x",) * 16


def test_messages_request_with_tools_comes_out_as_template_input() -> None:
    request = pb.GenerateRequest(
        messages=[
            pb.ChatMessage(role="system", content="Be brief."),
            user("Weather in Rome?"),
            pb.ChatMessage(
                role="assistant",
                tool_calls=[pb.ToolCall(id="c1", name="weather", arguments_json='{"city": "Rome"}')],
            ),
            pb.ChatMessage(role="tool", tool_call_id="c1", content="sunny"),
        ],
        tools=[pb.Tool(name="weather", parameters_json='{"type": "object"}')],
    )
    validated = validate_generate(request, LIMITS)
    assert validated.input.kind == "messages"
    assert [m["role"] for m in validated.input.messages] == ["system", "user", "assistant", "tool"]
    assert validated.input.messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    assert validated.input.tools is not None
    assert validated.input.tools[0]["function"]["parameters"] == {"type": "object"}


def test_messages_without_tools_have_no_tools() -> None:
    validated = validate_generate(pb.GenerateRequest(messages=[user()]), LIMITS)
    assert validated.input.tools is None


def test_token_ids_request() -> None:
    validated = validate_generate(pb.GenerateRequest(prompt_token_ids=[0, 5, 2047]), LIMITS)
    assert validated.input.kind == "prompt_token_ids"
    assert validated.input.prompt_token_ids == [0, 5, 2047]


def test_tokenize_takes_prompt_or_messages() -> None:
    assert validate_tokenize(pb.TokenizeRequest(prompt="hi"), LIMITS).kind == "prompt"
    assert validate_tokenize(pb.TokenizeRequest(messages=[user()], tools=[pb.Tool(name="f")]), LIMITS).tools


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (pb.TokenizeRequest(), "prompt,messages,prompt_token_ids"),
        (pb.TokenizeRequest(prompt="a", messages=[user()]), "prompt,messages"),
        (pb.TokenizeRequest(prompt="a", tools=[pb.Tool(name="f")]), "tools"),
        (pb.TokenizeRequest(prompt="a", model="other"), "model"),
        (pb.TokenizeRequest(messages=[pb.ChatMessage(role="robot")]), "messages[0].role"),
    ],
)
def test_invalid_tokenize_request_names_the_field(request_: pb.TokenizeRequest, field: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        validate_tokenize(request_, LIMITS)
    assert info.value.field == field


def test_prompt_that_fits_with_max_tokens_passes() -> None:
    check_prompt_length(2000, Sampling(max_tokens=48), LIMITS, input_field="prompt")


def test_max_tokens_is_blamed_when_the_prompt_alone_fits() -> None:
    with pytest.raises(InvalidRequest) as info:
        check_prompt_length(2000, Sampling(max_tokens=49), LIMITS, input_field="messages")
    assert info.value.field == "sampling.max_tokens"
    assert "2000" in info.value.message and "49" in info.value.message and "2048" in info.value.message


@pytest.mark.parametrize("num_prompt_tokens", [2048, 5000])
def test_input_is_blamed_when_the_prompt_alone_does_not_fit(num_prompt_tokens: int) -> None:
    with pytest.raises(InvalidRequest) as info:
        check_prompt_length(num_prompt_tokens, Sampling(max_tokens=1), LIMITS, input_field="messages")
    assert info.value.field == "messages"
    assert str(num_prompt_tokens) in info.value.message


def test_tools_default_to_auto_with_parallel_calls() -> None:
    tool_use = validate_generate(chat_with_tools(), LIMITS).tool_use
    assert tool_use is not None and (tool_use.choice, tool_use.parallel) == ("auto", True)
    assert tool_use.tools[0]["function"]["name"] == "f"
    assert validate_generate(generate(), LIMITS).tool_use is None


def test_a_named_tool_choice_and_the_sampling_extras_come_through() -> None:
    valid = validate_generate(
        chat_with_tools(
            tool_choice=pb.ToolChoice(mode=pb.ToolChoice.MODE_FUNCTION, function_name="f"),
            parallel_tool_calls=False,
            sampling={
                "stop_token_ids": [7],
                "min_p": 0.1,
                "repetition_penalty": 1.2,
                "frequency_penalty": -1,
            },
        ),
        LIMITS,
    )
    assert valid.tool_use is not None
    assert (valid.tool_use.choice, valid.tool_use.function, valid.tool_use.parallel) == (
        "function",
        "f",
        False,
    )
    s = valid.sampling
    assert (s.stop_token_ids, s.repetition_penalty, s.frequency_penalty) == ((7,), pytest.approx(1.2), -1.0)
    assert s.min_p == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("fmt", "constraint"),
    [
        (pb.ResponseFormat(json_schema='{"type": "object"}'), Constraint(json_schema={"type": "object"})),
        (pb.ResponseFormat(json_object=True), Constraint(json_object=True)),
        (pb.ResponseFormat(regex="[a-z]+"), Constraint(regex="[a-z]+")),
        (
            pb.ResponseFormat(choice=pb.ResponseFormat.Choices(choices=["yes", "no"])),
            Constraint(choice=("yes", "no")),
        ),
    ],
    ids=["json_schema", "json_object", "regex", "choice"],
)
def test_a_response_format_becomes_the_engines_constraint(
    fmt: pb.ResponseFormat, constraint: Constraint
) -> None:
    assert validate_generate(generate(response_format=fmt), LIMITS).sampling.constraint == constraint


@pytest.mark.parametrize(
    "constraint",
    [Constraint(regex="(unclosed"), Constraint(json_schema={"type": "no-such-type"})],
    ids=["regex", "schema"],
)
def test_a_constraint_the_grammar_backend_cannot_compile_is_refused(constraint: Constraint) -> None:
    with pytest.raises(InvalidRequest) as info:
        check_constraint(Sampling(constraint=constraint))
    assert info.value.field == "response_format"
    assert ".cc:" not in info.value.message and "/" not in info.value.message  # no C++ source path


def test_template_variables_and_logprobs_come_through() -> None:
    valid = validate_generate(
        chat_with_tools(chat_template_kwargs_json='{"enable_thinking": false}', sampling={"logprobs": 0}),
        LIMITS,
    )
    assert valid.input.template_kwargs == {"enable_thinking": False}
    assert valid.sampling.logprobs == 0
    assert validate_generate(generate(), LIMITS).sampling.logprobs is None
