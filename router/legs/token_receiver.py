"""The router's end of the token channels: one ZMQ PULL socket that every decode replica pushes this router's
tokens to (engine/token_sender.py), and an inbox per decode leg that each frame's items are sorted into.

A decode leg is a Serve call (`generate`, with this receiver's address as `reply_to`) that stays open while
the replica streams: its tokens come here, its result is how many batches it sent, its error is the leg's
failure (a lost replica, a failed engine). Cancelling the call aborts the engine request.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import tempfile
import uuid
from collections.abc import AsyncGenerator, Awaitable
from pathlib import Path
from typing import Any, Protocol

import msgspec
import zmq

from engine.messages import ReplyTo, TokenBatch, TokenFrame
from router.errors import ClientNotReading

log = logging.getLogger(__name__)

# How long the batches of a leg whose call has returned may take to arrive (they were sent before it
# returned, over a socket that keeps order: only a lost channel makes them later than that).
ARRIVAL_GRACE_S = 5.0
# Batches a leg may hold unread (its client is not reading) before it is ended: its engine request is
# aborted rather than its tokens held at everyone else's expense.
MAX_UNREAD_BATCHES = 256
RECV_HWM = 100_000


class ChannelLost(Exception):
    """A decode leg's batches did not all arrive: the request can go on elsewhere."""


class LegCall(Protocol):
    """A Serve call (DeploymentResponse): awaitable for its result, cancellable."""

    def __await__(self) -> Any: ...

    def cancel(self) -> None: ...


class _Inbox:
    __slots__ = ("batches", "broken", "cancel", "next_seq", "waiter")

    def __init__(self) -> None:
        self.batches: collections.deque[TokenBatch] = collections.deque()
        self.next_seq = 0
        self.waiter: asyncio.Future[None] | None = None
        self.broken: Exception | None = None  # why the leg was ended here
        self.cancel: Any = lambda: None  # cancels the leg's call

    def end(self, why: Exception) -> None:
        self.batches.clear()
        self.broken = why
        self.cancel()
        self.wake()

    def wake(self, _: object = None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def wait(self) -> None:
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None


class TokenReceiver:
    """Bound at construction: on one machine an ipc socket (readable by this user only), else TCP on `host`
    (the address decode replicas reach this router at) on a free port. Read from the first leg on."""

    def __init__(
        self, host: str | None = None, context: zmq.Context[zmq.Socket[bytes]] | None = None
    ) -> None:
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, RECV_HWM)
        if host is None:
            base = Path(tempfile.gettempdir()) / "pdserve-tokens"
            base.mkdir(mode=0o700, exist_ok=True)
            self.address = f"ipc://{base}/{uuid.uuid4().hex}"
            self._sock.bind(self.address)
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
            self.address = f"tcp://{host}:{port}"
        self._fd = int(self._sock.getsockopt(zmq.FD))
        self._inboxes: dict[int, _Inbox] = {}
        self._legs = itertools.count()
        self._decoder = msgspec.msgpack.Decoder(TokenFrame)
        # The loop whose reader callback drains the socket (no task: a callback per readable socket).
        self._loop: asyncio.AbstractEventLoop | None = None
        self.frames = 0
        self.items = 0
        self.strays = 0  # items for a leg no longer listening (it ended, moved or was cancelled)

    def open(self) -> ReplyTo:
        """Where a new decode leg's tokens go: its call gets this, and `stream` reads them (call it at once:
        it is what forgets the leg). From now on the leg's batches are kept, even those that come first."""
        reply_to = ReplyTo(address=self.address, leg=next(self._legs))
        self._inboxes[reply_to.leg] = _Inbox()
        return reply_to

    async def stream(self, reply_to: ReplyTo, call: LegCall) -> AsyncGenerator[TokenBatch, None]:
        """The batches of the decode leg `reply_to` in order, its last one (finish_reason set) included.
        Raises what `call` raises (the leg failed), ChannelLost or ClientNotReading. Closing it cancels
        `call`."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop = loop
            loop.add_reader(self._fd, self._read)
            self._read()  # what came before the reader was added
        leg = reply_to.leg
        inbox = self._inboxes[leg]
        inbox.cancel = call.cancel
        ended: asyncio.Future[int] = asyncio.ensure_future(_result(call))
        ended.add_done_callback(inbox.wake)
        finished = False
        try:
            deadline: float | None = None
            while True:
                if inbox.batches:
                    batch = inbox.batches.popleft()
                    if batch.finish_reason is not None:
                        finished = True
                    yield batch
                    if finished:
                        return
                    continue
                if inbox.broken is not None:
                    raise inbox.broken
                if ended.done():
                    sent = ended.result()  # raises the leg's failure
                    if deadline is None:
                        deadline = asyncio.get_running_loop().time() + ARRIVAL_GRACE_S
                    remaining = deadline - asyncio.get_running_loop().time()
                    if remaining <= 0:
                        raise ChannelLost(
                            f"the replica sent {sent} batches; {inbox.next_seq} arrived "
                            f"in {ARRIVAL_GRACE_S:.0f} s"
                        )
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(inbox.wait(), remaining)
                    continue
                await inbox.wait()
        finally:
            del self._inboxes[leg]
            # After the last batch the call returns on its own: nothing to cancel.
            if not finished and not ended.done():
                call.cancel()
            ended.add_done_callback(_log_late_failure)

    def deliver(self, frame: TokenFrame) -> None:
        self.frames += 1
        for item in frame.items:
            self.items += 1
            inbox = self._inboxes.get(item.leg)
            if inbox is None or inbox.broken is not None:
                self.strays += 1
                continue
            if item.seq != inbox.next_seq:
                # A frame went missing: end the leg rather than stream a gap.
                log.error(
                    "token channel: leg %d got batch %d, expected %d", item.leg, item.seq, inbox.next_seq
                )
                inbox.end(ChannelLost(f"batch {inbox.next_seq} of the leg was lost on its token channel"))
                continue
            inbox.next_seq += 1
            inbox.batches.append(item.batch)
            if len(inbox.batches) > MAX_UNREAD_BATCHES:
                unread = f"the client left {MAX_UNREAD_BATCHES} batches of its stream unread"
                inbox.end(ClientNotReading(unread))
                continue
            inbox.wake()

    def _read(self) -> None:
        """Everything the socket holds now. ZMQ's descriptor signals edges, not levels: it must be drained."""
        sock = self._sock
        while True:
            try:
                data = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                frame = self._decoder.decode(data)
            except msgspec.DecodeError as exc:  # not a replica of this version: say so, keep reading
                log.error("token channel: undecodable frame (%d bytes): %s", len(data), exc)
                continue
            self.deliver(frame)

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self._sock.close(linger=0)
        if self.address.startswith("ipc://"):
            Path(self.address.removeprefix("ipc://")).unlink(missing_ok=True)


async def _result(call: Awaitable[Any]) -> int:
    return int(await call)


def _log_late_failure(ended: asyncio.Future[int]) -> None:
    """A call whose leg the router already ended: its outcome changes nothing, but is retrieved."""
    if not ended.cancelled() and (exc := ended.exception()) is not None:
        log.debug("a decode call ended after its leg: %r", exc)
