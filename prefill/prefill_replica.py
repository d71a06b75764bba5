"""The prefill replica: computes prompts and keeps their KV for a decode replica to pull over NIXL. Legs
come from routers over the replica's leg channel (engine/leg_server.py)."""

from __future__ import annotations

from collections.abc import Mapping

from engine.double import DoubleEngineHost
from engine.leg_server import Handler
from engine.messages import EngineRequest, LegKind, PrefillResult, ReplyTo
from engine.replica import EngineReplica
from engine.tracing import child_span
from prefill.engine import PrefillEngine


class PrefillReplica(EngineReplica):
    HOST = PrefillEngine
    host: PrefillEngine | DoubleEngineHost

    def leg_handlers(self) -> Mapping[LegKind, Handler]:
        return {"prefill": self.prefill}

    async def prefill(self, req: EngineRequest, reply_to: ReplyTo | None = None) -> PrefillResult:
        replica = self.host.replica_id
        with child_span(self.tracer, "prefill_replica.prefill", req.trace_context, replica=replica):
            return await self.host.prefill(req)
