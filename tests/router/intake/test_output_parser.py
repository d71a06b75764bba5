"""The model's output as the agent gets it: tool calls and reasoning parsed out of the text by vLLM's parsers,
batch by batch, and what the tool choice asks of the engine."""

from __future__ import annotations

import copy
import json
import queue
from typing import Any

import pytest
from inprocess_server import endpoint

from engine.messages import Constraint, EngineRequest, Sampling
from engine.tiny_model import ensure_tiny_model
from pdserve_client.sdk import PdserveClient
from router.intake.output_parser import OutputParser, OutputParsers, ToolUse
from router.intake.tokenizer import PromptTokenizer
from router.messages import ParsedDelta

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
HERMES_CALL = (
    'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def tokenizer() -> PromptTokenizer:
    return PromptTokenizer(ensure_tiny_model())


@pytest.fixture(scope="module")
def parsers(tokenizer: PromptTokenizer) -> OutputParsers:
    return OutputParsers(tokenizer.hf_tokenizer, "hermes", None)


def stream(
    parser: OutputParser,
    tokenizer: PromptTokenizer,
    text: str,
    every: int = 3,
    skip_special_tokens: bool = False,
) -> list[ParsedDelta]:
    """Feed `text` as the engine streams it: a few tokens a batch, each with its new text; then finish."""
    ids = tokenizer.encode_rendered(text)
    deltas = []
    for k in range(0, len(ids), every):
        before = tokenizer.decode(ids[:k], skip_special_tokens=skip_special_tokens)
        now = tokenizer.decode(ids[: k + every], skip_special_tokens=skip_special_tokens)
        deltas.append(parser.feed(ids[k : k + every], now[len(before) :]))
    deltas.append(parser.finish())
    return deltas


def gathered(deltas: list[ParsedDelta]) -> tuple[str, list[dict[str, str]]]:
    """The content, and the calls as a client assembles them from their deltas (by index)."""
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        for c in d.tool_calls:
            call = calls.setdefault(c.index, {"id": "", "name": "", "arguments": ""})
            call["id"] = call["id"] or c.id
            call["name"] = call["name"] or c.name
            call["arguments"] += c.arguments
    return "".join(d.content for d in deltas), [calls[i] for i in sorted(calls)]


def test_auto_streams_the_content_and_the_call_apart(
    parsers: OutputParsers, tokenizer: PromptTokenizer
) -> None:
    parser = parsers.parser(ToolUse(tools=[WEATHER]))
    deltas = stream(parser, tokenizer, HERMES_CALL)
    content, calls = gathered(deltas)
    assert content.strip() == "Let me look."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0]["id"] and parser.tools_called
    # Incremental: the call's name went out before the output ended.
    assert any(c.name for d in deltas[:-1] for c in d.tool_calls)


def test_auto_without_a_call_is_all_content(parsers: OutputParsers, tokenizer: PromptTokenizer) -> None:
    parser = parsers.parser(ToolUse(tools=[WEATHER]))
    content, calls = gathered(stream(parser, tokenizer, "It is sunny in Paris today."))
    assert (content, calls, parser.tools_called) == ("It is sunny in Paris today.", [], False)


def test_auto_keeps_special_tokens_and_leaves_the_output_free(parsers: OutputParsers) -> None:
    sampling = parsers.engine_sampling(Sampling(), ToolUse(tools=[WEATHER]))
    assert sampling.skip_special_tokens is False and sampling.constraint is None


def test_none_leaves_sampling_and_output_alone(parsers: OutputParsers, tokenizer: PromptTokenizer) -> None:
    tool_use = ToolUse(tools=[WEATHER], choice="none")
    assert parsers.engine_sampling(Sampling(), tool_use) == Sampling()
    content, calls = gathered(stream(parsers.parser(tool_use), tokenizer, HERMES_CALL))
    assert content == HERMES_CALL and calls == []


