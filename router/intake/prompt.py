"""A request in, a prompt the router can route out: validated, tokenized, checked against the context.

    (gRPC: a text prompt whose wire bytes alone show it cannot fit is refused before the request is parsed,
    `refuse_by_wire_size`) ->
    validate (every field, by path) -> tool choice against the model's parsers -> the engine's sampling
    -> grammar check (xgrammar, off the event loop) -> a prompt that cannot fit is refused before it is
    tokenized (its length bounds its tokens from below) -> token ids (a session's next turn: only what it
    appended) and, for ids encoded in full, their block hashes in the same thread -> prompt length against
    max_model_len

Every refusal is `RequestFailed(INVALID_ARGUMENT)` naming the field; nothing reaches a replica before it.
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

import grpc

from engine.messages import Sampling
from pdserve_client.api import pdserve_pb2 as pb
from router.block_hash import hash_blocks
from router.errors import RequestFailed
from router.intake.chat_encoder import SessionChatEncoder
from router.intake.output_parser import OutputParser, OutputParsers
from router.intake.token_sessions import SessionTokenIds, TokenIdsTurn
from router.intake.tokenizer import ChatInputError, PromptTokenizer
from router.intake.validation import (
    InvalidRequest,
    ModelLimits,
    PromptInput,
    check_constraint,
    check_prompt_length,
    validate_generate,
    validate_tokenize,
)
from router.intake.wire_size import prompt_span
from router.messages import PromptReuse
from router.metrics import RouterMetrics
from router.sessions import Sessions

# A token-id prompt this long (with no previous turn to extend) is hashed in a thread rather than by the
# decision on the event loop (shorter ones hash in less than the thread hop costs).
_HASH_APART_TOKENS = 8192


class Prompt(NamedTuple):
    """A request that passed intake."""

    session_id: str | None
    token_ids: list[int]
    sampling: Sampling  # what the engine runs (with the tool choice's grammar)
    reuse: PromptReuse | None  # which ids the session's previous turn already had
    output: OutputParser  # this request's parser of the model's output
    # The prompt's block hashes (router.block_hash), when intake encoded it in full: hashed in the thread
    # that tokenized it, so a long first turn's decision does not hash it on the event loop. None: the
    # decision hashes what it must (a session's next turn: only its new blocks).
    block_hashes: list[int] | None


class PromptIntake:
    def __init__(
        self,
        *,
        tokenizer: PromptTokenizer,
        chat_encoder: SessionChatEncoder,
        parsers: OutputParsers,
        limits: ModelLimits,
        block_size: int,
        metrics: RouterMetrics,
        sessions: Sessions | None = None,
    ) -> None:
        """`block_size`: the KV index's (the block hashes intake computes are the decision's)."""
        self.limits = limits
        self._block_size = block_size
        self._tokenizer = tokenizer
        self._chat = chat_encoder
        self._parsers = parsers
        self._metrics = metrics
        self._token_sessions = SessionTokenIds(sessions)

    async def take(self, request: pb.GenerateRequest, raw: bytes | None = None) -> Prompt:
        """`raw`: the request's wire bytes when it came as protobuf (a token-id session's next turn is then
        recognised by its bytes, router/intake/token_sessions.py); None from the HTTP door."""
        turn = None if raw is None else self._token_sessions.start(request, raw)
        try:
            valid = validate_generate(request, self.limits, None if turn is None else turn.prior)
            tool_use = valid.tool_use
            if tool_use is not None and tool_use.choice == "auto" and not self._parsers.parses_tools:
                raise InvalidRequest(
                    "tool_choice",
                    "auto needs model.tool_call_parser in the topology; use none, required or a function",
                )
            sampling = self._parsers.engine_sampling(valid.sampling, tool_use)
            if sampling.constraint is not None:
                await asyncio.to_thread(check_constraint, sampling)
            session_id = valid.session_id or None
            ids, reuse, hashes = await self._encode(valid.input, session_id, turn, sampling)
            check_prompt_length(len(ids), sampling, self.limits, input_field=valid.input.kind)
            if valid.input.kind == "prompt_token_ids" and reuse is None and len(ids) >= _HASH_APART_TOKENS:
                # Token ids with no previous turn to extend, once they fit: hashed off the event loop.
                hashes = await asyncio.to_thread(hash_blocks, ids, self._block_size)
        except (InvalidRequest, ChatInputError) as exc:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, f"{exc.field}: {exc.message}") from exc
        if turn is not None:
            self._token_sessions.finish(turn, ids)
            prior = len(turn.prior or ())
            self._metrics.on_token_ids(prior, len(ids) - prior)
        return Prompt(session_id, ids, sampling, reuse, self._parsers.parser(tool_use), hashes)

    def refuse_by_wire_size(self, raw: bytes) -> None:
        """Refuse a request (its wire bytes, not yet parsed) whose text prompt cannot fit the context
        whatever its max_tokens (router/intake/wire_size.py); anything else is left to `take`."""
        longest = self._tokenizer.max_token_chars
        if longest is None or len(raw) < self.limits.max_model_len * longest:
            return  # too short for the bound to refuse it
        span = prompt_span(raw)
        if span is None:
            return
        start, end = span
        fewest = self._tokenizer.fewest_tokens_in_utf8(end - start, ascii=False)
        if fewest is not None and fewest < self.limits.max_model_len and raw[start:end].isascii():
            fewest = self._tokenizer.fewest_tokens_in_utf8(end - start, ascii=True)  # a tighter bound
        if fewest is not None and fewest >= self.limits.max_model_len:
            limit = self.limits.max_model_len
            raise RequestFailed(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt: the prompt has at least {fewest} tokens: over max_model_len {limit}",
            )

    async def tokenize(self, request: pb.TokenizeRequest) -> list[int]:
        try:
            prompt = validate_tokenize(request, self.limits)
            ids, _, _ = await self._encode(prompt)
        except (InvalidRequest, ChatInputError) as exc:
            raise RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, f"{exc.field}: {exc.message}") from exc
        return ids

    async def _encode(
        self,
        prompt: PromptInput,
        session_id: str | None = None,
        turn: TokenIdsTurn | None = None,
        sampling: Sampling | None = None,
    ) -> tuple[list[int], PromptReuse | None, list[int] | None]:
        """The prompt's ids, what of them the session's previous turn had, and their block hashes where they
        were encoded in full. `sampling`: a request to generate (None: only tokenize; nothing is hashed):
        refuse a text that cannot fit with max_tokens before tokenizing it."""
        # Tokenizing a long prompt takes milliseconds of CPU: keep it off the event loop.
        route = sampling is not None
        if prompt.kind == "prompt_token_ids":
            # Validation built this request's own list (from the previous turn's when `turn` extends it).
            return prompt.prompt_token_ids, None if turn is None else turn.reuse, None
        if prompt.kind == "prompt":
            self._check_fits(prompt.prompt, sampling, "prompt")
            ids, hashes = await asyncio.to_thread(self._text_hashed, prompt.prompt, route)
            return ids, None, hashes
        text = await asyncio.to_thread(
            self._tokenizer.render_chat, prompt.messages, prompt.tools, prompt.template_kwargs
        )
        self._check_fits(text, sampling, "messages")
        # A session's chat is encoded incrementally: only the text its new turn appended.
        return await asyncio.to_thread(self._chat_hashed, session_id, text, route)

    def _text_hashed(self, text: str, route: bool) -> tuple[list[int], list[int] | None]:
        ids = self._tokenizer.encode_text(text)
        return ids, hash_blocks(ids, self._block_size) if route else None

    def _chat_hashed(
        self, session_id: str | None, text: str, route: bool
    ) -> tuple[list[int], PromptReuse | None, list[int] | None]:
        ids, reuse = self._chat.encode_rendered_reusing(session_id, text)
        # Encoded in full (no reuse): hashed in full here; a next turn's new blocks are the decision's.
        return ids, reuse, hash_blocks(ids, self._block_size) if route and reuse is None else None

    def _check_fits(self, text: str, sampling: Sampling | None, field: str) -> None:
        fewest = self._tokenizer.fewest_tokens(text)
        if sampling is not None and fewest is not None:
            check_prompt_length(fewest, sampling, self.limits, input_field=field, at_least=True)
