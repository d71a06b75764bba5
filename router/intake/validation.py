"""Validation of public API requests at the edge, before anything reaches an engine.

Every check raises `InvalidRequest` with the path of the offending field ("sampling.top_p",
"messages[2].role", "prompt_token_ids[7]") and a message a human can act on; the gRPC server turns it
into INVALID_ARGUMENT. A request that passes comes out as typed values with the server's defaults
applied: which input it carries (already converted for the chat template) and an `engine.messages.Sampling`.
The one check that needs the token count, `check_prompt_length`, runs after tokenization.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from engine.messages import Constraint, Sampling
from pdserve_client.api import pdserve_pb2
from router.intake.output_parser import ToolChoiceMode, ToolUse
from router.intake.tokenizer import ChatInputError, message_dicts, tool_dicts

ROLES = ("system", "user", "assistant", "tool")
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 16
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_ID_LENGTH = 256
_XGRAMMAR_WHERE = re.compile(r"\[\d\d:\d\d:\d\d\] \S+:\d+: ")
_INPUT_FIELDS = ("prompt", "messages", "prompt_token_ids")

InputKind = Literal["prompt", "messages", "prompt_token_ids"]


class InvalidRequest(Exception):
    """A request the server refuses; `field` is the path of the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ModelLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What a request is checked against: the served model and its limits."""

    served_name: str
    max_model_len: int
    vocab_size: int


class PromptInput(msgspec.Struct, frozen=True, kw_only=True):
    """A request's input: exactly one of a text prompt, chat messages (+ tools) or token ids."""

    # Also the name of the request field it came from (for check_prompt_length's input_field).
    kind: InputKind
    prompt: str = ""
    # Chat-template dicts (tool-call arguments and tool schemas parsed from their JSON).
    messages: list[dict[str, Any]] = msgspec.field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] | None = None
    prompt_token_ids: list[int] = msgspec.field(default_factory=list)


class ValidatedInput(msgspec.Struct, frozen=True, kw_only=True):
    """A GenerateRequest that passed validation, with the server's defaults applied."""

    input: PromptInput
    sampling: Sampling  # with the response format's constraint (tool choice adds its own later)
    # The tools and what the request asks of them (None: no tools).
    tool_use: ToolUse | None
    session_id: str
    # Empty: the server makes one.
    request_id: str


def validate_generate(
    req: pdserve_pb2.GenerateRequest, limits: ModelLimits, token_prefix: list[int] | None = None
) -> ValidatedInput:
    """`token_prefix`: ids already validated that `req.prompt_token_ids` is known to start with (the session's
    previous turn, `router.intake.token_sessions`); only the ids after them are converted and checked."""
    _check_model(req.model, limits)
    prompt = _prompt_input(req.prompt, req.messages, req.prompt_token_ids, req.tools, limits, token_prefix)
    prompt = _with_template_kwargs(prompt, req.chat_template_kwargs_json)
    for name, value in (("session_id", req.session_id), ("request_id", req.request_id)):
        if len(value) > MAX_ID_LENGTH:
            raise InvalidRequest(name, f"at most {MAX_ID_LENGTH} characters, got {len(value)}")
    sampling = _sampling(req.sampling, limits)
    if req.HasField("response_format"):
        sampling = msgspec.structs.replace(sampling, constraint=_constraint(req.response_format))
    return ValidatedInput(
        input=prompt,
        sampling=sampling,
        tool_use=_tool_use(req, prompt),
        session_id=req.session_id,
        request_id=req.request_id,
    )


def validate_tokenize(req: pdserve_pb2.TokenizeRequest, limits: ModelLimits) -> PromptInput:
    _check_model(req.model, limits)
    prompt = _prompt_input(req.prompt, req.messages, (), req.tools, limits)
    return _with_template_kwargs(prompt, req.chat_template_kwargs_json)


