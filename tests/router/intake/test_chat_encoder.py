"""SessionChatEncoder: a session's next turn encodes only its new text, and the ids are always exactly what
encoding the whole rendered chat gives (the built-in model's tokenizer and ChatML template)."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
from tokenizers import AddedToken

from engine.tiny_model import ensure_tiny_model
from router.block_hash import SessionHasher, hash_blocks
from router.intake.chat_encoder import CHAT, SessionChatEncoder, incremental_unsupported
from router.intake.tokenizer import PromptTokenizer
from router.sessions import Sessions

WORDS = [
    "the", "file", "build", "error:", "  indented", "\n", "\n\n", "é", "naïve", "日本語", "🙂", " ", "\t",
    "{}", "<|im_end|>", "<|im_start|>", "<|endoftext|>", "<|im_", "|>", "def f(x):", "    return x",
    "'quoted'",
]  # fmt: skip
TOOLS = [
    {
        "type": "function",
        "function": {"name": "run", "description": "Run a command", "parameters": {"type": "object"}},
    }
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PromptTokenizer:
    return PromptTokenizer(ensure_tiny_model(tmp_path_factory.mktemp("cache")))


def text(rng: random.Random, n: int) -> str:
    # Words glued with and without spaces: piece boundaries land inside words, whitespace runs and special
    # token look-alikes (a user may paste "<|im_end|>"), the cases an incremental encoder could get wrong.
    return "".join(rng.choice(WORDS) + rng.choice(["", " ", "\n"]) for _ in range(n))


def next_turn(rng: random.Random, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What an agent sends next: usually the conversation plus the reply and a tool result or user message;
    sometimes an edited history (compaction, a changed system prompt, a re-rendered last message)."""
    out = copy.deepcopy(messages)
    edit = rng.random()
    if edit < 0.1 and len(out) > 3:
        del out[1 : rng.randrange(2, len(out) - 1)]  # compaction: older turns dropped
    elif edit < 0.15:
        out[0]["content"] = text(rng, 3)  # new system prompt
    elif edit < 0.2 and len(out) > 1:
        out[-1]["content"] += text(rng, 2)  # the last message re-rendered longer
    r = rng.random()
    if r < 0.4:
        call = {
            "id": f"c{len(out)}",
            "type": "function",
            "function": {"name": "run", "arguments": {"cmd": "ls"}},
        }
        out.append({"role": "assistant", "content": text(rng, rng.randrange(0, 5)), "tool_calls": [call]})
        out.append({"role": "tool", "tool_call_id": call["id"], "content": text(rng, rng.randrange(1, 40))})
    elif r < 0.7:
        out.append({"role": "assistant", "content": text(rng, rng.randrange(0, 30))})
        out.append({"role": "user", "content": text(rng, rng.randrange(1, 40))})
    else:
        out.append({"role": "user", "content": text(rng, rng.randrange(1, 40))})
    return out


@pytest.mark.parametrize("seed", range(8))
def test_every_turn_equals_a_full_encoding_and_appended_turns_reuse_the_previous_ids(
    tokenizer: PromptTokenizer, seed: int
) -> None:
    rng = random.Random(seed)
    enc = SessionChatEncoder(tokenizer)
    assert enc.unsupported is None
    tools = TOOLS if seed % 2 else None
    sessions = {f"s{i}": [{"role": "system", "content": text(rng, 5)}] for i in range(3)}
    previous: dict[str, list[int]] = {}
    hasher = SessionHasher(block_size=4)
    for _turn in range(40):
        sid = rng.choice(list(sessions))
        sessions[sid] = next_turn(rng, sessions[sid])
        reused_before = enc.reused_tokens
        got, reuse = enc.encode_reusing(sid, sessions[sid], tools)
        assert got == tokenizer.encode_chat(sessions[sid], tools), (seed, _turn)
        if reuse is not None:  # what it says it copied, it copied: the session's previous ids, same objects
            assert reuse.base is previous[sid]
            assert all(a is b for a, b in zip(got[: reuse.tokens], reuse.base[: reuse.tokens], strict=True))
        # The router's hasher, taking the encoder's word, hashes exactly what a full hash gives.
        assert hasher.hash(sid, got, reuse) == hash_blocks(got, 4)
        previous[sid] = got
    # Most turns appended: most ids came from previous turns.
    assert enc.reused_tokens > enc.encoded_tokens
    assert reused_before <= enc.reused_tokens


def test_an_appended_turn_encodes_only_its_new_text_and_shares_the_previous_id_objects(
    tokenizer: PromptTokenizer,
) -> None:
    enc = SessionChatEncoder(tokenizer)
    rng = random.Random(1)
    turn1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text(rng, 400)}]
    ids1 = enc.encode("s", turn1)
    encoded = enc.encoded_tokens
    turn2 = [*turn1, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and now?"}]
    ids2 = enc.encode("s", turn2)
    assert ids2 == tokenizer.encode_chat(turn2)
    assert enc.encoded_tokens - encoded < 30  # the reply, the new message and their role tokens
    shared = enc.reused_tokens
    assert shared > 0.9 * len(ids1)
    assert all(a is b for a, b in zip(ids1[:shared], ids2[:shared], strict=True))


def test_without_a_session_or_after_forget_the_prompt_is_encoded_in_full(tokenizer: PromptTokenizer) -> None:
    enc = SessionChatEncoder(tokenizer)
    msgs = [{"role": "user", "content": "hello there"}]
    assert enc.encode(None, msgs) == tokenizer.encode_chat(msgs)
    enc.encode("s", msgs)
    enc.forget("s")
    longer = [*msgs, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "bye"}]
    assert enc.encode("s", longer) == tokenizer.encode_chat(longer)
    assert enc.reused_tokens == 0


def test_each_sessions_turn_is_kept_in_the_routers_session_state(tokenizer: PromptTokenizer) -> None:
    sessions = Sessions(max_sessions=2, max_tokens=10_000)
    enc = SessionChatEncoder(tokenizer, sessions)
    for sid in ("a", "b", "c"):
        enc.encode(sid, [{"role": "user", "content": "x" * 100}])
    assert len(sessions) == 2 and "a" not in sessions
    assert sessions.get("c", CHAT) is not None and sessions.tokens > 0


def test_tokenizers_whose_added_tokens_absorb_whitespace_are_encoded_in_full(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    tok = PromptTokenizer(ensure_tiny_model(tmp_path_factory.mktemp("cache")))
    tok.hf_tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken("<tool>", lstrip=True)]})
    reason = incremental_unsupported(tok.hf_tokenizer)
    assert reason is not None and "'<tool>'" in reason and "lstrip" in reason
    enc = SessionChatEncoder(tok)
    msgs = [{"role": "user", "content": "a <tool> b"}]
    enc.encode("s", msgs)
    more = [*msgs, {"role": "assistant", "content": "c"}, {"role": "user", "content": "d  <tool>"}]
    assert enc.encode("s", more) == tok.encode_chat(more)
    assert enc.reused_tokens == 0
