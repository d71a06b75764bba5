"""A token-id session's next turn reuses the previous turn's ids when its packed ids extend them."""

from __future__ import annotations

import random

import pytest

from pdserve_client.api import pdserve_pb2 as pb
from router.block_hash import SessionHasher, hash_blocks
from router.intake.token_sessions import PROMPT_TOKEN_IDS_FIELD, SessionTokenIds, packed_field
from router.intake.validation import InvalidRequest, ModelLimits, validate_generate
from router.sessions import Sessions

LIMITS = ModelLimits(served_name="m", max_model_len=1 << 20, vocab_size=200_000)


def _request(ids: list[int], session_id: str = "s", **fields: object) -> tuple[pb.GenerateRequest, bytes]:
    raw = pb.GenerateRequest(session_id=session_id, prompt_token_ids=ids, **fields).SerializeToString()  # type: ignore[arg-type]
    return pb.GenerateRequest.FromString(raw), raw


def _turn_ids(sessions: SessionTokenIds, ids: list[int], session_id: str = "s") -> tuple[list[int], bool]:
    """What the server does: start the turn, validate with its prior, finish it. (ids, whether reused)."""
    req, raw = _request(ids, session_id)
    turn = sessions.start(req, raw)
    valid = validate_generate(req, LIMITS, None if turn is None else turn.prior)
    got = valid.input.prompt_token_ids
    if turn is not None:
        sessions.finish(turn, got)
    return got, turn is not None and turn.prior is not None


# ---- the wire scan --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"request_id": "r" * 300, "model": "m"},
        {"sampling": pb.SamplingParams(max_tokens=7, temperature=0.5)},
    ],
)
def test_packed_field_is_the_ids_payload_whatever_else_the_request_holds(fields: dict[str, object]) -> None:
    ids = [0, 1, 127, 128, 300, 16_383, 16_384, 199_999]
    _, raw = _request(ids, **fields)
    only_ids = pb.GenerateRequest(prompt_token_ids=ids).SerializeToString()
    # The field alone serializes as tag, length, payload.
    assert packed_field(raw, PROMPT_TOKEN_IDS_FIELD) == packed_field(only_ids, PROMPT_TOKEN_IDS_FIELD)
    payload = packed_field(only_ids, PROMPT_TOKEN_IDS_FIELD)
    assert (
        payload is not None and only_ids == bytes([PROMPT_TOKEN_IDS_FIELD << 3 | 2, len(payload)]) + payload
    )


def test_packed_field_is_none_when_absent_unpacked_split_or_truncated() -> None:
    _, raw = _request([], request_id="x")
    assert packed_field(raw, PROMPT_TOKEN_IDS_FIELD) is None
    tag_packed = bytes([PROMPT_TOKEN_IDS_FIELD << 3 | 2])
    tag_unpacked = bytes([PROMPT_TOKEN_IDS_FIELD << 3 | 0])
    unpacked = tag_unpacked + b"\x05" + tag_unpacked + b"\x06"
    split = tag_packed + b"\x01\x05" + tag_packed + b"\x01\x06"
    for wire in (unpacked, split):
        assert list(pb.GenerateRequest.FromString(wire).prompt_token_ids) == [5, 6]  # legal protobuf
        assert packed_field(wire, PROMPT_TOKEN_IDS_FIELD) is None
    assert packed_field(tag_packed + b"\x05\x01\x02", PROMPT_TOKEN_IDS_FIELD) is None  # length past the end
    assert packed_field(b"\xff", PROMPT_TOKEN_IDS_FIELD) is None  # truncated tag


# ---- sessions -------------------------------------------------------------------------------------------


def test_a_turn_that_extends_the_previous_one_reuses_its_list_and_objects() -> None:
    sessions = SessionTokenIds()
    rng = random.Random(0)
    turn1 = [rng.randrange(200_000) for _ in range(5000)]
    ids1, reused1 = _turn_ids(sessions, turn1)
    assert ids1 == turn1 and not reused1
    turn2 = turn1 + [rng.randrange(200_000) for _ in range(300)]
    ids2, reused2 = _turn_ids(sessions, turn2)
    assert ids2 == turn2 and reused2
    assert all(a is b for a, b in zip(ids1, ids2[:5000], strict=True))


def test_an_edited_history_or_another_session_takes_the_full_path() -> None:
    sessions = SessionTokenIds()
    base = list(range(1000, 3000))
    _turn_ids(sessions, base)
    edited = [*base, 7, 8]
    edited[500] += 1
    assert _turn_ids(sessions, edited) == (edited, False)
    other = [*base, 9]
    assert _turn_ids(sessions, other, session_id="other") == (other, False)
    shorter = base[:1500]
    assert _turn_ids(sessions, shorter) == (shorter, False)


def test_a_reused_turn_still_checks_its_new_ids_and_names_the_index() -> None:
    sessions = SessionTokenIds()
    _turn_ids(sessions, [5] * 100)
    with pytest.raises(InvalidRequest) as exc:
        _turn_ids(sessions, [5] * 100 + [1, LIMITS.vocab_size])
    assert exc.value.field == "prompt_token_ids[101]"


def test_a_prefix_of_ids_is_not_a_prefix_of_bytes_unless_it_is_a_prefix_of_ids() -> None:
    """128 encodes as 0x80 0x01: a previous turn ending in 1 ([.., 1]) is a byte prefix only of turns that
    continue those very ids, never of one where 1 became 128."""
    sessions = SessionTokenIds()
    _turn_ids(sessions, [3, 1])
    assert _turn_ids(sessions, [3, 128]) == ([3, 128], False)


@pytest.mark.parametrize("seed", range(6))
def test_random_sessions_always_get_protobufs_own_ids_and_the_hasher_agrees(seed: int) -> None:
    rng = random.Random(seed)
    state = Sessions(max_sessions=3, max_tokens=50_000)
    sessions = SessionTokenIds(state)
    hasher = SessionHasher(block_size=16)
    prompts: dict[str, list[int]] = {}
    reused_turns = 0
    for _ in range(200):
        sid = f"s{rng.randrange(5)}"
        ids = list(prompts.get(sid, []))
        r = rng.random()
        if r < 0.1 and ids:
            ids[rng.randrange(len(ids))] = rng.randrange(300)  # edited history
        elif r < 0.15:
            ids = ids[: rng.randrange(len(ids) + 1)]  # compaction
        ids += [
            rng.choice((rng.randrange(128), rng.randrange(200_000))) for _ in range(rng.randrange(1, 400))
        ]
        prompts[sid] = ids
        req, raw = _request(ids, sid)
        turn = sessions.start(req, raw)
        got = validate_generate(req, LIMITS, None if turn is None else turn.prior).input.prompt_token_ids
        assert got == list(req.prompt_token_ids)
        assert hasher.hash(sid, got, None if turn is None else turn.reuse) == hash_blocks(got, 16)
        if turn is not None:
            sessions.finish(turn, got)
            reused_turns += turn.prior is not None
    assert reused_turns > 50
    assert len(state) <= 3


def test_memory_is_bounded_by_tokens() -> None:
    state = Sessions(max_sessions=10, max_tokens=1000)
    sessions = SessionTokenIds(state)
    for i in range(5):
        _turn_ids(sessions, list(range(400)), session_id=f"s{i}")
    assert len(state) == 2
    _turn_ids(sessions, list(range(2000)), session_id="big")  # larger than the whole budget: not kept
    assert _turn_ids(sessions, list(range(2001)), session_id="big") == (list(range(2001)), False)
