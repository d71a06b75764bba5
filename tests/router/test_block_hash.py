"""The router's block hash chain and the per-session hasher."""

import os
import random
import subprocess
import sys

import numpy as np
import pytest

from router.block_hash import HASHED, SessionHasher, hash_blocks
from router.messages import PromptReuse
from router.sessions import Sessions


def _tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200_000) for _ in range(n)]


def test_only_full_blocks_are_hashed() -> None:
    assert len(hash_blocks(_tokens(63), 16)) == 3
    assert len(hash_blocks(_tokens(64), 16)) == 4
    assert hash_blocks(_tokens(15), 16) == []


def test_chain_depends_on_whole_prefix() -> None:
    a = _tokens(64)
    b = list(a)
    b[3] += 1  # differs in block 0 only
    ha, hb = hash_blocks(a, 16), hash_blocks(b, 16)
    assert all(x != y for x, y in zip(ha, hb, strict=True))


def test_same_block_content_at_different_positions_differs() -> None:
    block = _tokens(16)
    h = hash_blocks(block + block, 16)
    assert h[0] != h[1]


def test_parent_continues_the_chain() -> None:
    toks = _tokens(160)
    full = hash_blocks(toks, 16)
    assert hash_blocks(toks[64:], 16, parent=full[3]) == full[4:]


def test_accepts_any_int_sequence() -> None:
    toks = _tokens(48)
    assert hash_blocks(tuple(toks), 16) == hash_blocks(toks, 16) == hash_blocks(iter(toks), 16)  # type: ignore[arg-type]


def test_a_long_prompt_hashes_as_block_by_block() -> None:
    # Long prompts take numpy's cumulative form of the chain, short ones a loop: the same hashes, and the
    # same across the switch and from any parent.
    toks = _tokens(16 * 300 + 5)
    stepwise: list[int] = []
    for i in range(300):
        stepwise += hash_blocks(toks[16 * i : 16 * (i + 1)], 16, stepwise[-1] if stepwise else None)
    assert hash_blocks(toks, 16) == stepwise
    for n in (63, 64, 65):
        assert hash_blocks(toks[: 16 * n], 16) == stepwise[:n]
    assert hash_blocks(toks[16 * 100 :], 16, parent=stepwise[99]) == stepwise[100:]


def test_a_numpy_array_hashes_as_its_list() -> None:
    toks = _tokens(16 * 70)
    assert hash_blocks(np.array(toks, dtype=np.uint32), 16) == hash_blocks(toks, 16)


def test_swapped_blocks_differ() -> None:
    a, b = _tokens(16, seed=1), _tokens(16, seed=2)
    filler = _tokens(16 * 80, seed=3)
    one, two = hash_blocks(a + b + filler, 16), hash_blocks(b + a + filler, 16)
    assert not set(one[1:]) & set(two[1:])


def test_independent_of_pythonhashseed() -> None:
    code = "from router.block_hash import hash_blocks; print(hash_blocks(list(range(1000, 1064)), 16))"
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("0", "1", "12345")
    }
    assert len(outs) == 1


def test_rejects_bad_block_size() -> None:
    with pytest.raises(ValueError):
        hash_blocks([1, 2], 0)


def test_session_next_turn_hashes_only_new_blocks() -> None:
    h = SessionHasher(block_size=16)
    turn1 = _tokens(1000)
    turn2 = turn1 + _tokens(300, seed=1)
    assert h.hash("s", turn1) == hash_blocks(turn1, 16)
    before = h.hashed_blocks
    assert h.hash("s", turn2) == hash_blocks(turn2, 16)
    assert h.hashed_blocks - before == len(turn2) // 16 - len(turn1) // 16
    assert h.reused_blocks == len(turn1) // 16


@pytest.mark.parametrize("sealed", [False, True])
def test_session_next_turn_of_fresh_int_objects_reuses_the_previous_turn(sealed: bool) -> None:
    """A live router re-tokenizes every turn: equal ids, new objects. Sealed or not, the prefix is reused."""
    h = SessionHasher(block_size=16)
    turn1 = _tokens(1000)
    h.hash("s", turn1)
    if sealed:
        h.seal("s")
    turn2 = [int(str(t)) for t in turn1] + _tokens(300, seed=1)
    assert h.hash("s", turn2) == hash_blocks(turn2, 16)
    assert h.reused_blocks == len(turn1) // 16


@pytest.mark.parametrize("sealed", [False, True])
@pytest.mark.parametrize("edit_at", [0, 17, 500, 999])
def test_session_edited_history_rehashes_from_the_first_changed_block(edit_at: int, sealed: bool) -> None:
    h = SessionHasher(block_size=16)
    turn1 = _tokens(1000)
    h.hash("s", turn1)
    if sealed:
        h.seal("s")
    turn2 = list(turn1) + _tokens(100, seed=2)
    turn2[edit_at] += 1
    reused_before = h.reused_blocks
    assert h.hash("s", turn2) == hash_blocks(turn2, 16)
    assert h.reused_blocks - reused_before == edit_at // 16


