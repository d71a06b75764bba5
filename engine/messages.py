"""Messages between pdserve's processes: router <-> prefill/decode engine replicas.

Every message that crosses a process boundary is one of these msgspec Structs (they pickle through Ray
and encode with msgspec for anything else). Nothing here imports vLLM: the router depends on this module,
and must not depend on the engine.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

Role = Literal["prefill", "decode"]
FinishReason = Literal["stop", "length", "abort"]
ServingPath = Literal["disaggregated", "local_prefill", "decode_full_prefill"]


class Constraint(msgspec.Struct, frozen=True, kw_only=True):
    """What the output must match (vLLM structured outputs, applied on the engine that samples the output:
    decode). Exactly one field is set."""

    json_schema: dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None


class Sampling(msgspec.Struct, frozen=True, kw_only=True):
    """Validated sampling parameters (the router checked every range before building this)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    # Off when the output is parsed for tool calls: some models' tool-call markers are special tokens.
    skip_special_tokens: bool = True
    constraint: Constraint | None = None
    # None: no log probabilities; 0: the sampled token's; k: and the k most likely tokens'.
    logprobs: int | None = None


# NixlConnector params that move no KV. With KV readback on (vLLM's bidirectional transfer), a decode engine
# pins the blocks of any request that carries connector params when it finishes: these ask only for that.
PIN_ONLY_KV_PARAMS: dict[str, Any] = {"do_remote_prefill": False, "do_remote_decode": False}


class StreamBatch(msgspec.Struct, frozen=True, array_like=True):
    """How a decode engine batches a streamed reply: the first token at once, then `tokens` tokens or `ms`
    milliseconds, whichever comes first (the router's `stream_batch_tokens` / `stream_batch_ms`)."""

    tokens: int
    ms: float


class EngineRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One leg of a request as an engine replica receives it: token ids only (the router tokenized)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    # vLLM NixlConnector parameters: None on a plain request; on the decode leg of a disaggregated
    # request, the prefill leg's returned params (remote engine, block ids, host, port, ...); on a prefill
    # leg, a decode engine's pinned blocks to pull the prompt's prefix from (KV readback).
    kv_transfer_params: dict[str, Any] | None = None
    # None: every engine output is sent as it comes.
    stream: StreamBatch | None = None
    # W3C trace headers of the router's request span (engine/tracing.py); None when tracing is off.
    trace_context: dict[str, str] | None = None


class PrefillResult(msgspec.Struct, frozen=True, kw_only=True):
    """What the prefill leg returns: where decode can pull the prompt's KV from."""

    request_id: str
    replica_id: str
    node_id: str
    # None when the engine did not hand off KV (e.g. the prompt finished by EOS/stop at its first
    # token): decode must then prefill in full.
    kv_transfer_params: dict[str, Any] | None
    num_prompt_tokens: int
    # Prompt tokens the prefill engine found in its own prefix cache.
    num_cached_tokens: int
    prefill_ms: float


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """A generated token's log probability; `top`: the most likely tokens (id, text, logprob), best first."""

    token_id: int
    token: str
    logprob: float
    top: list[tuple[int, str, float]]


