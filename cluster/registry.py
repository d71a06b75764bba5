"""The replica registry: the Serve application's ingress deployment, where every engine replica publishes
what the routers need (role, replica id, node, KV-events endpoint, NIXL side channel, readiness), and where
the routers meet: each one reports its endpoint and the load it has in flight at every poll (`sync`) and
reads back the replicas and every other router's report.

Replicas publish on start and then heartbeat; an entry that stops being refreshed (the replica died or
its node is gone) expires, and a replica withdraws itself on graceful shutdown; so do routers, sooner. The
registry holds no state that cannot be rebuilt: if Serve restarts it, the next heartbeats and polls
repopulate it.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from ray.serve.handle import DeploymentHandle

from engine.messages import ClusterState, DispatchedLoad, ReplicaInfo, RouterReport, add_loads

EXPIRY_S = 10.0  # 5 missed heartbeats (engine.replica.HEARTBEAT_S)
# A router polls every second: one not heard from for this long is gone, and its load no longer counts.
ROUTER_EXPIRY_S = 3.5
# A slot claimed by a replica that never published (it died while its engine started) is free after this.
CLAIM_TTL_S = 900.0


class Registry:
    # The engine deployments are bound here only so that Serve deploys them as part of this
    # application; the router reaches them by name.
    def __init__(self, *engine_pools: DeploymentHandle) -> None:
        self._entries: dict[str, tuple[ReplicaInfo, float]] = {}
        # Replicas a router found lost (their actor died: they cannot say so themselves), with the reason.
        self._reported: dict[str, str] = {}
        # Per-replica slots (e.g. a CPU engine's cores): replica id -> (role, slot, when claimed).
        self._slots: dict[str, tuple[str, int, float]] = {}
        self._topology: dict[str, Any] | None = None
        self._routers: dict[str, tuple[RouterReport, float]] = {}

    def reconfigure(self, config: dict[str, Any]) -> None:
        """Serve calls this with the deployment's user_config: the deployed topology
        (cluster/serve_config.py), which `pdserve apply` reads back. Routers follow its `router` section."""
        self._topology = config.get("topology")

    def topology(self) -> dict[str, Any] | None:
        """The deployed topology (plain data): what a router started as a Serve replica serves."""
        return self._topology

    def publish(self, info: ReplicaInfo) -> DispatchedLoad:
        """A replica's heartbeat; answered with what the live routers have dispatched to it and not seen end
        (the queue its pool's autoscaling policy reads: cluster/autoscaling.py)."""
        self._entries[info.replica_id] = (info, time.monotonic())
        total = DispatchedLoad()
        for report in self.routers():
            load = report.replicas.get(info.replica_id)
            if load is not None:
                total = add_loads(total, load)
        return total

    def withdraw(self, replica_id: str) -> None:
        self._entries.pop(replica_id, None)
        self._reported.pop(replica_id, None)
        self._slots.pop(replica_id, None)

    def claim_slot(self, role: str, replica_id: str, slots: int) -> int:
        """One of `slots` per-replica settings for a starting replica: the one fewest live replicas of its
        role hold; on a tie, the one whose holders were heard from least recently (then the lowest).

        A slot is free again once its replica's entry is gone, or once the replica failed. A replacement
        starts while its dead predecessor's entry waits to expire, and must get that replica's cores, not a
        live one's: an engine starting on a live engine's cores stalls its steps. Unreported deaths are what
        the tie-break is for: a dead replica stops heartbeating."""
        now = time.monotonic()
        self._slots = {
            rid: claim
            for rid, claim in self._slots.items()
            if rid in self._entries or now - claim[2] < CLAIM_TTL_S  # still starting, or running
        }
        used = [0] * slots
        heard = [-float("inf")] * slots  # the latest heartbeat of any holder (a starting one counts as now)
        for rid, (r, slot, _) in self._slots.items():
            if r == role and slot < slots and not self._failed(rid):
                used[slot] += 1
                entry = self._entries.get(rid)
                heard[slot] = max(heard[slot], now if entry is None else entry[1])
        chosen = min(range(slots), key=lambda i: (used[i], heard[i], i))
        self._slots[replica_id] = (role, chosen, now)
        return chosen

    def _failed(self, replica_id: str) -> bool:
        entry = self._entries.get(replica_id)
        return replica_id in self._reported or (entry is not None and bool(entry[0].failed))

    def report_failed(self, replica_id: str, reason: str) -> None:
        """A router found this replica lost: every router learns it at its next poll (replica ids are never
        reused, so the mark stays until the entry goes)."""
        if replica_id in self._entries:
            self._reported.setdefault(replica_id, reason)

    def sync(self, report: RouterReport) -> ClusterState:
        """A router's poll: its report in; the replicas, every other live router's report and the deployed
        router settings out."""
        self._routers[report.router_id] = (report, time.monotonic())
        others = [r for r in self.routers() if r.router_id != report.router_id]
        settings = (self._topology or {}).get("router")
        return ClusterState(replicas=self.snapshot(), routers=others, router_settings=settings)

    def routers(self) -> list[RouterReport]:
        """Every live router's last report."""
        now = time.monotonic()
        self._routers = {rid: e for rid, e in self._routers.items() if now - e[1] <= ROUTER_EXPIRY_S}
        return [report for report, _ in self._routers.values()]

    def withdraw_router(self, router_id: str) -> None:
        """A router stopping: its load no longer counts (it has drained its streams)."""
        self._routers.pop(router_id, None)

    def snapshot(self) -> list[ReplicaInfo]:
        now = time.monotonic()
        expired = [rid for rid, (_, seen) in self._entries.items() if now - seen > EXPIRY_S]
        for rid in expired:
            del self._entries[rid]
            self._reported.pop(rid, None)
            self._slots.pop(rid, None)
        out = []
        for rid, (info, _) in self._entries.items():
            reported = self._reported.get(rid)
            if reported is not None and not info.failed:
                info = msgspec.structs.replace(info, failed=reported)
            out.append(info)
        return out
