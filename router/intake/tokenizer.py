"""The router's tokenizer: turns a request's prompt or chat messages into the token ids the engines get.

The router tokenizes (engines receive token ids only) so that it can hash prompt blocks and route by
cached prefix before any engine sees the request. The token ids must equal what vLLM itself would
produce for the same input, so this follows vLLM's conventions:
- plain text is encoded with the tokenizer's default special tokens (`add_special_tokens=True`): none
  for the built-in tiny model, a BOS for models whose tokenizer adds one (as vLLM does for completions);
- chat messages are rendered with the model's chat template (`add_generation_prompt=True`) and the text
  is encoded with `add_special_tokens=False`, since the template already writes any BOS/role tokens.

A Hugging Face fast tokenizer must not be used from two threads at once (its Rust object raises
"Already borrowed"), and its encoding runs without the GIL. So the router keeps a few copies of it, each
call takes a free one: a long prompt being tokenized delays no short one, and prompts are tokenized in
parallel on as many cores. Callers on an event loop use `asyncio.to_thread`.
"""

from __future__ import annotations

import json
import os
import queue
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jinja2

from pdserve_client.api import pdserve_pb2


class ChatInputError(ValueError):
    """A chat message or tool that cannot be given to the chat template; `field` is its path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def message_dicts(messages: Sequence[pdserve_pb2.ChatMessage]) -> list[dict[str, Any]]:
    """Proto chat messages as the dicts chat templates take (OpenAI/HF shape, tool arguments parsed)."""
    return [_message_dict(message, f"messages[{i}]") for i, message in enumerate(messages)]


def tool_dicts(tools: Sequence[pdserve_pb2.Tool]) -> list[dict[str, Any]]:
    """Proto tool definitions as HF chat-template tools: {"type": "function", "function": {...}}."""
    return [_tool_dict(tool, f"tools[{i}]") for i, tool in enumerate(tools)]


def _message_dict(message: pdserve_pb2.ChatMessage, field: str) -> dict[str, Any]:
    converted: dict[str, Any] = {"role": message.role, "content": message.content}
    # Optional keys only when set: templates test `message.tool_calls is defined` and the like.
    if message.name:
        converted["name"] = message.name
    if message.tool_call_id:
        converted["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        converted["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.name,
                    "arguments": _json_object(call.arguments_json, f"{field}.tool_calls[{j}].arguments_json"),
                },
            }
            for j, call in enumerate(message.tool_calls)
        ]
    return converted


def _tool_dict(tool: pdserve_pb2.Tool, field: str) -> dict[str, Any]:
    if not tool.name:
        raise ChatInputError(f"{field}.name", "a tool needs a name")
    parameters = _json_object(tool.parameters_json, f"{field}.parameters_json")
    function: dict[str, Any] = {
        "name": tool.name,
        "description": tool.description,
        # An empty schema means "no arguments".
        "parameters": parameters or {"type": "object", "properties": {}},
    }
    return {"type": "function", "function": function}


def _json_object(text: str, field: str) -> dict[str, Any]:
    """Parse JSON object text; empty text is an empty object."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ChatInputError(field, f"invalid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ChatInputError(field, f"must be a JSON object, got {type(value).__name__}")
    return value


def _copies() -> int:
    """How many prompts the router tokenizes at once: one per core, at least two (so that one long prompt
    never holds up a short one), at most eight."""
    return min(max(len(os.sched_getaffinity(0)), 2), 8)


