"""What the OpenAI door speaks: OpenAI requests as `pdserve.v1.GenerateRequest`s (the public API's one
definition of a request, validated as any other; never serialised), and the request path's output as
OpenAI responses and SSE chunks. Requests arrive parsed by vLLM's own OpenAI protocol models."""

from __future__ import annotations

import json
import time
import uuid
import warnings
from typing import Any

from engine.messages import TokenLogprob
from pdserve_client.api import pdserve_pb2 as pb
from router.messages import Finished, OutputDelta, ParsedDelta, ToolCallDelta

# Request fields pdserve does not serve: refused by name rather than ignored.
_UNSUPPORTED = {
    "n": lambda v: v not in (None, 1),
    "best_of": lambda v: v not in (None, 1),
    "prompt_logprobs": lambda v: v is not None,
    "logit_bias": lambda v: bool(v),
    "echo": lambda v: bool(v),
}


class BadRequest(Exception):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def include_usage(req: Any) -> bool:
    if not req.stream:
        return True
    return bool(req.stream_options and req.stream_options.include_usage)


def refuse_unsupported(req: Any) -> None:
    for field, is_set in _UNSUPPORTED.items():
        if is_set(getattr(req, field, None)):
            raise BadRequest(field, "not supported by pdserve")


def _sampling(req: Any) -> pb.SamplingParams:
    stop = req.stop
    with warnings.catch_warnings():  # chat's max_tokens is deprecated in favour of max_completion_tokens
        warnings.simplefilter("ignore", DeprecationWarning)
        max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
    return pb.SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k if req.top_k not in (None, 0) else None,
        seed=req.seed,
        stop=[stop] if isinstance(stop, str) else list(stop or ()),
        ignore_eos=bool(req.ignore_eos),
        stop_token_ids=list(req.stop_token_ids or ()),
        frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty,
        repetition_penalty=req.repetition_penalty,
        min_p=req.min_p,
        logprobs=_logprobs(req),
    )


def _logprobs(req: Any) -> int | None:
    """Chat: `logprobs: true` and `top_logprobs: k`; completions: `logprobs: k`."""
    logprobs = req.logprobs
    if isinstance(logprobs, bool) or logprobs is None:  # chat
        if not logprobs:
            if getattr(req, "top_logprobs", None):
                raise BadRequest("top_logprobs", "needs logprobs: true")
            return None
        return int(getattr(req, "top_logprobs", None) or 0)
    return int(logprobs)


def chat_request(req: Any) -> pb.GenerateRequest:
    out = pb.GenerateRequest(model=_model(req), sampling=_sampling(req))
    # Built in place: protobuf copies an appended message (a 4 MB one in ~6 ms, 20x the time to build it).
    for i, message in enumerate(req.messages):
        _chat_message(out.messages.add(), message, f"messages[{i}]")
    for tool in req.tools or ():
        out.tools.add(
            name=tool.function.name,
            description=tool.function.description or "",
            parameters_json=json.dumps(tool.function.parameters or {}),
        )
    if req.tools:
        choice = req.tool_choice
        if isinstance(choice, str):
            mode = {"auto": 0, "none": 1, "required": 2}[choice]
            out.tool_choice.CopyFrom(pb.ToolChoice(mode=mode))  # type: ignore[arg-type]
        elif choice is not None:
            out.tool_choice.CopyFrom(
                pb.ToolChoice(mode=pb.ToolChoice.MODE_FUNCTION, function_name=choice.function.name)
            )
        if req.parallel_tool_calls is False:
            out.parallel_tool_calls = False
    if req.chat_template_kwargs:
        out.chat_template_kwargs_json = json.dumps(req.chat_template_kwargs)
    _response_format(req, out)
    return out


def completion_request(req: Any) -> pb.GenerateRequest:
    prompt = req.prompt
    out = pb.GenerateRequest(model=_model(req), sampling=_sampling(req))
    if isinstance(prompt, str):
        out.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        out.prompt_token_ids.extend(prompt)
    elif isinstance(prompt, list) and len(prompt) == 1:
        return completion_request(req.model_copy(update={"prompt": prompt[0]}))
    else:
        raise BadRequest("prompt", "one prompt per request: a string or a list of token ids")
    _response_format(req, out)
    return out


