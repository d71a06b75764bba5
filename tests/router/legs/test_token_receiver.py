"""The token channel, both ends: a decode replica's TokenSender pushing to a router's TokenReceiver over a
real ZMQ socket. The Serve call that runs a leg is stood in for by a task running the sender, as the
replica's `generate` does (decode/decode_replica.py); the real call path is exercised in tests/e2e."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from engine.messages import ReplicaFailed, ReplyTo, TokenBatch, TokenFrame, TokenItem, TokenLogprob
from engine.token_sender import TokenSender
from router.errors import ClientNotReading
from router.legs import token_receiver
from router.legs.token_receiver import ChannelLost, TokenReceiver


@pytest.fixture
async def channel() -> AsyncIterator[tuple[TokenSender, TokenReceiver]]:
    receiver, sender = TokenReceiver(), TokenSender()
    yield sender, receiver
    sender.close()
    receiver.close()


def batch(*ids: int, final: bool = False) -> TokenBatch:
    return TokenBatch(token_ids=list(ids), text="", finish_reason="length" if final else None)


async def engine(
    n: int, *, step_s: float = 0.0, closed: list[str] | None = None
) -> AsyncIterator[TokenBatch]:
    """`n` batches of one token, the last final; records in `closed` that it was closed (an engine abort)."""
    try:
        for i in range(n):
            await asyncio.sleep(step_s)
            yield batch(i, final=i == n - 1)
    finally:
        if closed is not None:
            closed.append("closed")


def leg(
    sender: TokenSender, receiver: TokenReceiver, batches: AsyncIterator[TokenBatch]
) -> tuple[ReplyTo, asyncio.Task[int]]:
    reply_to = receiver.open()
    return reply_to, asyncio.ensure_future(sender.stream(reply_to, batches))


async def collect(receiver: TokenReceiver, reply_to: ReplyTo, call: asyncio.Task[int]) -> list[int]:
    return [t async for b in receiver.stream(reply_to, call) for t in b.token_ids]


async def test_two_legs_of_one_request_id_stay_apart(channel: tuple[TokenSender, TokenReceiver]) -> None:
    """Request ids come from clients; a router numbers its legs itself."""
    sender, receiver = channel
    legs = [leg(sender, receiver, engine(n)) for n in (5, 9)]
    assert [len(await collect(receiver, *one)) for one in legs] == [5, 9]


async def test_every_leg_gets_its_own_batches_in_order(channel: tuple[TokenSender, TokenReceiver]) -> None:
    sender, receiver = channel
    legs = [leg(sender, receiver, engine(50)) for _ in range(3)]
    got = await asyncio.gather(*(collect(receiver, *one) for one in legs))
    assert got == [list(range(50))] * 3
    assert [call.result() for _, call in legs] == [50, 50, 50]  # the call's result: batches sent


async def test_one_frame_carries_the_batches_of_every_leg_made_in_one_loop_turn(
    channel: tuple[TokenSender, TokenReceiver],
) -> None:
    sender, receiver = channel
    legs = [leg(sender, receiver, engine(20, step_s=0.002)) for _ in range(16)]
    await asyncio.gather(*(collect(receiver, *one) for one in legs))
    assert receiver.items == 16 * 20
    # The 16 legs step together, as an engine's batch does: far fewer frames than batches.
    assert receiver.frames <= receiver.items / 4


async def test_a_failed_leg_raises_its_error_after_the_batches_that_came_before_it(
    channel: tuple[TokenSender, TokenReceiver],
) -> None:
    sender, receiver = channel

    async def failing() -> AsyncIterator[TokenBatch]:
        yield batch(1)
        yield batch(2)
        await asyncio.sleep(0.05)
        raise ReplicaFailed("D1", "its vLLM engine core died")

    got: list[int] = []
    with pytest.raises(ReplicaFailed, match="engine core died"):
        async for b in receiver.stream(*leg(sender, receiver, failing())):
            got += b.token_ids
    assert got == [1, 2]


async def test_closing_the_stream_cancels_the_call_and_the_engine_request(
    channel: tuple[TokenSender, TokenReceiver],
) -> None:
    sender, receiver = channel
    closed: list[str] = []
    reply_to, call = leg(sender, receiver, engine(1000, step_s=0.01, closed=closed))
    stream = receiver.stream(reply_to, call)
    await anext(stream)
    await stream.aclose()  # the client went away
    await asyncio.sleep(0.05)
    assert call.cancelled() and closed == ["closed"]


async def test_batches_for_a_leg_that_ended_are_counted_and_dropped(
    channel: tuple[TokenSender, TokenReceiver],
) -> None:
    sender, receiver = channel
    reply_to, call = leg(sender, receiver, engine(2))
    assert len(await collect(receiver, reply_to, call)) == 2
    receiver.deliver(TokenFrame(items=[TokenItem(leg=reply_to.leg, seq=2, batch=batch(1))]))
    assert receiver.strays == 1


async def test_a_missing_batch_ends_the_leg_as_lost(channel: tuple[TokenSender, TokenReceiver]) -> None:
    _, receiver = channel
    call = asyncio.ensure_future(asyncio.Event().wait())
    reply_to = receiver.open()
    stream = receiver.stream(reply_to, call)  # type: ignore[arg-type]
    pending = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    receiver.deliver(TokenFrame(items=[TokenItem(leg=reply_to.leg, seq=1, batch=batch(1))]))
    with pytest.raises(ChannelLost, match="batch 0"):
        await pending
    await asyncio.sleep(0)
    assert call.cancelled()


async def test_a_call_that_returned_without_its_batches_arriving_is_lost(
    channel: tuple[TokenSender, TokenReceiver], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, receiver = channel
    monkeypatch.setattr(token_receiver, "ARRIVAL_GRACE_S", 0.05)

    async def returned() -> int:
        return 3  # says it sent 3 batches; none came

    with pytest.raises(ChannelLost, match="sent 3 batches; 0 arrived"):
        await collect(receiver, receiver.open(), asyncio.ensure_future(returned()))


async def test_a_client_that_stops_reading_has_its_leg_ended(
    channel: tuple[TokenSender, TokenReceiver], monkeypatch: pytest.MonkeyPatch
) -> None:
    sender, receiver = channel
    monkeypatch.setattr(token_receiver, "MAX_UNREAD_BATCHES", 8)
    closed: list[str] = []
    reply_to, call = leg(sender, receiver, engine(1000, step_s=0.001, closed=closed))
    stream = receiver.stream(reply_to, call)
    await anext(stream)
    await asyncio.sleep(0.2)  # the client reads nothing more
    assert call.cancelled() and closed == ["closed"]  # the engine stopped generating for it
    with pytest.raises(ClientNotReading, match="8 batches"):
        async for _ in stream:
            pass


async def test_batches_that_wait_for_the_reader_are_handed_on_as_one(
    channel: tuple[TokenSender, TokenReceiver],
) -> None:
    sender, receiver = channel
    reply_to, call = leg(sender, receiver, engine(6))
    await call  # all six sent before the reader reads: they wait in the leg's inbox
    await asyncio.sleep(0.05)
    got = [b async for b in receiver.stream(reply_to, call)]
    assert [(b.token_ids, b.finish_reason) for b in got] == [([0, 1, 2, 3, 4, 5], "length")]
    with_logprobs = [
        TokenBatch(token_ids=[1], text="a", logprobs=[TokenLogprob(1, "a", -0.5, [])]),
        TokenBatch(token_ids=[2], text="b", replica_id="D1", logprobs=[TokenLogprob(2, "b", -0.1, [])]),
    ]
    joined = token_receiver._joined(*with_logprobs)
    assert (joined.token_ids, joined.text, joined.replica_id) == ([1, 2], "ab", "D1")
    assert [lp.token_id for lp in joined.logprobs or []] == [1, 2]
