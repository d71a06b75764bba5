"""Token-id prompts of a session, reused across turns.

A client that sends token ids (an agent framework applying its own chat template, an RL rollout) re-sends
the whole context every turn. Converting and checking the ids costs time linear in the context, on the event
loop (docs/benchmarks.md, "The router's own costs"), and most of them are the previous turn's.

On the wire the ids are one packed field: a string of varints. Varints are self-delimiting, so a payload that
starts with the previous turn's whole payload decodes to the previous turn's ids followed by new ones, and
one byte comparison (memcmp) proves that a new turn extends the previous one. Such a turn then converts and
checks only its new ids and reuses the previous turn's list for the rest: the very int objects, which the
router's block hasher recognises (`PromptReuse`) without comparing them either. Any other request (first
turn, edited history, ids not sent as one packed field) takes the full path; the result is the same list
either way, which the tests check against protobuf's own decoding.

Each session's ids are kept in the router's `Sessions` (router/sessions.py, which bounds them). One per event
loop.
"""

from __future__ import annotations

from pdserve_client.api import pdserve_pb2 as pb
from router.messages import PromptReuse
from router.sessions import Part, Sessions

PROMPT_TOKEN_IDS_FIELD = pb.GenerateRequest.DESCRIPTOR.fields_by_name["prompt_token_ids"].number

_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5


def packed_field(raw: bytes, field_number: int) -> bytes | None:
    """The payload of `field_number` in a serialized message when it occurs exactly once, length-delimited
    (a packed repeated scalar field); None when it is absent, split, unpacked or the bytes do not parse.
    Only the top level is scanned: other fields are skipped by their lengths."""
    i, n = 0, len(raw)
    found: bytes | None = None
    while i < n:
        tag, i = _varint(raw, i)
        if i < 0:
            return None
        number, wire_type = tag >> 3, tag & 7
        if wire_type == _LENGTH_DELIMITED:
            length, i = _varint(raw, i)
            if i < 0 or i + length > n:
                return None
            if number == field_number:
                if found is not None:
                    return None  # split into several chunks: legal, but not one comparable payload
                found = raw[i : i + length]
            i += length
        elif number == field_number:
            return None  # unpacked elements
        elif wire_type == _VARINT:
            _, i = _varint(raw, i)
            if i < 0:
                return None
        elif wire_type == _FIXED64:
            i += 8
        elif wire_type == _FIXED32:
            i += 4
        else:
            return None  # groups: not in this API
    return found if i == n else None


def _varint(raw: bytes, i: int) -> tuple[int, int]:
    """(value, index after it), or (0, -1) when truncated or longer than 10 bytes."""
    value = shift = 0
    for j in range(i, min(i + 10, len(raw))):
        b = raw[j]
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, j + 1
        shift += 7
    return 0, -1


class TokenIdsTurn:
    """One token-id request of a session: its packed ids, and the previous turn's ids it extends (if so)."""

    __slots__ = ("packed", "prior", "session_id")

    def __init__(self, session_id: str, packed: bytes, prior: list[int] | None) -> None:
        self.session_id = session_id
        self.packed = packed
        self.prior = prior

    @property
    def reuse(self) -> PromptReuse | None:
        return None if self.prior is None else PromptReuse(self.prior, len(self.prior))


class _Entry:
    __slots__ = ("ids", "packed")

    def __init__(self, packed: bytes, ids: list[int]) -> None:
        self.packed = packed
        self.ids = ids


TOKEN_IDS = Part[_Entry]("token_ids", lambda e: len(e.ids))


class SessionTokenIds:
    def __init__(self, sessions: Sessions | None = None) -> None:
        """`sessions`: the router's (default: one of its own)."""
        self._sessions = sessions if sessions is not None else Sessions.default()

    def start(self, request: pb.GenerateRequest, raw: bytes) -> TokenIdsTurn | None:
        """For a session's token-id request (`raw`: its serialized form): the turn, with the previous turn's
        ids when this one extends them. None for any other request."""
        if not request.session_id or not request.prompt_token_ids:
            return None
        packed = packed_field(raw, PROMPT_TOKEN_IDS_FIELD)
        if packed is None:
            return None
        entry = self._sessions.get(request.session_id, TOKEN_IDS)
        prior = None
        if entry is not None and len(packed) >= len(entry.packed) and packed.startswith(entry.packed):
            prior = entry.ids
        return TokenIdsTurn(request.session_id, packed, prior)

    def finish(self, turn: TokenIdsTurn, ids: list[int]) -> None:
        """The turn's ids were accepted: keep them for the session's next turn. `ids` is kept by reference
        (a prompt's list is never mutated)."""
        self._sessions.put(turn.session_id, TOKEN_IDS, _Entry(turn.packed, ids))
