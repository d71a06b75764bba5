"""Prefix sources a prefill replica can pull from instead of computing (KV readback and exports): the one seam
through which they reach the routing options. With readback off a request carries neither, `offer` returns
None, and every option is scored from the replicas' own caches.

- Readback (`RouteRequest.readback`): the session's previous decode replica keeps its turn pinned; any prefill
  replica can pull it over NIXL (~20 ms per 100k tokens across nodes on the default model) rather than
  recompute it (seconds). A session is then no longer tied to the prefill replica holding its context.
- Export (`RouteRequest.export_ttl_s`): the longest prefix any eligible decode replica holds in its prefix
  cache, which the orchestrator has that replica pin (a one-token request) before the prefill leg. The
  session's pin wins a tie (it needs no extra request).

A pull happens when the prefill replica schedules the prompt, after its queue: a pin that may expire first is
not counted on (the prompt would then be computed in full, a miss the cost did not plan for).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from router.messages import ReplicaView, RouteRequest
from router.policy.cost import CostWeights, queued_prefill_s, same_node, transfer_term


class Pull(NamedTuple):
    source: ReplicaView  # the decode replica holding the prefix
    tokens: int  # leading prompt tokens it holds
    left_s: float  # seconds it keeps them pinned
    export: bool  # it must be asked to pin them first (not the session's own pin)


def offer(
    req: RouteRequest,
    decode: Sequence[ReplicaView],
    eligible_decode: Sequence[ReplicaView],
    matched: Mapping[str, int],
    most: int,
) -> Pull | None:
    """The longest prefix this request could pull, or None. `matched`: leading blocks each replica's prefix
    cache holds; `most`: the prompt's cacheable tokens."""
    if req.readback is None and req.export_ttl_s is None:
        return None  # readback off
    best: Pull | None = None
    rb = req.readback
    if rb is not None:
        src = next((d for d in decode if d.replica_id == rb.replica_id and d.ready), None)
        if src is not None:
            best = Pull(src, min(rb.tokens, most), rb.expires_in_s, False)
    if req.export_ttl_s is not None:
        holder = max(eligible_decode, key=lambda d: matched[d.replica_id])
        held = min(matched[holder.replica_id] * req.block_size, most)
        if held > (0 if best is None else best.tokens):
            best = Pull(holder, held, req.export_ttl_s, True)
    return best if best is not None and best.tokens > 0 else None


def starts_from(w: CostWeights, pull: Pull | None, p: ReplicaView, own: int) -> int:
    """Tokens prefill replica `p`, holding `own` itself, starts from: its own prefix or what it can pull."""
    if pull is not None and pull.tokens > own and queued_prefill_s(w.timing, p) < pull.left_s:
        return pull.tokens
    return own


def pull_term(w: CostWeights, pull: Pull | None, p: ReplicaView, pulled: int) -> float:
    """Weighted seconds of pulling `pulled` tokens to `p`."""
    if pull is None or pulled <= 0:
        return 0.0
    return transfer_term(w, pulled, same_node(pull.source, p))
