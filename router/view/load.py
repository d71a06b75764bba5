"""Router-side load accounting per replica, producing the `ReplicaView`s a policy decides on.

The router knows what it dispatched before any engine reports it, so queued prefill work and active sequences
are counted here at dispatch time (engine statistics lag by a refresh interval, and two requests routed within
that interval would otherwise both see an idle replica). Engine statistics refresh what only the engine knows:
KV cache usage. Pure bookkeeping, no I/O; one instance per router event loop.

Request lifecycle: `on_dispatch` (after `Policy.choose`) -> `on_prefill_done` (the prompt is computed: the
prefill leg returned, or the decode replica emitted its first token after a local prefill) -> `on_finish` (any
outcome; also releases the prefill work if it never completed).

Several routers: each counts what it dispatched itself, fresh, and adds what the others have in flight as they
last reported it (`set_peers`, from the registry at every poll: cluster/registry.py), so N routers see one
cluster's load, the others' part up to a poll interval old.

Queued prefill work is kept in tokens, requests and estimated seconds (`ServiceTimeModel.prefill_s` of each
prompt's uncached part after its predicted cached part, the estimate the routing cost uses): give the tracker
the policy's model (`router.service_time`, `PdservePolicy.weights.timing`).
"""

from __future__ import annotations

import msgspec

from engine.messages import DispatchedLoad, Role, add_loads
from router.messages import Decision, ReplicaView, RouteRequest
from router.policy.cost import estimated_prefill_s
from router.service_time import ServiceTimeModel, Timing


class _ReplicaLoad:
    __slots__ = (
        "active_context_tokens",
        "active_seqs",
        "draining",
        "kv_usage",
        "node_id",
        "queued_prefill_requests",
        "queued_prefill_s",
        "queued_prefill_tokens",
        "ready",
        "role",
        "view",
    )

    def __init__(self, role: Role, node_id: str | None) -> None:
        self.role = role
        self.node_id = node_id
        self.queued_prefill_tokens = 0
        self.queued_prefill_requests = 0
        self.queued_prefill_s = 0.0
        self.active_seqs = 0
        self.active_context_tokens = 0
        self.kv_usage = 0.0
        self.ready = True
        self.draining = False
        self.view: ReplicaView | None = None  # built on demand, dropped at every change


class _InFlight(msgspec.Struct):
    prefill_replica: str  # the replica computing the prompt (the decode replica itself on local prefill)
    prefill_tokens: int  # tokens it must compute (prompt minus predicted cached)
    prefill_s: float  # their estimated seconds
    decode_replica: str
    context_tokens: int  # prompt tokens the sequence holds on the decode replica
    prefill_pending: bool = True


