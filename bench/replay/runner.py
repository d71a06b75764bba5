"""One replay of a trace slice through one policy, and the load setting that precedes a comparison."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import msgspec

from bench.replay.autoscaler import Autoscaler, PoolScaling
from bench.replay.index_feed import KvIndexFeed
from bench.replay.load import estimate_concurrency, estimate_time_scale, refine
from bench.replay.metrics import PolicyResult, summarize
from bench.replay.policies import PolicyFactory
from bench.replay.sim import RequestRecord, SimConfig, Simulator
from bench.replay.traces import Trace, infinite_cache_hit_ratio
from bench.slo import Slo


def replay_policy(
    trace: Trace,
    name: str,
    factory: PolicyFactory,
    cfg: SimConfig,
    bound: float,
    *,
    slo: Slo | None = None,
    pooled: float | None = None,
    autoscaling: Sequence[PoolScaling] = (),
    tick_s: float = 2.0,
) -> tuple[PolicyResult, list[RequestRecord]]:
    """The policy's summary, and what happened to each request (`pdserve replay --records`). `autoscaling`:
    the pools that scale (bench/replay/autoscaler.py), deciding every `tick_s`; the config's replica counts
    are then what they start with."""
    replica_ids = [f"p{i}" for i in range(cfg.prefill_replicas)] + [
        f"d{i}" for i in range(cfg.decode_replicas)
    ]

    def index_factory() -> tuple[KvIndexFeed, object]:
        feed = KvIndexFeed(trace, replica_ids)
        return feed, feed.index

    t0 = time.perf_counter()
    # A policy instance per router, from the same factory: each router keeps its own sessions and recent work.
    policies = [factory(cfg.timing) for _ in range(cfg.routers)]
    sim = Simulator(trace, policies, cfg, index_factory=index_factory)  # type: ignore[arg-type]
    if autoscaling:
        Autoscaler(sim, list(autoscaling), tick_s)
    records = sim.run()
    return summarize(name, sim, records, bound, time.perf_counter() - t0, slo=slo, pooled=pooled), records


def set_load(
    trace: Trace,
    cfg: SimConfig,
    target: float,
    *,
    reference: tuple[str, PolicyFactory] | None,
    pilot_rounds: int,
    log: Callable[[str], None],
) -> SimConfig:
    """The config with `time_scale` (open loop) or `concurrency` (closed loop) set for `target` utilisation.

    Analytic estimate first; then, with a reference policy, pilot runs correct it. The pilots run behind one
    router whatever `cfg.routers` says: the offered load is the workload's, so replays with different numbers
    of routers are compared at the same load."""
    bound = infinite_cache_hit_ratio(trace)
    if trace.closed_loop:
        est = estimate_concurrency(
            trace, cfg.timing, cfg.prefill_replicas, target, gap_scale=cfg.gap_scale, max_gap_s=cfg.max_gap_s
        )
        knob = max(1.0, round(est))
        log(f"load: analytic concurrency {est:.1f} for util {target}")
    else:
        knob = estimate_time_scale(trace, cfg.timing, cfg.prefill_replicas, target)
        log(f"load: analytic time scale {knob:.3f} for util {target}")

    def with_knob(k: float, base: SimConfig = cfg) -> SimConfig:
        if trace.closed_loop:
            return msgspec.structs.replace(base, concurrency=int(k))
        return msgspec.structs.replace(base, time_scale=k)

    if reference is not None and pilot_rounds > 0:
        name, factory = reference
        pilot = msgspec.structs.replace(cfg, routers=1)

        def measure(k: float) -> float:
            return replay_policy(trace, name, factory, with_knob(k, pilot), bound)[0].prefill_util

        knob, _ = refine(knob, target, measure, rounds=pilot_rounds, integer=trace.closed_loop, log=log)
    return with_knob(knob)
