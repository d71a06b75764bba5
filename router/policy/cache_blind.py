"""Cache-blind policies: round robin, least loaded and session hash, the baselines pdserve's routing is
measured against.

A router runs one when the topology says `router.policy: round_robin`, `least_loaded` or `session_hash`, so a
benchmark can compare pdserve's choice with a cache-blind one on the same live cluster (`pdserve bench
--side-by-side aggregated2,aggregated2:round_robin`); the replay runs them as `--policies
round_robin,least_loaded`. Each picks the prefill and the decode replica by its own rule (the next one, the
least loaded one, the one the session hashes to) and always disaggregates when a prefill replica is eligible.
None reads the KV index to decide; their decisions' `predicted_*` fields come from it, so hit metrics compare
fairly with pdserve's.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

from router.errors import NoReplicaError
from router.messages import Decision, ReplicaView, RouteRequest
from router.policy.cost import cached_tokens
from router.policy.types import PrefixLookup


def least_loaded_decode(decode: Sequence[ReplicaView]) -> ReplicaView:
    """The eligible decode replica with the fewest running sequences, then the lowest KV usage."""
    eligible = [d for d in decode if d.eligible]
    if not eligible:
        raise NoReplicaError("no ready decode replica")
    return min(eligible, key=lambda d: (d.active_seqs, d.kv_usage))


def decision_of(
    req: RouteRequest, p: ReplicaView | None, d: ReplicaView, cache: PrefixLookup, cost: float, reason: str
) -> Decision:
    """The decision for prefill `p` (None: decode prefills) and decode `d`, what they hold from the index."""
    ids = [d.replica_id] if p is None else [p.replica_id, d.replica_id]
    matched = cache.matched_blocks(req.block_hashes, ids)
    n, bs = req.num_prompt_tokens, req.block_size
    cached_d = cached_tokens(matched[d.replica_id], bs, n)
    return Decision(
        prefill=None if p is None else p.replica_id,
        decode=d.replica_id,
        local_prefill=p is None,
        predicted_cached_tokens=cached_d if p is None else cached_tokens(matched[p.replica_id], bs, n),
        predicted_decode_cached_tokens=cached_d,
        cost=cost,
        reason=reason if p is not None or reason == "dynamo_local" else "no_prefill_replica",
    )


class RoundRobinPolicy:
    """Cycles through eligible prefill replicas and, independently, through eligible decode replicas."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next_p = 0
        self._next_d = 0

    def choose(
        self,
        req: RouteRequest,
        prefill: Sequence[ReplicaView],
        decode: Sequence[ReplicaView],
        cache: PrefixLookup,
    ) -> Decision:
        decs = [d for d in decode if d.eligible]
        if not decs:
            raise NoReplicaError("no ready decode replica")
        d = decs[self._next_d % len(decs)]
        self._next_d += 1
        pres = [p for p in prefill if p.eligible]
        p = pres[self._next_p % len(pres)] if pres else None
        self._next_p += 1
        return decision_of(req, p, d, cache, 0.0, "round_robin")

    def on_finish(self, req: RouteRequest, d: Decision) -> None:
        return None


class LeastLoadedPolicy:
    """Prefill replica with the fewest queued prefill tokens (then fewest queued requests); decode least
    loaded."""

    name = "least_loaded"

    def choose(
        self,
        req: RouteRequest,
        prefill: Sequence[ReplicaView],
        decode: Sequence[ReplicaView],
        cache: PrefixLookup,
    ) -> Decision:
        d = least_loaded_decode(decode)
        pres = [p for p in prefill if p.eligible]
        p = min(pres, key=lambda r: (r.queued_prefill_tokens, r.queued_prefill_requests)) if pres else None
        return decision_of(req, p, d, cache, float(p.queued_prefill_tokens if p else 0), "least_loaded")

    def on_finish(self, req: RouteRequest, d: Decision) -> None:
        return None


def session_replica(key: str, replica_ids: Sequence[str]) -> str:
    """The replica of `replica_ids` that `key` hashes to: the same on every router and in every run while the
    replicas are the same (CRC-32, not Python's salted hash, over the ids in sorted order)."""
    if not replica_ids:
        raise NoReplicaError("no replica to hash to")
    ids = sorted(replica_ids)
    return ids[zlib.crc32(key.encode()) % len(ids)]


class SessionHashPolicy:
    """Sticky sessions, blind to cache and load: each session's turns go to the decode (and prefill) replica
    its id hashes to among the eligible ones (`session_replica`); a request without a session by its own id.
    A consistent-hash router's baseline, and how a benchmark places a request on a chosen replica
    (bench/served_timing.py)."""

    name = "session_hash"

    def choose(
        self,
        req: RouteRequest,
        prefill: Sequence[ReplicaView],
        decode: Sequence[ReplicaView],
        cache: PrefixLookup,
    ) -> Decision:
        key = req.session_id or req.request_id
        decs = {d.replica_id: d for d in decode if d.eligible}
        if not decs:
            raise NoReplicaError("no ready decode replica")
        d = decs[session_replica(key, list(decs))]
        pres = {p.replica_id: p for p in prefill if p.eligible}
        p = pres[session_replica(key, list(pres))] if pres else None
        return decision_of(req, p, d, cache, 0.0, "session_hash")

    def on_finish(self, req: RouteRequest, d: Decision) -> None:
        return None
