"""The router's settings: defined here once, embedded as the topology's `router` section, read by the live
router and by the trace replay (`pdserve replay --topology FILE`).

Every field applies to a running router in place (`pdserve apply`: the router follows the deployed topology,
`router.process.RouterProcess.reconfigure`); none restarts an engine. What each routing setting does is in
docs/routing.md, with the replay measurements its default came from.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from router.service_time import ServiceTime

NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
# An OTLP/gRPC collector, e.g. http://127.0.0.1:4317.
OtlpEndpoint = Annotated[str, msgspec.Meta(pattern=r"^https?://[^/\s]+/?$")]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]

# auto: each request takes the option of lowest cost: disaggregated (prefill replica, KV moved to decode) or
# prefilled on the decode replica that holds its context. disaggregate: always prefill on a prefill replica
# (a decode replica prefills only when no prefill replica can).
RouterMode = Literal["auto", "disaggregate"]
# pdserve: the cost-based choice (router/policy/selector.py). round_robin, least_loaded, session_hash:
# cache-blind baselines (router/policy/cache_blind.py) to measure pdserve's routing against on a live cluster,
# not to serve with.
RouterPolicy = Literal["pdserve", "round_robin", "least_loaded", "session_hash"]


class RouterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    mode: RouterMode = "auto"
    policy: RouterPolicy = "pdserve"
    # An uncached suffix at most this long is prefilled by the decode replica holding the rest (no KV move);
    # a longer one only when that costs less than the prefill hop (the H200 example's value; the replay
    # evaluates it).
    local_prefill_max_tokens: NonNegativeInt = 1024
    # With every prefill replica this many estimated seconds behind, a decode replica's long prefill is
    # charged as a short one's (decode absorbs prefill overflow); null: never.
    prefill_overflow_queue_s: NonNegativeFloat | None = 10.0
    # A cache miss is charged prefill_weight x its own prefill seconds (higher: more hits, less balance);
    # a new prompt's seconds recomputing a prefix another prefill replica holds, COPY_WEIGHT x
    # (router/policy/cost.py). Replay your traffic to choose it (`pdserve replay --topology FILE`).
    prefill_weight: NonNegativeFloat = 5.0
    # The decode replicas' inter-token latency SLO: a prefill on a decode replica whose mixed steps (chunked
    # prefill) would be slower than this for its running sequences is charged OVER_SLO_WEIGHT x the delay it
    # adds to each of them (router/policy/cost.py); within it, the delay itself.
    tpot_slo_ms: PositiveFloat = 50.0
    # The time-to-first-token SLO: a wait for a prefill replica that takes the first token past it is charged
    # OVER_SLO_WEIGHT x the excess on top of the wait itself. The replay's goodput counts against both SLOs.
    ttft_slo_ms: PositiveFloat = 5000.0
    # Prefill balance: charges for recent compute seconds and for recent tokens computed (cache churn)
    # above the prefill pool's mean.
    balance_weight: NonNegativeFloat = 0.2
    churn_weight: NonNegativeFloat = 0.5
    # A session's next turn goes to the decode replica holding its KV while that replica is not overloaded.
    session_affinity: bool = True
    # What the router keeps of sessions between turns (router/sessions.py: placement, token history, block
    # hashes, pins), all together: at most this many sessions and token ids; the least recent go first.
    max_sessions: PositiveInt = 100_000
    max_session_tokens: PositiveInt = 32_000_000
    # With KV readback on (the topology's pools.kv_readback_ttl_s): a prefill may also pull a prefix any
    # decode replica holds in its prefix cache (that replica pins it first), not only a session's pinned turn.
    kv_readback_exports: bool = True
    overload_queue_tokens: PositiveInt = 65536  # queued prompt tokens beyond which requests are refused
    stream_batch_tokens: PositiveInt = 16  # tokens per streamed message ...
    stream_batch_ms: PositiveFloat = 20.0  # ... or this long, whichever comes first
    # A request whose replica fails continues on another (the tokens streamed so far appended to its
    # prompt); after this many such moves the client gets UNAVAILABLE.
    failover_attempts: NonNegativeInt = 3
    # What one replica is (hardware, GPUs, model shape): the cost's seconds are estimated for it.
    service_time: ServiceTime = msgspec.field(default_factory=ServiceTime)


class LiveConfig:
    """The router's settings as the running router reads them: `current` is replaced when the deployed
    topology changes (`pdserve apply`, router/process.py), and every part reads the setting it needs from it
    when it needs it, so a change reaches the next request. A new setting is a field above, the line that
    reads it, and its test."""

    def __init__(self, config: RouterConfig | None = None) -> None:
        self.current = config or RouterConfig()


class TlsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    cert_file: str
    key_file: str


# `pdserve apply` changes this field on a running cluster (the deepest mark on a field's path wins over the
# `server` section's restart mark: cluster/apply.py): Serve scales the router deployment.
_LIVE = {"apply": "live"}


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The topology's `server`: where the routers listen (read once: changing it restarts pdserve, except
    `routers`)."""

    # Router replicas (Serve replicas of the `router` deployment), each a whole front end: both doors, its
    # own picture of the cluster from every engine's KV events, the load the others report. Routers on one
    # node share the doors' ports (SO_REUSEPORT: the kernel spreads connections); a router that dies is
    # replaced by Serve while the others serve, and the SDK continues its streams on another.
    routers: Annotated[int, msgspec.Meta(ge=1, extra=_LIVE)] = 1
    # Where the routers run: {} on the Ray head; else a Ray label selector (as pools.*.node_labels), one
    # router per matching node (`pdserve export` gives them a node group and a Service of their own).
    router_node_labels: dict[str, str] = {}
    grpc_host: str = "127.0.0.1"
    grpc_port: Port = 50051
    # The OpenAI-compatible HTTP door (router/doors/openai_http.py): off unless a port is set. Same TLS
    # and token.
    http_host: str = "127.0.0.1"
    http_port: Port | None = None
    metrics_host: str = "127.0.0.1"
    # Several routers on one node: each takes the first free port from this one up.
    metrics_port: Port = 9400
    tls: TlsConfig | None = None
    auth_token_env: str | None = None  # the NAME of an env var holding the token, never the token itself
    # Request traces (OpenTelemetry, OTLP over gRPC) from the router and every engine replica; off unless set.
    otlp_traces_endpoint: OtlpEndpoint | None = None


class ServedModel(msgspec.Struct, frozen=True, kw_only=True):
    """What the router needs of the model it serves (the cluster fills it from the topology's `model`)."""

    name: str
    block_size: int
    max_model_len: int
    trust_remote_code: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
