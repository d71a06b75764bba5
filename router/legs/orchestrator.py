"""One request's legs: the prefill leg (if any), then the decode leg, streaming tokens.

    (a) no prefill leg: the decode replica prefills locally (no prefill pool, or the route says so)
    (b) prefill leg (max_tokens=1, do_remote_decode) -> kv_transfer_params -> decode leg with those params:
        the decode engine pulls the KV over NIXL. The prefill leg may first pull a prefix from a decode
        engine: the session's pinned previous turn (`Route.readback_params`), or a prefix a decode replica
        is first asked to pin (`Route.export_replica`; if that pins nothing, prefill computes the prefix and
        the completion says so). Legs reach each prefill replica in decision order (leg_order.py).

Legs go straight to the chosen replicas (leg_channel.py); KV export and release are Serve calls. No KV bytes
pass here; tokens come over this router's token channel (token_receiver.py). Cancelling aborts
the engine request; a decode leg that ends before its first token has the prefill engine free the KV nobody
will pull. Failover (`serve`): a request whose replica fails goes on elsewhere with the tokens streamed so
far appended to its prompt: one stream for the client (greedy: the same tokens). The request's lifecycle
(router/request/lifecycle.py) is told of each step and stage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import msgspec
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from engine.messages import (
    PIN_ONLY_KV_PARAMS,
    EngineRequest,
    PrefillResult,
    ReplicaFailed,
    Role,
    Sampling,
    ServingPath,
    StreamBatch,
    TokenBatch,
)
from router.config import LiveConfig
from router.decision.readback import block_id_groups, cut_pinned
from router.errors import NoReplicaError
from router.legs.leg_channel import LegChannel, ReplicaLost
from router.legs.leg_order import LegOrder, Ticket
from router.legs.token_receiver import ChannelLost, TokenReceiver
from router.messages import RequestSummary, Route
from router.request.lifecycle import RequestLifecycle

log = logging.getLogger(__name__)

# A replica that died or vanished mid-call (Serve calls: export, release); Serve replaces it.
REPLICA_LOST = (RayActorError, ActorDiedError, ActorUnavailableError)
# Wait before the second move of one request (and twice that before the third, ...).
MOVE_BACKOFF_S = 0.5


class LegFailed(Exception):
    """A leg's replica died or its engine failed; the request can go on elsewhere. `replica_id`: the failed
    replica ("" when not known for sure)."""

    def __init__(self, role: Role, replica_id: str, reason: str) -> None:
        super().__init__(f"{role} replica {replica_id or '(unknown)'}: {reason}")
        self.role = role
        self.replica_id = replica_id
        self.reason = reason


class Orchestrator:
    def __init__(
        self,
        legs: LegChannel,
        decode: Any,
        *,
        tokens: TokenReceiver,
        block_size: int,
        config: LiveConfig | None = None,
        export_timeout_s: float = 5.0,
    ) -> None:
        """`legs`: how legs reach their replicas. `decode`: the decode deployment's Serve handle (KV export
        and release). `tokens`: where replicas send this router's tokens. `config`: the router's settings (how
        decode legs batch their tokens; None: they do not)."""
        self._tokens = tokens
        self._config = config
        self._legs = legs
        self._decode = decode
        self._block_size = block_size
        self._export_timeout_s = export_timeout_s
        self._order = LegOrder()
        self._releases: set[asyncio.Task[None]] = set()  # held so that a running release is not collected

    def _stream(self) -> StreamBatch | None:
        if self._config is None:
            return None
        cfg = self._config.current
        return StreamBatch(tokens=cfg.stream_batch_tokens, ms=cfg.stream_batch_ms)

    async def serve(self, request: RequestLifecycle) -> AsyncIterator[TokenBatch | RequestSummary]:
        """`run` for `request`, moved to another replica when one fails: the request is told which replica
        failed, then routes the continuation (`request.reroute`). The continuation's prompt is the original
        one plus every token streamed so far, and its max_tokens what is left, so a greedy stream goes on
        exactly where it stopped. At most `request.attempts` moves."""
        prompt_token_ids, sampling, route = request.prompt, request.sampling, request.route
        generated: list[int] = []
        moves: list[str] = []

        def left() -> Sampling:  # what the continuation may still generate
            return msgspec.structs.replace(sampling, max_tokens=sampling.max_tokens - len(generated))

        while True:
            leg_id = f"{request.request_id}.{len(moves)}" if moves else request.request_id
            attempt_began = time.monotonic()
            try:
                async for event in self.run(leg_id, prompt_token_ids + generated, left(), route, request):
                    if isinstance(event, TokenBatch):
                        generated += event.token_ids
                    elif moves:
                        event = _continued(event, len(prompt_token_ids), generated, moves)
                    yield event
                return
            except LegFailed as exc:
                request.stage("failed_attempt", attempt_began, time.monotonic())
                if exc.replica_id:
                    request.replica_failed(exc.replica_id, exc.reason)
                moves.append(f"{exc} after {len(generated)} tokens")
                if sampling.constraint is not None and generated:
                    # vLLM starts a grammar at the output's first token: a continuation would start the
                    # constrained output over after what the client already has.
                    raise NoReplicaError(
                        f"{moves[-1]}; a request with a response format or a required tool call cannot "
                        "continue on another replica once its output has begun"
                    ) from exc
                if len(moves) > request.attempts:
                    raise NoReplicaError(f"no replica could finish the request: {'; '.join(moves)}") from exc
                log.warning("request %s: %s; continuing elsewhere", request.request_id, moves[-1])
                if len(moves) > 1:  # failing again at once: give the cluster a moment to replace replicas
                    await asyncio.sleep(MOVE_BACKOFF_S * (len(moves) - 1))
                route = await request.reroute(prompt_token_ids + generated, left())

    async def run(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: Sampling,
        route: Route,
        request: RequestLifecycle | None = None,
    ) -> AsyncIterator[TokenBatch | RequestSummary]:
        """Stream one attempt's token batches, then its RequestSummary. `request` is told once the prompt is
        computed (the prefill leg returned, or decode's first token after a local prefill)."""
        started = time.monotonic()
        prefill_result: PrefillResult | None = None
        path: ServingPath = "local_prefill"
        note = ""
        export = ""
        kv_params: dict[str, Any] | None = None
        headers = request.trace_headers if request is not None else None
        stage = request.stage if request is not None else lambda *_: None  # a lone attempt records none
        if route.prefill:
            if route.prefill_replica is None:
                raise NoReplicaError("the route names no prefill replica")
            # Taken before the first await: tickets follow decision order.
            ticket = self._order.take(route.prefill_replica)
            try:
                pull = route.readback_params
                if route.export_replica:
                    began = time.monotonic()
                    pull, export = await self._export(request_id, prompt_token_ids, route, headers)
                    stage("kv_export", began, time.monotonic())
                    if pull is None:
                        note = f"KV export from {route.export_replica} {export}: prefill computed the prefix"
                await ticket.turn()
                began = time.monotonic()
                prefill_result = await self._prefill_leg(
                    request_id, prompt_token_ids, route.prefill_replica, pull, ticket, headers
                )
                stage("prefill_leg", began, time.monotonic())
            finally:
                ticket.sent()
            kv_params = prefill_result.kv_transfer_params
            if kv_params:
                path = "disaggregated"
            else:
                path = "decode_full_prefill"
                note = "the prefill leg returned no KV transfer parameters; decode prefilled the whole prompt"
        prefill_done = time.monotonic()
        if prefill_result is not None and request is not None:
            request.prefill_done()

        if not kv_params and route.pin_kv:
            # With readback on, any connector params make the engine pin the request's blocks at the end.
            kv_params = dict(PIN_ONLY_KV_PARAMS)
        decode_req = EngineRequest(
            request_id=f"{request_id}-d",
            prompt_token_ids=prompt_token_ids,
            sampling=sampling,
            kv_transfer_params=kv_params,
            stream=self._stream(),
            trace_context=headers,
        )
        completion_tokens = 0
        generated: list[int] = []
        ttft_ms = 0.0
        dispatched = first_at = time.monotonic()
        # aclosing: if our consumer stops early, the decode stream is cancelled now, not at GC time.
        async with contextlib.aclosing(self._decode_leg(decode_req, route, path)) as batches:
            async for batch in batches:
                if batch.token_ids and completion_tokens == 0:
                    first_at = time.monotonic()
                    ttft_ms = (first_at - started) * 1e3
                    # With KV from a prefill leg: its pull over NIXL and the first decode step.
                    stage("first_token", dispatched, first_at)
                    if prefill_result is None and request is not None:
                        request.prefill_done()
                completion_tokens += len(batch.token_ids)
                if route.pin_kv:  # kept only to tell the router what a pin holds
                    generated += batch.token_ids
                if batch.finish_reason is None:
                    yield batch
                    continue
                # The last batch (its finish reason set), then the summary at once.
                stage("stream", first_at, time.monotonic())
                yield TokenBatch(
                    token_ids=batch.token_ids,
                    text=batch.text,
                    logprobs=batch.logprobs,
                    finish_reason=batch.finish_reason,
                )
                yield RequestSummary(
                    finish_reason=batch.finish_reason,
                    stop_reason=batch.stop_reason,
                    prompt_tokens=batch.num_prompt_tokens,
                    cached_tokens=batch.num_cached_tokens,
                    completion_tokens=completion_tokens,
                    kv_transferred_tokens=self._handed_off_tokens(kv_params, len(prompt_token_ids)),
                    predicted_cached_tokens=route.predicted_cached_tokens,
                    path=path,
                    prefill_replica=prefill_result.replica_id if prefill_result else "",
                    prefill_node=prefill_result.node_id if prefill_result else "",
                    decode_replica=batch.replica_id,
                    decode_node=batch.node_id,
                    note=note,
                    ttft_ms=ttft_ms,
                    prefill_ms=(prefill_done - started) * 1e3,
                    e2e_ms=(time.monotonic() - started) * 1e3,
                    pinned_kv=batch.pinned_kv,
                    output_token_ids=generated if batch.pinned_kv else [],
                    export=export,
                )
                return
        raise RuntimeError(f"decode stream for {request_id} ended without a final batch")

    async def _release(self, kv_params: dict[str, Any], replica: str | None, avoid: tuple[str, ...]) -> None:
        """Ask a decode replica (the chosen one, which may hold the request) to free `kv_params`' KV."""
        try:
            released = await asyncio.wait_for(
                self._decode.release.remote(kv_params, replica_hint=replica, replica_avoid=avoid),
                self._export_timeout_s,
            )
        except (*REPLICA_LOST, ReplicaFailed, TimeoutError) as exc:
            log.warning("could not release prefill KV %s: %s", kv_params.get("remote_request_id"), exc)
            return
        log.info("prefill KV %s released: %s", kv_params.get("remote_request_id"), released)

    async def _export(
        self, request_id: str, prompt: list[int], route: Route, headers: dict[str, str] | None = None
    ) -> tuple[dict[str, Any] | None, str]:
        """Have `route.export_replica` pin the prompt's first `route.export_tokens` tokens; the params that
        pull them, and the outcome."""
        tokens = route.export_tokens
        req = EngineRequest(
            request_id=f"{request_id}-x",
            # One token past the prefix: the engine computes at least one token, and this way every block of
            # the prefix is a cache hit (the one with the last token would otherwise be recomputed).
            prompt_token_ids=prompt[: tokens + 1],
            sampling=Sampling(max_tokens=1),
            trace_context=headers,
        )
        response = self._decode.export.remote(
            req, replica_hint=route.export_replica, replica_avoid=route.avoid
        )
        try:
            pinned = await asyncio.wait_for(response, self._export_timeout_s)
        except (*REPLICA_LOST, ReplicaFailed) as exc:
            log.warning("KV export for %s: decode replica %s lost: %s", request_id, route.export_replica, exc)
            return None, "lost"
        except TimeoutError:
            response.cancel()
            log.warning("KV export for %s: %s did not answer in time", request_id, route.export_replica)
            return None, "timeout"
        except BaseException:
            response.cancel()
            raise
        params = None if pinned is None else cut_pinned(pinned, tokens, self._block_size)
        return (None, "declined") if params is None else (params, "pinned")

    async def _prefill_leg(
        self,
        request_id: str,
        prompt: list[int],
        replica: str,
        pull: dict[str, Any] | None,
        ticket: Ticket | None = None,
        headers: dict[str, str] | None = None,
    ) -> PrefillResult:
        """`pull`: pinned decode KV of the prompt's prefix to pull instead of computing (readback). `ticket`:
        told once the leg is sent."""
        req = EngineRequest(
            request_id=f"{request_id}-p",
            prompt_token_ids=prompt,
            sampling=Sampling(),
            kv_transfer_params=pull,
            trace_context=headers,
        )
        try:
            response = self._legs.prefill(req, replica)
            if ticket is not None:
                ticket.sent()
            result: PrefillResult = await response
            return result
        except (ReplicaLost, ReplicaFailed) as exc:
            log.warning("prefill leg of %s: %s", request_id, exc)
            raise LegFailed("prefill", exc.replica_id, exc.reason) from exc

    async def _decode_leg(
        self, req: EngineRequest, route: Route, path: ServingPath
    ) -> AsyncGenerator[TokenBatch, None]:
        """The decode leg: the replica pushes its batches to this router's token channel
        (token_receiver.py); closing this cancels the leg, which aborts the engine request. If it ends before
        its first batch (cancelled, expired, its replica lost) after a prefill leg handed off KV, the prefill
        engine is told to free that KV now rather than when vLLM's lease runs out."""
        replica = route.decode_replica
        pulled = path != "disaggregated"
        avoid = route.avoid
        try:
            if replica is None:
                raise NoReplicaError("the route names no decode replica")
            reply_to = self._tokens.open()
            try:
                call = self._legs.generate(req, reply_to, replica)
            except BaseException:
                self._tokens.discard(reply_to)
                raise
            async with contextlib.aclosing(self._tokens.stream(reply_to, call)) as batches:
                async for batch in batches:
                    pulled = True  # a first token: the decode engine has read the KV
                    yield batch
        except (ReplicaLost, ReplicaFailed) as exc:
            log.warning("decode leg of %s: %s", req.request_id, exc)
            if exc.replica_id:
                avoid = (*avoid, exc.replica_id)  # a failed engine frees nothing
            raise LegFailed("decode", exc.replica_id, exc.reason) from exc
        except ChannelLost as exc:
            log.warning("decode leg of %s: %s", req.request_id, exc)
            # The channel lost batches: not the replica's fault, so it is not reported as failed.
            raise LegFailed("decode", "", str(exc)) from exc
        finally:
            if not pulled:
                release = self._release(req.kv_transfer_params or {}, replica, avoid)
                task = asyncio.get_running_loop().create_task(release)
                self._releases.add(task)
                task.add_done_callback(self._releases.discard)

    def _handed_off_tokens(self, kv_params: dict[str, Any] | None, prompt_len: int) -> int:
        """Prompt tokens whose KV the prefill engine handed off (its block ids x block size)."""
        groups = block_id_groups(kv_params)
        return min(len(groups[0]) * self._block_size, prompt_len) if groups else 0


def _continued(c: RequestSummary, prompt_len: int, generated: list[int], moves: list[str]) -> RequestSummary:
    """The last leg's summary, as the client's one request: the original prompt, every token streamed
    (its TTFT and end-to-end time are the request's: RequestLifecycle.turn_done)."""
    c.prompt_tokens = prompt_len
    c.cached_tokens = min(c.cached_tokens, prompt_len)
    c.completion_tokens = len(generated)
    c.note = "; ".join(filter(None, [c.note, *(f"continued after {m}" for m in moves)]))
    if c.output_token_ids:  # with readback: the pin holds the continuation's prompt and its output
        c.output_token_ids = generated
    return c
