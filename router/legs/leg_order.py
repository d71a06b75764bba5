"""Sends each prefill replica its legs in the order the router decided them.

The policy estimates a prefill replica's queue as everything dispatched to it so far, in decision order (the
engine schedules first come, first served). A leg that first waits for a KV export (a decode replica pinning
its prefix, one decode step) would otherwise reach the engine after legs decided later, and could wait behind
a long prompt the policy did not put ahead of it. So a leg is sent only once every leg decided before it for
the same replica has been sent, or `max_wait_s` has passed (an export that hangs does not hold the replica's
other requests for longer).

Tickets must be taken in decision order, with no await between the decision and `take`.
"""

from __future__ import annotations

import asyncio
import contextlib


class Ticket:
    __slots__ = ("_mine", "_order", "_prev", "_replica")

    def __init__(
        self, order: LegOrder, replica: str, prev: asyncio.Event | None, mine: asyncio.Event
    ) -> None:
        self._order, self._replica, self._prev, self._mine = order, replica, prev, mine

    async def turn(self) -> None:
        """Wait until the legs decided before this one were sent (at most the order's `max_wait_s`)."""
        if self._prev is not None and not self._prev.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._prev.wait(), self._order.max_wait_s)
        self._prev = None

    def sent(self) -> None:
        """This leg was sent (or will never be): the next one may go. Idempotent."""
        self._mine.set()
        self._order._forget(self._replica, self._mine)


class LegOrder:
    def __init__(self, max_wait_s: float = 1.0) -> None:
        self.max_wait_s = max_wait_s
        self._last: dict[str, asyncio.Event] = {}  # per replica: the latest ticket's event, until sent

    def take(self, replica: str) -> Ticket:
        mine = asyncio.Event()
        prev = self._last.get(replica)
        self._last[replica] = mine
        return Ticket(self, replica, prev, mine)

    def __len__(self) -> int:
        return len(self._last)

    def _forget(self, replica: str, event: asyncio.Event) -> None:
        if self._last.get(replica) is event:
            del self._last[replica]
