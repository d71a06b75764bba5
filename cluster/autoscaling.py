"""SLO-driven autoscaling of the engine pools (the topology's `pools.*.autoscaling`).

Who does what:
1. Every engine replica reports its load to Serve (`EngineReplica.record_autoscaling_stats`): a `ReplicaLoad`
   from its engine's own counters (KV usage, running and waiting sequences, step time) and from what the
   routers have queued on it (their estimated prefill seconds, which the registry hands back at each
   heartbeat).
2. Serve's controller averages each signal over the pool's `window_s` and asks `PoolPolicy`, the pool's
   custom autoscaling policy, how many replicas it wants; Serve then applies min/max, starts replicas, and
   stops the ones it scales away. A stopping replica drains (engine/replica.py `__del__`): it tells the
   routers to stop sending, then finishes its legs and transfers.
3. The policy answers the most the pool needed over the last `downscale_delay_s` (`HeldNeed`), not the
   latest need: a pool scales up at once, and down only to what the recent peak needed, never to a lull
   between two busy minutes (Serve's own delay would drop to whatever the latest answer is once every
   answer for the delay was lower). So Serve's `downscale_delay_s` is 0: the hold is the delay.
4. `needed_replicas` and `HeldNeed` are the one formula. The replay (bench/replay/autoscaler.py) calls them
   with the same signals read from its simulated replicas, so a replayed deployment scales as a live one
   does.

The formula, for a pool whose replicas report window-mean loads (sums over its running replicas):
    prefill: need = sum busy / BUSY_TARGET
                    + max(0, sum queued_prefill_s - replicas x queue_share_of_ttft x TTFT SLO)
                      / (TTFT SLO + mean start_s)
    decode:  need = max(sum kv_usage / kv target, sum (running + waiting) / sequence target,
                        replicas x mean step_s / TPOT SLO)
    wanted = ceil(the most `need` over the last downscale_delay_s) + warm_replicas,
             within min_replicas..max_replicas
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from cluster.topology import Pool, Topology
from engine.messages import ReplicaLoad, Role

# The share of the window a prefill replica may be busy: short of it even with a short queue, it has no room
# for the next burst.
BUSY_TARGET = 0.85
QUEUE_SHARE_OF_TTFT = 0.25
KV_USAGE = 0.8
POLICY_IMPORT_PATH = "cluster.autoscaling:PoolPolicy"


class ScaleTargets(msgspec.Struct, frozen=True, kw_only=True):
    """What one pool's replicas may hold, resolved from the topology (its SLOs and engine limits)."""

    role: Role
    warm_replicas: int = 0
    queue_s: float = 1.25  # prefill: queued prefill seconds a replica may hold
    ttft_s: float = 5.0  # prefill: the TTFT SLO, within which a longer queue should drain
    kv_usage: float = KV_USAGE
    running_seqs: float | None = None  # decode: None: no target on sequences
    tpot_s: float = 0.05
    hold_s: float = 300.0  # the topology's downscale_delay_s: how long a need is held (`HeldNeed`)


def scale_targets(topo: Topology, role: Role) -> ScaleTargets:
    pool: Pool = getattr(topo.pools, role)
    scaling = pool.autoscaling
    if scaling is None:
        raise ValueError(f"pools.{role} has no autoscaling")
    share = scaling.queue_share_of_ttft or QUEUE_SHARE_OF_TTFT
    # Sequences: by default as many as a replica runs at once; beyond them, they wait (and count as waiting).
    seqs = scaling.running_seqs or pool.engine.max_num_seqs
    return ScaleTargets(
        role=role,
        warm_replicas=scaling.warm_replicas,
        queue_s=share * topo.router.ttft_slo_ms / 1e3,
        ttft_s=topo.router.ttft_slo_ms / 1e3,
        kv_usage=scaling.kv_usage or KV_USAGE,
        running_seqs=seqs,
        tpot_s=topo.router.tpot_slo_ms / 1e3,
        hold_s=scaling.downscale_delay_s,
    )


def needed_replicas(targets: ScaleTargets, loads: Sequence[ReplicaLoad]) -> float:
    """The replicas the pool's load needs, before the warm buffer and the bounds (the module docstring)."""
    if not loads:
        return 0.0
    if targets.role == "prefill":
        # The busy replicas, with headroom; plus what drains the queue beyond each replica's share of it
        # within a TTFT budget of a new replica's start: sooner, they cannot (and asking for more, while
        # the first are still starting, overshoots).
        excess = sum(r.queued_prefill_s for r in loads) - len(loads) * targets.queue_s
        start_s = sum(r.start_s for r in loads) / len(loads)
        return sum(r.busy for r in loads) / BUSY_TARGET + max(0.0, excess) / (targets.ttft_s + start_s)
    need = sum(r.kv_usage for r in loads) / targets.kv_usage
    if targets.running_seqs is not None:
        need = max(need, sum(r.running + r.waiting for r in loads) / targets.running_seqs)
    stepping = [r.step_s for r in loads if r.step_s > 0]
    if stepping:
        need = max(need, len(loads) * (sum(stepping) / len(stepping)) / targets.tpot_s)
    return need


