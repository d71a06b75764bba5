"""The routing-policy contract shared by the live router and the trace-replay simulator.

Both callers build `ReplicaView`s from their own load accounting, hash the prompt into
`RouteRequest.block_hashes` with `router.block_hash`, and call `Policy.choose(req, prefill, decode, cache)`;
when the request finishes they call `Policy.on_finish(req, decision)`. `cache` answers "how many leading
blocks of this prompt does each replica hold" (router/view/kv_index.py's `KvIndex` implements it; the
replay feeds a `KvIndex` from its own LRU caches' events).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

from router.messages import Decision, ReplicaView, RouteRequest


class PrefixLookup(Protocol):
    def matched_blocks(self, block_hashes: Sequence[int], replica_ids: Iterable[str]) -> dict[str, int]:
        """Number of leading blocks of `block_hashes` each replica holds (0 when none or unknown)."""
        ...


@runtime_checkable
class MemoPrefixLookup(PrefixLookup, Protocol):
    """A `PrefixLookup` that can resume from what an earlier lookup established (`KvIndex`):
    a session's next turn then walks its new blocks, not its whole history. The memo is opaque to callers."""

    def matched_blocks_memo(
        self, block_hashes: Sequence[int], replica_ids: Iterable[str], memo: object | None
    ) -> tuple[dict[str, int], object]:
        """`matched_blocks`, resumed from `memo` (None: from scratch), and the memo of this lookup."""
        ...

    def expect_stored(self, memo: object, replica_ids: Iterable[str], block_hashes: Sequence[int]) -> None:
        """Note in `memo` that these replicas will hold all of `block_hashes` (the request went there)."""
        ...


class Policy(Protocol):
    name: str

    def choose(
        self,
        req: RouteRequest,
        prefill: Sequence[ReplicaView],
        decode: Sequence[ReplicaView],
        cache: PrefixLookup,
    ) -> Decision:
        """Pick the prefill and decode replicas. Raises NoReplicaError when no eligible decode replica
        exists."""
        ...

    def on_finish(self, req: RouteRequest, d: Decision) -> None:
        """The request finished (any outcome); policies with per-request state release it here."""
        ...
