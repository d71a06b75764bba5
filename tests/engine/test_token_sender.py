"""A decode replica's end of the token channels (engine/token_sender.py): what it does when its router does
not read. Both ends together are specified in tests/router/legs/test_token_receiver.py."""

from __future__ import annotations

import asyncio
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from engine import token_sender
from engine.leg_server import LegServer
from engine.messages import EngineRequest, LegFrame, LegStart, ReplyTo, Sampling, TokenBatch, TokenFrame
from engine.token_sender import TokenSender


async def batches(n: int) -> AsyncIterator[TokenBatch]:
    for i in range(n):
        yield TokenBatch(token_ids=[i], text="", finish_reason="length" if i == n - 1 else None)
        await asyncio.sleep(0)


async def test_a_router_that_does_not_read_makes_its_streams_wait_and_loses_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(token_sender, "BACKLOG_ITEMS", 16)
    monkeypatch.setattr(token_sender, "SEND_HWM", 4)
    address = f"ipc://{Path(tempfile.gettempdir())}/pdserve-test-{uuid.uuid4().hex}"
    sender = TokenSender()
    # Nobody listens yet: the channel buffers SEND_HWM frames, then holds items, then the stream waits.
    stream = asyncio.ensure_future(sender.stream(ReplyTo(address=address, leg=0), batches(2000)))
    await asyncio.sleep(0.3)
    assert not stream.done()

    ctx = zmq.asyncio.Context.instance()
    pull = ctx.socket(zmq.PULL)
    pull.bind(address)
    decoder = msgspec.msgpack.Decoder(TokenFrame)
    got: list[int] = []
    try:
        async with asyncio.timeout(10):
            while len(got) < 2000:
                frame = decoder.decode(await pull.recv())
                got += [item.seq for item in frame.items]
        assert await stream == 2000
    finally:
        pull.close(linger=0)
        sender.close()
    assert got == list(range(2000))  # every batch, in order, none twice


async def test_the_legs_of_a_router_that_went_away_are_cancelled(monkeypatch: pytest.MonkeyPatch) -> None:
    """A router's process dies with legs streaming: once its channel has been closed ROUTER_GONE_S, the leg
    server cancels them (their engine requests are aborted), where before they ran to max_tokens, or waited
    forever on a full channel. The other router's leg goes on."""
    monkeypatch.setattr(token_sender, "ROUTER_GONE_S", 0.5)
    ctx = zmq.asyncio.Context.instance()
    tokens = TokenSender()
    ended = {0: asyncio.Event(), 1: asyncio.Event()}  # by leg: its engine stream was closed

    async def generate(req: EngineRequest, reply_to: ReplyTo) -> int:
        async def endless() -> AsyncIterator[TokenBatch]:
            try:
                while True:
                    yield TokenBatch(token_ids=[1], text="")
                    await asyncio.sleep(0.01)
            finally:
                ended[reply_to.leg].set()

        return await tokens.stream(reply_to, endless())

    server = LegServer({"generate": generate}, tokens, None)
    server.start()
    routers = [ctx.socket(zmq.PULL) for _ in range(2)]
    addresses = [f"ipc://{Path(tempfile.gettempdir())}/pdserve-test-{uuid.uuid4().hex}" for _ in routers]
    legs = ctx.socket(zmq.PUSH)
    try:
        for router, address in zip(routers, addresses, strict=True):
            router.bind(address)
        legs.connect(server.address)
        request = EngineRequest(request_id="r", prompt_token_ids=[1, 2], sampling=Sampling(max_tokens=10**6))
        starts = [LegStart("generate", request, ReplyTo(address=a, leg=i)) for i, a in enumerate(addresses)]
        await legs.send(msgspec.msgpack.encode(LegFrame(items=starts)))
        async with asyncio.timeout(10):
            for router in routers:
                await router.recv()  # both legs stream
            assert server.running == 2

            routers[0].close(linger=0)  # the first router's process died
            await ended[0].wait()
            await asyncio.sleep(0.05)  # the cancelled leg's task ends after its stream
        assert server.running == 1 and not ended[1].is_set()
        await routers[1].recv()  # the live router still gets its tokens
    finally:
        legs.close(linger=0)
        for router in routers:
            router.close(linger=0)
        server.close()
        tokens.close()
