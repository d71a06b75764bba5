"""The decode role's engine: streams a request's tokens in batches (pulling its prompt's KV from a prefill
engine when handed transfer parameters), pins a cached prefix for a prefill engine to pull (KV export), and
frees a prefill engine's KV that no decode will pull (release)."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator
from typing import Any

from engine.host import EngineHost
from engine.messages import (
    PIN_ONLY_KV_PARAMS,
    EngineRequest,
    ReplicaFailed,
    Sampling,
    StreamBatch,
    TokenBatch,
    TokenLogprob,
)
from engine.spec import EngineSpec

log = logging.getLogger(__name__)

# Prefill request ids remembered by `release` (see `_hand`): far more than can be in flight at once.
_HANDED_KEPT = 65536
# When an idle decode engine steps after a `release` (see there): the NIXL handshake takes ~0.1 s on loopback.
_KICK_DELAYS_S = (0.25, 1.0, 3.0)


class DecodeEngine(EngineHost):
    def __init__(self, spec: EngineSpec, *, replica_id: str, node_id: str, node_ip: str) -> None:
        super().__init__(spec, replica_id=replica_id, node_id=node_id, node_ip=node_ip)
        # Prefill requests whose KV this engine was handed (pulled, or released by vLLM's abort path):
        # `release` must not tell their prefill engine a second time. Bounded: only recent ids can race.
        self._handed: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._kicks: set[asyncio.Task[None]] = set()

    async def generate(self, req: EngineRequest) -> AsyncIterator[TokenBatch]:
        """Generate and stream tokens in batches: the first token at once (TTFT), then by count or
        time, whichever comes first (engine.batched_outputs gathers them). Cancelling the iterator
        aborts the request in the engine."""
        kv = req.kv_transfer_params
        if kv and kv.get("do_remote_prefill") and not self._hand(str(kv.get("remote_request_id", ""))):
            # Released already (the router gave this request up, then it arrived anyway): the prefill
            # engine may have reused those blocks, so compute the prompt here instead of pulling them.
            log.warning("%s: its prefill KV was released; computing the prompt locally", req.request_id)
            kv = None
        params = self._sampling_params(req.sampling, kv)
        want_logprobs = req.sampling.logprobs
        async for out in self._outputs(req, params, req.stream or StreamBatch(tokens=1, ms=0.0)):
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            logprobs = (
                None
                if want_logprobs is None
                else _logprobs(completion.token_ids, completion.logprobs or [], want_logprobs)
            )
            if out.finished:
                yield TokenBatch(
                    token_ids=ids,
                    text=completion.text,
                    logprobs=logprobs,
                    finish_reason="length" if completion.finish_reason == "length" else "stop",
                    stop_reason=completion.stop_reason if isinstance(completion.stop_reason, str) else None,
                    num_prompt_tokens=len(req.prompt_token_ids),
                    num_cached_tokens=int(out.num_cached_tokens or 0),
                    replica_id=self.replica_id,
                    node_id=self.node_id,
                    # Set only by an engine with KV readback on, for a request given connector params.
                    pinned_kv=out.kv_transfer_params or None,
                )
                return
            if ids:
                yield TokenBatch(
                    token_ids=ids, text=completion.text, replica_id=self.replica_id, logprobs=logprobs
                )
        raise RuntimeError(f"engine stream for {req.request_id} ended without a finished output")

    async def export(self, req: EngineRequest) -> dict[str, Any] | None:
        """KV export (decode engines, readback on): pin the prompt's blocks for a prefill engine to pull, and
        say where (vLLM's params; None: the engine pinned nothing). The prompt is a prefix this engine holds
        in its prefix cache plus one token: a one-token request that computes that token and, finishing
        with connector params, leaves its blocks pinned for the TTL (or until read)."""
        final = await self._one_token(req, dict(PIN_ONLY_KV_PARAMS))
        return final.kv_transfer_params or None

    async def release(self, kv_transfer_params: dict[str, Any]) -> bool:
        """Tell a prefill engine to free the KV it keeps for a decode that will never pull it (the request
        was cancelled, expired or moved before its decode leg reached an engine); without this the blocks
        stay held until vLLM's KV lease runs out (30 s). False: this engine was handed that request itself,
        and vLLM's abort path has told the prefill engine already."""
        if (reason := self.failure()) is not None:
            raise ReplicaFailed(self.replica_id, reason)
        remote_id = str(kv_transfer_params.get("remote_request_id", ""))
        if not self._hand(remote_id):
            return False
        # vLLM's own hook for a transfer the serving layer rejected: a request aborted before it is
        # scheduled, whose connector notifies the prefill engine without reading.
        await self._llm.notify_kv_transfer_request_rejected(f"release-{remote_id}", kv_transfer_params)
        if self._inflight == 0:
            # The notification goes out at an engine step, and the first one to a prefill engine only once
            # the NIXL handshake with it is done: an idle engine has no next step, so make a few.
            task = asyncio.get_running_loop().create_task(self._step_soon(remote_id))
            self._kicks.add(task)
            task.add_done_callback(self._kicks.discard)
        return True

    async def _step_soon(self, tag: str) -> None:
        """A few one-token engine steps over the next seconds (a one-token prompt caches no block)."""
        for i, delay in enumerate(_KICK_DELAYS_S):
            await asyncio.sleep(delay)
            req = EngineRequest(
                request_id=f"step-{tag}-{i}", prompt_token_ids=[0], sampling=Sampling(max_tokens=1)
            )
            try:
                async for _ in self._outputs(req, self._sampling_params(req.sampling, None)):
                    pass
            except ReplicaFailed:
                return  # the replica is being replaced: its failure is reported by the watchdog

    def _hand(self, remote_request_id: str) -> bool:
        """Record that the prefill request's KV has been handed to this engine; False if it already was."""
        if not remote_request_id or remote_request_id in self._handed:
            return False
        self._handed[remote_request_id] = None
        if len(self._handed) > _HANDED_KEPT:
            self._handed.popitem(last=False)
        return True


def _logprobs(token_ids: list[int], per_token: list[dict[int, Any]], k: int) -> list[TokenLogprob]:
    """vLLM's per-token logprob dicts (the sampled token and the top k, by rank) as messages."""
    out = []
    for token_id, ranked in zip(token_ids, per_token, strict=True):
        chosen = ranked[token_id]
        top = sorted(
            (lp.rank, tid, lp.decoded_token or "", lp.logprob) for tid, lp in ranked.items() if lp.rank <= k
        )
        out.append(
            TokenLogprob(
                token_id=token_id,
                token=chosen.decoded_token or "",
                logprob=chosen.logprob,
                top=[(tid, tok, lp) for _, tid, tok, lp in top],
            )
        )
    return out
