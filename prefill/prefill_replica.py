"""The prefill replica: computes prompts and keeps their KV for a decode replica to pull over NIXL."""

from __future__ import annotations

from engine.double import DoubleEngineHost
from engine.messages import EngineRequest, PrefillResult
from engine.replica import EngineReplica
from engine.tracing import child_span
from prefill.engine import PrefillEngine


class PrefillReplica(EngineReplica):
    HOST = PrefillEngine
    host: PrefillEngine | DoubleEngineHost

    # replica_hint: the router's choice, read by its Serve request router (router/legs/replica_hint.py).
    async def prefill(
        self, req: EngineRequest, replica_hint: str | None = None, replica_avoid: tuple[str, ...] = ()
    ) -> PrefillResult:
        replica = self.host.replica_id
        with child_span(self.tracer, "prefill_replica.prefill", req.trace_context, replica=replica):
            return await self.host.prefill(req)