def check_prompt_length(
    num_prompt_tokens: int,
    sampling: Sampling,
    limits: ModelLimits,
    *,
    input_field: str,
    at_least: bool = False,
) -> None:
    """Refuse a prompt that, with max_tokens, does not fit the context. The field blamed is
    sampling.max_tokens when a smaller max_tokens would fit, else the input (`input_field`). `at_least`:
    `num_prompt_tokens` is a lower bound (the prompt was not tokenized)."""
    total = num_prompt_tokens + sampling.max_tokens
    if total <= limits.max_model_len:
        return
    field = "sampling.max_tokens" if num_prompt_tokens < limits.max_model_len else input_field
    has = f"at least {num_prompt_tokens}" if at_least else str(num_prompt_tokens)
    raise InvalidRequest(
        field,
        f"the prompt has {has} tokens and max_tokens is {sampling.max_tokens}: "
        f"{'over' if at_least else str(total) + ' >'} max_model_len {limits.max_model_len}",
    )


def _check_model(model: str, limits: ModelLimits) -> None:
    if model and model != limits.served_name:
        raise InvalidRequest("model", f"unknown model {model!r}; this cluster serves {limits.served_name!r}")


def _prompt_input(
    prompt: str,
    messages: Sequence[pdserve_pb2.ChatMessage],
    token_ids: Sequence[int],
    tools: Sequence[pdserve_pb2.Tool],
    limits: ModelLimits,
    token_prefix: list[int] | None = None,
) -> PromptInput:
    given = [name for name, value in zip(_INPUT_FIELDS, (prompt, messages, token_ids), strict=True) if value]
    if len(given) != 1:
        # Name every field involved: all three when none was given, else the conflicting ones.
        fields = given or list(_INPUT_FIELDS)
        got = " and ".join(given) if given else "none (an empty prompt counts as none)"
        raise InvalidRequest(
            ",".join(fields), f"exactly one of prompt, messages, prompt_token_ids is required; got {got}"
        )
    if tools and given != ["messages"]:
        raise InvalidRequest("tools", "tools are only allowed with messages")
    if prompt:
        return PromptInput(kind="prompt", prompt=prompt)
    if token_ids:
        if len(token_ids) >= limits.max_model_len:  # refused before converting 1M+ ids
            raise InvalidRequest(
                "prompt_token_ids",
                f"the prompt has {len(token_ids)} tokens: max_model_len {limits.max_model_len} leaves no "
                "room to generate",
            )
        ids = _token_ids(token_ids, limits, token_prefix)
        return PromptInput(kind="prompt_token_ids", prompt_token_ids=ids)
    _check_messages(messages)
    try:
        return PromptInput(
            kind="messages", messages=message_dicts(messages), tools=tool_dicts(tools) if tools else None
        )
    except ChatInputError as exc:
        raise InvalidRequest(exc.field, exc.message) from exc


def _token_ids(token_ids: Sequence[int], limits: ModelLimits, prefix: list[int] | None = None) -> list[int]:
    # uint32 in the proto: never negative. max() is one C-level pass; the index is looked for only when an id
    # is out of range (a per-id Python loop cost ~1 ms for an 8k-token prompt). With a known valid prefix
    # only the ids after it are converted and checked.
    start = 0 if prefix is None else len(prefix)
    if start > len(token_ids):
        raise ValueError("token_prefix is longer than the request's token ids")
    new = list(token_ids[start:]) if start else list(token_ids)
    if new and max(new) >= limits.vocab_size:
        i = next(i for i, token in enumerate(new) if token >= limits.vocab_size)
        raise InvalidRequest(
            f"prompt_token_ids[{start + i}]",
            f"token id {new[i]} is not below vocab_size {limits.vocab_size}",
        )
    return prefix + new if prefix is not None else new