class HeldNeed:
    """The most a pool needed over the last `hold_s` seconds: a sliding-window maximum, kept as the
    (time, need) samples that may still become the maximum (each newer one is smaller)."""

    def __init__(self, hold_s: float, peaks: Sequence[Sequence[float]] = ()) -> None:
        self.hold_s = hold_s
        self.peaks: deque[tuple[float, float]] = deque((t, n) for t, n in peaks)

    @classmethod
    def starting(cls, targets: ScaleTargets, now: float, replicas: int) -> HeldNeed:
        """A pool's hold as it starts: the count it starts with, less its warm buffer, is held as needed, so
        a quiet first minute does not drain what the next one may need."""
        return cls(targets.hold_s, [(now, float(max(0, replicas - targets.warm_replicas)))])

    def add(self, now: float, need: float) -> float:
        """Record the latest need; the most over the last `hold_s`, this one included."""
        while self.peaks and self.peaks[-1][1] <= need:
            self.peaks.pop()
        self.peaks.append((now, need))
        while self.peaks[0][0] < now - self.hold_s:
            self.peaks.popleft()
        return self.peaks[0][1]


def wanted_replicas(targets: ScaleTargets, need: float) -> int:
    """A (held) need rounded up, plus the warm buffer (the bounds are applied after)."""
    return math.ceil(need - 1e-9) + targets.warm_replicas


class PoolPolicy:
    """The pools' Serve autoscaling policy (`policy_function`, a class: Serve builds it with the pool's
    `ScaleTargets` as `policy_kwargs` and calls it with an AutoscalingContext at every control loop)."""

    def __init__(self, **targets: Any) -> None:
        self.targets = msgspec.convert(targets, ScaleTargets)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        now = time.time() if ctx.current_time is None else ctx.current_time
        state = dict(ctx.policy_state)
        if "pdserve_peaks" not in state:
            start = HeldNeed.starting(self.targets, now, ctx.target_num_replicas)
            state["pdserve_peaks"] = [list(p) for p in start.peaks]
        loads = replica_loads(ctx.aggregated_metrics or {}, ctx.running_replicas)
        if not loads:  # nothing running has reported yet (all starting): keep the target
            return ctx.target_num_replicas, state
        need = needed_replicas(self.targets, loads)
        held = HeldNeed(self.targets.hold_s, state["pdserve_peaks"])
        wanted = wanted_replicas(self.targets, held.add(now, need))
        state["pdserve_peaks"] = [list(p) for p in held.peaks]
        state["pdserve_need"] = round(need, 3)
        return wanted, state


def replica_loads(metrics: Mapping[str, Mapping[Any, float]], replicas: Sequence[Any]) -> list[ReplicaLoad]:
    """The running replicas' window-mean loads from Serve's aggregated custom metrics (metric -> replica ->
    value); a replica that has not reported a signal yet counts as idle in it."""
    fields = ReplicaLoad.__struct_fields__
    reported = [r for r in replicas if any(r in metrics.get(f, {}) for f in fields)]
    return [ReplicaLoad(**{f: float(metrics.get(f, {}).get(r, 0.0)) for f in fields}) for r in reported]


def serve_autoscaling_config(topo: Topology, role: Role) -> dict[str, Any]:
    """The deployment's Serve `autoscaling_config` for an autoscaled pool."""
    pool: Pool = getattr(topo.pools, role)
    scaling = pool.autoscaling
    assert scaling is not None
    return {
        "min_replicas": scaling.min_replicas,
        "max_replicas": scaling.max_replicas,
        "initial_replicas": pool.replicas,
        "look_back_period_s": scaling.window_s,
        # How often replicas push their samples (Serve's default, 10 s, would lag a window shorter than that);
        # Serve marks the field deprecated but reads it for the push period.
        "metrics_interval_s": min(10.0, scaling.window_s / 5),
        # The window already smooths the load: a burst is met as soon as the window's mean shows it.
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,  # the policy holds each need for the topology's delay (`HeldNeed`)
        "policy": {
            "policy_function": POLICY_IMPORT_PATH,
            "policy_kwargs": msgspec.to_builtins(scale_targets(topo, role)),
        },
    }
