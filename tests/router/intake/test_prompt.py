"""PromptIntake: a request in, a routable prompt out; a prompt that cannot fit is refused before it is
tokenized (its length bounds its tokens from below), so an over-long one costs no tokenizer time."""

from __future__ import annotations

import time
from typing import Any

import grpc
import pytest

from engine.tiny_model import ensure_tiny_model
from pdserve_client.api import pdserve_pb2 as pb
from router.block_hash import hash_blocks
from router.errors import RequestFailed
from router.intake.chat_encoder import SessionChatEncoder
from router.intake.output_parser import OutputParsers
from router.intake.prompt import PromptIntake
from router.intake.tokenizer import PromptTokenizer
from router.intake.validation import ModelLimits
from router.metrics import RouterMetrics


class CountingTokenizer(PromptTokenizer):
    """The built-in model's tokenizer, counting the characters it was asked to encode."""

    encoded_chars = 0

    def encode_text(self, text: str) -> list[int]:
        self.encoded_chars += len(text)
        return super().encode_text(text)

    def encode_rendered(self, text: str) -> list[int]:
        self.encoded_chars += len(text)
        return super().encode_rendered(text)


@pytest.fixture(scope="module")
def tokenizer() -> CountingTokenizer:
    return CountingTokenizer(ensure_tiny_model())


BS = 16


def make_intake(tokenizer: PromptTokenizer, max_model_len: int = 2048) -> PromptIntake:
    return PromptIntake(
        tokenizer=tokenizer,
        chat_encoder=SessionChatEncoder(tokenizer),
        parsers=OutputParsers(tokenizer.hf_tokenizer, None, None),
        limits=ModelLimits(
            served_name="tiny-llama", max_model_len=max_model_len, vocab_size=tokenizer.vocab_size
        ),
        block_size=BS,
        metrics=RouterMetrics(),
    )


@pytest.fixture
def intake(tokenizer: CountingTokenizer) -> PromptIntake:
    tokenizer.encoded_chars = 0
    return make_intake(tokenizer)


async def refused(intake: PromptIntake, request: pb.GenerateRequest) -> tuple[str, float]:
    began = time.perf_counter()
    with pytest.raises(RequestFailed) as info:
        await intake.take(request)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return info.value.message, time.perf_counter() - began


LONG = "word " * 400_000  # 2 MB of text: ~400k tokens for a 2048-token model


async def test_an_over_long_prompt_is_refused_untokenized(intake: PromptIntake, tokenizer: Any) -> None:
    message, _ = await refused(intake, pb.GenerateRequest(prompt=LONG))
    assert tokenizer.encoded_chars == 0
    assert message.startswith("prompt: the prompt has at least ") and "max_model_len 2048" in message


async def test_an_over_long_chat_is_refused_untokenized(intake: PromptIntake, tokenizer: Any) -> None:
    request = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=LONG)], session_id="s")
    message, _ = await refused(intake, request)
    assert tokenizer.encoded_chars == 0 and message.startswith("messages: the prompt has at least ")


async def test_a_prompt_that_fits_only_without_its_max_tokens_blames_max_tokens(
    intake: PromptIntake, tokenizer: Any
) -> None:
    # ~600 tokens by the bound (36 characters a token at most), 2000 to generate: max_tokens is to blame.
    request = pb.GenerateRequest(prompt="a" * 22_000, sampling=pb.SamplingParams(max_tokens=2000))
    message, _ = await refused(intake, request)
    assert tokenizer.encoded_chars == 0 and message.startswith("sampling.max_tokens: the prompt has at least")


async def test_over_long_token_ids_are_refused_by_their_count(intake: PromptIntake) -> None:
    message, _ = await refused(intake, pb.GenerateRequest(prompt_token_ids=[1] * 1_000_000))
    assert message == (
        "prompt_token_ids: the prompt has 1000000 tokens: max_model_len 2048 leaves no room to generate"
    )


async def test_a_prompt_the_bound_lets_through_is_still_checked_once_tokenized(
    intake: PromptIntake, tokenizer: Any
) -> None:
    # 3000 characters can be as few as 84 tokens; encoded, they are ~3000: refused after tokenizing.
    message, _ = await refused(intake, pb.GenerateRequest(prompt="é" * 3000))
    assert tokenizer.encoded_chars == 3000 and message.startswith("prompt: the prompt has ")
    assert "at least" not in message


def wire_refusal(intake: PromptIntake, request: pb.GenerateRequest) -> str | None:
    """The message `refuse_by_wire_size` refuses the request's wire bytes with; None: let through."""
    try:
        intake.refuse_by_wire_size(request.SerializeToString())
    except RequestFailed as exc:
        assert exc.code == grpc.StatusCode.INVALID_ARGUMENT
        return exc.message
    return None


