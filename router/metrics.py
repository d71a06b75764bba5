"""The router's Prometheus metrics (prometheus-client), in a registry of their own (no global state).

Latencies are histograms, so Prometheus computes P50/P95/P99 with histogram_quantile() per replica or in
aggregate. Predicted vs engine-reported cached tokens are both exported so that drift between what the
router believes and what the engine did is visible.
"""

from __future__ import annotations

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from router.policy.types import Terms

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pdserve_requests", "Requests by terminal gRPC status code.", ["code"], registry=r
        )
        self.inflight = Gauge("pdserve_requests_inflight", "Requests being served.", registry=r)
        self.failovers = Counter(
            "pdserve_failovers",
            "Requests moved to another replica after theirs failed (the tokens so far kept).",
            registry=r,
        )
        self.serving = Gauge(
            "pdserve_serving", "1 while at least one decode replica can take requests, else 0.", registry=r
        )
        self.ttft = Histogram(
            "pdserve_ttft_seconds", "Time to first token.", ["path"], buckets=_LATENCY_BUCKETS_S, registry=r
        )
        self.tpot = Histogram(
            "pdserve_tpot_seconds",
            "Time per output token after the first (mean per request).",
            ["decode_replica"],
            buckets=_TPOT_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve_e2e_seconds",
            "End-to-end request latency.",
            ["path"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.prefill = Histogram(
            "pdserve_prefill_leg_seconds",
            "Prefill leg latency (router view).",
            ["prefill_replica"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens served.", registry=r)
        self.completion_tokens = Counter("pdserve_completion_tokens", "Tokens generated.", registry=r)
        self.cached_tokens = Counter(
            "pdserve_cached_tokens", "Prompt tokens the engine reported as cached (not computed).", registry=r
        )
        self.predicted_cached_tokens = Counter(
            "pdserve_predicted_cached_tokens", "Prompt tokens the router predicted to be cached.", registry=r
        )
        self.cache_prediction_error = Histogram(
            "pdserve_cache_prediction_error_tokens",
            "Per request: engine-reported minus router-predicted cached prompt tokens (0 = the router's KV "
            "index agrees with the engine; negative = it expected cache that was not there).",
            buckets=(-4096, -1024, -256, -64, -1, 0, 64, 256, 1024, 4096),
            registry=r,
        )
        self.kv_transfer_tokens = Counter(
            "pdserve_kv_transfer_tokens",
            "Prompt tokens whose KV was handed from a prefill to a decode replica.",
            ["prefill_replica", "decode_replica"],
            registry=r,
        )
        self.readback_tokens = Counter(
            "pdserve_kv_readback_tokens",
            "Prompt tokens the router expects prefill replicas to pull from a decode replica's pinned KV "
            "instead of computing (KV readback and exports; the engines report what they pulled as external "
            "KV).",
            ["decode_replica"],
            registry=r,
        )
        self.exports = Counter(
            "pdserve_kv_exports",
            "KV exports (a decode replica asked to pin a cached prefix for a prefill leg to pull), by "
            "outcome: 'pinned', or 'declined' / 'lost' / 'timeout' (the prefill leg computed the prefix "
            "instead).",
            ["outcome"],
            registry=r,
        )
        self.paths = Counter("pdserve_serving_path", "Requests by serving path.", ["path"], registry=r)
        self.decisions = Counter(
            "pdserve_routing_decisions",
            "Routing decisions by the policy's reason: 'disaggregated', 'local_prefill' (decode holds all "
            "but a short suffix), 'long_local_prefill' (decode prefilled a longer suffix over the context it "
            "holds: cheaper than the prefill hop's recompute), 'prefill_overflow' (the same because every "
            "prefill replica was backed up: the prefill pool is short of capacity), 'no_prefill_replica'; "
            "'affinity_' in front when a session stayed on its decode replica; 'unrouted' before any decode "
            "replica was registered.",
            ["reason"],
            registry=r,
        )
        self.cost_terms = Histogram(
            "pdserve_routing_cost_term_seconds",
            "The chosen option's routing cost by term (weighted seconds, router/policy/cost.py): 'prefill', "
            "'queue', 'pull', 'balance', 'churn', 'decode', 'transfer', 'stall'. Which terms decide where "
            "requests go; the per-request breakdown is logged at DEBUG (router.routing).",
            ["term"],
            buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0, 600.0),
            registry=r,
        )
        self.chat_tokens = Counter(
            "pdserve_chat_prompt_tokens",
            "Chat prompt token ids by how the router got them: 'encoded' by the tokenizer, or 'reused' from "
            "the session's previous turn (incremental tokenization).",
            ["source"],
            registry=r,
        )
        self.token_id_tokens = Counter(
            "pdserve_token_id_prompt_tokens",
            "Token ids of session requests sent as ids, by how the router got them: 'converted' from the "
            "request, or 'reused' from the session's previous turn (its ids extended on the wire).",
            ["source"],
            registry=r,
        )

    def on_decision(self, reason: str, terms: Terms | None) -> None:
        self.decisions.labels(reason=reason).inc()
        if terms is not None:
            for term, seconds in msgspec.structs.asdict(terms).items():
                self.cost_terms.labels(term=term).observe(seconds)

    def on_token_ids(self, reused: int, received: int) -> None:
        self.token_id_tokens.labels(source="reused").inc(reused)
        self.token_id_tokens.labels(source="converted").inc(received)

    def on_chat_encoded(self, reused: int, encoded: int) -> None:
        self.chat_tokens.labels(source="reused").inc(reused)
        self.chat_tokens.labels(source="encoded").inc(encoded)

    def serve(self, host: str, port: int) -> None:
        """Expose /metrics (prometheus-client's own HTTP server thread)."""
        start_http_server(port, addr=host, registry=self.registry)
