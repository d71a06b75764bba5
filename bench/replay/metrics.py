"""What a replay reports per policy, and the side-by-side table."""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec

from bench.replay.sim import RequestRecord, Simulator
from bench.slo import Slo, percentile

# Goodput's SLO when `--slo` does not say (the replay's CLI takes both from the router's own SLOs).
DEFAULT_SLO = Slo(ttft_s=5.0, tpot_s=0.05)


class PolicyResult(msgspec.Struct, kw_only=True):
    policy: str
    requests: int
    # Block hit ratio where the prompt was computed (prefill replica, or decode replica for a local prefill).
    hit_ratio: float
    bound: float
    hit_vs_bound: float
    # Prompt tokens computed per prefill replica, and their max/mean (1.0 = perfectly even): over the whole
    # replay, and over the requests that arrived in the measurement window (the steady load that utilisation
    # and latency are measured at, without the drain of the last sessions).
    prefill_tokens: list[int]
    load_max_over_mean: float
    load_max_over_mean_window: float
    # Prompt tokens computed by decode replicas (local prefills), all replicas together.
    decode_local_prefill_tokens: int
    prefill_tokens_total: int
    # Share of prompt tokens a prefill replica pulled from a decode replica instead of computing (KV
    # readback; counted as hits in hit_ratio, since they were not computed).
    pulled_share: float
    # The most blocks allocated on one decode replica at once (running sequences, and readback pins) / its
    # cache capacity (1: they filled it, leaving nothing cached for other prefixes).
    pinned_peak: float
    # The most blocks a decode replica's running sequences (and pins) held above its capacity / capacity: KV
    # demand a real engine would have met by making sequences wait (0: it always fitted).
    decode_overflow: float
    local_prefill_share: float
    # Busy fraction of the prefill pool over the measurement window (mean over replicas, and the busiest).
    prefill_util: float
    prefill_util_max: float
    # The same max/mean in busy seconds (prefill_util_max / prefill_util): load counted by what it costs,
    # where a token computed over a long cached context weighs its attention (load_max_over_mean: tokens).
    busy_max_over_mean: float
    window_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    # Per request, mean time per output token after the first: what prefills on decode replicas slow down.
    tpot_p50_s: float
    tpot_p99_s: float
    queue_p50_s: float
    queue_p99_s: float
    # Requests in the window meeting `slo` (TTFT and TPOT together): their share, and per second.
    slo: Slo
    goodput_share: float
    goodput_rps: float
    # With `--bounds`: the hit ratio against the pooled prefill caches' LRU ceiling (bench.replay.bounds).
    pooled_ceiling: float | None = None
    hit_vs_pooled: float | None = None
    # Router belief vs simulated engine: mean |predicted - actual| cached tokens per request.
    prediction_error_tokens: float
    decision_us_mean: float
    wall_s: float
    # Replica-seconds each pool ran (fixed pools: replicas x the replay's length; autoscaled: each replica
    # from its start to its stop).
    prefill_replica_s: float = 0.0
    decode_replica_s: float = 0.0
    # The most replicas of each pool that ran at once.
    prefill_replicas_peak: int = 0
    decode_replicas_peak: int = 0