def _check_messages(messages: Sequence[pdserve_pb2.ChatMessage]) -> None:
    for i, message in enumerate(messages):
        field = f"messages[{i}]"
        if message.role not in ROLES:
            raise InvalidRequest(f"{field}.role", f"must be one of {', '.join(ROLES)}; got {message.role!r}")
        if message.role == "tool" and not message.tool_call_id:
            raise InvalidRequest(f"{field}.tool_call_id", "a tool message must name the call it answers")
        if message.tool_calls and message.role != "assistant":
            raise InvalidRequest(
                f"{field}.tool_calls", f"only assistant messages make tool calls; this is {message.role}"
            )
        for j, call in enumerate(message.tool_calls):
            if not call.name:
                raise InvalidRequest(f"{field}.tool_calls[{j}].name", "a tool call needs a function name")


# apply_chat_template's own arguments: a template variable must not change how pdserve renders.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
     "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


def _with_template_kwargs(prompt: PromptInput, text: str) -> PromptInput:
    field = "chat_template_kwargs_json"
    if not text:
        return prompt
    if prompt.kind != "messages":
        raise InvalidRequest(field, "only with messages")
    kwargs = _json(text, field)
    if not isinstance(kwargs, dict):
        raise InvalidRequest(field, "must be a JSON object")
    if reserved := sorted(_RESERVED_TEMPLATE_KWARGS & set(kwargs)):
        raise InvalidRequest(field, f"{', '.join(reserved)}: set by pdserve, not a template variable")
    return msgspec.structs.replace(prompt, template_kwargs=kwargs)


_TOOL_CHOICE: dict[int, ToolChoiceMode] = {
    pdserve_pb2.ToolChoice.MODE_AUTO: "auto",
    pdserve_pb2.ToolChoice.MODE_NONE: "none",
    pdserve_pb2.ToolChoice.MODE_REQUIRED: "required",
    pdserve_pb2.ToolChoice.MODE_FUNCTION: "function",
}


def _tool_use(req: pdserve_pb2.GenerateRequest, prompt: PromptInput) -> ToolUse | None:
    if not prompt.tools:
        for field in ("tool_choice", "parallel_tool_calls"):
            if req.HasField(field):
                raise InvalidRequest(field, "only allowed with tools")
        return None
    choice = req.tool_choice
    mode = _TOOL_CHOICE.get(choice.mode)
    if mode is None:
        raise InvalidRequest("tool_choice.mode", f"unknown mode {choice.mode}")
    names = [t["function"]["name"] for t in prompt.tools]
    if mode == "function" and choice.function_name not in names:
        raise InvalidRequest(
            "tool_choice.function_name",
            f"must name one of the tools ({', '.join(names)}); got {choice.function_name!r}",
        )
    if mode != "function" and choice.function_name:
        raise InvalidRequest("tool_choice.function_name", "only with mode MODE_FUNCTION")
    if mode in ("required", "function") and req.HasField("response_format"):
        raise InvalidRequest(
            "response_format", f"cannot be combined with tool_choice {mode}: the call's JSON is the format"
        )
    parallel = req.parallel_tool_calls if req.HasField("parallel_tool_calls") else True
    return ToolUse(tools=prompt.tools, choice=mode, function=choice.function_name, parallel=parallel)


def _constraint(fmt: pdserve_pb2.ResponseFormat) -> Constraint:
    kind = fmt.WhichOneof("format")
    if kind == "json_schema":
        schema = _json(fmt.json_schema, "response_format.json_schema")
        if not isinstance(schema, dict):
            raise InvalidRequest("response_format.json_schema", "must be a JSON Schema object")
        return Constraint(json_schema=schema)
    if kind == "json_object":
        if not fmt.json_object:
            raise InvalidRequest(
                "response_format.json_object", "set it to true, or leave response_format unset"
            )
        return Constraint(json_object=True)
    if kind == "regex":
        if not fmt.regex:
            raise InvalidRequest("response_format.regex", "must not be empty")
        return Constraint(regex=fmt.regex)
    if kind == "choice":
        choices = tuple(fmt.choice.choices)
        if not choices or not all(choices):
            raise InvalidRequest("response_format.choice", "needs at least one choice, none of them empty")
        return Constraint(choice=choices)
    raise InvalidRequest("response_format", "set one of json_schema, json_object, regex, choice")


def _json(text: str, field: str) -> Any:
    import json

    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(field, f"invalid JSON: {exc}") from exc


