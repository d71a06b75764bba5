"""The routing-policy contract shared by the live router and the trace-replay simulator.

Both callers build `ReplicaView`s from their own load accounting, hash the prompt into
`RouteRequest.block_hashes` with `router.block_hash`, and call `Policy.choose(req, prefill, decode, cache)`;
when the request finishes they call `Policy.on_finish(req, decision)`. `cache` answers "how many leading
blocks of this prompt does each replica hold" (`router.kv_index.KvIndex` implements it; the simulator feeds a
`KvIndex` from its own LRU caches' events).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Literal, Protocol, runtime_checkable

import msgspec

Role = Literal["prefill", "decode"]


class ReplicaView(msgspec.Struct, kw_only=True, frozen=True):
    """One replica's load as the router sees it at decision time (immutable: `LoadTracker` shares views
    between decisions until the replica changes)."""

    replica_id: str
    role: Role
    # Prompt tokens dispatched to this replica and not yet prefilled (for decode replicas: local prefills).
    queued_prefill_tokens: int
    # Sequences currently decoding on it (0 for pure prefill replicas).
    active_seqs: int
    # Fraction of its KV cache in use, 0..1 (engine-reported, refreshed periodically).
    kv_usage: float
    ready: bool = True
    draining: bool = False
    # Requests behind `queued_prefill_tokens` (request-count load, as SGLang's router measures it).
    queued_prefill_requests: int = 0
    # Node the replica runs on: a P->D transfer within a node (NVLink) is cheaper than across nodes.
    node_id: str | None = None
    # Estimated seconds of the prefill work behind `queued_prefill_tokens` (sum of the service-time model's
    # estimate per queued request; `router.load.LoadTracker` keeps it). None: the cost estimates it from the
    # token and request counts alone (no attention over cached context).
    queued_prefill_s: float | None = None
    # Prompt tokens of the sequences behind `active_seqs` (their KV, which every decode step streams).
    active_context_tokens: int = 0

    @property
    def eligible(self) -> bool:
        """May receive new work."""
        return self.ready and not self.draining


class Terms(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One option's weighted seconds, term by term (what the log and the decision show)."""

    prefill: float = 0.0
    queue: float = 0.0
    pull: float = 0.0
    balance: float = 0.0
    churn: float = 0.0
    decode: float = 0.0
    transfer: float = 0.0
    stall: float = 0.0

    @property
    def total(self) -> float:
        # Added in this order everywhere (the computing replica's part first), so equal options tie exactly.
        return (
            self.prefill
            + self.queue
            + self.pull
            + self.balance
            + self.churn
            + self.decode
            + self.transfer
            + self.stall
        )


class Readback(msgspec.Struct, frozen=True):
    """KV a decode replica keeps pinned after a session's previous turn, which a prefill replica can pull
    over NIXL instead of computing (vLLM's bidirectional KV transfer): the first `tokens` tokens of this
    prompt, held on `replica_id` for another `expires_in_s` seconds (then the engine unpins them)."""

    replica_id: str
    tokens: int
    expires_in_s: float = math.inf


class RouteRequest(msgspec.Struct, kw_only=True):
    request_id: str
    session_id: str | None
    num_prompt_tokens: int
    # Router hashes of the prompt's full blocks (router.block_hash chain), in prompt order.
    block_hashes: list[int]
    block_size: int
    max_tokens: int
    # What the session's previous decode replica holds for a prefill replica to pull (None: nothing).
    readback: Readback | None = None
    # KV export: any decode replica pins a prefix it holds in its prefix cache, on request, for this many
    # seconds, for a prefill replica to pull (None: off; only `readback` can be pulled).
    export_ttl_s: float | None = None


class Decision(msgspec.Struct, kw_only=True):
    # Prefill replica; None when the decode replica prefills the prompt itself (local prefill).
    prefill: str | None
    decode: str
    local_prefill: bool
    # Prompt tokens the router expects to be cached on the replica that computes the prompt.
    predicted_cached_tokens: int
    # Prompt tokens the router expects to be cached on the decode replica (what a transfer can skip).
    predicted_decode_cached_tokens: int
    # Of `predicted_cached_tokens`, those the prefill replica should pull from decode replica
    # `readback_replica`: the session's pin (`RouteRequest.readback`), or, with `readback_export`, a prefix
    # that replica is first asked to pin (`RouteRequest.export_ttl_s`).
    readback_tokens: int = 0
    readback_replica: str | None = None
    readback_export: bool = False
    cost: float
    # The cost's terms (pdserve's policy; None for baselines).
    terms: Terms | None = None
    # Short machine-friendly label for logs/metrics, e.g. "cost", "local_prefill", "affinity", "round_robin".
    reason: str


class PrefixLookup(Protocol):
    def matched_blocks(self, block_hashes: Sequence[int], replica_ids: Iterable[str]) -> dict[str, int]:
        """Number of leading blocks of `block_hashes` each replica holds (0 when none or unknown)."""
        ...


@runtime_checkable
class MemoPrefixLookup(PrefixLookup, Protocol):
    """A `PrefixLookup` that can resume from what an earlier lookup established (`router.kv_index.KvIndex`):
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


class NoReplicaError(Exception):
    """No ready, non-draining replica can serve the request (maps to gRPC UNAVAILABLE)."""
