"""The router's Prometheus metrics (prometheus-client), in a registry of their own (no global state).

Latencies are histograms, so Prometheus computes P50/P95/P99 with histogram_quantile() per replica or in
aggregate. Predicted vs engine-reported cached tokens are both exported so that drift between what the
router believes and what the engine did is visible.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from typing import Protocol

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.messages import ReplicaInfo, Role
from router.messages import Terms

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class Queues(Protocol):
    """The router's per-replica prefill queues (`router.view.load.LoadTracker` is one)."""

    def queues(self) -> list[tuple[str, Role, int, int]]: ...


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
            "replica was registered; 'round_robin', 'least_loaded', 'session_hash' when a cache-blind "
            "baseline decides (router.policy, for benchmarks).",
            ["reason"],
            registry=r,
        )
        self.cost_terms = Histogram(
            "pdserve_routing_cost_term_seconds",
            "The chosen option's routing cost by term (weighted seconds, router/policy/cost.py): 'prefill', "
            "'queue', 'pull', 'balance', 'churn', 'decode', 'transfer', 'stall'. Which terms decide where "
            "requests go; the per-request breakdown is logged at DEBUG (router.decision.decider).",
            ["term"],
            buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0, 600.0),
            registry=r,
        )
        self.itl = _TokenHistogram(
            "pdserve_itl_seconds",
            "Inter-token latency as the client sees it: the gap between streamed messages divided by the "
            "tokens the later one carries (one observation per token).",
            buckets=_TPOT_BUCKETS_S,
        )
        r.register(self.itl)
        self.decision_seconds = Histogram(
            "pdserve_routing_decision_seconds",
            "Time the router takes to route one request (index lookup, cost, selection).",
            buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05),
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

    def observe_itl(self, gap_s: float, tokens: int) -> None:
        """A streamed message of `tokens` tokens arrived `gap_s` after the previous one."""
        self.itl.observe(gap_s / tokens, tokens)

    def on_token_ids(self, reused: int, received: int) -> None:
        self.token_id_tokens.labels(source="reused").inc(reused)
        self.token_id_tokens.labels(source="converted").inc(received)

    def on_chat_encoded(self, reused: int, encoded: int) -> None:
        self.chat_tokens.labels(source="reused").inc(reused)
        self.chat_tokens.labels(source="encoded").inc(encoded)

    def watch(self, model: str, replicas: Callable[[], dict[str, ReplicaInfo]], load: Queues) -> None:
        """Also export every engine replica's own statistics (as its registry entry last carried them) and
        the router's queue, read at each scrape."""
        self.registry.register(_ClusterCollector(model, replicas, load))

    def serve(self, host: str, port: int) -> None:
        """Expose /metrics (prometheus-client's own HTTP server thread)."""
        start_http_server(port, addr=host, registry=self.registry)


