"""The router's picture of the engine replicas, kept current in the background.

- Membership and readiness come from the replica registry (cluster/registry.py), polled every second.
- What KV blocks each replica holds comes from its engine's KV events (one subscriber per replica,
  feeding the KV index); a replica that leaves the registry is dropped from the index.
- Load is counted by the router at dispatch (router/view/load.py); the engines' own KV-cache usage, from the
  registry's heartbeat stats, refreshes it. Several routers: each poll also reports this router's load in
  flight (a `RouterReport`) and reads back the other routers', which the load adds to its own, and which
  admission counts (`peer_admitted_tokens`).
- The same poll reads the deployed router settings (`pdserve apply`); the router process applies them
  in place.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Any

from engine.messages import ClusterState, ReplicaInfo, RouterReport
from router.service_time import Timing
from router.view.kv_events import KvEventSubscriber
from router.view.kv_index import KvIndex
from router.view.load import LoadTracker

log = logging.getLogger(__name__)


class ClusterView:
    def __init__(
        self,
        registry: Any,
        *,
        block_size: int,
        timing: Timing | None = None,
        poll_s: float = 1.0,
        router_id: str | None = None,
    ) -> None:
        """`registry`: a Serve deployment handle to the registry (anything with `.sync.remote(report)`).
        `router_id`: this router's name among the routers (default: a random one)."""
        self._registry = registry
        self._poll_s = poll_s
        self.router_id = router_id or uuid.uuid4().hex[:12]
        self.index = KvIndex(block_size)
        self.load = LoadTracker(timing)
        # What this router reports at each poll (the router process adds its endpoints and admission).
        self.report: Callable[[], RouterReport] = lambda: RouterReport(
            router_id=self.router_id, replicas=self.load.dispatched()
        )
        self.peers: list[RouterReport] = []  # the other routers, as they last reported
        # Given the deployed topology's `router` section at each poll that carries one.
        self.on_router_settings: Callable[[dict[str, Any]], None] = lambda raw: None
        self._known: dict[str, ReplicaInfo] = {}
        self._subscribers: dict[str, asyncio.Task[None]] = {}
        # Replicas this router saw fail, before the registry says so (replica ids are never reused).
        self._failed: dict[str, str] = {}

    @property
    def replicas(self) -> dict[str, ReplicaInfo]:
        return dict(self._known)

    def legs_address(self, replica_id: str) -> str | None:
        """Where `replica_id` takes legs (engine/leg_server.py); None while the registry does not list it."""
        info = self._known.get(replica_id)
        return info.legs_address if info is not None else None

    async def run(self) -> None:
        """Poll the registry until cancelled; a failed poll is logged and retried (the registry may be
        restarting), never fatal: the router keeps routing on its last view meanwhile."""
        try:
            while True:
                try:
                    await self.refresh()
                except Exception as exc:
                    log.warning("registry poll failed (keeping the last view): %s", exc)
                await asyncio.sleep(self._poll_s)
        finally:
            for task in self._subscribers.values():
                task.cancel()

    async def refresh(self) -> None:
        """One poll now (used at start-up, so the first request already sees the replicas)."""
        state: ClusterState = await self._registry.sync.remote(self.report())
        self.sync(state.replicas)
        self.peers = [r for r in state.routers if r.router_id != self.router_id]
        self.load.set_peers([r.replicas for r in self.peers])
        if state.router_settings is not None:
            self.on_router_settings(state.router_settings)

    @property
    def peer_admitted_tokens(self) -> int:
        """Prompt tokens the other routers have admitted and not finished, as they last reported."""
        return sum(r.admitted_tokens for r in self.peers)

    def sync(self, infos: list[ReplicaInfo]) -> None:
        current = {i.replica_id: i for i in infos}
        # Failed replicas are remembered while the registry lists them (ids are never reused).
        self._failed = {rid: why for rid, why in self._failed.items() if rid in current}
        for rid in [r for r in self._known if r not in current]:
            self._drop(rid)
        for rid, info in current.items():
            if rid not in self._known:
                self._add(info)
            if info.failed and rid not in self._failed:
                log.warning("replica %s (%s) failed: %s", rid, info.role, info.failed)
                self._failed[rid] = info.failed
            self._known[rid] = info
            self.load.set_ready(rid, info.ready and rid not in self._failed)
            self.load.set_draining(rid, info.draining)
            if info.stats is not None:
                self.load.update_kv_usage(rid, info.stats.kv_cache_usage)

    def mark_failed(self, replica_id: str, reason: str) -> None:
        """Stop routing to a replica now (a call to it failed); the registry tells the other routers."""
        if replica_id in self._failed:
            return
        self._failed[replica_id] = reason
        if replica_id in self._known:
            log.warning("replica %s failed: %s", replica_id, reason)
            self.load.set_ready(replica_id, False)
            report = self._registry.report_failed.remote(replica_id, reason)
            # Fire and forget: the registry being away must not fail the request that found the loss.
            asyncio.ensure_future(report).add_done_callback(_log_report_error)

    def failed_ids(self) -> tuple[str, ...]:
        return tuple(self._failed)

    def serving(self, role: str) -> int:
        """Replicas of `role` that can take requests now."""
        return sum(
            1
            for rid, info in self._known.items()
            if info.role == role and info.ready and not info.draining and rid not in self._failed
        )

    def _add(self, info: ReplicaInfo) -> None:
        log.info("replica %s (%s) joined on node %s", info.replica_id, info.role, info.node_id[:12])
        self.load.add_replica(info.replica_id, info.role, info.node_id)
        self.index.add_replica(info.replica_id)
        if info.kv_events_endpoint is not None:
            subscriber = KvEventSubscriber(
                info.replica_id,
                info.kv_events_endpoint,
                info.kv_events_replay_endpoint,
                self.index,
                topic="kv",
            )
            self._subscribers[info.replica_id] = asyncio.create_task(
                subscriber.run(), name=f"kv-events-{info.replica_id}"
            )

    def _drop(self, replica_id: str) -> None:
        log.info("replica %s left", replica_id)
        task = self._subscribers.pop(replica_id, None)
        if task is not None:
            task.cancel()
        self.index.remove_replica(replica_id)
        self.load.remove_replica(replica_id)
        del self._known[replica_id]


def _log_report_error(done: asyncio.Future[None]) -> None:
    if not done.cancelled() and done.exception() is not None:
        log.warning("could not report a failed replica to the registry: %s", done.exception())
