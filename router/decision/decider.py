"""Admission and replica choice: decides where a request goes; the legs (router/legs/) send it.

admission (RESOURCE_EXHAUSTED beyond `overload_queue_tokens` in flight)
  -> hash the prompt's blocks (per session: a new turn hashes only its new blocks; a prompt intake encoded
     in full comes hashed)
  -> what a prefill leg could pull instead of computing (router.decision.readback.KvPulls), if readback is on
  -> the policy chooses prefill and decode replicas jointly from the KV index and the load
  -> dispatch is counted (load), the route goes to the legs with the replica hints (and, with
     readback, what the legs pull, export and pin).
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from engine.messages import Sampling
from router.block_hash import SessionHasher
from router.config import LiveConfig
from router.decision.readback import KvPulls, PullPlan
from router.errors import NoReplicaError, Overloaded
from router.messages import Decision, PromptReuse, Route, RouteRequest
from router.policy.types import Policy
from router.sessions import Sessions
from router.view.cluster_view import ClusterView

log = logging.getLogger(__name__)


class _Admitted(msgspec.Struct):
    tokens: int
    req: RouteRequest
    decision: Decision
    policy: Policy  # the one that decided: it hears of the request's end


class Decider:
    def __init__(
        self,
        *,
        view: ClusterView,
        policy: Policy,
        block_size: int,
        has_prefill_pool: bool,
        config: LiveConfig,
        pulls: KvPulls | None = None,
        sessions: Sessions | None = None,
    ) -> None:
        """`pulls`: KV readback and exports (None: off). `sessions`: the router's session state (the block
        hasher keeps each session's hashed prompt there)."""
        self._view = view
        self._policy = policy
        self._block_size = block_size
        self._has_prefill = has_prefill_pool
        self._hasher = SessionHasher(block_size, sessions)
        self._pulls = pulls
        self._config = config
        self._admitted: dict[str, _Admitted] = {}
        self._admitted_tokens = 0

    def route(
        self,
        request_id: str,
        session_id: str | None,
        prompt: list[int],
        sampling: Sampling,
        reuse: PromptReuse | None = None,
        block_hashes: list[int] | None = None,
    ) -> Route:
        """`reuse`: which of the prompt's ids were copied from the session's previous prompt (by the chat
        encoder or the token-id sessions). `block_hashes`: the prompt's, when intake hashed it."""
        limit = self._config.current.overload_queue_tokens
        # The limit is the cluster's: the other routers' admitted tokens count, as they last reported them.
        in_flight = self._admitted_tokens + self._view.peer_admitted_tokens
        if in_flight and in_flight + len(prompt) > limit:
            raise Overloaded(
                f"cluster overloaded: {in_flight} prompt tokens in flight (limit {limit}); retry later"
            )
        pulls = self._pulls
        offer = None if pulls is None else pulls.offer(session_id, prompt, reuse)
        req = RouteRequest(
            request_id=request_id,
            session_id=session_id,
            num_prompt_tokens=len(prompt),
            block_hashes=self._hasher.hash(session_id, prompt, reuse, block_hashes),
            block_size=self._block_size,
            max_tokens=sampling.max_tokens,
            readback=None if offer is None else offer.readback,
            export_ttl_s=None if pulls is None else pulls.export_ttl_s,
            other_routers=bool(self._view.peers),
        )
        prefill = self._view.load.views("prefill") if self._has_prefill else []
        decode = self._view.load.views("decode")
        if not decode:
            # Legs go to the replica chosen here: with none registered (yet) there is nowhere to send one.
            raise NoReplicaError("no decode replica is registered yet")
        d = self._policy.choose(req, prefill, decode, self._view.index)  # NoReplicaError: UNAVAILABLE
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "%s: %s, prefill %s, decode %s, cost %.4g s %s",
                request_id,
                d.reason,
                d.prefill or "-",
                d.decode,
                d.cost,
                msgspec.structs.asdict(d.terms) if d.terms is not None else {},
            )
        self._view.load.on_dispatch(req, d)
        self._admit(request_id, len(prompt), req, d, self._policy)
        plan = PullPlan() if pulls is None else pulls.plan(d, offer, session_id, decode)
        return Route(
            prefill=d.prefill is not None,
            prefill_replica=d.prefill,
            decode_replica=d.decode,
            predicted_cached_tokens=d.predicted_cached_tokens,
            readback_params=plan.readback_params,
            readback_tokens=d.readback_tokens,
            readback_replica=plan.readback_replica,
            pin_kv=plan.pin_kv,
            export_replica=plan.export_replica,
            export_tokens=plan.export_tokens,
            reason=d.reason,
            terms=d.terms,
            avoid=self._view.failed_ids(),
        )

    @property
    def admitted_tokens(self) -> int:
        """Prompt tokens of this router's requests in flight (admission counts them; the others add them)."""
        return self._admitted_tokens

    def use_policy(self, policy: Policy) -> None:
        """Decide with `policy` from the next request on; requests in flight end with the one that decided."""
        self._policy = policy

    def _admit(self, request_id: str, tokens: int, req: RouteRequest, d: Decision, policy: Policy) -> None:
        self._admitted[request_id] = _Admitted(tokens, req, d, policy)
        self._admitted_tokens += tokens

    def turn_done(
        self,
        session_id: str | None,
        decode_replica: str,
        pinned_kv: dict[str, Any] | None,
        prompt: list[int],
        output: list[int],
    ) -> None:
        """A turn completed on `decode_replica`, which keeps its blocks pinned (`pinned_kv`) for readback."""
        if self._pulls is not None:
            self._pulls.turn_done(session_id, decode_replica, pinned_kv, prompt, output)

    async def refresh(self) -> None:
        """Poll the registry now rather than at the view's next poll."""
        await self._view.refresh()

    def replica_failed(self, replica_id: str, reason: str) -> None:
        """A call found `replica_id` dead or its engine failed: no more routing to it, on any router."""
        self._view.mark_failed(replica_id, reason)

    def prefill_done(self, request_id: str) -> None:
        if request_id in self._admitted:
            self._view.load.on_prefill_done(request_id)

    def finish(self, request_id: str) -> None:
        admitted = self._admitted.pop(request_id, None)
        if admitted is None:
            return
        self._admitted_tokens -= admitted.tokens
        # The turn is over: prepare the session's next-turn check now, off any decision's path.
        self._hasher.seal(admitted.req.session_id)
        self._view.load.on_finish(request_id)
        admitted.policy.on_finish(admitted.req, admitted.decision)