class _TokenHistogram(Collector):
    """A histogram that takes one value for several observations at once (a streamed message's per-token
    gap, once per message rather than once per token), for the request path: an observation is a bisect
    and three additions on the event loop; prometheus-client's Histogram takes a lock per observation.
    Scraped from the metrics server's thread, which only copies the counts."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self._name = name
        self._doc = documentation
        self._bounds = list(buckets)
        self._counts = [0] * (len(buckets) + 1)  # the last: above every bound (+Inf)
        self._sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self._counts[bisect.bisect_left(self._bounds, value)] += times
        self._sum += value * times

    def collect(self) -> Iterator[Metric]:
        counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, n in zip([*map(str, self._bounds), "+Inf"], counts, strict=True):
            running += n
            cumulative.append((bound, running))
        yield HistogramMetricFamily(self._name, self._doc, buckets=cumulative, sum_value=total)


# (metric name, help, EngineStats field) of the engines' own statistics, labelled replica, role, model.
_ENGINE_GAUGES = (
    ("pdserve_engine_running_requests", "Requests the engine is running (vLLM's scheduler).", "running"),
    ("pdserve_engine_waiting_requests", "Requests waiting in the engine's queue.", "waiting"),
    (
        "pdserve_engine_kv_cache_usage",
        "Share of the engine's KV cache blocks in use (0-1).",
        "kv_cache_usage",
    ),
)
_ENGINE_COUNTERS = (
    ("pdserve_engine_prompt_tokens_computed", "Prompt tokens the engine computed.", "prompt_tokens_computed"),
    (
        "pdserve_engine_prompt_tokens_cache_hit",
        "Prompt tokens the engine took from its own prefix cache.",
        "prompt_tokens_local_cache_hit",
    ),
    (
        "pdserve_engine_prompt_tokens_external_kv",
        "Prompt tokens whose KV the engine received over NIXL.",
        "prompt_tokens_external_kv",
    ),
    (
        "pdserve_engine_kv_transfer_bytes",
        "Bytes of KV moved over NIXL (vLLM's NixlConnector).",
        "nixl_bytes_transferred",
    ),
    ("pdserve_engine_kv_transfers", "KV transfers over NIXL.", "nixl_transfers"),
    (
        "pdserve_engine_kv_transfer_seconds",
        "Seconds the NIXL KV transfers took, summed.",
        "nixl_transfer_seconds",
    ),
    ("pdserve_engine_requests_finished", "Requests the engine finished.", "requests_finished"),
    # Acceptance rate: accepted / draft tokens; accepted tokens per step: 1 + accepted / drafts.
    ("pdserve_engine_spec_drafts", "Engine steps that verified a speculative draft.", "spec_drafts"),
    ("pdserve_engine_spec_draft_tokens", "Tokens the speculator proposed.", "spec_draft_tokens"),
    ("pdserve_engine_spec_accepted_tokens", "Proposed tokens the engine accepted.", "spec_accepted_tokens"),
)
# (metric name, help, GpuSample field) per GPU, from NVML (nothing on machines without NVIDIA GPUs).
_GPU_GAUGES = (
    ("pdserve_gpu_power_watts", "GPU power draw (NVML).", "power_w"),
    ("pdserve_gpu_temperature_celsius", "GPU temperature (NVML).", "temperature_c"),
    ("pdserve_gpu_sm_clock_mhz", "GPU SM clock (NVML).", "sm_clock_mhz"),
    ("pdserve_gpu_memory_used_bytes", "GPU memory in use (NVML).", "memory_used_bytes"),
    ("pdserve_gpu_memory_total_bytes", "GPU memory (NVML).", "memory_total_bytes"),
)


class _ClusterCollector(Collector):
    """Reads the router's cluster view at scrape time (from the metrics server's thread: it only reads)."""

    def __init__(self, model: str, replicas: Callable[[], dict[str, ReplicaInfo]], load: Queues) -> None:
        self._model = model
        self._replicas = replicas
        self._load = load

    def collect(self) -> Iterator[Metric]:
        labels = ["replica", "role", "model"]
        gauges = {n: GaugeMetricFamily(n, h, labels=labels) for n, h, _ in _ENGINE_GAUGES}
        counters = {n: CounterMetricFamily(n, h, labels=labels) for n, h, _ in _ENGINE_COUNTERS}
        gpus = {n: GaugeMetricFamily(n, h, labels=[*labels, "gpu"]) for n, h, _ in _GPU_GAUGES}
        start = GaugeMetricFamily(
            "pdserve_replica_start_seconds",
            "Seconds each phase of the replica's start took (actor, weights, engine_init, compile,"
            " engine_other, nixl_handshake).",
            labels=[*labels, "phase"],
        )
        for info in list(self._replicas().values()):
            for phase, seconds in info.start_phases.items():
                start.add_metric([info.replica_id, info.role, self._model, phase], seconds)
            s = info.stats
            if s is None:
                continue
            ids = [info.replica_id, info.role, self._model]
            for name, _, field in _ENGINE_GAUGES:
                gauges[name].add_metric(ids, float(getattr(s, field)))
            for name, _, field in _ENGINE_COUNTERS:
                counters[name].add_metric(ids, float(getattr(s, field)))
            for gpu in s.gpus:
                for name, _, field in _GPU_GAUGES:
                    gpus[name].add_metric([*ids, str(gpu.index)], float(getattr(gpu, field)))
        yield from gauges.values()
        yield from counters.values()
        yield from gpus.values()
        yield start
        queued_requests = GaugeMetricFamily(
            "pdserve_router_queued_prefill_requests",
            "Prefill legs the router dispatched that have not finished, per replica (its queue).",
            labels=["replica", "role"],
        )
        queued_tokens = GaugeMetricFamily(
            "pdserve_router_queued_prefill_tokens",
            "Uncached prompt tokens of those legs, per replica.",
            labels=["replica", "role"],
        )
        for replica, role, requests, tokens in self._load.queues():
            queued_requests.add_metric([replica, role], requests)
            queued_tokens.add_metric([replica, role], tokens)
        yield queued_requests
        yield queued_tokens