def test_an_over_long_prompt_is_refused_from_its_wire_bytes(intake: PromptIntake, tokenizer: Any) -> None:
    message = wire_refusal(intake, pb.GenerateRequest(prompt=LONG, session_id="s"))
    assert message is not None and message.startswith("prompt: the prompt has at least ")
    assert "over max_model_len 2048" in message and tokenizer.encoded_chars == 0


def test_the_wire_bound_is_tighter_for_ascii_text(intake: PromptIntake) -> None:
    # 120 KB: as ASCII at least 3,334 tokens (36 bytes a token at most); as two-byte characters only 834.
    assert wire_refusal(intake, pb.GenerateRequest(prompt="a" * 120_000)) is not None
    assert wire_refusal(intake, pb.GenerateRequest(prompt="é" * 60_000)) is None  # left to `take`
    assert wire_refusal(intake, pb.GenerateRequest(prompt="é" * 2_000_000)) is not None  # 4 MB: over anyway


def test_what_the_wire_bound_cannot_refuse_is_let_through(intake: PromptIntake) -> None:
    assert wire_refusal(intake, pb.GenerateRequest(prompt="hello")) is None
    # A prompt that fits only without its max_tokens blames max_tokens, which `take` reads.
    assert wire_refusal(intake, pb.GenerateRequest(prompt="a" * 22_000)) is None
    chat = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=LONG)])
    assert wire_refusal(intake, chat) is None  # a chat template may drop text: rendered first
    assert wire_refusal(intake, pb.GenerateRequest(prompt_token_ids=[1] * 100_000)) is None
    intake.refuse_by_wire_size(b"\x12" + b"\xff" * 80_000)  # not protobuf: the parser answers


async def test_a_prompt_that_fits_is_tokenized_as_before(intake: PromptIntake, tokenizer: Any) -> None:
    prompt = await intake.take(
        pb.GenerateRequest(prompt="hello world", sampling=pb.SamplingParams(max_tokens=4))
    )
    assert prompt.token_ids == tokenizer.encode_text("hello world") and prompt.sampling.max_tokens == 4


# Block hashes: a prompt intake encodes in full is hashed in the thread that encoded it, so the decision
# does not hash a long first turn on the event loop; what extends a session's previous turn is the
# decision's (it hashes only the new blocks).


async def test_a_text_prompt_comes_hashed(intake: PromptIntake) -> None:
    prompt = await intake.take(
        pb.GenerateRequest(prompt="hello world " * 40, sampling=pb.SamplingParams(max_tokens=4))
    )
    assert prompt.block_hashes is not None and len(prompt.block_hashes) == len(prompt.token_ids) // BS > 0
    assert prompt.block_hashes == hash_blocks(prompt.token_ids, BS)


async def test_a_chat_is_hashed_when_encoded_in_full_and_not_when_it_extends_the_session(
    intake: PromptIntake,
) -> None:
    messages = [pb.ChatMessage(role="user", content="list the files " * 30)]
    first = await intake.take(
        pb.GenerateRequest(messages=messages, session_id="s", sampling=pb.SamplingParams(max_tokens=4))
    )
    assert first.reuse is None and first.block_hashes == hash_blocks(first.token_ids, BS)
    messages += [
        pb.ChatMessage(role="assistant", content="ok"),
        pb.ChatMessage(role="user", content="and now the tests"),
    ]
    second = await intake.take(
        pb.GenerateRequest(messages=messages, session_id="s", sampling=pb.SamplingParams(max_tokens=4))
    )
    assert second.reuse is not None and second.block_hashes is None


async def test_long_token_ids_are_hashed_apart_and_short_ones_by_the_decision(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    intake = make_intake(tokenizer, max_model_len=20_000)
    hashed: list[int] = []

    def counted(ids: list[int], block_size: int) -> list[int]:
        hashed.append(len(ids))
        return hash_blocks(ids, block_size)

    monkeypatch.setattr("router.intake.prompt.hash_blocks", counted)
    long_ids = [i % 1000 + 1 for i in range(10_000)]
    long = await intake.take(
        pb.GenerateRequest(prompt_token_ids=long_ids, sampling=pb.SamplingParams(max_tokens=4))
    )
    assert long.block_hashes == hash_blocks(long_ids, BS)
    short = await intake.take(
        pb.GenerateRequest(prompt_token_ids=long_ids[:500], sampling=pb.SamplingParams(max_tokens=4))
    )
    assert short.block_hashes is None
    # Ids that cannot fit are refused before they are hashed.
    too_long = pb.GenerateRequest(prompt_token_ids=long_ids * 2, sampling=pb.SamplingParams(max_tokens=4))
    await refused(intake, too_long)
    assert hashed == [10_000]