def summarize(
    name: str,
    sim: Simulator,
    records: list[RequestRecord],
    bound: float,
    wall_s: float,
    *,
    slo: Slo | None = None,
    pooled: float | None = None,
) -> PolicyResult:
    blocks = sum(r.num_blocks for r in records)
    prompt = sum(r.cached_tokens + r.computed_tokens for r in records)
    hits = sum(r.cached_blocks for r in records)
    hit_ratio = hits / blocks if blocks else 0.0
    p_tokens = sim.computed_tokens(sim.prefill)
    d_tokens = sum(sim.computed_tokens(sim.decode))
    total = sum(p_tokens) + d_tokens
    mean_p = sum(p_tokens) / len(p_tokens) if p_tokens else 0.0
    in_window = dict.fromkeys((s.replica_id for s in sim.prefill), 0)
    for r in records:
        if r.in_window and r.prefill_replica in in_window:
            in_window[r.prefill_replica] += r.computed_tokens
    mean_w = sum(in_window.values()) / len(in_window) if in_window else 0.0
    window = sim.window_end or 0.0
    busy = sim.busy_time([s.replica_id for s in sim.prefill], window) if window > 0 else []
    utils = [b / window for b in busy] if busy else [0.0]
    measured = [r for r in records if r.in_window]
    ttft = [r.ttft for r in measured]
    wait = [r.queue_wait for r in measured]
    tpot = [t for t in (r.tpot for r in measured) if t is not None]
    pred_err = [abs(r.predicted_cached_tokens - r.cached_tokens) for r in records]
    slo = slo or DEFAULT_SLO
    good = sum(slo.met(r.ttft, r.tpot) for r in measured)
    return PolicyResult(
        policy=name,
        requests=len(records),
        hit_ratio=hit_ratio,
        bound=bound,
        hit_vs_bound=hit_ratio / bound if bound else math.nan,
        prefill_tokens=p_tokens,
        load_max_over_mean=max(p_tokens) / mean_p if mean_p else math.nan,
        load_max_over_mean_window=max(in_window.values()) / mean_w if mean_w else math.nan,
        decode_local_prefill_tokens=d_tokens,
        prefill_tokens_total=total,
        pulled_share=sum(r.pulled_tokens for r in records) / prompt if prompt else 0.0,
        pinned_peak=sim.pinned_peak,
        decode_overflow=max((s.cache.overflow for s in sim.decode), default=0)
        / (sim.cfg.capacity_blocks or 1),
        local_prefill_share=sum(r.local_prefill for r in records) / len(records) if records else 0.0,
        prefill_util=sum(utils) / len(utils),
        prefill_util_max=max(utils),
        busy_max_over_mean=max(utils) / (sum(utils) / len(utils)) if sum(utils) else math.nan,
        window_s=window,
        ttft_p50_s=percentile(ttft, 50),
        ttft_p99_s=percentile(ttft, 99),
        tpot_p50_s=percentile(tpot, 50),
        tpot_p99_s=percentile(tpot, 99),
        queue_p50_s=percentile(wait, 50),
        queue_p99_s=percentile(wait, 99),
        slo=slo,
        goodput_share=good / len(measured) if measured else math.nan,
        goodput_rps=good / window if window > 0 else math.nan,
        pooled_ceiling=pooled,
        hit_vs_pooled=hit_ratio / pooled if pooled else None,
        prediction_error_tokens=sum(pred_err) / len(pred_err) if pred_err else 0.0,
        decision_us_mean=1e6 * sim.decide_s / sim.decisions if sim.decisions else 0.0,
        wall_s=wall_s,
        prefill_replica_s=sim.replica_seconds(sim.prefill),
        decode_replica_s=sim.replica_seconds(sim.decode),
        prefill_replicas_peak=sim.replica_peak(sim.prefill),
        decode_replicas_peak=sim.replica_peak(sim.decode),
    )


def format_table(results: Sequence[PolicyResult]) -> str:
    cols = [
        ("policy", "{:<22}", lambda r: r.policy),
        ("hit", "{:>6.3f}", lambda r: r.hit_ratio),
        ("hit/bnd", "{:>7.3f}", lambda r: r.hit_vs_bound),
        ("hit/pool", "{:>8.3f}", lambda r: math.nan if r.hit_vs_pooled is None else r.hit_vs_pooled),
        ("max/mean", "{:>8.3f}", lambda r: r.load_max_over_mean),
        ("mm_win", "{:>6.3f}", lambda r: r.load_max_over_mean_window),
        ("Mtok", "{:>8.1f}", lambda r: r.prefill_tokens_total / 1e6),
        ("local", "{:>6.2f}", lambda r: r.local_prefill_share),
        ("pulled", "{:>6.2f}", lambda r: r.pulled_share),
        ("pinned", "{:>6.2f}", lambda r: r.pinned_peak),
        ("ovfl", "{:>5.2f}", lambda r: r.decode_overflow),
        ("util", "{:>5.2f}", lambda r: r.prefill_util),
        ("busy_mm", "{:>7.3f}", lambda r: r.busy_max_over_mean),
        ("ttft50", "{:>7.2f}", lambda r: r.ttft_p50_s),
        ("ttft99", "{:>7.2f}", lambda r: r.ttft_p99_s),
        ("tpot50ms", "{:>8.1f}", lambda r: 1e3 * r.tpot_p50_s),
        ("tpot99ms", "{:>8.1f}", lambda r: 1e3 * r.tpot_p99_s),
        ("good", "{:>5.2f}", lambda r: r.goodput_share),
        ("good/s", "{:>6.2f}", lambda r: r.goodput_rps),
        ("q50", "{:>6.2f}", lambda r: r.queue_p50_s),
        ("q99", "{:>7.2f}", lambda r: r.queue_p99_s),
        ("dec_us", "{:>6.0f}", lambda r: r.decision_us_mean),
        ("wall_s", "{:>6.1f}", lambda r: r.wall_s),
    ]
    header = " ".join(f"{c[0]:>{len(c[1].format(c[2](results[0])))}}" if results else c[0] for c in cols)
    lines = [header]
    for r in results:
        lines.append(" ".join(fmt.format(get(r)) for _, fmt, get in cols))
    return "\n".join(lines)
