"""The prefill replica: computes prompts and keeps their KV for a decode replica to pull over NIXL."""

from __future__ import annotations

from engine.messages import EngineRequest, PrefillResult
from engine.replica import EngineReplica


class PrefillServer(EngineReplica):
    async def prefill(self, req: EngineRequest) -> PrefillResult:
        return await self.host.prefill(req)