def _model(req: Any) -> str:
    return req.model or ""


def _chat_message(out: pb.ChatMessage, message: Any, field: str) -> None:
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if part.get("type") != "text":
                raise BadRequest(
                    f"{field}.content[{j}]", f"only text parts are supported; got {part.get('type')}"
                )
            parts.append(part["text"])
        content = "".join(parts)
    out.role = message["role"]
    out.content = content or ""
    out.tool_call_id = message.get("tool_call_id") or ""
    out.name = message.get("name") or ""
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        arguments = function.get("arguments", "")
        out.tool_calls.add(
            id=call.get("id") or "",
            name=function.get("name") or "",
            arguments_json=arguments if isinstance(arguments, str) else json.dumps(arguments),
        )


def _response_format(req: Any, out: pb.GenerateRequest) -> None:
    fmt = getattr(req, "response_format", None)
    structured = getattr(req, "structured_outputs", None)
    if fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.json_schema if fmt.json_schema else None
        if schema is None:
            raise BadRequest("response_format.json_schema.schema", "a JSON Schema is required")
        out.response_format.json_schema = json.dumps(schema)
    elif fmt is not None and fmt.type == "json_object":
        out.response_format.json_object = True
    elif fmt is not None and fmt.type != "text":
        raise BadRequest("response_format.type", f"{fmt.type} is not supported by pdserve")
    elif structured is not None:  # vLLM's extension: {"regex": ...} or {"choice": [...]}
        if structured.regex:
            out.response_format.regex = structured.regex
        elif structured.choice:
            out.response_format.choice.choices.extend(structured.choice)
        elif structured.json is not None:
            schema = structured.json
            out.response_format.json_schema = schema if isinstance(schema, str) else json.dumps(schema)
        else:
            raise BadRequest("structured_outputs", "pdserve serves regex, choice and json")


# The request path's output -> OpenAI responses.


class Output:
    """Gathers a request's output for one OpenAI response, or turns each event into SSE chunks."""

    prefix = ""
    object_whole = ""
    object_chunk = ""

    def __init__(self, *, model_name: str, include_usage: bool, return_token_ids: bool = False) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model_name
        self.include_usage = include_usage
        # vLLM's extension: each choice carries the ids of its tokens (benchmarks count tokens with it).
        self.return_token_ids = return_token_ids
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.logprobs: list[TokenLogprob] = []
        self.finished: Finished | None = None
        self.started = False

    def add(self, event: OutputDelta | Finished) -> None:
        parsed = event.parsed
        self.text.append(parsed.content)
        self.reasoning.append(parsed.reasoning)
        for d in parsed.tool_calls:
            call = self.calls.setdefault(
                d.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            )
            call["id"] = call["id"] or d.id
            call["function"]["name"] = call["function"]["name"] or d.name
            call["function"]["arguments"] += d.arguments
        if isinstance(event, Finished):
            self.finished = event
        self.token_ids.extend(event.token_ids)
        self.logprobs.extend(event.logprobs)

    def usage(self) -> dict[str, Any]:
        assert self.finished is not None
        c = self.finished.completion
        return {
            "prompt_tokens": c.prompt_tokens,
            "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": c.cached_tokens},
        }

    def served_by(self) -> dict[str, Any]:
        """pdserve's extension field (clients ignore unknown fields): how the request was served."""
        assert self.finished is not None
        c = self.finished.completion
        return {
            "path": c.path,
            "prefill_replica": c.prefill_replica,
            "decode_replica": c.decode_replica,
            "kv_transferred_tokens": c.kv_transferred_tokens,
            "predicted_cached_tokens": c.predicted_cached_tokens,
            "note": c.note,
            "ttft_ms": c.ttft_ms,
            "e2e_ms": c.e2e_ms,
            # Where the request spent its time (docs/api.md lists the stages).
            "timeline": [
                {"stage": s.name, "start_ms": s.start_ms, "duration_ms": s.duration_ms} for s in c.timeline
            ],
        }

    def finish_reason(self) -> str | None:
        return None if self.finished is None else self.finished.finish_reason

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunks(self, event: OutputDelta | Finished) -> list[dict[str, Any]]:
        """The SSE chunks for one event: its choice delta (if it has any), the usage at the end."""
        fields, has_content = self.piece(event.parsed)
        self.add(event)
        token_ids, logprobs = event.token_ids, event.logprobs
        out = []
        if has_content or self.finished is not None or (self.return_token_ids and token_ids):
            choice = {
                "index": 0,
                **fields,
                "logprobs": self.logprobs_json(logprobs) if logprobs else None,
                "finish_reason": self.finish_reason(),
            }
            if self.return_token_ids:
                choice["token_ids"] = list(token_ids)
            chunk = self.envelope(self.object_chunk, [choice])
            if self.finished is not None:
                chunk["pdserve"] = self.served_by()
            out.append(chunk)
        if self.finished is not None and self.include_usage:
            out.append({**self.envelope(self.object_chunk, []), "usage": self.usage()})
        return out

    def whole(self) -> dict[str, Any]:
        """The non-streaming response, once every message was added."""
        choice = {
            "index": 0,
            **self.whole_fields(),
            "logprobs": self.logprobs_json(self.logprobs) if self.logprobs else None,
            "finish_reason": self.finish_reason(),
        }
        if self.return_token_ids:
            choice["token_ids"] = self.token_ids
        return {
            **self.envelope(self.object_whole, [choice]),
            "usage": self.usage(),
            "pdserve": self.served_by(),
        }

    def whole_fields(self) -> dict[str, Any]:
        """The whole output's part of the response's choice."""
        raise NotImplementedError

    def piece(self, parsed: ParsedDelta) -> tuple[dict[str, Any], bool]:
        """This event's part of a chunk's choice, and whether it carries anything."""
        raise NotImplementedError

    def logprobs_json(self, logprobs: Any) -> dict[str, Any]:
        raise NotImplementedError


