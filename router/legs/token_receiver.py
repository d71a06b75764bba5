"""The router's end of the token channels: one ZMQ PULL socket that every engine replica pushes this router's
tokens and leg outcomes to (engine/token_sender.py), and an inbox per decode leg that each frame's items are
sorted into.

A leg is started on its replica with this receiver's address as `reply_to` (router/legs/leg_channel.py). A
decode leg's tokens come here, then its LegEnd (how many batches it sent, or its failure); a prefill leg sends
only its LegEnd. The leg's call (a LegCall) resolves with that end; cancelling it aborts the engine request.
Batches that wait for a slow reader are handed on as one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import random
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Protocol

import msgspec
import zmq

from engine.messages import LegEnd, ReplyTo, TokenBatch, TokenFrame
from engine.pull_socket import bind_pull, frames, unlink
from router.errors import ClientNotReading

log = logging.getLogger(__name__)

# How long the batches of a leg that has ended may take to arrive. Its LegEnd follows them on the same socket,
# so a batch missing then is lost; the grace only covers a stand-in that reports the end another way.
ARRIVAL_GRACE_S = 5.0
# Batches a leg may hold unread (its client is not reading) before it is ended: its engine request is
# aborted rather than its tokens held at everyone else's expense.
MAX_UNREAD_BATCHES = 256
RECV_HWM = 100_000


class ChannelLost(Exception):
    """A decode leg's batches did not all arrive: the request can go on elsewhere."""


class LegCall(Protocol):
    """A started leg (router/legs/leg_channel.py): awaitable for its result, cancellable."""

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
        self._sock, self.address = bind_pull(self._ctx, host, hwm=RECV_HWM)
        self._fd = int(self._sock.getsockopt(zmq.FD))
        self._inboxes: dict[int, _Inbox] = {}
        # Who is told when a leg ends (router/legs/leg_channel.py), by leg.
        self._ends: dict[int, Callable[[LegEnd], None]] = {}
        # From a random start: a replica may still run legs of an earlier router at this same address.
        self._legs = itertools.count(random.getrandbits(62))
        self._decoder = msgspec.msgpack.Decoder(TokenFrame)
        # The loop whose reader callback drains the socket (no task: a callback per readable socket).
        self._loop: asyncio.AbstractEventLoop | None = None
        self.frames = 0
        self.items = 0
        self.strays = 0  # items for a leg no longer listening (it ended, moved or was cancelled)

    def open(self, *, batches: bool = True) -> ReplyTo:
        """Where a new leg's outcome goes. With `batches` (a decode leg) its tokens are kept from now on, even
        those that come first, and `stream` reads them (call it at once: it is what forgets the leg)."""
        reply_to = ReplyTo(address=self.address, leg=next(self._legs))
        if batches:
            self._inboxes[reply_to.leg] = _Inbox()
        return reply_to

    def discard(self, reply_to: ReplyTo) -> None:
        """Forget a leg that was opened but never started."""
        self._inboxes.pop(reply_to.leg, None)
        self._ends.pop(reply_to.leg, None)

    def expect_end(self, leg: int, on_end: Callable[[LegEnd], None]) -> None:
        """Call `on_end` with the leg's LegEnd when it comes (once), unless `forget` is called first."""
        self._ends[leg] = on_end
        self._listen()

    def forget(self, leg: int) -> None:
        self._ends.pop(leg, None)

    def _listen(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop = loop
            loop.add_reader(self._fd, self._read)
            self._read()  # what came before the reader was added

    async def stream(self, reply_to: ReplyTo, call: LegCall) -> AsyncGenerator[TokenBatch, None]:
        """The batches of the decode leg `reply_to` in order, its last one (finish_reason set) included.
        Raises what `call` raises (the leg failed), ChannelLost or ClientNotReading. Closing it cancels
        `call`."""
        self._listen()
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
                    while inbox.batches and batch.finish_reason is None:
                        # The client reads slower than the engine streams (a busy router): one message
                        # for what waits, not a message per engine batch.
                        batch = _joined(batch, inbox.batches.popleft())
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
            if isinstance(item, LegEnd):
                on_end = self._ends.pop(item.leg, None)
                if on_end is None:
                    self.strays += 1
                else:
                    on_end(item)
                continue
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
        for frame in frames(self._sock, self._decoder, "token channel"):
            self.deliver(frame)

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self._sock.close(linger=0)
        unlink(self.address)


def _joined(first: TokenBatch, then: TokenBatch) -> TokenBatch:
    """Two consecutive batches of one leg as one: `then`'s fields (a final batch's end, its replica), the
    tokens, text and log probabilities of both."""
    logprobs = None if then.logprobs is None else (first.logprobs or []) + then.logprobs
    return msgspec.structs.replace(
        then, token_ids=first.token_ids + then.token_ids, text=first.text + then.text, logprobs=logprobs
    )


async def _result(call: Awaitable[Any]) -> int:
    return int(await call)


def _log_late_failure(ended: asyncio.Future[int]) -> None:
    """A call whose leg the router already ended: its outcome changes nothing, but is retrieved."""
    if not ended.cancelled() and (exc := ended.exception()) is not None:
        log.debug("a decode call ended after its leg: %r", exc)
