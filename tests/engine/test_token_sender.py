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
from engine.messages import ReplyTo, TokenBatch, TokenFrame
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
