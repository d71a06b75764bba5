"""The prefill role's engine: computes a prompt and keeps its KV for a decode engine to pull over NIXL."""

from __future__ import annotations

import time
from typing import Any

from engine.host import EngineHost
from engine.messages import EngineRequest, PrefillResult

# The prefill leg asks vLLM to keep the prompt's KV for a remote decode (vLLM's NixlConnector protocol).
_PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class PrefillEngine(EngineHost):
    async def prefill(self, req: EngineRequest) -> PrefillResult:
        """The prefill leg: compute the prompt, keep its KV for a remote decode, return where it is. Its one
        sampled token is discarded: decode samples the first token itself."""
        kv = dict(_PREFILL_KV_PARAMS)
        if req.kv_transfer_params:
            # KV readback: pull the prefix a decode engine keeps pinned, compute the rest.
            kv.update(req.kv_transfer_params)
            kv["do_remote_decode"], kv["do_remote_prefill"] = True, False
        started = time.monotonic()
        final = await self._one_token(req, kv)
        return PrefillResult(
            request_id=req.request_id,
            replica_id=self.replica_id,
            node_id=self.node_id,
            kv_transfer_params=final.kv_transfer_params,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_cached_tokens=int(final.num_cached_tokens or 0),
            prefill_ms=(time.monotonic() - started) * 1e3,
        )
