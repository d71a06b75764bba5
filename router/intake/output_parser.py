"""The model's output as an agent reads it: content, reasoning and tool calls, parsed by vLLM's own parsers.

Per model (topology `model.tool_call_parser`, `model.reasoning_parser`): `OutputParsers`. Per request: what
the tool choice asks of the engine (`engine_sampling`: a grammar for a required or named call, special tokens
kept), and an `OutputParser` that turns each streamed batch of tokens into a `ParsedDelta`:
    tool_choice auto   -> vLLM's tool parser (e.g. hermes, kimi_k2), incremental: content and call deltas
    required / named   -> the grammar makes the output JSON (vLLM's tool schema); parsed once it is complete
    none, or no tools  -> content as generated
A reasoning parser, when set, first splits reasoning text from the rest.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from engine.messages import Constraint, Sampling
from router.messages import ParsedDelta, ToolCallDelta

ToolChoiceMode = Literal["auto", "none", "required", "function"]


class ToolUse(msgspec.Struct, frozen=True, kw_only=True):
    """A request's tools and what it asks of them (validated: a named function is one of the tools)."""

    tools: list[dict[str, Any]]  # chat-template tool dicts: {"type": "function", "function": {...}}
    choice: ToolChoiceMode = "auto"
    function: str = ""  # with choice "function"
    parallel: bool = True


class ParserNameError(ValueError):
    """An unknown parser name; the message lists the known ones."""


def tool_parser_names() -> list[str]:
    from vllm.tool_parsers import ToolParserManager

    return sorted(ToolParserManager.list_registered())


def reasoning_parser_names() -> list[str]:
    from vllm.reasoning import ReasoningParserManager

    return sorted(ReasoningParserManager.list_registered())


class OutputParsers:
    """The model's parsers, looked up once (names checked against vLLM's registries)."""

    def __init__(self, hf_tokenizer: Any, tool_parser: str | None, reasoning_parser: str | None) -> None:
        from vllm.reasoning import ReasoningParserManager
        from vllm.tool_parsers import ToolParserManager

        self._tokenizer = hf_tokenizer
        self._tool_cls = _lookup(ToolParserManager.get_tool_parser, tool_parser_names, tool_parser)
        self._reasoning_cls = _lookup(
            ReasoningParserManager.get_reasoning_parser, reasoning_parser_names, reasoning_parser
        )

    @property
    def parses_tools(self) -> bool:
        return self._tool_cls is not None

    def engine_sampling(self, sampling: Sampling, tool_use: ToolUse | None) -> Sampling:
        """`sampling` with what parsing this request needs of the engine: special tokens kept (tool-call and
        reasoning markers are special tokens in many models), and for a required or named call, the grammar of
        vLLM's tool-call JSON (it replaces any response format, as in vLLM's OpenAI server)."""
        if tool_use is None or tool_use.choice == "none":
            # A reasoning parser finds the reasoning's end by its marker in the text.
            return msgspec.structs.replace(sampling, skip_special_tokens=self._reasoning_cls is None)
        constraint = sampling.constraint
        if tool_use.choice in ("required", "function"):
            constraint = Constraint(json_schema=_tool_call_schema(tool_use))
        return msgspec.structs.replace(sampling, skip_special_tokens=False, constraint=constraint)

    def parser(self, tool_use: ToolUse | None) -> OutputParser:
        """A parser for one request's output (vLLM's parsers keep per-request state)."""
        tools = None if tool_use is None or tool_use.choice == "none" else tool_use
        if tools is not None and tools.choice == "auto" and self._tool_cls is None:
            raise ParserNameError("tools need model.tool_call_parser set in the topology")
        reasoning = self._reasoning_cls(self._tokenizer) if self._reasoning_cls else None
        auto = tools is not None and tools.choice == "auto"
        # vLLM's parsers read the request: built once (a pydantic model), only when a parser needs it.
        request: Any = _vllm_request(tools) if auto or reasoning is not None else None
        tool_parser = self._tool_cls(self._tokenizer, request.tools) if auto else None
        return OutputParser(tools, tool_parser, reasoning, request)