def check_constraint(sampling: Sampling) -> None:
    """Refuse a constraint the engine's grammar backend (xgrammar) cannot compile: an engine would otherwise
    fail the request after it was routed. Takes milliseconds of CPU for a schema: call it off the event
    loop."""
    if sampling.constraint is None:
        return
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    from engine.host import structured_outputs

    try:
        validate_xgrammar_grammar(SamplingParams(structured_outputs=structured_outputs(sampling.constraint)))
    except (ValueError, VLLMValidationError) as exc:
        # xgrammar's messages start with a time and its C++ source location: not for a client.
        raise InvalidRequest("response_format", _XGRAMMAR_WHERE.sub("", str(exc))) from exc


def _sampling(params: pdserve_pb2.SamplingParams, limits: ModelLimits) -> Sampling:
    defaults = Sampling()
    max_tokens = params.max_tokens if params.HasField("max_tokens") else defaults.max_tokens
    if not 1 <= max_tokens <= limits.max_model_len:
        raise InvalidRequest(
            "sampling.max_tokens", f"must be in [1, max_model_len={limits.max_model_len}]; got {max_tokens}"
        )
    temperature = params.temperature if params.HasField("temperature") else defaults.temperature
    if not (math.isfinite(temperature) and 0.0 <= temperature <= 2.0):
        raise InvalidRequest("sampling.temperature", f"must be in [0, 2]; got {temperature}")
    top_p = params.top_p if params.HasField("top_p") else defaults.top_p
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise InvalidRequest("sampling.top_p", f"must be in (0, 1]; got {top_p}")
    top_k = params.top_k if params.HasField("top_k") else defaults.top_k
    if top_k == 0 or top_k < -1:
        raise InvalidRequest("sampling.top_k", f"must be -1 (disabled) or >= 1; got {top_k}")
    if len(params.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest("sampling.stop", f"at most {MAX_STOP_STRINGS} strings; got {len(params.stop)}")
    for i, stop in enumerate(params.stop):
        if not stop:
            raise InvalidRequest(f"sampling.stop[{i}]", "stop strings must not be empty")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(
            "sampling.stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids; got {len(params.stop_token_ids)}"
        )
    for i, token in enumerate(params.stop_token_ids):
        if token >= limits.vocab_size:
            raise InvalidRequest(
                f"sampling.stop_token_ids[{i}]",
                f"token id {token} is not below vocab_size {limits.vocab_size}",
            )
    return Sampling(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=params.seed if params.HasField("seed") else None,
        stop=tuple(params.stop),
        ignore_eos=params.ignore_eos,
        stop_token_ids=tuple(params.stop_token_ids),
        frequency_penalty=_in_range(params, "frequency_penalty", -2.0, 2.0, 0.0),
        presence_penalty=_in_range(params, "presence_penalty", -2.0, 2.0, 0.0),
        repetition_penalty=_in_range(params, "repetition_penalty", 0.0, 2.0, 1.0, low_open=True),
        min_p=_in_range(params, "min_p", 0.0, 1.0, 0.0),
        logprobs=_logprobs(params),
    )


def _logprobs(params: pdserve_pb2.SamplingParams) -> int | None:
    if not params.HasField("logprobs"):
        return None
    if not 0 <= params.logprobs <= MAX_LOGPROBS:
        raise InvalidRequest("sampling.logprobs", f"must be in [0, {MAX_LOGPROBS}]; got {params.logprobs}")
    return params.logprobs


def _in_range(
    params: pdserve_pb2.SamplingParams,
    name: str,
    low: float,
    high: float,
    default: float,
    *,
    low_open: bool = False,
) -> float:
    if not params.HasField(name):
        return default
    value = float(getattr(params, name))
    if not (math.isfinite(value) and (low < value if low_open else low <= value) and value <= high):
        raise InvalidRequest(
            f"sampling.{name}", f"must be in {'(' if low_open else '['}{low:g}, {high:g}]; got {value}"
        )
    return value
