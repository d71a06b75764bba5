"""A stand-in for the router's leg channel (router/legs/leg_channel.py), for router tests without engines: a
decode leg's batches come from the test and go over the real token channel to the router's receiver, as a
decode replica sends them (decode/decode_replica.py); a prefill leg's result comes from the test.
tests/router/legs/test_leg_channel.py specifies the real channel; tests/e2e runs the real replicas."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from engine.messages import EngineRequest, PrefillResult, ReplyTo, TokenBatch
from engine.token_sender import TokenSender
from router.legs.token_receiver import TokenReceiver

Batches = Callable[[EngineRequest, str], AsyncIterator[TokenBatch]]
Prefill = Callable[[EngineRequest, str], Awaitable[PrefillResult]]

# Every receiver and sender a test made: closed after it (tests/conftest.py).
OPEN: list[TokenReceiver | TokenSender] = []


def token_receiver() -> TokenReceiver:
    receiver = TokenReceiver()
    OPEN.append(receiver)
    return receiver


class StandInLegs:
    """`batches(request, replica_id)`: what the decode replica streams for the request; `prefill(request,
    replica_id)`: what a prefill leg returns (None: there is no prefill pool)."""

    def __init__(self, batches: Batches, prefill: Prefill | None = None) -> None:
        self._batches = batches
        self._prefill = prefill
        self._sender = TokenSender()
        OPEN.append(self._sender)

    def generate(self, req: EngineRequest, reply_to: ReplyTo, replica_id: str) -> asyncio.Task[int]:
        return asyncio.ensure_future(self._sender.stream(reply_to, self._batches(req, replica_id)))

    def prefill(self, req: EngineRequest, replica_id: str) -> asyncio.Future[PrefillResult]:
        assert self._prefill is not None, "a prefill leg, with no prefill pool"
        return asyncio.ensure_future(self._prefill(req, replica_id))


def close_all() -> None:
    while OPEN:
        OPEN.pop().close()