class ChatOutput(Output):
    prefix = "chatcmpl"
    object_whole = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def whole_fields(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.text) or None}
        if any(self.reasoning):
            message["reasoning"] = "".join(self.reasoning)
        if self.calls:
            message["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        return {"message": message}

    def piece(self, parsed: ParsedDelta) -> tuple[dict[str, Any], bool]:
        delta: dict[str, Any] = {}
        if not self.started:
            delta["role"] = "assistant"
            self.started = True
        if parsed.content:
            delta["content"] = parsed.content
        if parsed.reasoning:
            delta["reasoning"] = parsed.reasoning
        if parsed.tool_calls:
            delta["tool_calls"] = [_delta_call(d) for d in parsed.tool_calls]
        return {"delta": delta}, bool(delta)

    def logprobs_json(self, logprobs: Any) -> dict[str, Any]:
        return _chat_logprobs(logprobs)


class CompletionOutput(Output):
    prefix = "cmpl"
    object_whole = "text_completion"
    object_chunk = "text_completion"

    def whole_fields(self) -> dict[str, Any]:
        return {"text": "".join(self.text)}

    def piece(self, parsed: ParsedDelta) -> tuple[dict[str, Any], bool]:
        return {"text": parsed.content}, bool(parsed.content)

    def logprobs_json(self, logprobs: Any) -> dict[str, Any]:
        return _completion_logprobs(logprobs)


def _chat_logprobs(logprobs: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {**entry(lp.token, lp.logprob), "top_logprobs": [entry(token, p) for _, token, p in lp.top]}
            for lp in logprobs
        ]
    }


def _completion_logprobs(logprobs: list[TokenLogprob]) -> dict[str, Any]:
    return {
        "tokens": [lp.token for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{token: p for _, token, p in lp.top} for lp in logprobs],
    }


def _delta_call(d: ToolCallDelta) -> dict[str, Any]:
    function: dict[str, str] = {"arguments": d.arguments}
    call: dict[str, Any] = {"index": d.index, "function": function}
    if d.id:
        call["id"], call["type"] = d.id, "function"
    if d.name:
        function["name"] = d.name
    return call
