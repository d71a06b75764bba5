"""The messages that pass between the router's stages, each defined once.

intake -> decision: `PromptReuse` (which prompt ids a session's turn copied from its previous turn).
decision <-> policy: `RouteRequest`, `ReplicaView`, `Readback` in; `Decision` (with its cost `Terms`) out.
decision -> legs: `Route` (where the legs go, what they pull, export and pin).
legs -> the request path: `RequestSummary` (the summary after the last token).
the request path -> the doors: `OutputDelta` per streamed batch (`ParsedDelta`: content, reasoning, tool
calls), then one `Finished`.
The trace replay (bench/replay) speaks the same policy messages.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import msgspec

from engine.messages import FinishReason, Role, ServingPath, TokenLogprob


class PromptReuse(NamedTuple):
    """A prompt's provenance from whoever built it: its first `tokens` ids are `base`'s first `tokens` (copied
    from that very list, e.g. by the incremental chat encoder), so nothing before them needs comparing."""

    base: list[int]
    tokens: int


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
    # estimate per queued request; router/view/load.py keeps it). None: the cost estimates it from the
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
    # Other routers serve the cluster too: the session's latest turn may be one another router placed.
    other_routers: bool = False


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


class Route(msgspec.Struct, frozen=True, kw_only=True):
    """Where a request goes: decided by the routing policy (or 'let Serve pick' when replica ids are
    None)."""

    prefill: bool
    prefill_replica: str | None = None
    decode_replica: str | None = None
    predicted_cached_tokens: int = 0
    # KV readback: the decode engine's pinned blocks the prefill leg pulls the prompt's prefix from.
    readback_params: dict[str, Any] | None = None
    # Of predicted_cached_tokens, those the prefill replica is expected to pull with readback_params.
    readback_tokens: int = 0
    readback_replica: str = ""
    # KV readback: have the decode engine pin this request's blocks when it finishes (a session's turn).
    pin_kv: bool = False
    # KV export: the decode replica to pin the prompt's first `export_tokens` tokens (which it holds) for the
    # prefill leg to pull ("": none).
    export_replica: str = ""
    export_tokens: int = 0
    # The policy's reason (`Decision.reason`, e.g. "local_prefill", "prefill_overflow"); "unrouted" when no
    # decode replica was known and Serve chose.
    reason: str = "unrouted"
    # The chosen option's cost, term by term (`Decision.terms`; None: unrouted or a baseline policy).
    terms: Terms | None = None
    # Replicas known to have failed, which Serve may still list: never to be chosen for any leg.
    avoid: tuple[str, ...] = ()


class Stage(msgspec.Struct, frozen=True, array_like=True):
    """One stage of a request's timeline: when it began (ms after the request reached the router) and how
    long it took."""

    name: str
    start_ms: float
    duration_ms: float


class RequestSummary(msgspec.Struct, kw_only=True):
    """The summary after the last token: what the gRPC layer puts in `final`."""

    finish_reason: FinishReason
    stop_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    kv_transferred_tokens: int
    predicted_cached_tokens: int
    path: ServingPath
    prefill_replica: str
    prefill_node: str
    decode_replica: str
    decode_node: str
    note: str
    ttft_ms: float
    prefill_ms: float
    e2e_ms: float
    # KV readback: where the decode engine keeps this request's blocks pinned, and the ids it generated
    # (prompt + generated ids are what those blocks hold).
    pinned_kv: dict[str, Any] | None = None
    output_token_ids: list[int] = []
    # KV export outcome: "" (none asked), "pinned" (the prefill leg pulled from it), "declined" (the replica
    # pinned nothing), "lost" (the replica died) or "timeout": in the last three the prefill leg computed the
    # prefix.
    export: str = ""
    # Where the request spent its time, in order (router/request/lifecycle.py; docs/api.md lists the stages).
    timeline: list[Stage] = []


class ToolCallDelta(msgspec.Struct, frozen=True, kw_only=True):
    """OpenAI's streamed tool-call shape: the first delta of a call has its id and name."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


class ParsedDelta(msgspec.Struct, kw_only=True):
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = msgspec.field(default_factory=list)

    def then(self, later: ParsedDelta) -> ParsedDelta:
        """This delta followed by `later`, as one."""
        return ParsedDelta(
            content=self.content + later.content,
            reasoning=self.reasoning + later.reasoning,
            tool_calls=self.tool_calls + later.tool_calls,
        )


class OutputDelta(msgspec.Struct, kw_only=True):
    """One streamed batch as the doors send it: its token ids (and logprobs), parsed for the agent."""

    token_ids: list[int]
    parsed: ParsedDelta
    logprobs: list[TokenLogprob] = []


class Finished(msgspec.Struct, kw_only=True):
    """The end of a stream: the last batch's tokens (they ride in the final message rather than in one of
    their own), what the parser held back, the finish reason as the client sees it ("tool_calls" when the
    model called tools), and the legs' summary."""

    parsed: ParsedDelta
    finish_reason: str
    completion: RequestSummary
    token_ids: list[int] = []
    logprobs: list[TokenLogprob] = []
