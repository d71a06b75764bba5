"""The decode replica: pulls a prompt's KV from a prefill replica (or prefills locally when it has no
transfer parameters) and streams generated tokens back in batches."""

from __future__ import annotations

from collections.abc import AsyncIterator

from engine.messages import EngineRequest, TokenBatch
from engine.replica import EngineReplica


class DecodeServer(EngineReplica):
    # replica_hint: the router's choice, read by its Serve request router (router/serve_request_router.py).
    async def generate(
        self, req: EngineRequest, replica_hint: str | None = None
    ) -> AsyncIterator[TokenBatch]:
        async for batch in self.host.generate(req):
            yield batch
