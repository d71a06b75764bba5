"""An engine replica's end of the token channels: generated tokens and leg outcomes go to each router over one
ZMQ PUSH socket per router (router/legs/token_receiver.py binds the other end), not as a Ray object each.

Every batch a request produces is queued on its router's channel, and the channel sends what is queued as one
frame at the end of the event-loop turn: vLLM hands a step's outputs to every request at once, so one frame
carries the step's tokens for all of that router's requests. A leg's LegEnd (engine/leg_server.py) follows its
last batch on the same channel, so it never overtakes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import msgspec
import zmq

from engine.messages import LegEnd, ReplyTo, TokenBatch, TokenFrame, TokenItem

log = logging.getLogger(__name__)

# Items a channel may hold unsent (its router not reading) before the requests feeding it wait.
BACKLOG_ITEMS = 4096
# How soon a channel whose router is not reading tries again.
RETRY_S = 0.005
# Frames ZMQ buffers per channel before a send would block.
SEND_HWM = 1000


class _Channel:
    """One router's channel: a PUSH socket and what is queued for the next frame."""

    def __init__(self, sock: zmq.Socket[bytes], address: str) -> None:
        self._sock = sock
        self.address = address
        self._items: list[TokenItem | LegEnd] = []
        self._scheduled = False
        self._stalled_since: float | None = None
        self._drained: asyncio.Future[None] | None = None
        self._encoder = msgspec.msgpack.Encoder()

    def put(self, item: TokenItem | LegEnd) -> None:
        self._items.append(item)
        if not self._scheduled:
            self._scheduled = True
            # Runs after every request woken by the same engine step has queued its batch.
            asyncio.get_running_loop().call_soon(self._flush)

    @property
    def backlogged(self) -> bool:
        return len(self._items) > BACKLOG_ITEMS

    @property
    def pending(self) -> bool:
        return bool(self._items)

    async def drained(self) -> None:
        if self._drained is None:
            self._drained = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._drained)

    def _flush(self) -> None:
        self._scheduled = False
        if not self._items or self._sock.closed:
            return
        try:
            self._sock.send(self._encoder.encode(TokenFrame(items=self._items)), zmq.NOBLOCK)
        except zmq.Again:
            # The router reads no more (its socket buffer is full): keep the items, try again shortly.
            now = time.monotonic()
            if self._stalled_since is None:
                self._stalled_since = now
                log.warning("token channel to %s: its router is not reading; holding tokens", self.address)
            self._scheduled = True
            asyncio.get_running_loop().call_later(RETRY_S, self._flush)
            return
        if self._stalled_since is not None:
            log.info(
                "token channel to %s: sending again after %.1f s",
                self.address,
                time.monotonic() - self._stalled_since,
            )
            self._stalled_since = None
        self._items = []
        if self._drained is not None:
            self._drained.set_result(None)
            self._drained = None

    def close(self, linger_ms: int) -> None:
        self._sock.close(linger=linger_ms)


class TokenSender:
    """The channels of one replica, one per router address, opened on first use and kept."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]] | None = None) -> None:
        self._ctx = context or zmq.Context.instance()
        self._channels: dict[str, _Channel] = {}

    async def stream(self, reply_to: ReplyTo, batches: AsyncIterator[TokenBatch]) -> int:
        """Send `batches` to the router leg `reply_to`, numbered from 0; how many were sent. Ends (and the
        batches' generator is closed, which aborts the engine request) when cancelled."""
        channel = self._channels.get(reply_to.address) or self._open(reply_to.address)
        seq = 0
        async with contextlib.aclosing(batches):  # type: ignore[type-var]
            async for batch in batches:
                channel.put(TokenItem(leg=reply_to.leg, seq=seq, batch=batch))
                seq += 1
                if channel.backlogged:
                    await channel.drained()
        return seq

    def end(self, reply_to: ReplyTo, end: LegEnd) -> None:
        """Send a leg's outcome, after whatever it streamed."""
        (self._channels.get(reply_to.address) or self._open(reply_to.address)).put(end)

    def _open(self, address: str) -> _Channel:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        # Sends to a router not yet (or no longer) connected queue instead of being dropped.
        sock.setsockopt(zmq.IMMEDIATE, 0)
        sock.connect(address)
        channel = self._channels[address] = _Channel(sock, address)
        log.info("token channel to %s opened", address)
        return channel

    async def flush(self, timeout_s: float) -> None:
        """Wait (up to `timeout_s`) until every channel has handed what it holds to ZMQ."""
        pending = [c.drained() for c in self._channels.values() if c.pending]
        if pending:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*pending), timeout_s)

    def close(self, linger_ms: int = 0) -> None:
        """`linger_ms`: how long ZMQ may still send what it holds (a stopping replica's last leg ends)."""
        for channel in self._channels.values():
            channel.close(linger_ms)
        self._channels.clear()
