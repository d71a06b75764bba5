"""Helpers for policy tests: replica views and a prefix lookup with fixed per-replica answers."""

from collections.abc import Iterable, Sequence

from engine.messages import Role
from router.messages import ReplicaView, RouteRequest

BS = 16


class FixedLookup:
    """Answers matched_blocks from a replica -> leading blocks table."""

    def __init__(self, blocks: dict[str, int] | None = None) -> None:
        self.blocks = blocks or {}

    def matched_blocks(self, block_hashes: Sequence[int], replica_ids: Iterable[str]) -> dict[str, int]:
        return {r: min(self.blocks.get(r, 0), len(block_hashes)) for r in replica_ids}


def view(
    rid: str,
    role: Role = "prefill",
    *,
    queued: int = 0,
    reqs: int = 0,
    active: int = 0,
    kv: float = 0.0,
    ready: bool = True,
    draining: bool = False,
    node: str | None = None,
) -> ReplicaView:
    return ReplicaView(
        replica_id=rid,
        role=role,
        queued_prefill_tokens=queued,
        queued_prefill_requests=reqs,
        active_seqs=active,
        kv_usage=kv,
        ready=ready,
        draining=draining,
        node_id=node,
    )


def request(
    n_tokens: int = 4096, session: str | None = None, rid: str = "r", hashes: list[int] | None = None
) -> RouteRequest:
    return RouteRequest(
        request_id=rid,
        session_id=session,
        num_prompt_tokens=n_tokens,
        block_hashes=hashes if hashes is not None else list(range(n_tokens // BS)),
        block_size=BS,
        max_tokens=64,
    )
