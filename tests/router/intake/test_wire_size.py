"""prompt_span: where a GenerateRequest's text prompt lies in its wire bytes, found without parsing them, as
a parser would read it; anything not well-formed at the top level is left to the parser (None)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pdserve_client.api import pdserve_pb2 as pb
from router.intake.wire_size import prompt_span

TEXT = st.text(alphabet=st.sampled_from(["a", " ", "é", "中", "🙂", "\n"]), max_size=300)


@given(
    prompt=TEXT,
    content=st.one_of(st.none(), TEXT),
    ids=st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=20),
    max_tokens=st.integers(min_value=0, max_value=2**31 - 1),
    session=TEXT,
    parallel=st.one_of(st.none(), st.booleans()),
)
def test_the_span_holds_the_prompt_a_parser_reads(
    prompt: str, content: str | None, ids: list[int], max_tokens: int, session: str, parallel: bool | None
) -> None:
    request = pb.GenerateRequest(
        prompt=prompt,
        messages=[] if content is None else [pb.ChatMessage(role="user", content=content)],
        prompt_token_ids=ids,
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.5),
        session_id=session,
        parallel_tool_calls=parallel,
    )
    raw = request.SerializeToString()
    span = prompt_span(raw)
    assert span is not None
    start, end = span
    assert raw[start:end].decode() == pb.GenerateRequest.FromString(raw).prompt == prompt


def test_of_two_prompt_fields_the_last_is_the_one_a_parser_keeps() -> None:
    raw = (
        pb.GenerateRequest(prompt="a" * 50).SerializeToString()
        + pb.GenerateRequest(prompt="bb").SerializeToString()
    )
    start, end = prompt_span(raw) or (0, 0)
    assert raw[start:end] == b"bb" == pb.GenerateRequest.FromString(raw).prompt.encode()


def test_a_request_without_a_prompt_has_an_empty_span() -> None:
    raw = pb.GenerateRequest(prompt_token_ids=[1, 2, 3], session_id="s").SerializeToString()
    assert prompt_span(raw) == (0, 0)
    assert prompt_span(b"") == (0, 0)


def test_bytes_that_are_not_well_formed_are_left_to_the_parser() -> None:
    whole = pb.GenerateRequest(prompt="hello", session_id="s").SerializeToString()
    assert prompt_span(whole[:-1]) is None  # a length that runs past the end
    assert prompt_span(b"\x12") is None  # a length that is missing
    assert prompt_span(b"\x80" * 11) is None  # a varint longer than ten bytes
    assert prompt_span(b"\x13") is None  # a group's start (wire type 3)
