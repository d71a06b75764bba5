"""A stand-in for the decode deployment's Serve handle, for router tests without engines: its `generate`
sends a request's batches over the real token channel to the router's receiver, as a decode replica does
(decode/decode_replica.py). The batches come from the test. tests/e2e runs the real replicas."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from engine.messages import EngineRequest, ReplyTo, TokenBatch
from engine.token_sender import TokenSender
from router.legs.token_receiver import TokenReceiver

Batches = Callable[[EngineRequest, str | None], AsyncIterator[TokenBatch]]

# Every receiver and sender a test made: closed after it (tests/conftest.py).
OPEN: list[TokenReceiver | TokenSender] = []


def token_receiver() -> TokenReceiver:
    receiver = TokenReceiver()
    OPEN.append(receiver)
    return receiver


class StandInDecodePool:
    """`batches(request, replica_hint)`: what the replica the call reached streams for the request."""

    def __init__(self, batches: Batches) -> None:
        self._batches = batches
        self._sender = TokenSender()
        OPEN.append(self._sender)

    @property
    def generate(self) -> StandInDecodePool:
        return self

    def remote(
        self,
        req: EngineRequest,
        reply_to: ReplyTo,
        replica_hint: str | None = None,
        replica_avoid: tuple[str, ...] = (),
    ) -> asyncio.Task[int]:
        return asyncio.ensure_future(self._sender.stream(reply_to, self._batches(req, replica_hint)))


def close_all() -> None:
    while OPEN:
        OPEN.pop().close()
