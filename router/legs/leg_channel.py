"""The router's end of the leg channels: a leg goes straight to the replica the router chose, as a LegStart on
a ZMQ PUSH socket per replica (engine/leg_server.py binds the other end), not as a Serve call, whose cost
(milliseconds of CPU in both processes) was most of a request's. Its outcome comes back on this router's token
channel (token_receiver.py) as a LegEnd.

Every leg started or cancelled in one event-loop turn goes to its replica as one LegFrame. A replica that is
gone surfaces as ReplicaLost on each of its open legs: its connection closed (a process that died; after
END_GRACE_S, for the ends a stopping replica sent last), or did not open within RECONNECT_S (an address nobody
listens on); ZMQ's own heartbeats close a connection whose peer
stopped answering (a lost node). Serve's health check covers the rest (a hung engine fails it; its replica
then stops).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Generator
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from engine.messages import (
    EngineRequest,
    LegCancel,
    LegEnd,
    LegFrame,
    LegKind,
    LegStart,
    ReplicaFailed,
    ReplyTo,
)
from router.legs.token_receiver import TokenReceiver

log = logging.getLogger(__name__)

# How long a leg may wait for its replica's connection to open before it fails over (TCP retries a lost
# connection request after 1 s: a slow network must not fail a healthy replica).
RECONNECT_S = 3.0
# ZMQ heartbeats on each connection: a peer silent for HEARTBEAT_TIMEOUT_MS is dropped (then RECONNECT_S).
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
# A stopping replica sends its last legs' ends on the token channel, then closes this connection: the two
# sockets are not ordered, so its open legs are failed only once the ends had this long to arrive.
END_GRACE_S = 0.2
SEND_HWM = 10_000


class ReplicaLost(Exception):
    """The replica running a leg can no longer be reached; the request can go on elsewhere."""

    def __init__(self, replica_id: str, reason: str) -> None:
        super().__init__(f"replica {replica_id}: {reason}")
        self.replica_id = replica_id
        self.reason = reason


class LegError(Exception):
    """A leg failed on its replica for a reason of the request's own (the replica's message)."""


class LegCall:
    """A started leg: awaitable for its outcome (a prefill leg's PrefillResult, a decode leg's batch count),
    cancellable (its engine request is aborted). Cancelling the task awaiting it cancels it too."""

    def __init__(self, link: _Link, reply_to: ReplyTo) -> None:
        self._link = link
        self.reply_to = reply_to
        self._future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._future.add_done_callback(lambda f: link.forget(self, cancel=f.cancelled()))

    def __await__(self) -> Generator[Any, None, Any]:
        return self._future.__await__()

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> None:
        self._future.cancel()

    def end(self, end: LegEnd) -> None:
        if self._future.done():
            return
        if end.failed:
            self._future.set_exception(ReplicaFailed(self._link.replica_id, end.failed))
        elif end.error:
            self._future.set_exception(LegError(end.error))
        else:
            self._future.set_result(end.result if end.result is not None else end.sent)

    def lose(self, why: ReplicaLost) -> None:
        if not self._future.done():
            self._future.set_exception(why)


class _Link:
    """The PUSH socket to one replica, its legs in flight, and whether it is connected."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        replica_id: str,
        address: str,
        tokens: TokenReceiver,
        on_gone: Callable[[_Link], None],
    ) -> None:
        self.replica_id = replica_id
        self.address = address
        self._tokens = tokens
        self._on_gone = on_gone
        self._loop = asyncio.get_running_loop()
        sock = self._sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.setsockopt(zmq.IMMEDIATE, 0)  # queue until connected: the first leg may precede the handshake
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self.connected = False
        self.closed = False
        self.lost: ReplicaLost | None = None
        self.calls: dict[int, LegCall] = {}
        self._pending: list[LegStart | LegCancel] = []
        self._check: asyncio.TimerHandle | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._monitor_fd = int(self._monitor.getsockopt(zmq.FD))
        self._loop.add_reader(self._monitor_fd, self._on_event)
        # ZMQ's descriptor signals only once the socket was read: without this first read no event is seen.
        self._on_event()
        sock.connect(address)

    def start(self, kind: LegKind, req: EngineRequest, reply_to: ReplyTo) -> LegCall:
        call = LegCall(self, reply_to)
        self.calls[reply_to.leg] = call
        self._tokens.expect_end(reply_to.leg, call.end)
        self._queue(LegStart(kind=kind, request=req, reply_to=reply_to))
        if not self.connected:
            self._watch()
        return call

    def forget(self, call: LegCall, *, cancel: bool) -> None:
        """The call is done: its end is expected no more; cancelled, its replica is told."""
        self._tokens.forget(call.reply_to.leg)
        if self.calls.pop(call.reply_to.leg, None) is not None and cancel and self.lost is None:
            self._queue(LegCancel(reply_to=call.reply_to))

    def _queue(self, item: LegStart | LegCancel) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(item)

    def _flush(self) -> None:
        items, self._pending = self._pending, []
        if not items or self.closed:
            return
        try:
            self._sock.send(self._encoder.encode(LegFrame(items=items)), zmq.NOBLOCK)
        except zmq.Again:  # SEND_HWM frames queued: the replica is not reading
            self.lose(f"its leg channel holds {SEND_HWM} unread frames")

    def _on_event(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_CONNECTED:
                self.connected = True
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                # A live replica never closes the connection: its process died, or heartbeats dropped it.
                self.connected = False
                if self.calls:
                    self._loop.call_later(END_GRACE_S, self._closed_with_calls)
                    continue
                self._watch()

    def _closed_with_calls(self) -> None:
        if self.closed:
            return
        if self.calls:
            self.lose(f"its leg channel ({self.address}) closed")
        else:  # its legs all ended: the next leg reconnects (or finds the replica gone)
            self._watch()

    def _watch(self) -> None:
        """Check in RECONNECT_S that the link is connected."""
        if self._check is None:
            self._check = self._loop.call_later(RECONNECT_S, self._checked)

    def _checked(self) -> None:
        self._check = None
        if self.connected or self.lost is not None:
            return
        if self.calls:
            self.lose(f"its leg channel ({self.address}) did not open in {RECONNECT_S} s")
        else:  # nothing in flight: drop the link; the next leg opens a new one
            self.close()

    def lose(self, reason: str) -> None:
        self.lost = ReplicaLost(self.replica_id, reason)
        log.warning("replica %s lost with %d legs open: %s", self.replica_id, len(self.calls), reason)
        for call in list(self.calls.values()):
            call.lose(self.lost)
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._check is not None:
            self._check.cancel()
            self._check = None
        if not self._loop.is_closed():
            self._loop.remove_reader(self._monitor_fd)
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._on_gone(self)


class LegChannel:
    """Start legs on the replicas the router chose. `address_of(replica_id)`: the replica's leg channel, as
    the registry lists it (None: not listed)."""

    def __init__(
        self,
        tokens: TokenReceiver,
        address_of: Callable[[str], str | None],
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self._tokens = tokens
        self._address_of = address_of
        self._ctx = context or zmq.Context.instance()
        self._links: dict[str, _Link] = {}

    def prefill(self, req: EngineRequest, replica_id: str) -> LegCall:
        """Compute `req`'s prompt on `replica_id`; the call's outcome is its PrefillResult."""
        return self._start("prefill", req, self._tokens.open(batches=False), replica_id)

    def generate(self, req: EngineRequest, reply_to: ReplyTo, replica_id: str) -> LegCall:
        """Stream `req`'s tokens to `reply_to` (opened on this router's TokenReceiver) from `replica_id`;
        the call's outcome is how many batches it sent."""
        return self._start("generate", req, reply_to, replica_id)

    def _start(self, kind: LegKind, req: EngineRequest, reply_to: ReplyTo, replica_id: str) -> LegCall:
        link = self._links.get(replica_id)
        if link is None:
            address = self._address_of(replica_id)
            if not address:
                raise ReplicaLost(replica_id, "it is not in the registry")
            link = self._links[replica_id] = _Link(self._ctx, replica_id, address, self._tokens, self._drop)
        return link.start(kind, req, reply_to)

    def _drop(self, link: _Link) -> None:
        if self._links.get(link.replica_id) is link:
            del self._links[link.replica_id]

    def close(self) -> None:
        """The router is stopping: every open leg ends as lost."""
        for link in list(self._links.values()):
            link.lose("the router is stopping")
