"""The pools' autoscaling in the replay: the live policy (cluster/autoscaling.py) deciding on the simulated
replicas' loads, as Serve's controller runs it, with a replica's start time.

Every `tick_s` of virtual time (the replicas' metrics push) each autoscaled pool samples its replicas'
`ReplicaLoad` (Simulator.replica_load: what engine/replica.py reports), averages each replica's samples over
the pool's window, and asks the policy's formula (`needed_replicas`, held by `HeldNeed` over the pool's
`downscale_delay_s`, seeded with the count it starts with, as `PoolPolicy` does). Then, as Serve does with
its delays at 0 (cluster/autoscaling.py `serve_autoscaling_config`): bounded by min/max, up or down at once
to the answer. A started replica takes routes after `start_s` (and costs from its start); a stopped one drains
first: routers stop sending, it finishes what it holds, then it is gone. Serve stops replicas still starting
before running ones; of running ones this stops the least loaded.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import msgspec

from bench.replay.sim import PrefillServer, Simulator
from cluster.autoscaling import HeldNeed, ScaleTargets, needed_replicas, wanted_replicas
from engine.messages import ReplicaLoad


@dataclass(frozen=True)
class PoolScaling:
    role: str
    targets: ScaleTargets
    min_replicas: int
    max_replicas: int
    window_s: float
    start_s: float  # from a replica's start to its first route: actor, weights, engine init, compile


@dataclass
class _Replica:
    server: PrefillServer
    ready: bool = False
    draining: bool = False
    samples: deque[tuple[float, ReplicaLoad]] = field(default_factory=deque)


class PoolAutoscaler:
    def __init__(self, sim: Simulator, pool: PoolScaling, tick_s: float) -> None:
        self.sim, self.pool, self.tick_s = sim, pool, tick_s
        servers = sim.prefill if pool.role == "prefill" else sim.decode
        self.replicas = [_Replica(s, ready=True) for s in servers]
        self.held = HeldNeed.starting(pool.targets, sim.now, len(servers))  # as PoolPolicy starts it
        self.history: list[tuple[float, int]] = [(0.0, len(self.replicas))]  # (time, target) at each change

    @property
    def target(self) -> int:
        return sum(not r.draining for r in self.replicas)

    def tick(self) -> None:
        now = self.sim.now
        for r in self.replicas:
            if r.ready and not r.draining:
                load = msgspec.structs.replace(self.sim.replica_load(r.server), start_s=self.pool.start_s)
                r.samples.append((now, load))
                while r.samples[0][0] <= now - self.pool.window_s:
                    r.samples.popleft()
            elif r.draining and r.server.stopped is None and (not r.ready or self.sim.idle(r.server)):
                self.sim.retire(r.server)
        loads = [_mean(r.samples) for r in self.replicas if r.ready and not r.draining and r.samples]
        if not loads:
            return
        pool = self.pool
        need = self.held.add(now, needed_replicas(pool.targets, loads))
        wanted = min(max(wanted_replicas(pool.targets, need), pool.min_replicas), pool.max_replicas)
        target = self.target
        if wanted > target:
            for _ in range(wanted - target):
                self._start()
        elif wanted < target:
            self._stop(target - wanted)
        if self.target != self.history[-1][1]:
            self.history.append((now, self.target))

    def _start(self) -> None:
        replica = _Replica(self.sim.add_replica(self.pool.role))
        self.replicas.append(replica)

        def ready() -> None:
            if not replica.draining:
                replica.ready = True
                self.sim.make_routable(replica.server)

        self.sim.at(self.sim.now + self.pool.start_s, ready)

    def _stop(self, n: int) -> None:
        live = [r for r in self.replicas if not r.draining]
        starting = sorted((r for r in live if not r.ready), key=lambda r: -r.server.started)
        running = sorted((r for r in live if r.ready), key=lambda r: _busy(r.samples))
        for r in (starting + running)[:n]:
            r.draining = True
            if r.ready:
                self.sim.drain(r.server)


class Autoscaler:
    """Ticks every autoscaled pool of one simulation."""

    def __init__(self, sim: Simulator, pools: list[PoolScaling], tick_s: float) -> None:
        self.sim, self.tick_s = sim, tick_s
        self.pools = {p.role: PoolAutoscaler(sim, p, tick_s) for p in pools}
        sim.at(tick_s, self._tick)

    def _tick(self) -> None:
        for pool in self.pools.values():
            pool.tick()
        if self.sim.pending():
            self.sim.at(self.sim.now + self.tick_s, self._tick)


def _mean(samples: deque[tuple[float, ReplicaLoad]]) -> ReplicaLoad:
    fields = ReplicaLoad.__struct_fields__
    n = len(samples)
    sums = dict.fromkeys(fields, 0.0)
    for _, load in samples:
        for f in fields:
            sums[f] += getattr(load, f)
    return msgspec.convert({f: v / n for f, v in sums.items()}, ReplicaLoad)


def _busy(samples: deque[tuple[float, ReplicaLoad]]) -> float:
    return _mean(samples).busy if samples else 0.0