class LoadTracker:
    def __init__(self, timing: Timing | None = None) -> None:
        self.timing = timing or ServiceTimeModel()
        self._replicas: dict[str, _ReplicaLoad] = {}
        self._inflight: dict[str, _InFlight] = {}
        # The other routers' dispatched work in flight, summed per replica (`set_peers`).
        self._peers: dict[str, DispatchedLoad] = {}
        # views(role) results, reused until a replica of that role changes (the router reads views at every
        # decision; most decisions change one or two replicas).
        self._views: dict[Role, list[ReplicaView]] = {}

    # ---- membership and engine-reported state
    # ----------------------------------------------------------------

    def add_replica(self, replica_id: str, role: Role, node_id: str | None = None) -> None:
        if replica_id not in self._replicas:
            self._replicas[replica_id] = _ReplicaLoad(role, node_id)
            self._views.pop(role, None)

    def remove_replica(self, replica_id: str) -> None:
        """Forget a replica; in-flight requests that used it keep their entry until they finish."""
        rep = self._replicas.pop(replica_id, None)
        if rep is not None:
            self._views.pop(rep.role, None)

    def set_ready(self, replica_id: str, ready: bool) -> None:
        rep = self._replicas[replica_id]
        rep.ready = ready
        self._changed(rep)

    def set_draining(self, replica_id: str, draining: bool) -> None:
        rep = self._replicas[replica_id]
        rep.draining = draining
        self._changed(rep)

    def update_kv_usage(self, replica_id: str, kv_usage: float) -> None:
        """Engine statistics refresh (fraction of KV cache blocks in use)."""
        rep = self._replicas.get(replica_id)
        if rep is not None:
            usage = min(max(kv_usage, 0.0), 1.0)
            if usage != rep.kv_usage:
                rep.kv_usage = usage
                self._changed(rep)

    # ---- request lifecycle
    # ----------------------------------------------------------------------------------

    def on_dispatch(self, req: RouteRequest, d: Decision) -> None:
        if req.request_id in self._inflight:
            raise ValueError(f"request {req.request_id!r} is already in flight")
        computing = d.decode if d.local_prefill or d.prefill is None else d.prefill
        n = req.num_prompt_tokens
        cached = min(max(d.predicted_cached_tokens, 0), n)
        seconds = estimated_prefill_s(self.timing, n, cached)
        self._inflight[req.request_id] = _InFlight(computing, n - cached, seconds, d.decode, n)
        rep = self._replicas.get(computing)
        if rep is not None:
            rep.queued_prefill_tokens += n - cached
            rep.queued_prefill_requests += 1
            rep.queued_prefill_s += seconds
            self._changed(rep)
        dec = self._replicas.get(d.decode)
        if dec is not None:
            dec.active_seqs += 1
            dec.active_context_tokens += n
            self._changed(dec)

    def on_prefill_done(self, request_id: str) -> None:
        f = self._inflight.get(request_id)
        if f is None or not f.prefill_pending:
            return
        f.prefill_pending = False
        rep = self._replicas.get(f.prefill_replica)
        if rep is not None:
            rep.queued_prefill_tokens -= f.prefill_tokens
            rep.queued_prefill_requests -= 1
            # Float sums drift: an empty queue is exactly empty.
            rep.queued_prefill_s = rep.queued_prefill_s - f.prefill_s if rep.queued_prefill_requests else 0.0
            self._changed(rep)

    def on_finish(self, request_id: str) -> None:
        self.on_prefill_done(request_id)
        f = self._inflight.pop(request_id, None)
        if f is None:
            return
        dec = self._replicas.get(f.decode_replica)
        if dec is not None:
            dec.active_seqs -= 1
            dec.active_context_tokens -= f.context_tokens
            self._changed(dec)

    def inflight(self) -> int:
        return len(self._inflight)

    # ---- several routers
    # ------------------------------------------------------------------------------------

    def dispatched(self) -> dict[str, DispatchedLoad]:
        """This router's own work in flight per replica (what it reports for the other routers to add)."""
        return {
            rid: DispatchedLoad(
                queued_prefill_tokens=r.queued_prefill_tokens,
                queued_prefill_requests=r.queued_prefill_requests,
                queued_prefill_s=r.queued_prefill_s,
                active_seqs=r.active_seqs,
                active_context_tokens=r.active_context_tokens,
            )
            for rid, r in self._replicas.items()
            if r.queued_prefill_requests or r.active_seqs
        }

    def set_peers(self, reports: list[dict[str, DispatchedLoad]]) -> None:
        """The other routers' work in flight (each one's `dispatched()`, as it last reported it): added to
        this router's own in every view from now on, replacing what was set before."""
        total: dict[str, DispatchedLoad] = {}
        for report in reports:
            for rid, d in report.items():
                t = total.get(rid)
                total[rid] = d if t is None else add_loads(t, d)
        if total == self._peers:
            return
        for rid in self._peers.keys() | total.keys():
            rep = self._replicas.get(rid)
            if rep is not None:
                self._changed(rep)
        self._peers = total

    # ---- views
    # ----------------------------------------------------------------------------------------------

    def queues(self) -> list[tuple[str, Role, int, int]]:
        """(replica, role, queued prefill requests, their uncached tokens) of every replica. Safe to call
        from another thread (the metrics server's): it copies the table in one step and only reads."""
        return [
            (rid, r.role, r.queued_prefill_requests, r.queued_prefill_tokens)
            for rid, r in list(self._replicas.items())
        ]  # this router's own: each router's /metrics shows what it dispatched

    def views(self, role: Role) -> list[ReplicaView]:
        """Every replica of `role`, including not-ready and draining ones (policies skip those).

        The list and its views are shared by the calls between two changes: read them, do not mutate them."""
        views = self._views.get(role)
        if views is None:
            views = self._views[role] = [
                self._view(rid, r, self._peers.get(rid)) if r.view is None else r.view
                for rid, r in self._replicas.items()
                if r.role == role
            ]
        return views

    def _changed(self, rep: _ReplicaLoad) -> None:
        rep.view = None
        self._views.pop(rep.role, None)

    @staticmethod
    def _view(replica_id: str, r: _ReplicaLoad, peers: DispatchedLoad | None) -> ReplicaView:
        p = peers or _NONE
        r.view = ReplicaView(
            replica_id=replica_id,
            role=r.role,
            queued_prefill_tokens=r.queued_prefill_tokens + p.queued_prefill_tokens,
            queued_prefill_requests=r.queued_prefill_requests + p.queued_prefill_requests,
            queued_prefill_s=r.queued_prefill_s + p.queued_prefill_s,
            active_seqs=r.active_seqs + p.active_seqs,
            active_context_tokens=r.active_context_tokens + p.active_context_tokens,
            kv_usage=r.kv_usage,
            ready=r.ready,
            draining=r.draining,
            node_id=r.node_id,
        )
        return r.view


_NONE = DispatchedLoad()
