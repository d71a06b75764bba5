"""KV readback table: what a session's pinned decode blocks may be pulled for, and only once."""

import random

import pytest

from router.decision.readback import PIN, ReadbackTable, common_prefix_len
from router.messages import PromptReuse

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def pin(prompt: list[int], output: list[int], engine_expiry: float = 123.0) -> dict[str, object]:
    held = len(prompt) + len(output) - 1  # the last generated token's KV is never computed
    blocks = -(-held // BS)
    return {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_block_ids": [list(range(100, 100 + blocks))],
        "remote_engine_id": "decode-d0",
        "remote_request_id": "t1-d",
        "remote_num_tokens": held,
        "remote_blocks_expiry_time": engine_expiry,
    }


def table(clock: Clock | None = None) -> ReadbackTable:
    return ReadbackTable(block_size=BS, ttl_s=60, expiry_margin_s=10, clock=clock or Clock())


def test_next_turn_pulls_whole_blocks_of_the_previous_prompt_and_reply() -> None:
    t = table()
    prompt, output = list(range(10)), [50, 51, 52]
    t.record("s", "d0", pin(prompt, output), prompt, output)
    nxt = prompt + output + [7, 7, 7, 7, 7]
    offer = t.offer("s", nxt)
    assert offer is not None
    # 12 tokens held (10 prompt + 2 computed replies), the new prompt shares 13: 3 whole blocks.
    assert offer.readback.replica_id == "d0" and offer.readback.tokens == 12
    assert offer.params["remote_block_ids"] == [[100, 101, 102]]
    assert offer.params["remote_num_tokens"] == 12
    # The engine's own deadline travels with the read: a late read is declined by the prefill engine.
    assert offer.params["remote_blocks_expiry_time"] == 123.0
    assert offer.params["remote_engine_id"] == "decode-d0"


def test_an_edited_history_is_pulled_only_up_to_the_edit() -> None:
    t = table()
    prompt = list(range(20))
    t.record("s", "d0", pin(prompt, [9]), prompt, [9])
    edited = [*prompt[:9], 999, *prompt[10:], 9, 1, 2, 3]
    offer = t.offer("s", edited)
    assert (
        offer is not None and offer.readback.tokens == 8 and offer.params["remote_block_ids"] == [[100, 101]]
    )
    assert t.offer("s", [999, *prompt]) is None  # nothing shared


def test_the_prompts_last_token_is_never_pulled() -> None:
    t = table()
    prompt = list(range(16))
    t.record("s", "d0", pin(prompt, [1, 2, 3, 4, 5]), prompt, [1, 2, 3, 4, 5])
    offer = t.offer("s", prompt)  # the same prompt again: the engine computes at least its last token
    assert offer is not None and offer.readback.tokens == 12


def test_a_pin_is_offered_until_taken_or_expired() -> None:
    clock = Clock()
    t = table(clock)
    prompt = list(range(40))
    t.record("s", "d0", pin(prompt, [1]), prompt, [1])
    first = t.offer("s", [*prompt, 1, 2])
    assert first is not None and first.readback.expires_in_s == pytest.approx(50.0)
    assert t.offer("s", [*prompt, 1, 2]) is not None  # offering does not consume (the turn may stay local)
    t.take("s")
    assert t.offer("s", [*prompt, 1, 2]) is None  # read once: the engine may reuse those blocks now
    t.record("s", "d0", pin(prompt, [1]), prompt, [1])
    clock.now += 49.0
    assert t.offer("s", [*prompt, 1, 2]) is not None
    clock.now += 1.0  # ttl 60 minus the 10 s margin
    assert t.offer("s", [*prompt, 1, 2]) is None
    assert t._sessions.get("s", PIN) is None  # an expired pin is dropped


def test_a_turn_without_a_pin_clears_the_session() -> None:
    t = table()
    prompt = list(range(40))
    t.record("s", "d0", pin(prompt, [1]), prompt, [1])
    t.record("s", "d1", None, prompt, [1])
    assert t.offer("s", [*prompt, 1, 2]) is None
    assert t.offer(None, prompt) is None


def test_flat_block_lists_of_older_vllm_are_one_group() -> None:
    t = table()
    prompt = list(range(12))
    params = pin(prompt, [1])
    params["remote_block_ids"] = [100, 101, 102]
    t.record("s", "d0", params, prompt, [1])
    offer = t.offer("s", [*prompt, 1, 5, 5])
    assert offer is not None and offer.params["remote_block_ids"] == [[100, 101, 102]]


def test_common_prefix_len_matches_a_token_by_token_scan() -> None:
    rng = random.Random(0)
    for _ in range(300):
        n = rng.choice([0, 1, 5, 4095, 4096, 4097, 9000])
        a = [rng.randrange(3) for _ in range(n)]
        b = list(a[: rng.randrange(n + 1)]) + [rng.randrange(3) for _ in range(rng.randrange(5000))]
        naive = 0
        while naive < min(len(a), len(b)) and a[naive] == b[naive]:
            naive += 1
        assert common_prefix_len(a, b) == naive


def test_ids_copied_from_the_previous_prompt_are_not_compared_again() -> None:
    t = table()
    prompt = list(range(40))
    t.record("s", "d0", pin(prompt, [1]), prompt, [1])
    nxt = [*prompt, 1, 2, 3]
    hinted = t.offer("s", nxt, PromptReuse(prompt, len(prompt)))
    assert hinted is not None and hinted.readback.tokens == 40
    # The hint is about that very list: a hint naming another base is not trusted.
    assert t.offer("s", nxt, PromptReuse(list(prompt), len(prompt))) == hinted


def test_common_prefix_len_from_a_known_start() -> None:
    assert common_prefix_len([1, 2, 3, 4], [1, 2, 9, 4], start=2) == 2
    assert common_prefix_len([1, 2, 3], [1, 2, 3, 4], start=1) == 3
    assert common_prefix_len([1], [1, 2], start=5) == 1
