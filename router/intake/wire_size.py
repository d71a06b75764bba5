"""A GenerateRequest's text prompt, sized from the request's wire bytes before they are parsed.

Parsing a request at the message limit and building its 4 MB prompt string costs the event loop (and the
GIL) ~0.5 ms or more only to refuse it. The prompt field's length in bytes bounds its tokens from below
(`PromptTokenizer.fewest_tokens_in_utf8`), so a prompt that cannot fit the context is refused from a walk
over the request's few top-level fields instead.
"""

from __future__ import annotations

from pdserve_client.api import pdserve_pb2 as pb

_PROMPT = pb.GenerateRequest.DESCRIPTOR.fields_by_name["prompt"].number
_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5


def prompt_span(raw: bytes) -> tuple[int, int] | None:
    """Where the text prompt lies in an encoded GenerateRequest: (start, end) of its last `prompt` field,
    the one a parser keeps ((0, 0) without one); None when `raw` is not well-formed at the top level (the
    parser then says what is wrong)."""
    pos, end, span = 0, len(raw), (0, 0)
    while pos < end:
        key, pos = _varint(raw, pos)
        if key is None:
            return None
        field, wire = key >> 3, key & 7
        if wire == _VARINT:
            value, pos = _varint(raw, pos)
            if value is None:
                return None
        elif wire == _FIXED64:
            pos += 8
        elif wire == _FIXED32:
            pos += 4
        elif wire == _LENGTH_DELIMITED:
            length, pos = _varint(raw, pos)
            if length is None:
                return None
            if field == _PROMPT:
                span = (pos, pos + length)
            pos += length
        else:  # groups (deprecated) or garbage: nothing a GenerateRequest holds
            return None
    return span if pos == end else None


def _varint(raw: bytes, pos: int) -> tuple[int | None, int]:
    """The varint at `pos` and the position after it; None when it runs past the end or 10 bytes."""
    value = shift = 0
    for i in range(pos, min(pos + 10, len(raw))):
        byte = raw[i]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i + 1
        shift += 7
    return None, pos