def test_a_reuse_hint_from_the_prompts_builder_replaces_the_comparison() -> None:
    h = SessionHasher(block_size=16)
    turn1 = _tokens(1000)
    h.hash("s", turn1)
    # Built from turn 1's list: its first 990 ids copied, the rest (re-encoded) new objects.
    turn2 = turn1[:990] + [int(str(t)) for t in turn1[990:]] + _tokens(300, seed=1)
    assert h.hash("s", turn2, PromptReuse(turn1, 990)) == hash_blocks(turn2, 16)
    # The block the re-encoded ids fall in is compared, not re-hashed: only the new blocks are hashed.
    assert (h.reused_blocks, h.hashed_blocks) == (1000 // 16, 1300 // 16)  # turn 1's blocks, then the new


def test_ids_re_encoded_differently_after_the_reuse_hint_are_hashed_anew() -> None:
    h = SessionHasher(block_size=16)
    turn1 = _tokens(1000)
    h.hash("s", turn1)
    turn2 = turn1[:990] + [t + 1 for t in turn1[990:]] + _tokens(300, seed=1)
    assert h.hash("s", turn2, PromptReuse(turn1, 990)) == hash_blocks(turn2, 16)
    assert h.reused_blocks == 990 // 16


def test_a_reuse_hint_about_another_list_is_ignored() -> None:
    """The hint vouches only for the session's own previous prompt; for any other base the prefix is checked,
    so a stale hint (the session's previous turn was hashed from another list) cannot corrupt the hashes."""
    h = SessionHasher(block_size=16)
    turn1 = _tokens(1000)
    h.hash("s", turn1)
    other = list(turn1)
    turn2 = list(turn1) + _tokens(100, seed=2)
    turn2[40] += 1
    assert h.hash("s", turn2, PromptReuse(other, 1000)) == hash_blocks(turn2, 16)
    assert h.reused_blocks == 40 // 16


def test_hashes_intake_computed_are_kept_for_the_next_turn() -> None:
    h = SessionHasher(block_size=16)
    turn1 = _tokens(1000)
    given = hash_blocks(turn1, 16)
    assert h.hash("s", turn1, hashed=list(given)) == given
    assert (h.reused_blocks, h.hashed_blocks) == (0, 1000 // 16)
    h.seal("s")  # no digest: the next turn comes hashed or with a reuse hint
    entry = h._sessions.get("s", HASHED)
    assert entry is not None and entry.digest is None
    # A turn that is neither (token ids not extending the wire) is still hashed right: by comparing lists.
    assert h.hash("s", [int(str(t)) for t in turn1] + [7] * 16) == hash_blocks(turn1 + [7] * 16, 16)
    assert h.reused_blocks == 1000 // 16
    h.hash("s", turn1, hashed=list(given))
    # The next turn extends turn 1: only its new blocks are hashed, from turn 1's chain.
    turn2 = turn1 + _tokens(300, seed=1)
    assert h.hash("s", turn2, PromptReuse(turn1, 1000)) == hash_blocks(turn2, 16)
    assert h.reused_blocks == 2 * (1000 // 16)
    with pytest.raises(ValueError, match="block hashes"):
        h.hash("s", turn2, hashed=list(given))


def test_session_shorter_prompt_and_no_session() -> None:
    sessions = Sessions(max_sessions=10, max_tokens=10_000)
    h = SessionHasher(block_size=16, sessions=sessions)
    t = _tokens(500)
    h.hash("s", t)
    assert h.hash("s", t[:100]) == hash_blocks(t[:100], 16)
    assert h.hash(None, t) == hash_blocks(t, 16)
    assert len(sessions) == 1


def test_returned_list_does_not_alias_the_cache() -> None:
    h = SessionHasher(block_size=16)
    t = _tokens(160)
    h.hash("s", t).clear()
    assert h.hash("s", t) == hash_blocks(t, 16)


def test_each_sessions_hashed_prompt_is_kept_in_the_routers_session_state() -> None:
    sessions = Sessions(max_sessions=100, max_tokens=500)
    h = SessionHasher(block_size=16, sessions=sessions)
    h.hash("a", _tokens(320))
    h.hash("b", _tokens(320))  # evicts "a": 640 tokens > 500
    assert "a" not in sessions and sessions.get("b", HASHED) is not None
    reused = h.reused_blocks
    h.hash("a", _tokens(320))
    assert h.reused_blocks == reused  # "a" was forgotten