class OutputParser:
    """One request's output, parsed batch by batch (stateful: vLLM's parsers diff against what was sent).
    `tool_parser`: vLLM's, for tool choice auto; `reasoning`: vLLM's reasoning parser, if the model has
    one; `request`: vLLM's request object they read (None when neither is set)."""

    def __init__(self, tool_use: ToolUse | None, tool_parser: Any, reasoning: Any, request: Any) -> None:
        self._tool_use = tool_use
        self._reasoning = reasoning
        self._reasoning_done = False
        self._reasoning_sent = ""
        self._json_calls = tool_use is not None and tool_use.choice in ("required", "function")
        self._tools = tool_parser
        self._request = request
        self._text = ""  # all text so far
        self._ids: list[int] = []
        self._content = ""  # text past the reasoning (what the tool parser sees)
        self._content_ids: list[int] = []
        self.tools_called = False

    def feed(self, token_ids: Sequence[int], text: str) -> ParsedDelta:
        """The parsed meaning of one more batch of output."""
        out = ParsedDelta()
        content_text = text
        if self._reasoning is not None and not self._reasoning_done:
            # Whole-text parsing, diffed against what was sent: vLLM's streaming reasoning parsers expect one
            # token per delta, and a batch holds several (the engine keeps the markers in the text for this).
            # The text and ids so far are kept only until the reasoning ends: after it, nothing reads them
            # (appending to a long output's text at every batch would copy it every time).
            self._text += text
            self._ids += token_ids
            reasoning, content = self._reasoning.extract_reasoning(self._text, self._request)
            out.reasoning = (reasoning or "")[len(self._reasoning_sent) :]
            self._reasoning_sent = reasoning or ""
            content_text = content or ""
            self._reasoning_done = self._reasoning.is_reasoning_end(self._ids)
        if self._json_calls:
            self._content += content_text
            return out  # parsed whole, at `finish`
        if self._tools is None:
            out.content = content_text
            return out
        previous, previous_ids = self._content, self._content_ids
        content_ids = list(token_ids)
        self._content += content_text
        self._content_ids = previous_ids + content_ids
        delta = self._tools.extract_tool_calls_streaming(
            previous, self._content, content_text, previous_ids, self._content_ids, content_ids, self._request
        )
        if delta is not None:
            out.content = delta.content or ""
            out.tool_calls = [_call_delta(c) for c in delta.tool_calls or ()]
            self.tools_called = self.tools_called or bool(out.tool_calls)
        return out

    def finish(self) -> ParsedDelta:
        """What is left once the output is complete: a required or named call's JSON, or the part of a
        streamed call's arguments the streaming parser held back."""
        if self._json_calls:
            return self._finish_json_calls()
        out = ParsedDelta()
        if self._tools is not None and self.tools_called:
            rest = self._tools.get_remaining_unstreamed_args()
            if rest:
                index = len(self._tools.prev_tool_call_arr) - 1
                out.tool_calls = [ToolCallDelta(index=index, arguments=rest)]
        return out

    def _finish_json_calls(self) -> ParsedDelta:
        from vllm.renderers.chat_utils import make_tool_call_id

        assert self._tool_use is not None
        try:
            value = json.loads(self._content)
        except json.JSONDecodeError:
            # Cut short (max_tokens) before the grammar closed it: what there is goes out as content.
            return ParsedDelta(content=self._content)
        if self._tool_use.choice == "function":
            calls = [(self._tool_use.function, value)]
        else:
            calls = [(c["name"], c["parameters"]) for c in value]
        self.tools_called = bool(calls)
        return ParsedDelta(
            tool_calls=[
                ToolCallDelta(index=i, id=make_tool_call_id(), name=name, arguments=json.dumps(args))
                for i, (name, args) in enumerate(calls)
            ]
        )


def _lookup(get: Any, names: Any, name: str | None) -> Any:
    if not name:
        return None
    try:
        return get(name)
    except KeyError as exc:
        raise ParserNameError(f"unknown parser {name!r}; vLLM has: {', '.join(names())}") from exc


def _vllm_request(tool_use: ToolUse | None) -> Any:
    """vLLM's request object, which its parsers read the tools and the tool choice from."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    if tool_use is None:
        return ChatCompletionRequest.model_validate({"model": "", "messages": []})
    choice: Any = tool_use.choice
    if choice == "function":
        choice = {"type": "function", "function": {"name": tool_use.function}}
    return ChatCompletionRequest.model_validate(
        dict(
            model="",
            messages=[],
            tools=tool_use.tools,
            tool_choice=choice,
            parallel_tool_calls=tool_use.parallel,
        )
    )


def _tool_call_schema(tool_use: ToolUse) -> dict[str, Any]:
    """vLLM's JSON schema of a required call (a list of {name, parameters}) or a named one (arguments)."""
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    request = _vllm_request(tool_use)
    schema = get_json_schema_from_tools(
        tool_choice=request.tool_choice, tools=request.tools, parallel_tool_calls=request.parallel_tool_calls
    )
    assert isinstance(schema, dict)
    return schema


def _call_delta(c: Any) -> ToolCallDelta:
    function = c.function
    name = getattr(function, "name", None) if function is not None else None
    arguments = getattr(function, "arguments", None) if function is not None else None
    if isinstance(function, dict):
        name, arguments = function.get("name"), function.get("arguments")
    return ToolCallDelta(index=c.index, id=c.id or "", name=name or "", arguments=arguments or "")
