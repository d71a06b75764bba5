"""The decode replica: pulls a prompt's KV from a prefill replica (or prefills locally when it has no
transfer parameters) and streams generated tokens in batches to the router that asked, over that router's
token channel (engine/token_sender.py). Legs come from routers over the replica's leg channel
(engine/leg_server.py); KV release and export stay Serve calls (rare, and Serve checks their replica)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

from opentelemetry.trace import Span

from decode.engine import DecodeEngine
from engine.double import DoubleEngineHost
from engine.leg_server import Handler
from engine.messages import EngineRequest, LegKind, ReplyTo, TokenBatch
from engine.replica import EngineReplica
from engine.tracing import child_span


class DecodeReplica(EngineReplica):
    HOST = DecodeEngine
    host: DecodeEngine | DoubleEngineHost

    def leg_handlers(self) -> Mapping[LegKind, Handler]:
        return {"generate": self.generate}

    async def generate(self, req: EngineRequest, reply_to: ReplyTo) -> int:
        """Stream the request's batches to the router's token channel (`reply_to`); returns how many were
        sent once the last one is. Cancelled (the router gave the request up): the engine aborts it."""
        replica = self.host.replica_id
        with child_span(self.tracer, "decode_replica.generate", req.trace_context, replica=replica) as span:
            batches = self.host.generate(req)
            return await self.tokens.stream(reply_to, batches if span is None else _marked(batches, span))

    # replica_hint: the router's choice, read by its Serve request router (router/legs/replica_hint.py).
    # replica_avoid: failed replicas the Serve request router must not choose (read there, unused here).
    async def release(
        self,
        kv_transfer_params: dict[str, Any],
        replica_hint: str | None = None,
        replica_avoid: tuple[str, ...] = (),
    ) -> bool:
        """Free a prefill engine's KV that no decode leg will pull (engine/host.py `release`)."""
        return await self.host.release(kv_transfer_params)

    async def export(
        self, req: EngineRequest, replica_hint: str | None = None, replica_avoid: tuple[str, ...] = ()
    ) -> dict[str, Any] | None:
        """KV export: pin a prefix this replica holds for a prefill replica to pull (router/decision/).
        Only on the replica the router chose: Serve spills a hinted call to another replica when the hinted
        one is busy, and that one would compute the whole prefix, stalling its decodes for nothing."""
        if replica_hint != self.host.replica_id:
            return None
        replica = self.host.replica_id
        with child_span(self.tracer, "decode_replica.export", req.trace_context, replica=replica):
            return await self.host.export(req)


async def _marked(batches: AsyncIterator[TokenBatch], span: Span) -> AsyncIterator[TokenBatch]:
    """`batches`, with the first token's arrival as an event of the leg's span (after a KV pull: the pull and
    the first decode step are done)."""
    first = True
    async for batch in batches:
        if first and batch.token_ids:
            span.add_event("first_token")
            first = False
        yield batch
