"""A Ray Serve request router that honours pdserve's replica choice.

pdserve's policy picks the prefill and decode replicas itself (it knows which one holds the prompt's
KV blocks); the choice travels with each call as the `replica_hint` keyword argument. Serve still owns
membership: its candidates are the replicas that are running and not draining, so a hint naming a
replica that died or is being drained is simply not among them, and Serve's usual choice applies.
Set per deployment in the Serve config (cluster/serve_config.py).
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

HINT_KWARG = "replica_hint"
# Replicas the router knows failed (their engine died) while Serve may still list them: never chosen.
AVOID_KWARG = "replica_avoid"
IMPORT_PATH = "router.legs.replica_hint:ReplicaHintRouter"


class ReplicaHintRouter(RequestRouter):
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        if pending_request is not None:
            # Every call considers every replica (no locality rounds), so when none of them takes the request
            # Serve must sleep before asking again. Its built-in routers set this; without it Serve's routing
            # loop retries at once, forever, and its thread holds the GIL (the whole router process starves).
            pending_request.routing_context.should_backoff = True
        avoid = set(kwargs.get(AVOID_KWARG) or ())
        usable = [r for r in candidate_replicas if r.replica_id.unique_id not in avoid]
        hint = kwargs.get(HINT_KWARG)
        if hint:
            target = [r for r in usable if r.replica_id.unique_id == hint]
            if target:
                # The hinted replica first; if it is at max_ongoing_requests, spill to the others rather
                # than queue (the request loses its cache locality, never its turn).
                return [target, [r for r in usable if r.replica_id.unique_id != hint]]
        # Empty when every candidate failed (e.g. the replacement is not in Serve's list yet): Serve backs off
        # (should_backoff above) and asks again, instead of sending the request to a dead engine.
        return [usable]