class TokenBatch(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A batch of generated tokens streamed from a decode replica (batched by count and by time: every batch
    is a message to the client)."""

    token_ids: list[int]
    text: str
    # Set on the last batch only.
    finish_reason: FinishReason | None = None
    stop_reason: str | None = None
    num_prompt_tokens: int = 0
    # Prompt tokens found cached where the prompt was computed, as vLLM reports them: after a KV transfer, the
    # prefill engine's hits (it passes them along with the KV), else this engine's own.
    num_cached_tokens: int = 0
    # The decode replica streaming (on every batch: a router that loses the stream knows whose it was).
    replica_id: str = ""
    node_id: str = ""
    # KV readback on: where this request's blocks stay pinned for a later prefill to pull (vLLM's params).
    pinned_kv: dict[str, Any] | None = None
    # With Sampling.logprobs set: one per token id.
    logprobs: list[TokenLogprob] | None = None


class ReplyTo(msgspec.Struct, frozen=True, array_like=True):
    """Where a leg's outcome (and a decode leg's tokens) go: a router's token channel, and the leg's number
    there (a router numbers its legs itself: request ids come from clients and need not be unique)."""

    address: str
    leg: int


LegKind = Literal["prefill", "generate"]


class LegStart(msgspec.Struct, frozen=True, array_like=True, tag="start"):
    """Run a leg on the replica (router/legs/leg_channel.py -> engine/leg_server.py): `prefill` computes the
    prompt and keeps its KV; `generate` streams the request's tokens to `reply_to`."""

    kind: LegKind
    request: EngineRequest
    reply_to: ReplyTo


class LegCancel(msgspec.Struct, frozen=True, array_like=True, tag="cancel"):
    """The router gave the leg up: abort its engine request; no LegEnd follows."""

    reply_to: ReplyTo


class LegFrame(msgspec.Struct, frozen=True, array_like=True):
    """One message from a router to a replica: every leg started or cancelled since its last frame."""

    items: list[LegStart | LegCancel]


class TokenItem(msgspec.Struct, frozen=True, array_like=True, tag="batch"):
    """One batch of one decode leg on a token channel; `seq` numbers the leg's batches from 0, so a router
    can tell that none went missing."""

    leg: int
    seq: int
    batch: TokenBatch


class LegEnd(msgspec.Struct, frozen=True, array_like=True, tag="end"):
    """How a leg ended, after its last batch on the same channel: `sent` batches; a prefill leg's `result`;
    `failed`: the replica's engine can no longer serve (ReplicaFailed's reason); `error`: the leg failed for
    another reason (the request's own)."""

    leg: int
    sent: int
    result: PrefillResult | None = None
    failed: str = ""
    error: str = ""


class TokenFrame(msgspec.Struct, frozen=True, array_like=True):
    """One message on a token channel (engine/token_sender.py -> router/legs/token_receiver.py): every batch
    and leg end a replica produced for one router since its last frame, across all of that router's
    requests."""

    items: list[TokenItem | LegEnd]


class GpuSample(msgspec.Struct, frozen=True, kw_only=True):
    """One GPU of a replica, as NVML reads it (engine/gpu_stats.py)."""

    index: int  # among the GPUs the replica's process sees
    power_w: float
    temperature_c: float
    sm_clock_mhz: float
    memory_used_bytes: int
    memory_total_bytes: int


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    """A replica's counters and load, read from its engine's own statistics."""

    replica_id: str
    role: Role
    node_id: str
    running: int
    waiting: int
    kv_cache_usage: float
    # Cumulative prompt-token accounting as the engine reports it.
    prompt_tokens_computed: int
    prompt_tokens_local_cache_hit: int
    prompt_tokens_external_kv: int
    nixl_bytes_transferred: int
    nixl_transfers: int
    requests_finished: int
    # Seconds the NIXL transfers took (vLLM's NixlConnector's own timing), summed.
    nixl_transfer_seconds: float = 0.0
    # Speculative decoding: steps that verified a draft, tokens drafted, tokens accepted (all 0 without).
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # Recent seconds between the engine's steps while it ran sequences (0: idle since it started).
    step_s: float = 0.0
    gpus: list[GpuSample] = []


class ReplicaInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What an engine replica publishes to the registry for the router."""

    replica_id: str
    role: Role
    node_id: str
    # ZMQ endpoint of the engine's KV-event publisher, e.g. tcp://127.0.0.1:5557 (None: events off).
    kv_events_endpoint: str | None
    # Where the publisher answers replay requests for missed event batches (vLLM's ROUTER socket).
    kv_events_replay_endpoint: str | None
    # Host/port of the NIXL side channel other engines use to read this one's KV.
    nixl_host: str
    nixl_port: int
    block_size: int
    # Where routers send this replica's legs (engine/leg_server.py); "" until it listens.
    legs_address: str = ""
    ready: bool = True
    draining: bool = False
    # Why this replica can no longer serve ("" while it can): its engine died or hung, seen by the replica
    # itself, or a router found it lost. Routers stop routing to it; Serve replaces it.
    failed: str = ""
    # The engine's counters at the time of publishing (refreshed with every heartbeat).
    stats: EngineStats | None = None
    # Seconds each phase of the replica's start took, in order (engine/start_phases.py).
    start_phases: dict[str, float] = {}


class ReplicaFailed(Exception):
    """Raised by an engine replica whose engine can no longer serve (its engine core died, or it hung). It
    crosses Ray as the cause of a RayTaskError, which is an instance of this class too; the router moves the
    request to another replica."""

    def __init__(self, replica_id: str, reason: str) -> None:
        super().__init__(f"replica {replica_id}: {reason}")
        self.replica_id = replica_id
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (ReplicaFailed, (self.replica_id, self.reason))


class DispatchedLoad(msgspec.Struct, frozen=True, array_like=True):
    """The work one router dispatched to one replica and that has not ended (router/view/load.py counts it at
    dispatch): what the other routers add to their own count of that replica."""

    queued_prefill_tokens: int = 0
    queued_prefill_requests: int = 0
    queued_prefill_s: float = 0.0
    active_seqs: int = 0
    active_context_tokens: int = 0


def add_loads(a: DispatchedLoad, b: DispatchedLoad) -> DispatchedLoad:
    return DispatchedLoad(
        queued_prefill_tokens=a.queued_prefill_tokens + b.queued_prefill_tokens,
        queued_prefill_requests=a.queued_prefill_requests + b.queued_prefill_requests,
        queued_prefill_s=a.queued_prefill_s + b.queued_prefill_s,
        active_seqs=a.active_seqs + b.active_seqs,
        active_context_tokens=a.active_context_tokens + b.active_context_tokens,
    )


class ReplicaLoad(msgspec.Struct, frozen=True, kw_only=True):
    """One engine replica's load as its pool's autoscaling policy reads it (cluster/autoscaling.py); Serve
    averages each field over the pool's window."""

    # What every router has dispatched here and not yet seen computed: the prompts' estimated seconds.
    queued_prefill_s: float = 0.0
    busy: float = 0.0  # 1 while the replica has any work, else 0: its window mean is the busy share
    kv_usage: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    step_s: float = 0.0  # the engine's recent seconds between steps while it runs sequences (0: idle)
    start_s: float = 0.0  # how long the replica took to start (its start phases): what a new one will


class RouterReport(msgspec.Struct, frozen=True, kw_only=True):
    """What a router tells the registry at every poll (cluster/registry.py): who it is, where it serves, and
    the load it has in flight, which every other router adds to its own picture of the replicas."""

    router_id: str
    node_id: str = ""
    grpc_address: str = ""  # host:port of its gRPC door
    metrics_address: str = ""  # host:port of its /metrics
    serving: bool = False  # what its gRPC health says
    # Engine replicas of each role it can route to now (ready, not draining, not failed): `pdserve up`
    # says it is up once every router sees every replica Serve runs, not just a decode replica.
    routable: dict[str, int] = {}
    inflight_requests: int = 0
    # Prompt tokens of the requests it admitted and that have not ended (admission counts the cluster's).
    admitted_tokens: int = 0
    replicas: dict[str, DispatchedLoad] = {}


class ClusterState(msgspec.Struct, frozen=True, kw_only=True):
    """What a router reads back at every poll: the replicas, every other live router's report, and the
    deployed topology's `router` section (plain data: each router validates it and applies it in place)."""

    replicas: list[ReplicaInfo]
    routers: list[RouterReport] = []
    router_settings: dict[str, Any] | None = None
