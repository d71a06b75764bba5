"""An engine replica's end of the token channels: generated tokens and leg outcomes go to each router over one
ZMQ PUSH socket per router (router/legs/token_receiver.py binds the other end), not as a Ray object each.

Every batch a request produces is queued on its router's channel, and the channel sends what is queued as one
frame at the end of the event-loop turn: vLLM hands a step's outputs to every request at once, so one frame
carries the step's tokens for all of that router's requests. A leg's LegEnd (engine/leg_server.py) follows its
last batch on the same channel, so it never overtakes them.

A router that goes away (its process died, or it stopped answering ZMQ's heartbeats) is given up once its
channel has been closed, or has not opened, for ROUTER_GONE_S: whoever asked (`on_router_lost`: the leg
server) then cancels its legs, which aborts their engine requests and frees their KV, instead of generating
for nobody until max_tokens, or waiting forever on a full channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from engine.messages import LegEnd, ReplyTo, TokenBatch, TokenFrame, TokenItem

log = logging.getLogger(__name__)

# Items a channel may hold unsent (its router not reading) before the requests feeding it wait.
BACKLOG_ITEMS = 4096
# How soon a channel whose router is not reading tries again.
RETRY_S = 0.005
# Frames ZMQ buffers per channel before a send would block.
SEND_HWM = 1000
# A channel closed, or not open, this long: its router is gone.
ROUTER_GONE_S = 3.0
# ZMQ heartbeats on each channel: a router silent for HEARTBEAT_TIMEOUT_MS is disconnected (then the above).
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000


class _Channel:
    """One router's channel: a PUSH socket and what is queued for the next frame."""

    def __init__(self, sock: zmq.Socket[bytes], address: str, on_gone: Callable[[_Channel], None]) -> None:
        self._sock = sock
        self.address = address
        self._items: list[TokenItem | LegEnd] = []
        self._scheduled = False
        self._stalled_since: float | None = None
        self._drained: asyncio.Future[None] | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._on_gone = on_gone
        self._loop = asyncio.get_running_loop()
        self._connected = False
        self._check: asyncio.TimerHandle | None = None
        self._monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._monitor_fd = int(self._monitor.getsockopt(zmq.FD))
        self._loop.add_reader(self._monitor_fd, self._on_event)
        self._on_event()  # ZMQ's descriptor signals only once the socket was read
        self._watch()

    def _on_event(self) -> None:
        while not self._monitor.closed:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            self._connected = event["event"] == zmq.EVENT_CONNECTED
            if not self._connected:
                self._watch()

    def _watch(self) -> None:
        if self._check is None:
            self._check = self._loop.call_later(ROUTER_GONE_S, self._checked)

    def _checked(self) -> None:
        self._check = None
        if not self._connected and not self._sock.closed:
            log.warning("token channel to %s: closed or not open for %.0f s", self.address, ROUTER_GONE_S)
            self._on_gone(self)

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
        if self._check is not None:
            self._check.cancel()
            self._check = None
        if not self._monitor.closed:
            if not self._loop.is_closed():
                self._loop.remove_reader(self._monitor_fd)
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
        self._sock.close(linger=linger_ms)


class TokenSender:
    """The channels of one replica, one per router address, opened on first use and kept."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]] | None = None) -> None:
        self._ctx = context or zmq.Context.instance()
        self._channels: dict[str, _Channel] = {}
        self._lost_callbacks: list[Callable[[str], None]] = []

    def on_router_lost(self, callback: Callable[[str], None]) -> None:
        """`callback(address)` once the router at `address` is gone (its channel is closed then)."""
        self._lost_callbacks.append(callback)

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
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        channel = self._channels[address] = _Channel(sock, address, self._gone)
        sock.connect(address)
        log.info("token channel to %s opened", address)
        return channel

    def _gone(self, channel: _Channel) -> None:
        if self._channels.get(channel.address) is channel:
            del self._channels[channel.address]  # a later leg from that address opens a new channel
        channel.close(linger_ms=0)
        for callback in self._lost_callbacks:
            callback(channel.address)

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