def test_required_is_vllms_tool_call_grammar_and_its_json_is_parsed(
    parsers: OutputParsers, tokenizer: PromptTokenizer
) -> None:
    tool_use = ToolUse(tools=[WEATHER, TIME], choice="required", parallel=False)
    constraint = parsers.engine_sampling(Sampling(), tool_use).constraint
    assert constraint is not None and constraint.json_schema is not None
    schema = constraint.json_schema
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    parser = parsers.parser(tool_use)
    content, calls = gathered(stream(parser, tokenizer, '[{"name": "get_time", "parameters": {}}]'))
    assert content == "" and [(c["name"], c["arguments"]) for c in calls] == [("get_time", "{}")]
    assert parser.tools_called


def test_a_named_function_is_its_arguments_grammar(
    parsers: OutputParsers, tokenizer: PromptTokenizer
) -> None:
    tool_use = ToolUse(tools=[WEATHER, TIME], choice="function", function="get_weather")
    sampling = parsers.engine_sampling(Sampling(constraint=Constraint(json_object=True)), tool_use)
    # The call's own grammar replaces any other constraint.
    assert sampling.constraint == Constraint(json_schema=WEATHER["function"]["parameters"])  # type: ignore[index]
    _, calls = gathered(stream(parsers.parser(tool_use), tokenizer, '{"city": "Oslo"}'))
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Oslo"})]


def test_a_required_call_cut_short_by_max_tokens_comes_back_as_content(
    parsers: OutputParsers, tokenizer: PromptTokenizer
) -> None:
    parser = parsers.parser(ToolUse(tools=[WEATHER], choice="required"))
    content, calls = gathered(stream(parser, tokenizer, '[{"name": "get_weather", "param'))
    assert content == '[{"name": "get_weather", "param' and calls == [] and not parser.tools_called


def test_a_reasoning_parser_splits_the_thinking_from_the_answer(tokenizer: PromptTokenizer) -> None:
    hf = copy.deepcopy(tokenizer.hf_tokenizer)
    hf.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})  # the tiny model has none

    class Tok(PromptTokenizer):
        def __init__(self) -> None:
            self._tokenizer = hf
            self._free = queue.SimpleQueue()
            self._free.put(hf)  # its one copy

    parsers = OutputParsers(hf, "hermes", "deepseek_r1")
    assert (
        parsers.engine_sampling(Sampling(), None).skip_special_tokens is False
    )  # the markers stay in the text
    parser = parsers.parser(None)
    text = "<think>The user wants a greeting.</think>Hello there!"
    deltas = stream(parser, Tok(), text, every=2)
    assert "".join(d.reasoning for d in deltas) == "The user wants a greeting."
    assert "".join(d.content for d in deltas) == "Hello there!"


def call_through_grpc(output: list[str], **fields: Any) -> tuple[Any, list[EngineRequest]]:
    seen: list[EngineRequest] = []
    with endpoint(output=output, seen=seen) as address, PdserveClient(address) as client:
        done = client.generate_text(messages=[{"role": "user", "content": "Weather in Paris?"}], **fields)
    return done, seen


def test_a_parsed_tool_call_reaches_the_grpc_client_with_finish_reason_tool_calls() -> None:
    half = len(HERMES_CALL) // 2
    done, seen = call_through_grpc([HERMES_CALL[:half], HERMES_CALL[half:]], tools=[WEATHER])
    assert done.finish_reason == "tool_calls"
    assert done.text.strip() == "Let me look."
    ((call),) = done.tool_calls
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert seen[0].sampling.skip_special_tokens is False


def test_a_required_call_over_grpc_sends_the_grammar_to_the_engine() -> None:
    done, seen = call_through_grpc(
        ['[{"name": "get_weather", ', '"parameters": {"city": "Rome"}}]'],
        tools=[WEATHER],
        tool_choice="required",
    )
    assert done.finish_reason == "tool_calls" and done.text == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in done.tool_calls] == [
        ("get_weather", {"city": "Rome"})
    ]
    constraint = seen[0].sampling.constraint
    assert constraint is not None and constraint.json_schema is not None
    assert constraint.json_schema["type"] == "array"
