"""The router's /metrics: its own latencies and routing, and, read at each scrape, every engine replica's
statistics (labelled replica, role, model), GPU readings where there are GPUs, and the router's queue. The
Grafana dashboard in deploy/observability/ queries only metrics this exports."""

from __future__ import annotations

import pytest
from dashboard import dashboard_metrics
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.messages import EngineStats, GpuSample, ReplicaInfo
from router.messages import Decision, RouteRequest
from router.metrics import RouterMetrics
from router.view.load import LoadTracker


def info(replica: str, role: str, *, gpus: int = 0) -> ReplicaInfo:
    stats = EngineStats(
        replica_id=replica,
        role=role,  # type: ignore[arg-type]
        node_id="n",
        running=3,
        waiting=1,
        kv_cache_usage=0.25,
        prompt_tokens_computed=1000,
        prompt_tokens_local_cache_hit=400,
        prompt_tokens_external_kv=600,
        nixl_bytes_transferred=1 << 20,
        nixl_transfers=4,
        nixl_transfer_seconds=0.02,
        requests_finished=7,
        spec_drafts=20,
        spec_draft_tokens=80,
        spec_accepted_tokens=30,
        gpus=[
            GpuSample(
                index=i,
                power_w=500.0,
                temperature_c=60.0,
                sm_clock_mhz=1980.0,
                memory_used_bytes=100,
                memory_total_bytes=141 << 30,
            )
            for i in range(gpus)
        ],
    )
    return ReplicaInfo(
        replica_id=replica,
        role=role,  # type: ignore[arg-type]
        node_id="n",
        kv_events_endpoint=None,
        kv_events_replay_endpoint=None,
        nixl_host="127.0.0.1",
        nixl_port=1,
        block_size=16,
        stats=stats,
    )


def scrape(metrics: RouterMetrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> (labels, value) of everything the registry exposes now."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def watched(gpus: int = 0) -> tuple[RouterMetrics, LoadTracker]:
    metrics = RouterMetrics()
    load = LoadTracker()
    replicas = {"p0": info("p0", "prefill", gpus=gpus), "d0": info("d0", "decode", gpus=gpus)}
    for rid, r in replicas.items():
        load.add_replica(rid, r.role)
    metrics.watch("kimi-k2", lambda: replicas, load)
    return metrics, load


def test_every_engine_replicas_statistics_are_exported_with_replica_role_and_model() -> None:
    metrics, _ = watched()
    got = scrape(metrics)
    labels = {"replica": "d0", "role": "decode", "model": "kimi-k2"}
    assert (labels, 3.0) in got["pdserve_engine_running_requests"]
    assert (labels, 0.25) in got["pdserve_engine_kv_cache_usage"]
    assert (labels, float(1 << 20)) in got["pdserve_engine_kv_transfer_bytes_total"]
    assert (labels, 0.02) in got["pdserve_engine_kv_transfer_seconds_total"]
    assert (labels, 600.0) in got["pdserve_engine_prompt_tokens_external_kv_total"]
    assert (labels, 20.0) in got["pdserve_engine_spec_drafts_total"]
    assert (labels, 80.0) in got["pdserve_engine_spec_draft_tokens_total"]
    assert (labels, 30.0) in got["pdserve_engine_spec_accepted_tokens_total"]
    assert "pdserve_gpu_power_watts" not in got  # no GPUs: no GPU series, and no error


def test_gpu_readings_are_exported_per_replica_and_gpu() -> None:
    metrics, _ = watched(gpus=2)
    got = scrape(metrics)
    power = got["pdserve_gpu_power_watts"]
    assert len(power) == 4  # two replicas x two GPUs
    assert ({"replica": "p0", "role": "prefill", "model": "kimi-k2", "gpu": "1"}, 500.0) in power


def test_the_routers_queue_follows_its_dispatches() -> None:
    metrics, load = watched()
    req = RouteRequest(
        request_id="r", session_id=None, num_prompt_tokens=1000, block_hashes=[], block_size=16, max_tokens=8
    )
    decision = Decision(
        prefill="p0",
        decode="d0",
        local_prefill=False,
        predicted_cached_tokens=200,
        predicted_decode_cached_tokens=0,
        cost=0.0,
        reason="disaggregated",
    )
    load.on_dispatch(req, decision)
    got = scrape(metrics)
    assert ({"replica": "p0", "role": "prefill"}, 1.0) in got["pdserve_router_queued_prefill_requests"]
    assert ({"replica": "p0", "role": "prefill"}, 800.0) in got["pdserve_router_queued_prefill_tokens"]
    load.on_prefill_done("r")
    assert ({"replica": "p0", "role": "prefill"}, 0.0) in scrape(metrics)[
        "pdserve_router_queued_prefill_requests"
    ]


def test_inter_token_latency_counts_every_token_of_a_streamed_message() -> None:
    metrics = RouterMetrics()
    metrics.observe_itl(0.08, 4)  # four tokens in one message, 80 ms after the previous one: 20 ms each
    metrics.observe_itl(0.001, 1)
    metrics.observe_itl(5.0, 1)  # above every bucket
    got = scrape(metrics)
    assert got["pdserve_itl_seconds_count"] == [({}, 6.0)]
    assert got["pdserve_itl_seconds_sum"][0][1] == pytest.approx(5.081)
    buckets = {labels["le"]: n for labels, n in got["pdserve_itl_seconds_bucket"]}
    assert (buckets["0.001"], buckets["0.01"], buckets["0.02"], buckets["1.28"], buckets["+Inf"]) == (
        1.0,
        1.0,
        5.0,  # cumulative, and a bound holds what equals it
        5.0,
        6.0,
    )


def test_every_dashboard_query_names_a_metric_the_router_exports() -> None:
    metrics, _ = watched(gpus=1)
    metrics.observe_itl(0.01, 1)
    exported = set(scrape(metrics))
    # Labelled histograms and counters show samples only once observed: their families' series names count.
    suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",), "gauge": ("",)}
    for family in metrics.registry.collect():
        exported |= {family.name + suffix for suffix in suffixes.get(family.type, ("",))}
    missing = dashboard_metrics() - exported
    assert not missing, f"the dashboard queries metrics nobody exports: {sorted(missing)}"
