"""An engine replica's end of the leg channels: routers send legs straight to the replica over ZMQ
(router/legs/leg_channel.py), not as Serve calls, which cost milliseconds of CPU on both sides per request.

One PULL socket per replica takes every router's LegFrames. Each LegStart runs as a task; its outcome goes
back to the router on the token channel as a LegEnd, after its last batch. A LegCancel cancels the task, which
aborts the engine request; so does the router's going away (engine/token_sender.py). Serve still places,
health-checks and replaces the replica; since it no longer sees these legs, draining them is the replica's
own job (`drain`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import msgspec
import zmq

from engine.messages import (
    EngineRequest,
    LegCancel,
    LegEnd,
    LegFrame,
    LegKind,
    LegStart,
    PrefillResult,
    ReplicaFailed,
    ReplyTo,
)
from engine.pull_socket import bind_pull, frames, unlink
from engine.token_sender import TokenSender

log = logging.getLogger(__name__)

# A leg's work: a prefill leg returns its PrefillResult, a decode leg how many batches it streamed.
Handler = Callable[[EngineRequest, ReplyTo], Coroutine[Any, Any, PrefillResult | int]]
# How long a draining replica keeps taking legs after it told the registry: routers poll it every second.
DRAIN_NOTICE_S = 2.5
RECV_HWM = 100_000


class LegServer:
    def __init__(
        self,
        handlers: Mapping[LegKind, Handler],
        tokens: TokenSender,
        host: str | None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        """`host`: the address routers reach this replica at (None or loopback: an ipc socket)."""
        self._handlers = handlers
        self._tokens = tokens
        self._sock, self.address = bind_pull(context or zmq.Context.instance(), host, hwm=RECV_HWM)
        self._fd = int(self._sock.getsockopt(zmq.FD))
        self._decoder = msgspec.msgpack.Decoder(LegFrame)
        self._running: dict[ReplyTo, asyncio.Task[Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last_start = 0.0
        self._idle = asyncio.Event()
        self._idle.set()
        tokens.on_router_lost(self._router_lost)

    def start(self) -> None:
        """Take legs from now on (on the running loop)."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._fd, self._read)
        self._read()

    @property
    def running(self) -> int:
        return len(self._running)

    async def drain(self, notice_s: float = DRAIN_NOTICE_S) -> None:
        """Return once no leg runs and none started for `notice_s`, counted from this call at the earliest
        (routers stop sending once they see the replica draining in the registry): then no router still
        counts on this replica."""
        began = time.monotonic()
        while True:
            await self._idle.wait()
            quiet = time.monotonic() - max(self._last_start, began)
            if quiet >= notice_s:
                return
            await asyncio.sleep(notice_s - quiet)

    def _read(self) -> None:
        for frame in frames(self._sock, self._decoder, "leg channel"):
            for item in frame.items:
                if isinstance(item, LegCancel):
                    self._cancel(item)
                    continue
                try:
                    self._start(item)
                except Exception as exc:  # one bad leg must not stop the others being read
                    log.exception("leg %d from %s not started", item.reply_to.leg, item.reply_to.address)
                    self._send(item.reply_to, LegEnd(leg=item.reply_to.leg, sent=0, error=repr(exc)))

    def _start(self, leg: LegStart) -> None:
        assert self._loop is not None
        handler = self._handlers.get(leg.kind)
        if handler is None:
            raise ValueError(f"this replica runs {'/'.join(self._handlers)} legs, not {leg.kind}")
        task: asyncio.Task[Any] = self._loop.create_task(handler(leg.request, leg.reply_to))
        self._running[leg.reply_to] = task
        self._last_start = time.monotonic()
        self._idle.clear()
        task.add_done_callback(lambda t: self._ended(leg.reply_to, t))

    def _cancel(self, cancel: LegCancel) -> None:
        task = self._running.get(cancel.reply_to)
        if task is not None:
            task.cancel()

    def _router_lost(self, address: str) -> None:
        """The router at `address` is gone: nobody reads its legs' tokens, so their engine requests stop."""
        gone = [task for reply_to, task in self._running.items() if reply_to.address == address]
        if gone:
            log.warning("cancelling %d legs of the router at %s: it is gone", len(gone), address)
        for task in gone:
            task.cancel()

    def _ended(self, reply_to: ReplyTo, task: asyncio.Task[Any]) -> None:
        if self._running.get(reply_to) is task:
            del self._running[reply_to]
        if not task.cancelled():  # cancelled: the router gave the leg up and expects nothing more
            self._send(reply_to, _outcome(reply_to, task))
        # Only once its end is queued: a drain waiting for this must not close the channel before it is sent.
        if not self._running:
            self._idle.set()

    def _send(self, reply_to: ReplyTo, end: LegEnd) -> None:
        try:
            self._tokens.end(reply_to, end)
        except Exception:  # e.g. an address ZMQ refuses: that router's legs are lost to it either way
            log.exception("could not send the end of leg %d to %s", reply_to.leg, reply_to.address)

    def close(self) -> None:
        """Stop taking legs and cancel those running (their engine requests are aborted)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        for task in list(self._running.values()):
            task.cancel()
        self._sock.close(linger=0)
        unlink(self.address)


def _outcome(reply_to: ReplyTo, task: asyncio.Task[Any]) -> LegEnd:
    exc = task.exception()
    if exc is None:
        outcome = task.result()
        if isinstance(outcome, PrefillResult):
            return LegEnd(leg=reply_to.leg, sent=0, result=outcome)
        return LegEnd(leg=reply_to.leg, sent=outcome)
    if isinstance(exc, ReplicaFailed):
        return LegEnd(leg=reply_to.leg, sent=0, failed=exc.reason)
    log.error("leg %d from %s failed", reply_to.leg, reply_to.address, exc_info=exc)
    return LegEnd(leg=reply_to.leg, sent=0, error=f"{type(exc).__name__}: {exc}")