class PromptTokenizer:
    """A model's tokenizer and chat template, loaded from a local model directory (never the hub)."""

    def __init__(
        self, model_dir: str | Path, *, trust_remote_code: bool = False, copies: int | None = None
    ) -> None:
        """`trust_remote_code`: run the tokenizer code the model directory ships (topology
        `model.trust_remote_code`; e.g. Kimi-K2's), as the engines do. `copies`: how many calls run at once
        (default: one per core, 2 to 8)."""
        # Imported here, not at the top: transformers imports torch (seconds), and validation uses this
        # module's conversion helpers without ever loading a tokenizer.
        from transformers import AutoTokenizer

        def load() -> Any:
            return AutoTokenizer.from_pretrained(
                str(model_dir), local_files_only=True, trust_remote_code=trust_remote_code
            )

        # The one other code reads (vocabulary, parsers); never used for encoding by the pool's callers.
        self._tokenizer = load()
        self._free: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for _ in range(copies or _copies()):
            self._free.put(load())
        self.max_token_chars = _max_token_chars(self._tokenizer)

    @contextmanager
    def _instance(self) -> Iterator[Any]:
        """A copy no other thread is using (waits for one when all are busy)."""
        tokenizer = self._free.get()
        try:
            yield tokenizer
        finally:
            self._free.put(tokenizer)

    def fewest_tokens(self, text: str) -> int | None:
        """A count `text` cannot encode to fewer tokens than (no token covers more than `max_token_chars`
        characters of it), known without tokenizing; None when this tokenizer gives no such bound."""
        if self.max_token_chars is None:
            return None
        return -(-len(text) // self.max_token_chars)

    def fewest_tokens_in_utf8(self, n_bytes: int, *, ascii: bool) -> int | None:
        """As `fewest_tokens`, for a text known only by its length in UTF-8: a character is 1 to 4 bytes
        (exactly 1 when the text is `ascii`)."""
        if self.max_token_chars is None:
            return None
        chars = n_bytes if ascii else -(-n_bytes // 4)
        return -(-chars // self.max_token_chars)

    @property
    def hf_tokenizer(self) -> Any:
        """The Hugging Face tokenizer the vocabulary and the output parsers are read from (on the event loop;
        prompts are encoded by copies of it)."""
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added special tokens included."""
        return len(self._tokenizer)

    @property
    def eos_token_id(self) -> int | None:
        eos = self._tokenizer.eos_token_id
        return int(eos) if eos is not None else None

    def encode_text(self, text: str) -> list[int]:
        """Token ids of a plain-text prompt, with the special tokens the model's tokenizer adds by default."""
        with self._instance() as tokenizer:
            return list(tokenizer.encode(text, add_special_tokens=True))

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The chat template's text for these messages, ending with the assistant's generation prompt.
        `template_kwargs`: variables for the template (validated: none of apply_chat_template's own)."""
        if self._tokenizer.chat_template is None:
            raise ValueError("this model has no chat template: send a prompt or token ids instead")
        try:
            with self._instance() as tokenizer:
                text = tokenizer.apply_chat_template(
                    messages,
                    tools=list(tools) if tools else None,
                    tokenize=False,
                    add_generation_prompt=True,
                    **(template_kwargs or {}),
                )
        except jinja2.TemplateError as exc:
            # Templates reject conversations they cannot render (e.g. roles out of order).
            raise ChatInputError("messages", f"the chat template rejected the conversation: {exc}") from exc
        return str(text)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat; the template itself writes any BOS and role tokens."""
        return self.encode_rendered(self.render_chat(messages, tools, template_kwargs))

    def encode_rendered(self, text: str) -> list[int]:
        """Token ids of chat-template output (or a piece of it): no special tokens added."""
        with self._instance() as tokenizer:
            return list(tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of these token ids (special tokens dropped by default, as vLLM's detokenizer does)."""
        with self._instance() as tokenizer:
            return str(tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))


# Normalizers and pre-tokenizers that never drop or merge characters of the input (each input character
# stays covered by the token that holds it); any other, and tokenizers that are not `tokenizers`-backed, give
# no bound.
_KEEPS_TEXT = {"Prepend", "NFC", "NFD", "ByteLevel", "Metaspace", "Digits", "Punctuation", "Split"}


def _max_token_chars(tokenizer: Any) -> int | None:
    """The most input characters one token can cover: its longest vocabulary entry or added token in UTF-8
    bytes (a byte-level entry's characters each stand for one byte; a byte-fallback entry for one byte), at
    least 4 (an unknown character). None when normalization or pre-tokenization may drop or fold characters
    (NFKC, lowercasing, whitespace splitting) or unknown characters may fuse into one token."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    for part in (spec.get("normalizer"), spec.get("pre_tokenizer")):
        if part is not None and not _keeps_text(part):
            return None
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (
        model.get("fuse_unk") and model.get("unk_token") and not model.get("byte_fallback")
    ):
        return None
    entries = [*model.get("vocab", {}), *(t.get("content", "") for t in spec.get("added_tokens") or ())]
    return max(4, *(len(e.encode()) for e in entries))


def _keeps_text(part: dict[str, Any]) -> bool:
    kind = part.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p) for p in part.get("normalizers") or part.get("pretokenizers") or ())
    if kind == "Split":
        return part.get("behavior") != "Removed"
    if kind == "Replace":  # e.g. " " -> "▁": never shorter, so never covers more input per token
        pattern = part.get("pattern", {}).get("String")
        return pattern is not None and len(part.get("content", "")) >= len(pattern)
    return kind in _KEEPS_TEXT
